//! The host build of the Llama's kernels against stoker-kernels' CPU ops: RMSNorm and its
//! gradients (within f32 rounding; the fused residual bit for bit against adding first),
//! rotary embeddings (the same tables and arithmetic: bit for bit, both directions),
//! SwiGLU (the exponentials differ: within 1e-6), and grouped-query attention's repeated
//! key/value heads against plain index loops, bit for bit.

mod common;

use candle_core::{Device, Tensor};
use common::*;
use stoker_gpu::{llama, Heads, Host};
use stoker_testkit::{assert_bits_eq, assert_close};

#[test]
fn rmsnorm_matches_the_cpu_op_forward_and_backward() {
    let (rows, c) = (29, 72);
    let x = uniform(rows * c, 61, 2.0);
    let w: Vec<f32> = uniform(c, 62, 0.2).iter().map(|v| 1.0 + v).collect();
    let dy = uniform(rows * c, 63, 1.0);
    let (xv, wv) = (var(&x, &[rows, c]), var(&w, &[c]));
    let y = stoker_kernels::rms_norm(xv.as_tensor(), wv.as_tensor(), 1e-5).unwrap();
    let dyt = Tensor::from_slice(&dy, (rows, c), &Device::Cpu).unwrap();
    let grads = (&y * &dyt).unwrap().sum_all().unwrap().backward().unwrap();

    let (xb, wb, out, rstd) = (up(&x), up(&w), zeros::<f32>(rows * c), zeros::<f32>(rows));
    llama::rmsnorm_forward(&Host, all(&out), all(&rstd), all(&xb), None, all(&wb), 1e-5).unwrap();
    assert_close(&down(&out), &values(&y), 2e-6, "rmsnorm forward");
    for warps in [1, 6] {
        let (dx, dw, partials, dyb) = (
            up(&vec![0.5f32; rows * c]),
            zeros::<f32>(c),
            zeros::<f32>(warps * c),
            up(&dy),
        );
        llama::rmsnorm_backward(
            &Host,
            all(&dx),
            all(&dw),
            all(&partials),
            all(&dyb),
            all(&xb),
            all(&wb),
            all(&rstd),
            warps,
        )
        .unwrap();
        let want_dx: Vec<f32> = values(grads.get(xv.as_tensor()).unwrap())
            .iter()
            .map(|g| g + 0.5)
            .collect();
        assert_close(&down(&dx), &want_dx, 2e-6, "rmsnorm dx (added)");
        assert_close(
            &down(&dw),
            &values(grads.get(wv.as_tensor()).unwrap()),
            2e-6,
            "rmsnorm dweight",
        );
    }
    // The fused residual is the same as adding first.
    let a2 = uniform(rows * c, 64, 1.0);
    let sum: Vec<f32> = x.iter().zip(&a2).map(|(p, q)| p + q).collect();
    let (sb, want) = (up(&sum), zeros::<f32>(rows * c));
    llama::rmsnorm_forward(
        &Host,
        all(&want),
        all(&rstd),
        all(&sb),
        None,
        all(&wb),
        1e-5,
    )
    .unwrap();
    let (resid, a2b) = (zeros::<f32>(rows * c), up(&a2));
    llama::rmsnorm_forward(
        &Host,
        all(&out),
        all(&rstd),
        all(&xb),
        Some((all(&resid), all(&a2b))),
        all(&wb),
        1e-5,
    )
    .unwrap();
    assert_bits_eq(&down(&resid), &sum, "fused residual sum");
    assert_bits_eq(
        &down(&out),
        &down(&want),
        "rmsnorm after the fused residual",
    );
}

#[test]
fn rope_is_the_cpu_rotation_bit_for_bit_both_ways() {
    let (b, t, h, d, base) = (2, 9, 3, 16, 10_000.0);
    let x = uniform(b * t * h * d, 71, 1.0);
    let dy = uniform(b * t * h * d, 72, 1.0);
    let xv = var(&x, &[b, t, h, d]);
    let y = stoker_kernels::rope(xv.as_tensor(), base).unwrap();
    let dyt = Tensor::from_slice(&dy, (b, t, h, d), &Device::Cpu).unwrap();
    let grads = (&y * &dyt).unwrap().sum_all().unwrap().backward().unwrap();
    let (cos, sin) = stoker_kernels::rope::tables(t, d, base);
    let (cb, sb) = (up(&cos), up(&sin));
    let xb = up(&x);
    llama::rope(&Host, all(&xb), all(&cb), all(&sb), t, h, d, false).unwrap();
    assert_bits_eq(&down(&xb), &values(&y), "rope forward");
    let g = up(&dy);
    llama::rope(&Host, all(&g), all(&cb), all(&sb), t, h, d, true).unwrap();
    assert_close(
        &down(&g),
        &values(grads.get(xv.as_tensor()).unwrap()),
        0.0,
        "rope backward",
    );
}

