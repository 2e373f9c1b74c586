//! Fused cross-entropy (sum over valid tokens) against the composed twin, f64 finite
//! differences, bf16, ignored rows and bad targets.
mod common;

use candle_core::{DType, Device, Tensor, Var};
use common::*;
use stoker_kernels::{cross_entropy_sum, reference, valid_token_count};

const IGNORE: i64 = -100;

/// Targets for `n` rows of `v` classes; every third row (from row 1) ignored.
fn targets(n: usize, v: usize, seed: u64) -> Vec<i64> {
    values(n, seed, 1.0)
        .iter()
        .enumerate()
        .map(|(i, r)| {
            if i % 3 == 1 {
                IGNORE
            } else {
                ((r.abs() * v as f32) as i64).min(v as i64 - 1)
            }
        })
        .collect()
}

/// f32 fused vs composed, i64 and u32 targets: loss within 1e-5 of max(1, |loss|),
/// dlogits within 1e-6 absolute (softmax entries are below 1).
#[test]
fn cross_entropy_matches_composed_f32() {
    for (i, &shape) in SHAPES.iter().chain([&[5usize, 3][..]].iter()).enumerate() {
        let (n, v) = (shape[0], shape[1]);
        let x = var(shape, i as u64, 6.0);
        let t = targets(n, v, 100 + i as u64);
        let t64 = Tensor::new(t.as_slice(), &Device::Cpu).unwrap();
        // u32 targets cannot hold -100: use v (out of range) as their ignore index.
        let t32: Vec<u32> = t
            .iter()
            .map(|&t| if t == IGNORE { v as u32 } else { t as u32 })
            .collect();
        let t32 = Tensor::new(t32.as_slice(), &Device::Cpu).unwrap();
        for (tt, ign) in [(&t64, IGNORE), (&t32, v as i64)] {
            let lf = cross_entropy_sum(x.as_tensor(), tt, ign).unwrap();
            let lc = reference::cross_entropy_sum(x.as_tensor(), tt, ign).unwrap();
            assert_eq!(lf.dims(), &[] as &[usize]);
            let tol = 1e-5 * max_mag(&lc).max(1.0);
            assert!(
                max_abs(&lf, &lc) <= tol,
                "{shape:?} loss {}",
                max_abs(&lf, &lc)
            );
            let gf = (lf * 0.7).unwrap().backward().unwrap();
            let gc = (lc * 0.7).unwrap().backward().unwrap();
            let (gf, gc) = (
                gf.get(x.as_tensor()).unwrap(),
                gc.get(x.as_tensor()).unwrap(),
            );
            assert!(
                max_abs(gf, gc) <= 1e-6,
                "{shape:?} grad {}",
                max_abs(gf, gc)
            );
        }
    }
}

/// f32 fused dlogits vs f64 central differences: within 1e-6 of max(1, |grad|).
#[test]
fn cross_entropy_backward_matches_finite_differences() {
    for (i, &shape) in FD_SHAPES.iter().enumerate() {
        let (n, v) = (shape[0], shape[1]);
        let x = var(shape, 110 + i as u64, 6.0);
        let t = targets(n, v, 120 + i as u64);
        let tt = Tensor::new(t.as_slice(), &Device::Cpu).unwrap();
        let g = cross_entropy_sum(x.as_tensor(), &tt, IGNORE)
            .unwrap()
            .backward()
            .unwrap();
        let xs = x
            .as_tensor()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let mut fd = vec![0.0; n * v];
        let h = 1e-6;
        let loss = |x: &[f64]| -> f64 {
            x.chunks(v)
                .zip(&t)
                .filter(|(_, &t)| t != IGNORE)
                .map(|(r, &t)| {
                    let m = r
                        .iter()
                        .cloned()
                        .fold(f64::NEG_INFINITY, stoker_testkit::nan_max);
                    m + r.iter().map(|x| (x - m).exp()).sum::<f64>().ln() - r[t as usize]
                })
                .sum()
        };
        let mut x64: Vec<f64> = xs.iter().map(|&v| v as f64).collect();
        for (j, fd) in fd.iter_mut().enumerate() {
            let v0 = x64[j];
            x64[j] = v0 + h;
            let up = loss(&x64);
            x64[j] = v0 - h;
            let down = loss(&x64);
            x64[j] = v0;
            *fd = (up - down) / (2.0 * h);
        }
        let err = max_rel_f64(g.get(x.as_tensor()).unwrap(), &fd);
        assert!(err <= 1e-6, "{shape:?} {err}");
    }
}

