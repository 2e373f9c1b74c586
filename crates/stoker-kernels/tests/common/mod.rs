//! Shared test helpers: deterministic inputs, error measures, f64 finite differences.
#![allow(dead_code)]

use candle_core::{DType, Device, Result, Tensor, Var};

/// The awkward shapes every op is tested on: one element, odd widths, widths that are
/// not a multiple of any vector length, one long row.
pub const SHAPES: &[&[usize]] = &[&[1, 1], &[1, 7], &[3, 17], &[2, 33], &[1, 4099]];
/// The subset small enough for an f64 finite-difference check.
pub const FD_SHAPES: &[&[usize]] = &[&[1, 1], &[1, 7], &[3, 17], &[2, 33]];

/// `n` deterministic values uniform in `[-scale, scale)` (an LCG; no rand dependency).
pub fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// A differentiable f32 variable of `shape` filled from [`values`].
pub fn var(shape: &[usize], seed: u64, scale: f32) -> Var {
    let n = shape.iter().product();
    Var::from_vec(values(n, seed, scale), shape, &Device::Cpu).unwrap()
}

/// Largest absolute difference between two tensors, compared in f32; NaN when either
/// holds a NaN or infinity (so every `diff <= tol` check fails on one).
pub fn max_abs(a: &Tensor, b: &Tensor) -> f32 {
    let a = a
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let b = b
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert_eq!(a.len(), b.len());
    stoker_testkit::max_abs_diff(&a, &b) as f32
}

/// Largest absolute value of a tensor (for relative tolerances); NaN when it holds a NaN
/// or infinity.
pub fn max_mag(a: &Tensor) -> f32 {
    let a = a
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    stoker_testkit::max_abs(&a) as f32
}

/// `loss = sum(r * f(x))` with a fixed random `r`, so every output feeds the gradient
/// with a different weight.
pub fn weighted_sum(y: &Tensor, seed: u64) -> Result<Tensor> {
    let r = Tensor::from_vec(values(y.elem_count(), seed, 1.0), y.shape(), y.device())?
        .to_dtype(y.dtype())?;
    (y * r)?.to_dtype(DType::F32)?.sum_all()
}

/// Central finite differences in f64 of `loss(x) = sum(r * f(x))`, `f` given as an f64
/// function of the flat input; `r` as in [`weighted_sum`].
pub fn fd_grad(x: &[f32], seed: u64, f: impl Fn(&[f64]) -> Vec<f64>) -> Vec<f64> {
    let r: Vec<f64> = values(x.len(), seed, 1.0)
        .into_iter()
        .map(f64::from)
        .collect();
    let loss = |x: &[f64]| f(x).iter().zip(&r).map(|(y, r)| y * r).sum::<f64>();
    let mut x: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let h = 1e-6;
    (0..x.len())
        .map(|j| {
            let v = x[j];
            x[j] = v + h;
            let up = loss(&x);
            x[j] = v - h;
            let down = loss(&x);
            x[j] = v;
            (up - down) / (2.0 * h)
        })
        .collect()
}

/// Largest `|a - b| / max(1, |b|)` between an f32 tensor and f64 values; NaN when any
/// value is not finite.
pub fn max_rel_f64(a: &Tensor, b: &[f64]) -> f64 {
    let a = a
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let mut worst = 0f64;
    for (&a, &b) in a.iter().zip(b) {
        let r = (a as f64 - b).abs() / b.abs().max(1.0);
        if !r.is_finite() {
            return f64::NAN;
        }
        worst = worst.max(r);
    }
    worst
}
