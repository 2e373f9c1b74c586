//! The host build of the row kernels (one warp per row) against stoker-kernels' CPU ops:
//! layer norm with and without the fused residual, the fused classifier, and causal
//! attention assembled from the layout kernels, the softmax kernels and plain matrix
//! products. The sums are bracketed differently (32 lanes and a butterfly against 8-wide
//! accumulators), so f32 agrees within float rounding; bf16 storage within bf16's.

mod common;

use candle_core::{Device, Tensor};
use common::*;
use half::bf16;
use stoker_gpu::host::{self, RowStats};
use stoker_gpu::Heads;
use stoker_testkit::{assert_bits_eq, assert_close};

/// bf16 storage against the f32 kernel: a relative error a few times bf16's 2^-8.
const BF16_REL: f64 = 2e-2;

#[test]
fn layernorm_matches_the_cpu_op_forward_and_backward() {
    let (rows, c) = (37, 70);
    let x = uniform(rows * c, 11, 2.0);
    let w = uniform(c, 12, 1.0);
    let b = uniform(c, 13, 0.5);
    let dy = uniform(rows * c, 14, 1.0);
    let (xv, wv, bv) = (var(&x, &[rows, c]), var(&w, &[c]), var(&b, &[c]));
    let y =
        stoker_kernels::layer_norm(xv.as_tensor(), wv.as_tensor(), bv.as_tensor(), 1e-5).unwrap();
    let dyt = Tensor::from_slice(&dy, (rows, c), &Device::Cpu).unwrap();
    let grads = (&y * &dyt).unwrap().sum_all().unwrap().backward().unwrap();

    let (mut out, mut mean, mut rstd) = (
        vec![0.0f32; rows * c],
        vec![0.0f32; rows],
        vec![0.0f32; rows],
    );
    let stats = RowStats {
        mean: &mut mean,
        rstd: &mut rstd,
    };
    host::layernorm_forward(&mut out, stats, &x, None, &w, &b, 1e-5).unwrap();
    assert_close(&out, &values(&y), 2e-6, "layernorm forward");

    for warps in [1, 5, 64] {
        let mut dx = vec![0.25f32; rows * c];
        let (mut dw, mut db) = (vec![0.0f32; c], vec![0.0f32; c]);
        host::layernorm_backward(&mut dx, &mut dw, &mut db, &dy, &x, &w, &mean, &rstd, warps)
            .unwrap();
        let want_dx: Vec<f32> = values(grads.get(xv.as_tensor()).unwrap())
            .iter()
            .map(|g| g + 0.25)
            .collect();
        assert_close(&dx, &want_dx, 2e-6, "layernorm dx (added)");
        assert_close(
            &dw,
            &values(grads.get(wv.as_tensor()).unwrap()),
            2e-6,
            "layernorm dweight",
        );
        assert_close(
            &db,
            &values(grads.get(bv.as_tensor()).unwrap()),
            2e-6,
            "layernorm dbias",
        );
    }

    // The fused residual: the same as adding first.
    let a2 = uniform(rows * c, 15, 1.0);
    let sum: Vec<f32> = x.iter().zip(&a2).map(|(p, q)| p + q).collect();
    let mut want = vec![0.0f32; rows * c];
    let (mut m2, mut r2) = (vec![0.0f32; rows], vec![0.0f32; rows]);
    host::layernorm_forward(
        &mut want,
        RowStats {
            mean: &mut m2,
            rstd: &mut r2,
        },
        &sum,
        None,
        &w,
        &b,
        1e-5,
    )
    .unwrap();
    let mut resid = vec![0.0f32; rows * c];
    host::layernorm_forward(
        &mut out,
        RowStats {
            mean: &mut mean,
            rstd: &mut rstd,
        },
        &x,
        Some((&mut resid, &a2)),
        &w,
        &b,
        1e-5,
    )
    .unwrap();
    assert_bits_eq(&resid, &sum, "fused residual sum");
    assert_bits_eq(&out, &want, "layernorm after the fused residual");

    // bf16 storage.
    let (xb, wb, bb) = (to_bf16(&x), to_bf16(&w), to_bf16(&b));
    let mut outb = vec![bf16::ZERO; rows * c];
    host::layernorm_forward(
        &mut outb,
        RowStats {
            mean: &mut m2,
            rstd: &mut r2,
        },
        &xb,
        None,
        &wb,
        &bb,
        1e-5,
    )
    .unwrap();
    assert_close(
        &from_bf16(&outb),
        &values(&y),
        BF16_REL,
        "layernorm forward bf16",
    );
}

