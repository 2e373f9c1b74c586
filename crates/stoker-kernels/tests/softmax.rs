//! Fused softmax (last dim) against the composed twin, f64 finite differences, and bf16.
mod common;

use candle_core::{DType, Var};
use common::*;
use stoker_kernels::{reference, softmax_last_dim};

/// f32 fused vs composed: forward within 1e-6, backward within 1e-6 absolute
/// (probabilities and their gradients are below 1; inputs in [-8, 8]).
#[test]
fn softmax_matches_composed_f32() {
    for (i, &shape) in SHAPES
        .iter()
        .chain([&[2usize, 3, 5][..]].iter())
        .enumerate()
    {
        let x = var(shape, i as u64, 8.0);
        let yf = softmax_last_dim(x.as_tensor()).unwrap();
        let yc = reference::softmax_last_dim(x.as_tensor()).unwrap();
        assert!(
            max_abs(&yf, &yc) <= 1e-6,
            "{shape:?} fwd {}",
            max_abs(&yf, &yc)
        );
        let gf = weighted_sum(&yf, 5).unwrap().backward().unwrap();
        let gc = weighted_sum(&yc, 5).unwrap().backward().unwrap();
        let (gf, gc) = (
            gf.get(x.as_tensor()).unwrap(),
            gc.get(x.as_tensor()).unwrap(),
        );
        assert!(max_abs(gf, gc) <= 1e-6, "{shape:?} bwd {}", max_abs(gf, gc));
    }
}

fn softmax64(d: usize) -> impl Fn(&[f64]) -> Vec<f64> {
    move |x: &[f64]| {
        x.chunks(d)
            .flat_map(|r| {
                let m = r
                    .iter()
                    .cloned()
                    .fold(f64::NEG_INFINITY, stoker_testkit::nan_max);
                let s: f64 = r.iter().map(|v| (v - m).exp()).sum();
                r.iter().map(move |v| (v - m).exp() / s).collect::<Vec<_>>()
            })
            .collect()
    }
}

/// f32 fused backward vs f64 central differences: within 1e-6 of max(1, |grad|).
#[test]
fn softmax_backward_matches_finite_differences() {
    for (i, &shape) in FD_SHAPES.iter().enumerate() {
        let x = var(shape, 30 + i as u64, 8.0);
        let y = softmax_last_dim(x.as_tensor()).unwrap();
        let g = weighted_sum(&y, 8).unwrap().backward().unwrap();
        let xs = x
            .as_tensor()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let fd = fd_grad(&xs, 8, softmax64(*shape.last().unwrap()));
        let err = max_rel_f64(g.get(x.as_tensor()).unwrap(), &fd);
        assert!(err <= 1e-6, "{shape:?} {err}");
    }
}

/// bf16 fused vs f32 fused on the same inputs: forward within 2^-8 (one rounding of a
/// value below 1), backward within 2^-6 (y and the incoming grad are bf16 too).
#[test]
fn softmax_bf16_matches_f32() {
    for (i, &shape) in SHAPES.iter().enumerate() {
        let x16 = Var::from_tensor(
            &var(shape, 40 + i as u64, 8.0)
                .to_dtype(DType::BF16)
                .unwrap(),
        )
        .unwrap();
        let x32 = Var::from_tensor(&x16.to_dtype(DType::F32).unwrap()).unwrap();
        let y16 = softmax_last_dim(x16.as_tensor()).unwrap();
        let y32 = softmax_last_dim(x32.as_tensor()).unwrap();
        assert!(max_abs(&y16, &y32) <= 1.0 / 256.0, "{shape:?} fwd");
        let g16 = weighted_sum(&y16, 4).unwrap().backward().unwrap();
        let g32 = weighted_sum(&y32, 4).unwrap().backward().unwrap();
        let (g16, g32) = (
            g16.get(x16.as_tensor()).unwrap(),
            g32.get(x32.as_tensor()).unwrap(),
        );
        assert!(
            max_abs(g16, g32) <= 1.0 / 64.0,
            "{shape:?} bwd {}",
            max_abs(g16, g32)
        );
    }
}

/// A rank-0 input is a shape error naming the op.
#[test]
fn softmax_rejects_scalars() {
    let x = candle_core::Tensor::new(1.0f32, &candle_core::Device::Cpu).unwrap();
    let e = softmax_last_dim(&x).unwrap_err().to_string();
    assert!(e.contains("softmax"), "{e}");
}
