//! Fused causal attention against the composed twin, f64 finite differences, and bf16.
mod common;

use candle_core::{DType, Var};
use common::*;
use stoker_kernels::{causal_attention, reference};

/// [B, H, T, D]: one element, odd T and D, T not a multiple of a vector, a longer T.
const SHAPES4: &[[usize; 4]] = &[
    [1, 1, 1, 1],
    [1, 1, 7, 3],
    [2, 3, 17, 5],
    [1, 2, 33, 8],
    [1, 1, 130, 16],
];

fn qkv(shape: &[usize], seed: u64) -> [Var; 3] {
    [
        var(shape, seed, 1.5),
        var(shape, seed + 1, 1.5),
        var(shape, seed + 2, 1.0),
    ]
}

/// f32 fused vs composed: output within 1e-5, dq/dk/dv within 1e-5 of max(1, |grad|).
#[test]
fn attention_matches_composed_f32() {
    for (i, shape) in SHAPES4.iter().enumerate() {
        let [q, k, v] = qkv(shape, 10 * i as u64);
        let yf = causal_attention(q.as_tensor(), k.as_tensor(), v.as_tensor()).unwrap();
        let yc = reference::causal_attention(q.as_tensor(), k.as_tensor(), v.as_tensor()).unwrap();
        assert!(
            max_abs(&yf, &yc) <= 1e-5,
            "{shape:?} fwd {}",
            max_abs(&yf, &yc)
        );
        let gf = weighted_sum(&yf, 3).unwrap().backward().unwrap();
        let gc = weighted_sum(&yc, 3).unwrap().backward().unwrap();
        for (name, x) in [("dq", &q), ("dk", &k), ("dv", &v)] {
            let (a, c) = (
                gf.get(x.as_tensor()).unwrap(),
                gc.get(x.as_tensor()).unwrap(),
            );
            assert_eq!(a.shape(), x.shape());
            let tol = 1e-5 * max_mag(c).max(1.0);
            assert!(max_abs(a, c) <= tol, "{shape:?} {name} {}", max_abs(a, c));
        }
    }
}

/// Causal attention in f64 on flat `q | k | v` of one `[B, H, T, D]` shape.
fn attention64(shape: [usize; 4]) -> impl Fn(&[f64]) -> Vec<f64> {
    move |x: &[f64]| {
        let [b, h, t, d] = shape;
        let n = b * h * t * d;
        let (q, k, v) = (&x[..n], &x[n..2 * n], &x[2 * n..]);
        let mut out = vec![0.0; n];
        for head in 0..b * h {
            let at = |m: &[f64], r: usize, c: usize| m[head * t * d + r * d + c];
            for i in 0..t {
                let s: Vec<f64> = (0..=i)
                    .map(|j| {
                        (0..d).map(|c| at(q, i, c) * at(k, j, c)).sum::<f64>() / (d as f64).sqrt()
                    })
                    .collect();
                let m = s
                    .iter()
                    .cloned()
                    .fold(f64::NEG_INFINITY, stoker_testkit::nan_max);
                let z: f64 = s.iter().map(|s| (s - m).exp()).sum();
                for c in 0..d {
                    out[head * t * d + i * d + c] = s
                        .iter()
                        .enumerate()
                        .map(|(j, s)| (s - m).exp() / z * at(v, j, c))
                        .sum();
                }
            }
        }
        out
    }
}