#[test]
fn classifier_is_cross_entropy_and_its_gradient() {
    let (n, v, vp) = (29, 53, 64);
    let logits = uniform(n * v, 21, 4.0);
    let mut targets = ids(n, 22, v);
    targets[3] = -100;
    targets[17] = -100;
    let lv = var(&logits, &[n, v]);
    let tt = Tensor::from_vec(
        targets.iter().map(|&t| t as i64).collect::<Vec<_>>(),
        n,
        &Device::Cpu,
    )
    .unwrap();
    let loss = stoker_kernels::cross_entropy_sum(lv.as_tensor(), &tt, -100).unwrap();
    let dscale = 1.0 / 27.0;
    let grads = (&loss * dscale as f64).unwrap().backward().unwrap();
    let want_grad = values(grads.get(lv.as_tensor()).unwrap());

    // Padded rows: the padding holds junk that must not count, and gets gradient 0.
    let mut padded: Vec<f32> = (0..n)
        .flat_map(|r| {
            logits[r * v..(r + 1) * v]
                .iter()
                .copied()
                .chain(std::iter::repeat_n(1e3, vp - v))
        })
        .collect();
    let mut losses = vec![0.0f32; n];
    host::classifier(&mut padded, &mut losses, &targets, v, dscale, -100).unwrap();
    let total: f64 = losses.iter().map(|&l| l as f64).sum();
    stoker_testkit::assert_close_scalar(total, values(&loss)[0] as f64, 1e-6, "summed loss");
    assert_eq!((losses[3], losses[17]), (0.0, 0.0), "ignored rows' losses");
    let got: Vec<f32> = (0..n)
        .flat_map(|r| padded[r * vp..r * vp + v].to_vec())
        .collect();
    assert_close(&got, &want_grad, 1e-6, "dlogits");
    assert!(
        (0..n).all(|r| padded[r * vp + v..(r + 1) * vp].iter().all(|&g| g == 0.0)),
        "the padding's gradient is not 0"
    );

    // Loss only (dscale 0): the logits stay.
    let mut kept = logits.clone();
    host::classifier(&mut kept, &mut losses, &targets, v, 0.0, -100).unwrap();
    assert_bits_eq(&kept, &logits, "logits without a gradient");

    let mut lb = to_bf16(&logits);
    let mut lossb = vec![0.0f32; n];
    host::classifier(&mut lb, &mut lossb, &targets, v, dscale, -100).unwrap();
    assert_close(&lossb, &losses, BF16_REL, "losses from bf16 logits");
    assert_close(&from_bf16(&lb), &want_grad, BF16_REL, "dlogits bf16");
}

/// `c[i, j] = sum_k a[i, k] b[j, k]` (`a` `[m, k]`, `b` `[n, k]`), or with `b` `[k, n]`
/// when not `bt`; per matrix of a batch.
fn matmul(
    a: &[f32],
    b: &[f32],
    batch: usize,
    (m, k, n): (usize, usize, usize),
    bt: bool,
    at: bool,
) -> Vec<f32> {
    let mut c = vec![0.0f32; batch * m * n];
    for z in 0..batch {
        let (a, b) = (
            &a[z * m * k..(z + 1) * m * k],
            &b[z * k * n..(z + 1) * k * n],
        );
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0f64;
                for l in 0..k {
                    let av = if at { a[l * m + i] } else { a[i * k + l] };
                    let bv = if bt { b[j * k + l] } else { b[l * n + j] };
                    s += av as f64 * bv as f64;
                }
                c[z * m * n + i * n + j] = s as f32;
            }
        }
    }
    c
}

/// Causal attention as the GPU step runs it: layouts, `q k^T`, the softmax kernel,
/// `att v`, and back; against stoker-kernels' fused attention and its gradient.
#[test]
fn attention_from_the_kernels_matches_the_cpu_op() {
    let (b, t, h, d) = (2, 13, 3, 8);
    let c = h * d;
    let g = Heads {
        b: b as i32,
        t: t as i32,
        h: h as i32,
        d: d as i32,
    };
    let qkv = uniform(b * t * 3 * c, 31, 1.5);
    let dout = uniform(b * t * c, 32, 1.0);
    let qv = var(&qkv, &[b, t, 3 * c]);
    let y = stoker_kernels::causal_attention_qkv(qv.as_tensor(), h).unwrap();
    let dyt = Tensor::from_slice(&dout, (b, t, c), &Device::Cpu).unwrap();
    let grads = (&y * &dyt).unwrap().sum_all().unwrap().backward().unwrap();

    let (bh, n) = (b * h, b * h * t * d);
    let scale = 1.0 / (d as f32).sqrt();
    let mut heads = vec![0.0f32; 3 * n];
    host::qkv_heads(&mut heads, &qkv, g, false).unwrap();
    let (q, rest) = heads.split_at(n);
    let (k, v) = rest.split_at(n);
    let pre = matmul(q, k, bh, (t, d, t), true, false);
    let mut att = vec![0.0f32; bh * t * t];
    host::attention_softmax_forward(&mut att, &pre, t, scale).unwrap();
    let out_h = matmul(&att, v, bh, (t, t, d), false, false);
    let mut out = vec![0.0f32; n];
    host::merged_heads(&mut out, &out_h, g, false).unwrap();
    assert_close(&out, &values(&y), 1e-5, "attention forward");

    let mut dout_h = vec![0.0f32; n];
    host::merged_heads(&mut dout_h, &dout, g, true).unwrap();
    let mut datt = matmul(&dout_h, v, bh, (t, d, t), true, false);
    let dv = matmul(&att, &dout_h, bh, (t, t, d), false, true);
    host::attention_softmax_backward_in_place(&att, &mut datt, t, scale).unwrap();
    let dq = matmul(&datt, k, bh, (t, t, d), false, false);
    let dk = matmul(&datt, q, bh, (t, t, d), false, true);
    let dheads: Vec<f32> = [dq, dk, dv].concat();
    let mut dqkv = vec![0.0f32; 3 * n];
    host::qkv_heads(&mut dqkv, &dheads, g, true).unwrap();
    assert_close(
        &dqkv,
        &values(grads.get(qv.as_tensor()).unwrap()),
        1e-5,
        "attention dqkv",
    );

    // The mask: no probability after the query, each row summing to 1.
    for r in 0..bh * t {
        let i = r % t;
        let row = &att[r * t..(r + 1) * t];
        assert!(
            row[i + 1..].iter().all(|&p| p == 0.0),
            "row {r} attends past its query"
        );
        let s: f32 = row.iter().sum();
        assert!((s - 1.0).abs() < 1e-6, "row {r} sums to {s}");
    }

    let mut attb = vec![bf16::ZERO; bh * t * t];
    host::attention_softmax_forward(&mut attb, &to_bf16(&pre), t, scale).unwrap();
    assert_close(&from_bf16(&attb), &att, BF16_REL, "attention softmax bf16");
}
