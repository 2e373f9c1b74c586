//! The host build of the row kernels (one warp per row) against stoker-kernels' CPU ops:
//! layer norm with and without the fused residual, the fused classifier, and causal
//! attention assembled from the layout kernels, the softmax kernels and plain matrix
//! products. The sums are bracketed differently (32 lanes and a butterfly against 8-wide
//! accumulators), so f32 agrees within float rounding; bf16 storage within bf16's.

mod common;

use candle_core::{Device, Tensor};
use common::*;
use half::bf16;
use stoker_gpu::{kernels, Heads, Host};
use stoker_testkit::{assert_bits_eq, assert_close};

/// bf16 storage against the f32 kernel: a relative error a few times bf16's 2^-8.
const BF16_REL: f64 = 2e-2;

/// Layer norm on the host build: (out, mean, rstd, residual sum).
fn layernorm<T: stoker_gpu::Act>(
    x: &[T],
    a2: Option<&[T]>,
    w: &[T],
    b: &[T],
) -> (Vec<T>, Vec<f32>, Vec<f32>, Vec<T>) {
    let rows = x.len() / w.len();
    let (xb, wb, bb) = (up(x), up(w), up(b));
    let (out, mean, rstd, sum) = (
        zeros::<T>(x.len()),
        zeros::<f32>(rows),
        zeros::<f32>(rows),
        zeros::<T>(x.len()),
    );
    let a2b = a2.map(up);
    let residual = a2b.as_ref().map(|a| (all(&sum), all(a)));
    let stats = kernels::Stats {
        mean: all(&mean),
        rstd: all(&rstd),
    };
    kernels::layernorm_forward(
        &Host,
        all(&out),
        stats,
        all(&xb),
        residual,
        all(&wb),
        all(&bb),
        1e-5,
    )
    .unwrap();
    (down(&out), down(&mean), down(&rstd), down(&sum))
}

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

    let (out, mean, rstd, _) = layernorm(&x, None, &w, &b);
    assert_close(&out, &values(&y), 2e-6, "layernorm forward");

    let (xb, wb, dyb, mb, rb) = (up(&x), up(&w), up(&dy), up(&mean), up(&rstd));
    for warps in [1, 5, 64] {
        let (dx, dw, db) = (
            up(&vec![0.25f32; rows * c]),
            zeros::<f32>(c),
            zeros::<f32>(c),
        );
        let partials = zeros::<f32>(warps * 2 * c);
        let stats = kernels::Stats {
            mean: all(&mb),
            rstd: all(&rb),
        };
        kernels::layernorm_backward(
            &Host,
            all(&dx),
            all(&dw),
            all(&db),
            all(&partials),
            all(&dyb),
            all(&xb),
            all(&wb),
            stats,
            warps,
        )
        .unwrap();
        let want_dx: Vec<f32> = values(grads.get(xv.as_tensor()).unwrap())
            .iter()
            .map(|g| g + 0.25)
            .collect();
        assert_close(&down(&dx), &want_dx, 2e-6, "layernorm dx (added)");
        assert_close(
            &down(&dw),
            &values(grads.get(wv.as_tensor()).unwrap()),
            2e-6,
            "layernorm dweight",
        );
        assert_close(
            &down(&db),
            &values(grads.get(bv.as_tensor()).unwrap()),
            2e-6,
            "layernorm dbias",
        );
    }

    // The fused residual: the same as adding first.
    let a2 = uniform(rows * c, 15, 1.0);
    let sum: Vec<f32> = x.iter().zip(&a2).map(|(p, q)| p + q).collect();
    let (want, ..) = layernorm(&sum, None, &w, &b);
    let (fused, _, _, resid) = layernorm(&x, Some(&a2), &w, &b);
    assert_bits_eq(&resid, &sum, "fused residual sum");
    assert_bits_eq(&fused, &want, "layernorm after the fused residual");

    // bf16 storage.
    let (out16, ..) = layernorm(&to_bf16(&x), None, &to_bf16(&w), &to_bf16(&b));
    assert_close(
        &from_bf16(&out16),
        &values(&y),
        BF16_REL,
        "layernorm forward bf16",
    );
}

