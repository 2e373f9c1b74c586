//! Fused layer norm against the composed twin, f64 finite differences, and bf16.
mod common;

use candle_core::{DType, Device, Tensor, Var};
use common::*;
use stoker_kernels::{layer_norm, reference};

const EPS: f64 = 1e-5;

fn params(d: usize, seed: u64) -> (Var, Var) {
    let w: Vec<f32> = values(d, seed, 0.5).iter().map(|v| v + 1.0).collect();
    let w = Var::from_vec(w, d, &Device::Cpu).unwrap();
    (w, var(&[d], seed + 1, 0.5))
}

/// f32 fused vs composed: forward within 1e-5, dx within 1e-4, dw/db within 1e-4 of
/// max(1, |grad|) (normalized values are O(1); 1/rstd amplifies rounding for [1,1]).
#[test]
fn layer_norm_matches_composed_f32() {
    for (i, &shape) in SHAPES
        .iter()
        .chain([&[2usize, 3, 5][..]].iter())
        .enumerate()
    {
        let d = *shape.last().unwrap();
        let x = var(shape, i as u64, 3.0);
        let (w, b) = params(d, 50 + i as u64);
        let yf = layer_norm(x.as_tensor(), w.as_tensor(), b.as_tensor(), EPS).unwrap();
        let yc = reference::layer_norm(x.as_tensor(), w.as_tensor(), b.as_tensor(), EPS).unwrap();
        assert!(
            max_abs(&yf, &yc) <= 1e-5,
            "{shape:?} fwd {}",
            max_abs(&yf, &yc)
        );
        let gf = weighted_sum(&yf, 6).unwrap().backward().unwrap();
        let gc = weighted_sum(&yc, 6).unwrap().backward().unwrap();
        for (name, v) in [("dx", &x), ("dw", &w), ("db", &b)] {
            let (a, c) = (
                gf.get(v.as_tensor()).unwrap(),
                gc.get(v.as_tensor()).unwrap(),
            );
            assert_eq!(a.shape(), v.shape());
            let tol = 1e-4 * max_mag(c).max(1.0);
            assert!(max_abs(a, c) <= tol, "{shape:?} {name} {}", max_abs(a, c));
        }
    }
}

fn ln64(d: usize, w: Vec<f64>, b: Vec<f64>) -> impl Fn(&[f64]) -> Vec<f64> {
    move |x: &[f64]| {
        x.chunks(d)
            .flat_map(|r| {
                let m = r.iter().sum::<f64>() / d as f64;
                let v = r.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / d as f64;
                let rs = 1.0 / (v + EPS).sqrt();
                r.iter()
                    .zip(&w)
                    .zip(&b)
                    .map(|((x, w), b)| (x - m) * rs * w + b)
                    .collect::<Vec<_>>()
            })
            .collect()
    }
}

fn to64(t: &Tensor) -> Vec<f64> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f64::from)
        .collect()
}