/// f32 fused dq, dk, dv vs f64 central differences: within 1e-4 of max(1, |grad|).
#[test]
fn attention_backward_matches_finite_differences() {
    for (i, shape) in [[1, 1, 1, 1], [1, 1, 5, 3], [2, 1, 4, 2]]
        .iter()
        .enumerate()
    {
        let [q, k, v] = qkv(shape, 100 + 10 * i as u64);
        let y = causal_attention(q.as_tensor(), k.as_tensor(), v.as_tensor()).unwrap();
        let g = weighted_sum(&y, 4).unwrap().backward().unwrap();
        let flat = |x: &Var| {
            x.as_tensor()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        let xs: Vec<f32> = [flat(&q), flat(&k), flat(&v)].concat();
        // `weighted_sum` uses values(n, seed); fd_grad draws values(3n, seed) for 3n inputs,
        // so weight the f64 output with the same n values explicitly.
        let n = y.elem_count();
        let r: Vec<f64> = values(n, 4, 1.0).into_iter().map(f64::from).collect();
        let f = attention64(*shape);
        let mut x64: Vec<f64> = xs.iter().map(|&v| v as f64).collect();
        let loss = |x: &[f64]| f(x).iter().zip(&r).map(|(y, r)| y * r).sum::<f64>();
        let h = 1e-6;
        let fd: Vec<f64> = (0..x64.len())
            .map(|j| {
                let v0 = x64[j];
                x64[j] = v0 + h;
                let up = loss(&x64);
                x64[j] = v0 - h;
                let down = loss(&x64);
                x64[j] = v0;
                (up - down) / (2.0 * h)
            })
            .collect();
        for (p, (name, x)) in [("dq", &q), ("dk", &k), ("dv", &v)].into_iter().enumerate() {
            let err = max_rel_f64(g.get(x.as_tensor()).unwrap(), &fd[p * n..(p + 1) * n]);
            assert!(err <= 1e-4, "{shape:?} {name} {err}");
        }
    }
}

/// bf16 fused vs f32 fused on the same inputs: output within 2^-7 of max(1, |y|), grads
/// within 2^-5 of max(1, |grad|) (dk and dv sum over up to T bf16-rounded terms).
#[test]
fn attention_bf16_matches_f32() {
    for (i, shape) in SHAPES4.iter().enumerate() {
        let vars = qkv(shape, 200 + 10 * i as u64);
        let bf = |v: &Var| Var::from_tensor(&v.to_dtype(DType::BF16).unwrap()).unwrap();
        let f32v = |v: &Var| Var::from_tensor(&v.to_dtype(DType::F32).unwrap()).unwrap();
        let x16: Vec<Var> = vars.iter().map(bf).collect();
        let x32: Vec<Var> = x16.iter().map(f32v).collect();
        let y16 =
            causal_attention(x16[0].as_tensor(), x16[1].as_tensor(), x16[2].as_tensor()).unwrap();
        let y32 =
            causal_attention(x32[0].as_tensor(), x32[1].as_tensor(), x32[2].as_tensor()).unwrap();
        assert!(
            max_abs(&y16, &y32) <= max_mag(&y32).max(1.0) / 128.0,
            "{shape:?} fwd"
        );
        let g16 = weighted_sum(&y16, 5).unwrap().backward().unwrap();
        let g32 = weighted_sum(&y32, 5).unwrap().backward().unwrap();
        for (a, c) in x16.iter().zip(&x32) {
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

/// Mismatched q/k shapes are an error naming the op.
#[test]
fn attention_rejects_mismatched_shapes() {
    let (q, k) = (var(&[1, 1, 4, 2], 1, 1.0), var(&[1, 1, 3, 2], 2, 1.0));
    let e = causal_attention(q.as_tensor(), k.as_tensor(), q.as_tensor())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("causal-attention") && e.contains("k must match"),
        "{e}"
    );
}

/// The packed-QKV op against the composed split + attention + merge: `[B, T, 3 H D]`
/// shapes with one head, odd head widths and T, f32 to 1e-5, bf16 to bf16 rounding.
#[test]
fn packed_qkv_attention_matches_composed() {
    use stoker_kernels::causal_attention_qkv;
    // (B, T, heads, head width)
    for (i, &(b, t, h, d)) in [(1, 1, 1, 1), (2, 7, 3, 5), (1, 33, 2, 8), (3, 17, 4, 3)]
        .iter()
        .enumerate()
    {
        for (dtype, tol) in [(DType::F32, 1e-5f32), (DType::BF16, 2.0 / 128.0)] {
            let x = var(&[b, t, 3 * h * d], 70 + i as u64, 1.5);
            let x = Var::from_tensor(&x.as_tensor().to_dtype(dtype).unwrap()).unwrap();
            let yf = causal_attention_qkv(x.as_tensor(), h).unwrap();
            let yc = reference::causal_attention_qkv(x.as_tensor(), h).unwrap();
            assert_eq!(yf.dims(), &[b, t, h * d]);
            let what = format!("{dtype:?} B{b} T{t} H{h} D{d}");
            let scale = max_mag(&yc).max(1.0);
            assert!(
                max_abs(&yf, &yc) <= tol * scale,
                "{what} fwd {}",
                max_abs(&yf, &yc)
            );
            let gf = weighted_sum(&yf, 5).unwrap().backward().unwrap();
            let gc = weighted_sum(&yc, 5).unwrap().backward().unwrap();
            let (a, c) = (
                gf.get(x.as_tensor()).unwrap(),
                gc.get(x.as_tensor()).unwrap(),
            );
            assert_eq!(a.dims(), x.dims());
            let tol = tol * max_mag(c).max(1.0);
            assert!(max_abs(a, c) <= tol, "{what} dqkv {}", max_abs(a, c));
        }
    }
    let bad = var(&[1, 4, 10], 1, 1.0);
    let e = causal_attention_qkv(bad.as_tensor(), 3)
        .unwrap_err()
        .to_string();
    assert!(e.contains("3 heads"), "{e}");
}