/// The fused classifier on the host build: (losses, logits or their gradient).
fn classify<T: stoker_gpu::Act>(
    logits: &[T],
    targets: &[i32],
    v: usize,
    dscale: Option<f32>,
) -> (Vec<f32>, Vec<T>) {
    let (lb, losses) = (up(logits), zeros::<f32>(targets.len()));
    let t = ids_on_host(targets, v, Some(-100));
    kernels::classifier(&Host, all(&lb), all(&losses), None, &t, v, dscale, -100).unwrap();
    (down(&losses), down(&lb))
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
    let padded: Vec<f32> = (0..n)
        .flat_map(|r| {
            logits[r * v..(r + 1) * v]
                .iter()
                .copied()
                .chain(std::iter::repeat_n(1e3, vp - v))
        })
        .collect();
    let (losses, grad) = classify(&padded, &targets, v, Some(dscale));
    let total: f64 = losses.iter().map(|&l| l as f64).sum();
    stoker_testkit::assert_close_scalar(total, values(&loss)[0] as f64, 1e-6, "summed loss");
    assert_eq!((losses[3], losses[17]), (0.0, 0.0), "ignored rows' losses");
    let got: Vec<f32> = (0..n)
        .flat_map(|r| grad[r * vp..r * vp + v].to_vec())
        .collect();
    assert_close(&got, &want_grad, 1e-6, "dlogits");
    assert!(
        (0..n).all(|r| grad[r * vp + v..(r + 1) * vp].iter().all(|&g| g == 0.0)),
        "the padding's gradient is not 0"
    );

    // Loss only (no gradient asked): the logits stay.
    let (same, kept) = classify(&logits, &targets, v, None);
    assert_bits_eq(&kept, &logits, "logits without a gradient");
    assert_close(&same, &losses, 1e-6, "losses without a gradient");

    let (loss16, grad16) = classify(&to_bf16(&logits), &targets, v, Some(dscale));
    assert_close(&loss16, &losses, BF16_REL, "losses from bf16 logits");
    assert_close(&from_bf16(&grad16), &want_grad, BF16_REL, "dlogits bf16");
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
    let (qkvb, heads) = (up(&qkv), zeros::<f32>(3 * n));
    kernels::qkv_heads(&Host, all(&heads), all(&qkvb), g, false).unwrap();
    let heads = down(&heads);
    let (q, rest) = heads.split_at(n);
    let (k, v) = rest.split_at(n);
    let pre = matmul(q, k, bh, (t, d, t), true, false);
    let (preb, attb) = (up(&pre), zeros::<f32>(bh * t * t));
    kernels::attention_softmax_forward(&Host, all(&attb), all(&preb), (t, t), scale).unwrap();
    let att = down(&attb);
    let out_h = up(&matmul(&att, v, bh, (t, t, d), false, false));
    let out = zeros::<f32>(n);
    kernels::merged_heads(&Host, all(&out), all(&out_h), g, false).unwrap();
    assert_close(&down(&out), &values(&y), 1e-5, "attention forward");

    let (doutb, dout_h) = (up(&dout), zeros::<f32>(n));
    kernels::merged_heads(&Host, all(&dout_h), all(&doutb), g, true).unwrap();
    let dout_h = down(&dout_h);
    let datt = up(&matmul(&dout_h, v, bh, (t, d, t), true, false));
    let dv = matmul(&att, &dout_h, bh, (t, t, d), false, true);
    kernels::attention_softmax_backward(&Host, all(&datt), all(&datt), all(&attb), (t, t), scale)
        .unwrap();
    let dpre = down(&datt);
    let dq = matmul(&dpre, k, bh, (t, t, d), false, false);
    let dk = matmul(&dpre, q, bh, (t, t, d), false, true);
    let (dheads, dqkv) = (up(&[dq, dk, dv].concat()), zeros::<f32>(3 * n));
    kernels::qkv_heads(&Host, all(&dqkv), all(&dheads), g, true).unwrap();
    assert_close(
        &down(&dqkv),
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

    let (pre16, att16) = (up(&to_bf16(&pre)), zeros::<bf16>(bh * t * t));
    kernels::attention_softmax_forward(&Host, all(&att16), all(&pre16), (t, t), scale).unwrap();
    assert_close(
        &from_bf16(&down(&att16)),
        &att,
        BF16_REL,
        "attention softmax bf16",
    );
}

/// A row's largest value, NaN if it holds one (a plain max would drop it; the
/// `position` below then finds no match and the test fails loudly).
fn row_max(row: &[f32]) -> f32 {
    row.iter().fold(f64::NEG_INFINITY, |m, &x| {
        stoker_testkit::nan_max(m, x as f64)
    }) as f32
}

/// The classifier's top-1 hits: 1 where the target is the first largest logit (ties go
/// to the lower index, as `argmax`), 0 elsewhere and on ignored rows.
#[test]
fn classifier_hits_are_argmax_top1() {
    let (n, v, vp) = (40, 37, 64);
    // Coarse logits so that ties happen, and the target placed on some maxima.
    let mut logits: Vec<f32> = uniform(n * v, 25, 3.0).iter().map(|x| x.round()).collect();
    let mut targets = ids(n, 26, v);
    targets[7] = -100;
    for r in (0..n).step_by(3) {
        let row = &logits[r * v..(r + 1) * v];
        let max = row_max(row);
        targets[r] = row.iter().position(|&x| x == max).unwrap() as i32;
    }
    logits[2 * v + 5] = 100.0; // one clear winner, another tie below
    let want: Vec<f32> = (0..n)
        .map(|r| {
            let row = &logits[r * v..(r + 1) * v];
            let max = row_max(row);
            let first = row.iter().position(|&x| x == max).unwrap() as i32;
            if targets[r] >= 0 && first == targets[r] {
                1.0
            } else {
                0.0
            }
        })
        .collect();
    let padded: Vec<f32> = (0..n)
        .flat_map(|r| {
            logits[r * v..(r + 1) * v]
                .iter()
                .copied()
                .chain(std::iter::repeat_n(1e3, vp - v))
        })
        .collect();
    let (lb, losses, hits) = (up(&padded), zeros::<f32>(n), zeros::<f32>(n));
    let t = ids_on_host(&targets, v, Some(-100));
    kernels::classifier(
        &Host,
        all(&lb),
        all(&losses),
        Some(all(&hits)),
        &t,
        v,
        None,
        -100,
    )
    .unwrap();
    assert_bits_eq(&down(&hits), &want, "top-1 hits");
    assert!(
        want.iter().sum::<f32>() >= 10.0,
        "too few hits to test: {want:?}"
    );
}

#[test]
fn chunked_softmax_rows_are_the_whole_rows_up_to_their_chunk_s_width() {
    // Queries in chunks of 4 of 10 positions: rows 0-3 written to 4 columns, 4-7 to 8,
    // 8-9 to all 10; the written part is the whole-row kernel's, bit for bit, in both
    // directions, and nothing past it is touched.
    let (bh, t, chunk, scale) = (3, 10, 4, 0.3);
    let pre = up(&uniform(bh * t * t, 21, 3.0));
    let dg = uniform(bh * t * t, 22, 1.0);
    let (whole, chunked) = (zeros::<f32>(bh * t * t), up(&vec![7.0f32; bh * t * t]));
    kernels::attention_softmax_forward(&Host, all(&whole), all(&pre), (t, t), scale).unwrap();
    kernels::attention_softmax_forward(&Host, all(&chunked), all(&pre), (t, chunk), scale).unwrap();
    let (dwhole, dchunked) = (up(&dg), up(&dg));
    kernels::attention_softmax_backward(
        &Host,
        all(&dwhole),
        all(&dwhole),
        all(&whole),
        (t, t),
        scale,
    )
    .unwrap();
    kernels::attention_softmax_backward(
        &Host,
        all(&dchunked),
        all(&dchunked),
        all(&chunked),
        (t, chunk),
        scale,
    )
    .unwrap();
    let (w, c, dw, dc) = (down(&whole), down(&chunked), down(&dwhole), down(&dchunked));
    for row in 0..bh * t {
        let q = row % t;
        let width = ((q / chunk + 1) * chunk).min(t);
        for j in 0..t {
            let at = row * t + j;
            if j < width {
                assert_eq!(c[at].to_bits(), w[at].to_bits(), "att row {row} col {j}");
                assert_eq!(dc[at].to_bits(), dw[at].to_bits(), "dpre row {row} col {j}");
            } else {
                assert_eq!(
                    c[at], 7.0,
                    "att row {row} col {j} past the width was written"
                );
                assert_eq!(dc[at], dg[at], "dpre row {row} col {j} past the width");
            }
        }
    }
}