/// f32 fused dx, dw, db vs f64 central differences: within 1e-4 of max(1, |grad|).
/// (Widths > 1: for width 1 the output is `b` whatever `x`, and dx is 0 in both.)
#[test]
fn layer_norm_backward_matches_finite_differences() {
    for (i, &shape) in FD_SHAPES.iter().enumerate() {
        let (n, d) = (shape[0], shape[1]);
        let x = var(shape, 60 + i as u64, 3.0);
        let (w, b) = params(d, 70 + i as u64);
        let y = layer_norm(x.as_tensor(), w.as_tensor(), b.as_tensor(), EPS).unwrap();
        let g = weighted_sum(&y, 9).unwrap().backward().unwrap();
        let (x64, w64, b64) = (
            to64(x.as_tensor()),
            to64(w.as_tensor()),
            to64(b.as_tensor()),
        );
        let xs: Vec<f32> = x64.iter().map(|&v| v as f32).collect();
        let fd = fd_grad(&xs, 9, ln64(d, w64.clone(), b64.clone()));
        let err = max_rel_f64(g.get(x.as_tensor()).unwrap(), &fd);
        assert!(err <= 1e-4, "{shape:?} dx {err}");
        // dw: differentiate w.r.t. w with x fixed; r is the same `values(n*d, 9)`.
        let r: Vec<f64> = values(n * d, 9, 1.0).into_iter().map(f64::from).collect();
        let h = 1e-6;
        let loss = |w: &[f64], b: &[f64]| -> f64 {
            ln64(d, w.to_vec(), b.to_vec())(&x64)
                .iter()
                .zip(&r)
                .map(|(y, r)| y * r)
                .sum()
        };
        let (mut dw, mut db) = (vec![0.0; d], vec![0.0; d]);
        for j in 0..d {
            let (mut wp, mut wm) = (w64.clone(), w64.clone());
            wp[j] += h;
            wm[j] -= h;
            dw[j] = (loss(&wp, &b64) - loss(&wm, &b64)) / (2.0 * h);
            let (mut bp, mut bm) = (b64.clone(), b64.clone());
            bp[j] += h;
            bm[j] -= h;
            db[j] = (loss(&w64, &bp) - loss(&w64, &bm)) / (2.0 * h);
        }
        assert!(
            max_rel_f64(g.get(w.as_tensor()).unwrap(), &dw) <= 1e-4,
            "{shape:?} dw"
        );
        assert!(
            max_rel_f64(g.get(b.as_tensor()).unwrap(), &db) <= 1e-4,
            "{shape:?} db"
        );
    }
}

/// bf16 fused vs f32 fused on the same inputs: forward within 2^-7 of max(1, |y|),
/// grads within 2^-5 of max(1, |grad|) (dw and db sum over rows of bf16 products).
#[test]
fn layer_norm_bf16_matches_f32() {
    for (i, &shape) in SHAPES.iter().enumerate() {
        let d = *shape.last().unwrap();
        let bf = |v: &Var| Var::from_tensor(&v.to_dtype(DType::BF16).unwrap()).unwrap();
        let f32v = |v: &Var| Var::from_tensor(&v.to_dtype(DType::F32).unwrap()).unwrap();
        let (w, b) = params(d, 80 + i as u64);
        let (x16, w16, b16) = (bf(&var(shape, 90 + i as u64, 3.0)), bf(&w), bf(&b));
        let (x32, w32, b32) = (f32v(&x16), f32v(&w16), f32v(&b16));
        let y16 = layer_norm(x16.as_tensor(), w16.as_tensor(), b16.as_tensor(), EPS).unwrap();
        let y32 = layer_norm(x32.as_tensor(), w32.as_tensor(), b32.as_tensor(), EPS).unwrap();
        assert!(
            max_abs(&y16, &y32) <= max_mag(&y32).max(1.0) / 128.0,
            "{shape:?} fwd"
        );
        let g16 = weighted_sum(&y16, 2).unwrap().backward().unwrap();
        let g32 = weighted_sum(&y32, 2).unwrap().backward().unwrap();
        for (a, c) in [(&x16, &x32), (&w16, &w32), (&b16, &b32)] {
            let (a, c) = (
                g16.get(a.as_tensor()).unwrap(),
                g32.get(c.as_tensor()).unwrap(),
            );
            assert!(
                max_abs(a, c) <= max_mag(c).max(1.0) / 32.0,
                "{shape:?} {}",
                max_abs(a, c)
            );
        }
    }
}

/// A weight of the wrong width is a shape error naming the op and the shape.
#[test]
fn layer_norm_rejects_bad_weight() {
    let x = var(&[2, 4], 1, 1.0);
    let (w, b) = params(3, 2);
    let e = layer_norm(x.as_tensor(), w.as_tensor(), b.as_tensor(), EPS)
        .unwrap_err()
        .to_string();
    assert!(e.contains("layer-norm") && e.contains("[3]"), "{e}");
}