#[test]
fn swiglu_matches_the_cpu_op_forward_and_backward() {
    let n = 3001;
    let (gate, upv, dy) = (
        uniform(n, 81, 6.0),
        uniform(n, 82, 2.0),
        uniform(n, 83, 1.0),
    );
    let (gv, uv) = (var(&gate, &[n]), var(&upv, &[n]));
    let y = stoker_kernels::swiglu(gv.as_tensor(), uv.as_tensor()).unwrap();
    let dyt = Tensor::from_slice(&dy, n, &Device::Cpu).unwrap();
    let grads = (&y * &dyt).unwrap().sum_all().unwrap().backward().unwrap();
    let (gb, ub, yb, dyb) = (up(&gate), up(&upv), zeros::<f32>(n), up(&dy));
    llama::swiglu_forward(&Host, all(&yb), all(&gb), all(&ub)).unwrap();
    assert_close(&down(&yb), &values(&y), 1e-6, "swiglu forward");
    let (dg, du) = (zeros::<f32>(n), zeros::<f32>(n));
    llama::swiglu_backward(&Host, all(&dg), all(&du), all(&gb), all(&ub), all(&dyb)).unwrap();
    assert_close(
        &down(&dg),
        &values(grads.get(gv.as_tensor()).unwrap()),
        1e-6,
        "swiglu dgate",
    );
    assert_close(
        &down(&du),
        &values(grads.get(uv.as_tensor()).unwrap()),
        1e-6,
        "swiglu dup",
    );
}

#[test]
fn kv_heads_repeat_and_sum_back_like_repeat_kv() {
    let (b, t, h, kv, d) = (2, 5, 6, 2, 4);
    let g = Heads {
        b: b as i32,
        t: t as i32,
        h: h as i32,
        d: d as i32,
    };
    let src = uniform(b * t * kv * d, 91, 1.0);
    let rep = h / kv;
    let mut want = vec![0f32; b * h * t * d];
    for (bb, hh, tt, dd) in (0..b).flat_map(|bb| {
        (0..h).flat_map(move |hh| (0..t).flat_map(move |tt| (0..d).map(move |dd| (bb, hh, tt, dd))))
    }) {
        want[((bb * h + hh) * t + tt) * d + dd] = src[((bb * t + tt) * kv + hh / rep) * d + dd];
    }
    let (sb, dst) = (up(&src), zeros::<f32>(b * h * t * d));
    llama::kv_heads(&Host, all(&dst), all(&sb), g, kv, false).unwrap();
    assert_bits_eq(&down(&dst), &want, "repeated kv heads");
    let dheads = uniform(b * h * t * d, 92, 1.0);
    let mut dsrc = vec![0f32; b * t * kv * d];
    for (bb, hh, tt, dd) in (0..b).flat_map(|bb| {
        (0..h).flat_map(move |hh| (0..t).flat_map(move |tt| (0..d).map(move |dd| (bb, hh, tt, dd))))
    }) {
        dsrc[((bb * t + tt) * kv + hh / rep) * d + dd] += dheads[((bb * h + hh) * t + tt) * d + dd];
    }
    let (db, back) = (up(&dheads), zeros::<f32>(b * t * kv * d));
    llama::kv_heads(&Host, all(&back), all(&db), g, kv, true).unwrap();
    assert_bits_eq(
        &down(&back),
        &dsrc,
        "kv gradients summed back in head order",
    );
    let e =
        llama::kv_heads(&Host, all(&dst), all(&sb), Heads { h: 5, ..g }, kv, false).unwrap_err();
    assert!(
        e.to_string()
            .contains("5 query heads are not a multiple of 2 kv heads"),
        "{e}"
    );
}

