//! Llama's fused ops (RMSNorm, rotary embeddings, SwiGLU's gate) against their composed
//! twins in `reference` (forward and every gradient, f32), bf16 against f32, and bad
//! shapes named.
mod common;

use candle_core::{DType, Device, Tensor, Var};
use common::*;
use stoker_kernels::{reference, rms_norm, rope, swiglu};

const EPS: f64 = 1e-5;
/// Rotary shapes `[B, T, H, D]`: one position, odd head counts, a long window.
const ROPE_SHAPES: &[[usize; 4]] = &[[1, 1, 1, 2], [2, 5, 3, 8], [1, 17, 2, 6], [1, 300, 1, 64]];

fn gain(d: usize, seed: u64) -> Var {
    let w: Vec<f32> = values(d, seed, 0.5).iter().map(|v| v + 1.0).collect();
    Var::from_vec(w, d, &Device::Cpu).unwrap()
}

/// Largest difference of the gradients of `vars` between two outputs' weighted sums,
/// each against `tol` x max(1, |reference grad|).
fn assert_grads(what: &str, fused: &Tensor, composed: &Tensor, vars: &[&Var], tol: f32) {
    let gf = weighted_sum(fused, 6).unwrap().backward().unwrap();
    let gc = weighted_sum(composed, 6).unwrap().backward().unwrap();
    for (i, v) in vars.iter().enumerate() {
        let (a, c) = (
            gf.get(v.as_tensor()).unwrap(),
            gc.get(v.as_tensor()).unwrap(),
        );
        assert_eq!(a.shape(), v.shape(), "{what} grad {i}");
        let d = max_abs(a, c);
        assert!(d <= tol * max_mag(c).max(1.0), "{what} grad {i}: {d}");
    }
}

#[test]
fn rms_norm_matches_composed_f32() {
    for (i, &shape) in SHAPES
        .iter()
        .chain([&[2usize, 3, 5][..]].iter())
        .enumerate()
    {
        let d = *shape.last().unwrap();
        let (x, w) = (var(shape, i as u64, 3.0), gain(d, 40 + i as u64));
        let yf = rms_norm(x.as_tensor(), w.as_tensor(), EPS).unwrap();
        let yc = reference::rms_norm(x.as_tensor(), w.as_tensor(), EPS).unwrap();
        assert!(
            max_abs(&yf, &yc) <= 1e-5,
            "{shape:?} fwd {}",
            max_abs(&yf, &yc)
        );
        assert_grads(&format!("rms-norm {shape:?}"), &yf, &yc, &[&x, &w], 1e-4);
    }
}

#[test]
fn rope_matches_composed_f32_and_keeps_each_pair_s_length() {
    for (i, &shape) in ROPE_SHAPES.iter().enumerate() {
        let x = var(&shape, 10 + i as u64, 2.0);
        for base in [10_000.0, 500_000.0] {
            let yf = rope(x.as_tensor(), base).unwrap();
            let yc = reference::rope(x.as_tensor(), base).unwrap();
            assert!(
                max_abs(&yf, &yc) <= 2e-6,
                "{shape:?} fwd {}",
                max_abs(&yf, &yc)
            );
            assert_grads(&format!("rope {shape:?}"), &yf, &yc, &[&x], 1e-5);
            // A rotation: |y| = |x| per head.
            let n = |t: &Tensor| {
                t.sqr()
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap()
            };
            let (nx, ny) = (n(x.as_tensor()), n(&yf));
            assert!((nx - ny).abs() <= 1e-5 * nx.max(1.0), "{shape:?} {nx} {ny}");
        }
        // Position 0 does not turn.
        let y0 = rope(&x.as_tensor().narrow(1, 0, 1).unwrap(), 10_000.0).unwrap();
        assert_eq!(max_abs(&y0, &x.as_tensor().narrow(1, 0, 1).unwrap()), 0.0);
    }
}

