//! Flash attention's kernels (`stoker_gpu::flash`, cuda/ops/flash.cuh) on the host build,
//! whose tensor-core products are the PTX fragment layouts multiplied out: the output,
//! each row's log-sum-exp and the three gradients against causal attention computed in
//! f64 from the same bf16 inputs, for head widths 16, 32 and 64 and T a multiple of 16
//! or not (partial tiles), below 16 too. The kernels round the probabilities (and their
//! gradient) to bf16 before the products they feed, as FlashAttention-2 does, so this is
//! a tolerance: a hundredth of the largest value.

use half::bf16;
use stoker_gpu::flash::{self, FlashShape};
use stoker_gpu::sample::uniform;
use stoker_gpu::{Backend, GpuError, Host};
use stoker_testkit::assert_close;

/// Causal attention in f64: the output, each row's log-sum-exp, dq, dk, dv.
struct Reference {
    out: Vec<f64>,
    lse: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
}

fn reference(q: &[f64], k: &[f64], v: &[f64], dout: &[f64], (bh, t, d): FlashShape) -> Reference {
    let n = bh * t * d;
    let scale = 1.0 / (d as f64).sqrt();
    let mut r = Reference {
        out: vec![0.0; n],
        lse: vec![0.0; bh * t],
        dq: vec![0.0; n],
        dk: vec![0.0; n],
        dv: vec![0.0; n],
    };
    for h in 0..bh {
        let at = |m: &[f64], row: usize, c: usize| m[(h * t + row) * d + c];
        for i in 0..t {
            let s: Vec<f64> = (0..=i)
                .map(|j| (0..d).map(|c| at(q, i, c) * at(k, j, c)).sum::<f64>() * scale)
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
            r.lse[h * t + i] = m + z.ln();
            let p: Vec<f64> = s.iter().map(|x| (x - m).exp() / z).collect();
            for c in 0..d {
                r.out[(h * t + i) * d + c] = (0..=i).map(|j| p[j] * at(v, j, c)).sum();
            }
            let dp: Vec<f64> = (0..=i)
                .map(|j| (0..d).map(|c| at(dout, i, c) * at(v, j, c)).sum())
                .collect();
            let corr: f64 = (0..d)
                .map(|c| at(dout, i, c) * r.out[(h * t + i) * d + c])
                .sum();
            for j in 0..=i {
                let ds = p[j] * (dp[j] - corr);
                for c in 0..d {
                    r.dq[(h * t + i) * d + c] += ds * at(k, j, c) * scale;
                    r.dk[(h * t + j) * d + c] += ds * at(q, i, c) * scale;
                    r.dv[(h * t + j) * d + c] += p[j] * at(dout, i, c);
                }
            }
        }
    }
    r
}

fn bf16s(n: usize, seed: u64, scale: f32) -> Vec<bf16> {
    uniform(n, seed, scale)
        .into_iter()
        .map(bf16::from_f32)
        .collect()
}

fn wide(x: &[bf16]) -> Vec<f64> {
    x.iter().map(|v| v.to_f64()).collect()
}

#[test]
fn flash_attention_is_causal_attention_within_bf16_rounding() {
    for shape @ (bh, t, d) in [
        (3, 37, 16),
        (2, 64, 32),
        (2, 48, 64),
        (1, 5, 64),
        (2, 16, 16),
    ] {
        let what = format!("B*H {bh}, T {t}, D {d}");
        let n = bh * t * d;
        let seed = (bh * 1000 + t * 10 + d) as u64;
        let (q, k, v, dout) = (
            bf16s(n, seed, 1.5),
            bf16s(n, seed + 1, 1.5),
            bf16s(n, seed + 2, 1.0),
            bf16s(n, seed + 3, 1.0),
        );
        let want = reference(&wide(&q), &wide(&k), &wide(&v), &wide(&dout), shape);
        let be = Host;
        let up = |x: &[bf16]| be.upload(x).unwrap();
        let (bq, bk, bv, bdo) = (up(&q), up(&k), up(&v), up(&dout));
        let out = be.zeros::<bf16>(n).unwrap();
        let lse = be.zeros::<f32>(bh * t).unwrap();
        let x = (be.all(&bq), be.all(&bk), be.all(&bv));
        flash::forward(&be, x, (be.all(&out), be.all(&lse)), shape).unwrap();
        let (dq, dk, dv) = (
            be.zeros::<bf16>(n).unwrap(),
            be.zeros::<bf16>(n).unwrap(),
            be.zeros::<bf16>(n).unwrap(),
        );
        let dsum = be.zeros::<f32>(bh * t).unwrap();
        flash::backward(
            &be,
            x,
            (be.all(&out), be.all(&bdo), be.all(&lse)),
            be.all(&dsum),
            (be.all(&dq), be.all(&dk), be.all(&dv)),
            shape,
        )
        .unwrap();
        let got = |b: &<Host as Backend>::Buf<bf16>| wide(&be.download(b).unwrap());
        assert_close(&got(&out), &want.out, 1e-2, &format!("{what}: output"));
        let lse: Vec<f64> = be
            .download(&lse)
            .unwrap()
            .iter()
            .map(|&x| x as f64)
            .collect();
        assert_close(&lse, &want.lse, 1e-3, &format!("{what}: log-sum-exp"));
        assert_close(&got(&dq), &want.dq, 2e-2, &format!("{what}: dq"));
        assert_close(&got(&dk), &want.dk, 2e-2, &format!("{what}: dk"));
        assert_close(&got(&dv), &want.dv, 2e-2, &format!("{what}: dv"));
    }
}

#[test]
fn flash_attention_refuses_other_head_widths_and_aliased_gradients() {
    let be = Host;
    let (bh, t, d) = (1, 8, 8);
    let a = be.zeros::<bf16>(bh * t * d).unwrap();
    let o = be.zeros::<bf16>(bh * t * d).unwrap();
    let l = be.zeros::<f32>(bh * t).unwrap();
    let x = (be.all(&a), be.all(&a), be.all(&a));
    match flash::forward(&be, x, (be.all(&o), be.all(&l)), (bh, t, d)) {
        Err(GpuError::Shape { what, .. }) => assert!(what.contains("head width 8"), "{what}"),
        other => panic!("head width 8: {other:?}"),
    }
    let (bh, t, d) = (1, 8, 16);
    let a = be.zeros::<bf16>(bh * t * d).unwrap();
    let x = (be.all(&a), be.all(&a), be.all(&a));
    // The output written over q.
    match flash::forward(&be, x, (be.all(&a), be.all(&l)), (bh, t, d)) {
        Err(GpuError::Shape { what, .. }) => assert!(what.contains("overlap"), "{what}"),
        other => panic!("the output over q: {other:?}"),
    }
}