/// bf16 logits vs the same logits in f32: loss within 1e-5 relative (both computed in
/// f32 from identical values), dlogits within 2^-8 (one bf16 rounding of a value < 1).
#[test]
fn cross_entropy_bf16_matches_f32() {
    for (i, &shape) in SHAPES.iter().enumerate() {
        let (n, v) = (shape[0], shape[1]);
        let x16 = Var::from_tensor(
            &var(shape, 130 + i as u64, 6.0)
                .to_dtype(DType::BF16)
                .unwrap(),
        )
        .unwrap();
        let x32 = Var::from_tensor(&x16.to_dtype(DType::F32).unwrap()).unwrap();
        let tt = Tensor::new(targets(n, v, 140 + i as u64).as_slice(), &Device::Cpu).unwrap();
        let l16 = cross_entropy_sum(x16.as_tensor(), &tt, IGNORE).unwrap();
        let l32 = cross_entropy_sum(x32.as_tensor(), &tt, IGNORE).unwrap();
        assert_eq!(l16.dtype(), DType::F32);
        assert!(
            max_abs(&l16, &l32) <= 1e-5 * max_mag(&l32).max(1.0),
            "{shape:?} loss"
        );
        let g16 = l16.backward().unwrap();
        let g32 = l32.backward().unwrap();
        let (g16, g32) = (
            g16.get(x16.as_tensor()).unwrap(),
            g32.get(x32.as_tensor()).unwrap(),
        );
        assert_eq!(g16.dtype(), DType::BF16);
        assert!(max_abs(g16, g32) <= 1.0 / 256.0, "{shape:?} grad");
    }
}

/// Ignored rows add no loss and get exactly zero gradient; the count skips them.
#[test]
fn cross_entropy_ignores_rows() {
    let x = var(&[4, 5], 7, 3.0);
    let tt = Tensor::new(&[1i64, IGNORE, 4, IGNORE], &Device::Cpu).unwrap();
    assert_eq!(valid_token_count(&tt, IGNORE).unwrap(), 2);
    let all = cross_entropy_sum(x.as_tensor(), &tt, IGNORE).unwrap();
    let kept = Tensor::new(&[1i64, 4], &Device::Cpu).unwrap();
    let rows = x
        .as_tensor()
        .index_select(&Tensor::new(&[0u32, 2], &Device::Cpu).unwrap(), 0)
        .unwrap();
    let part = cross_entropy_sum(&rows, &kept, IGNORE).unwrap();
    assert!(max_abs(&all, &part) <= 1e-6);
    let g = all.backward().unwrap();
    let g = g.get(x.as_tensor()).unwrap().to_vec2::<f32>().unwrap();
    assert!(g[1].iter().chain(&g[3]).all(|&v| v == 0.0));
    // Each valid row's gradient sums to zero (softmax minus one-hot).
    assert!(g[0].iter().sum::<f32>().abs() <= 1e-6);
}

/// A target outside 0..V that is not the ignore index is an error naming op and row.
#[test]
fn cross_entropy_rejects_bad_targets() {
    let x = var(&[2, 5], 7, 3.0);
    let tt = Tensor::new(&[1i64, 5], &Device::Cpu).unwrap();
    let e = cross_entropy_sum(x.as_tensor(), &tt, IGNORE)
        .unwrap_err()
        .to_string();
    assert!(e.contains("cross-entropy") && e.contains("row 1"), "{e}");
    let tt = Tensor::new(&[1i64], &Device::Cpu).unwrap();
    let e = cross_entropy_sum(x.as_tensor(), &tt, IGNORE)
        .unwrap_err()
        .to_string();
    assert!(e.contains("targets must be [2]"), "{e}");
}