#[test]
fn swiglu_matches_composed_f32() {
    for (i, &shape) in SHAPES.iter().enumerate() {
        let (g, u) = (
            var(shape, 20 + i as u64, 4.0),
            var(shape, 30 + i as u64, 2.0),
        );
        let yf = swiglu(g.as_tensor(), u.as_tensor()).unwrap();
        let yc = reference::swiglu(g.as_tensor(), u.as_tensor()).unwrap();
        assert!(
            max_abs(&yf, &yc) <= 1e-5 * max_mag(&yc).max(1.0),
            "{shape:?} fwd"
        );
        assert_grads(&format!("swiglu {shape:?}"), &yf, &yc, &[&g, &u], 1e-5);
    }
}

/// bf16 against f32 on the same (bf16-representable) inputs: forwards within 2^-7 and
/// gradients within 2^-5 of max(1, |f32|).
#[test]
fn llama_ops_in_bf16_match_f32() {
    let bf = |v: &Var| Var::from_tensor(&v.to_dtype(DType::BF16).unwrap()).unwrap();
    let up = |v: &Var| Var::from_tensor(&v.to_dtype(DType::F32).unwrap()).unwrap();
    type Op = dyn Fn(&[&Tensor]) -> Tensor;
    let cases: Vec<(&str, Vec<Var>, Box<Op>)> = vec![
        (
            "rms-norm",
            vec![var(&[3, 33], 1, 3.0), gain(33, 2)],
            Box::new(|v: &[&Tensor]| rms_norm(v[0], v[1], EPS).unwrap()),
        ),
        (
            "rope",
            vec![var(&[2, 9, 3, 16], 3, 2.0)],
            Box::new(|v: &[&Tensor]| rope(v[0], 10_000.0).unwrap()),
        ),
        (
            "swiglu",
            vec![var(&[4, 65], 4, 4.0), var(&[4, 65], 5, 2.0)],
            Box::new(|v: &[&Tensor]| swiglu(v[0], v[1]).unwrap()),
        ),
    ];
    for (name, vars, op) in cases {
        let v16: Vec<Var> = vars.iter().map(bf).collect();
        let v32: Vec<Var> = v16.iter().map(up).collect();
        let y16 = op(&v16.iter().map(|v| v.as_tensor()).collect::<Vec<_>>());
        let y32 = op(&v32.iter().map(|v| v.as_tensor()).collect::<Vec<_>>());
        let d = max_abs(&y16, &y32);
        assert!(d <= max_mag(&y32).max(1.0) / 128.0, "{name} fwd {d}");
        let g16 = weighted_sum(&y16, 2).unwrap().backward().unwrap();
        let g32 = weighted_sum(&y32, 2).unwrap().backward().unwrap();
        for (a, c) in v16.iter().zip(&v32) {
            let (a, c) = (
                g16.get(a.as_tensor()).unwrap(),
                g32.get(c.as_tensor()).unwrap(),
            );
            let d = max_abs(a, c);
            assert!(d <= max_mag(c).max(1.0) / 32.0, "{name} grad {d}");
        }
    }
}

#[test]
fn llama_ops_name_bad_shapes() {
    let x = var(&[2, 4], 1, 1.0);
    let e = rms_norm(x.as_tensor(), gain(3, 2).as_tensor(), EPS)
        .unwrap_err()
        .to_string();
    assert!(e.contains("rms-norm") && e.contains("[3]"), "{e}");
    let e = rope(var(&[1, 2, 1, 3], 1, 1.0).as_tensor(), 1e4)
        .unwrap_err()
        .to_string();
    assert!(e.contains("rope") && e.contains("D even"), "{e}");
    let e = rope(x.as_tensor(), 1e4).unwrap_err().to_string();
    assert!(e.contains("[B, T, H, D]"), "{e}");
    let e = swiglu(x.as_tensor(), var(&[2, 5], 2, 1.0).as_tensor())
        .unwrap_err()
        .to_string();
    assert!(e.contains("swiglu") && e.contains("differ"), "{e}");
}
