//! Fused GELU against the composed twin, f64 finite differences, and bf16.
mod common;

use candle_core::{DType, Tensor};
use common::*;
use stoker_kernels::{gelu, reference};

/// f32 fused vs composed: forward within 1e-6 absolute, backward within 1e-5 absolute
/// (inputs in [-4, 4]; the two differ only in f32 rounding order).
#[test]
fn gelu_matches_composed_f32() {
    for (i, &shape) in SHAPES.iter().enumerate() {
        let x = var(shape, i as u64, 4.0);
        let yf = gelu(x.as_tensor()).unwrap();
        let yc = reference::gelu(x.as_tensor()).unwrap();
        assert!(
            max_abs(&yf, &yc) <= 1e-6,
            "{shape:?} fwd {}",
            max_abs(&yf, &yc)
        );
        let gf = weighted_sum(&yf, 99).unwrap().backward().unwrap();
        let gc = weighted_sum(&yc, 99).unwrap().backward().unwrap();
        let (gf, gc) = (
            gf.get(x.as_tensor()).unwrap(),
            gc.get(x.as_tensor()).unwrap(),
        );
        assert!(max_abs(gf, gc) <= 1e-5, "{shape:?} bwd {}", max_abs(gf, gc));
    }
}

fn gelu64(x: &[f64]) -> Vec<f64> {
    let k = (2.0 / std::f64::consts::PI).sqrt();
    x.iter()
        .map(|&x| 0.5 * x * (1.0 + (k * (x + 0.044715 * x * x * x)).tanh()))
        .collect()
}

/// f32 fused backward vs f64 central differences: within 1e-5 of max(1, |grad|).
#[test]
fn gelu_backward_matches_finite_differences() {
    for (i, &shape) in FD_SHAPES.iter().enumerate() {
        let x = var(shape, 10 + i as u64, 4.0);
        let g = weighted_sum(&gelu(x.as_tensor()).unwrap(), 7)
            .unwrap()
            .backward()
            .unwrap();
        let xs = x
            .as_tensor()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let fd = fd_grad(&xs, 7, gelu64);
        let err = max_rel_f64(g.get(x.as_tensor()).unwrap(), &fd);
        assert!(err <= 1e-5, "{shape:?} {err}");
    }
}

/// bf16 fused vs f32 fused on the same (bf16-representable) inputs: forward within
/// 2^-8 of max(1, |y|) (one bf16 rounding), backward within 2^-7 (the grad is also bf16).
#[test]
fn gelu_bf16_matches_f32() {
    for (i, &shape) in SHAPES.iter().enumerate() {
        let x16 = var(shape, 20 + i as u64, 4.0)
            .as_tensor()
            .to_dtype(DType::BF16)
            .unwrap();
        let x16 = candle_core::Var::from_tensor(&x16).unwrap();
        let x32 = candle_core::Var::from_tensor(&x16.to_dtype(DType::F32).unwrap()).unwrap();
        let y16 = gelu(x16.as_tensor()).unwrap();
        let y32 = gelu(x32.as_tensor()).unwrap();
        let tol = max_mag(&y32).max(1.0) / 256.0;
        assert!(max_abs(&y16, &y32) <= tol, "{shape:?} fwd");
        let g16 = weighted_sum(&y16, 3).unwrap().backward().unwrap();
        let g32 = weighted_sum(&y32, 3).unwrap().backward().unwrap();
        let (g16, g32) = (
            g16.get(x16.as_tensor()).unwrap(),
            g32.get(x32.as_tensor()).unwrap(),
        );
        assert_eq!(g16.dtype(), DType::BF16);
        assert!(
            max_abs(g16, g32) <= max_mag(g32).max(1.0) / 128.0,
            "{shape:?} bwd {}",
            max_abs(g16, g32)
        );
    }
}

/// Integer input is an error naming the op, not a panic.
#[test]
fn gelu_rejects_integers() {
    let x = Tensor::new(&[1u32, 2], &candle_core::Device::Cpu).unwrap();
    let e = gelu(&x).unwrap_err().to_string();
    assert!(e.contains("gelu"), "{e}");
}
