//! The fused linear layer against its composed twin (forward and all three gradients),
//! f32 to 1e-5 relative and bf16 to bf16 rounding, over awkward shapes and a 3-D input,
//! plus an f64 finite-difference check of the f32 op.

mod common;

use candle_core::{DType, Tensor, Var};
use common::{max_abs, max_mag, var};
use stoker_kernels::{linear, reference};

/// `(x dims, out features)`.
const SHAPES: &[(&[usize], usize)] = &[
    (&[1, 1], 1),
    (&[1, 7], 3),
    (&[3, 17], 5),
    (&[33, 65], 31),
    (&[2, 5, 24], 72),
    (&[64, 128], 96),
];

fn check(dtype: DType, tol: f32) {
    for (i, &(xd, n)) in SHAPES.iter().enumerate() {
        let k = *xd.last().unwrap();
        let seed = 10 * i as u64;
        let cast = |v: Var| Var::from_tensor(&v.as_tensor().to_dtype(dtype).unwrap()).unwrap();
        let (x, w, b) = (
            cast(var(xd, seed, 1.0)),
            cast(var(&[n, k], seed + 1, 0.5)),
            cast(var(&[n], seed + 2, 0.5)),
        );
        let mut out_dims = xd.to_vec();
        *out_dims.last_mut().unwrap() = n;
        let r = var(&out_dims, seed + 3, 1.0)
            .as_tensor()
            .to_dtype(dtype)
            .unwrap();
        let run = |f: &dyn Fn(&Tensor, &Tensor, &Tensor) -> candle_core::Result<Tensor>| {
            let y = f(x.as_tensor(), w.as_tensor(), b.as_tensor()).unwrap();
            let g = (y.clone() * &r)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let get = |v: &Var| g.get(v.as_tensor()).expect("gradient").clone();
            (y, get(&x), get(&w), get(&b))
        };
        let fused = run(&linear);
        let composed = run(&reference::linear);
        let pairs = [
            ("y", &fused.0, &composed.0),
            ("dx", &fused.1, &composed.1),
            ("dW", &fused.2, &composed.2),
            ("db", &fused.3, &composed.3),
        ];
        for (what, f, c) in pairs {
            assert_eq!(f.dims(), c.dims(), "{what} {xd:?}x{n}");
            assert_eq!(f.dtype(), dtype, "{what}");
            let (d, m) = (max_abs(f, c), max_mag(c));
            assert!(
                d <= tol * m.max(1e-6),
                "{dtype:?} {xd:?} -> {n}: {what} differs by {d:e} (max {m:e})"
            );
        }
    }
}

#[test]
fn fused_linear_matches_composed_f32() {
    check(DType::F32, 1e-5);
}

#[test]
fn fused_linear_matches_composed_bf16() {
    // Both round each output once to bf16 from f32 sums (2^-8 relative), in different
    // summation orders; dx and dW see the bf16-rounded upstream gradient alike.
    check(DType::BF16, 1.0 / 64.0);
}

#[test]
fn linear_gradient_matches_f64_finite_differences() {
    let x = var(&[3, 5], 1, 1.0);
    let w = var(&[4, 5], 2, 1.0);
    let b = var(&[4], 3, 1.0);
    let r = var(&[3, 4], 4, 1.0);
    let loss = |x: &Tensor, w: &Tensor, b: &Tensor| -> f64 {
        let y = reference::linear(
            &x.to_dtype(DType::F64).unwrap(),
            &w.to_dtype(DType::F64).unwrap(),
            &b.to_dtype(DType::F64).unwrap(),
        )
        .unwrap();
        (y * r.as_tensor().to_dtype(DType::F64).unwrap())
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    };
    let y = linear(x.as_tensor(), w.as_tensor(), b.as_tensor()).unwrap();
    let g = (y * r.as_tensor())
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    for (name, v) in [("x", &x), ("w", &w), ("b", &b)] {
        let analytic: Vec<f32> = g
            .get(v.as_tensor())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let base: Vec<f32> = v.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        for i in 0..base.len() {
            let h = 1e-3f64;
            let bump = |d: f64| {
                let mut p: Vec<f64> = base.iter().map(|&v| v as f64).collect();
                p[i] += d;
                Tensor::from_vec(p, v.as_tensor().shape(), v.device()).unwrap()
            };
            let (xs, ws, bs) = (
                x.as_tensor().clone(),
                w.as_tensor().clone(),
                b.as_tensor().clone(),
            );
            let eval = |t: Tensor| match name {
                "x" => loss(&t, &ws, &bs),
                "w" => loss(&xs, &t, &bs),
                _ => loss(&xs, &ws, &t),
            };
            let fd = (eval(bump(h)) - eval(bump(-h))) / (2.0 * h);
            assert!(
                (fd - analytic[i] as f64).abs() <= 1e-4 * fd.abs().max(1.0),
                "{name}[{i}]: fd {fd}, analytic {}",
                analytic[i]
            );
        }
    }
}