/// Grouped-query attention as the GPU step would run it (q to heads, k and v repeated to
/// the query heads, scores, the causal softmax kernel, weighted values, and back, the
/// kv gradients summed over their query heads) against stoker-kernels' causal attention
/// over candle's repeated k and v, whose autograd sums the copies.
#[test]
fn gqa_attention_from_the_kernels_matches_the_cpu_op() {
    let (b, t, h, kv, d) = (2, 7, 4, 2, 8);
    let g = Heads {
        b: b as i32,
        t: t as i32,
        h: h as i32,
        d: d as i32,
    };
    let (n, nkv) = (b * h * t * d, b * kv * t * d);
    let (q, k, v) = (
        uniform(n, 101, 1.0),
        uniform(nkv, 102, 1.0),
        uniform(nkv, 103, 1.0),
    );
    let dout = uniform(n, 104, 1.0);
    // CPU: q [B, T, H, D], k and v [B, T, KV, D] -> heads, k and v repeated by index.
    let (qv, kvv, vv) = (
        var(&q, &[b, t, h, d]),
        var(&k, &[b, t, kv, d]),
        var(&v, &[b, t, kv, d]),
    );
    let rep_index = Tensor::from_vec(
        (0..h as u32)
            .map(|x| x / (h / kv) as u32)
            .collect::<Vec<_>>(),
        h,
        &Device::Cpu,
    )
    .unwrap();
    let heads = |x: &Tensor| x.transpose(1, 2).unwrap().contiguous().unwrap();
    let repeated = |x: &Tensor| heads(&x.index_select(&rep_index, 2).unwrap());
    let y = stoker_kernels::causal_attention(
        &heads(qv.as_tensor()),
        &repeated(kvv.as_tensor()),
        &repeated(vv.as_tensor()),
    )
    .unwrap();
    let dyt = Tensor::from_slice(&dout, (b, h, t, d), &Device::Cpu).unwrap();
    let grads = (&y * &dyt).unwrap().sum_all().unwrap().backward().unwrap();

    // The kernels: q to heads (the merged layout's inverse), k and v repeated.
    let (qb, kb, vb) = (up(&q), up(&k), up(&v));
    let (qh, kh, vh) = (zeros::<f32>(n), zeros::<f32>(n), zeros::<f32>(n));
    stoker_gpu::kernels::merged_heads(&Host, all(&qh), all(&qb), g, true).unwrap();
    llama::kv_heads(&Host, all(&kh), all(&kb), g, kv, false).unwrap();
    llama::kv_heads(&Host, all(&vh), all(&vb), g, kv, false).unwrap();
    let (qh, kh, vh) = (down(&qh), down(&kh), down(&vh));
    let bh = b * h;
    let scale = 1.0 / (d as f32).sqrt();
    let att = up(&matmul(&qh, &kh, bh, (t, d, t), true, false));
    stoker_gpu::kernels::attention_softmax_forward(&Host, all(&att), all(&att), (t, t), scale)
        .unwrap();
    let att = down(&att);
    assert_close(
        &matmul(&att, &vh, bh, (t, t, d), false, false),
        &values(&y),
        1e-5,
        "gqa forward",
    );

    let datt = up(&matmul(&dout, &vh, bh, (t, d, t), true, false));
    let dvh = matmul(&att, &dout, bh, (t, t, d), false, true);
    let attb = up(&att);
    stoker_gpu::kernels::attention_softmax_backward(
        &Host,
        all(&datt),
        all(&datt),
        all(&attb),
        (t, t),
        scale,
    )
    .unwrap();
    let dpre = down(&datt);
    let dqh = up(&matmul(&dpre, &kh, bh, (t, t, d), false, false));
    let dkh = up(&matmul(&dpre, &qh, bh, (t, t, d), false, true));
    let (dq, dk, dv) = (zeros::<f32>(n), zeros::<f32>(nkv), zeros::<f32>(nkv));
    stoker_gpu::kernels::merged_heads(&Host, all(&dq), all(&dqh), g, false).unwrap();
    llama::kv_heads(&Host, all(&dk), all(&dkh), g, kv, true).unwrap();
    llama::kv_heads(&Host, all(&dv), all(&up(&dvh)), g, kv, true).unwrap();
    assert_close(
        &down(&dq),
        &values(grads.get(qv.as_tensor()).unwrap()),
        1e-5,
        "gqa dq",
    );
    assert_close(
        &down(&dk),
        &values(grads.get(kvv.as_tensor()).unwrap()),
        1e-5,
        "gqa dk",
    );
    assert_close(
        &down(&dv),
        &values(grads.get(vv.as_tensor()).unwrap()),
        1e-5,
        "gqa dv",
    );
}
