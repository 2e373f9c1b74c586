//! Flash attention's kernels (`stoker_gpu::flash`, cuda/ops/flash.cuh) on the host build,
//! whose tensor-core products are the PTX fragment layouts multiplied out: the output,
//! each row's log-sum-exp and the three gradients against causal attention computed in
//! f64 from the same bf16 inputs, for head widths 16, 32 and 64, T a multiple of 16 or
//! not (partial tiles), below 16 too, and grouped-query heads (k and v per kv head). The kernels round the probabilities (and their
//! gradient) to bf16 before the products they feed, as FlashAttention-2 does, so this is
//! a tolerance: a hundredth of the largest value. Then the GPT's and the Llama's bf16
//! steps with `StepOptions::flash_attention` against the same steps keeping their
//! scores (within bf16's rounding, in the memory planned), and the refusals.

mod common;

use common::run_micro_batches;
use half::bf16;
use stoker_gpu::flash::{self, FlashShape};
use stoker_gpu::parallel::Trainable;
use stoker_gpu::sample::{gpt, llama, uniform};
use stoker_gpu::step::gpt::gpt_step_sizes;
use stoker_gpu::step::llama::llama_step_sizes;
use stoker_gpu::step::options::StepOptions;
use stoker_gpu::step::{GptGpuStep, LlamaGpuStep};
use stoker_gpu::{Backend, GpuError, Host};
use stoker_kernels::{GptDims, LlamaDims};
use stoker_testkit::assert_close;

/// Causal attention in f64: the output, each row's log-sum-exp, dq, dk, dv.
struct Reference {
    out: Vec<f64>,
    lse: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
}

/// `group` query heads share each kv head: k, v, dk and dv are `[B*H / group, T, D]`.
fn reference(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    dout: &[f64],
    ((bh, t, d), group): (FlashShape, usize),
) -> Reference {
    let (n, nkv) = (bh * t * d, bh / group * t * d);
    let scale = 1.0 / (d as f64).sqrt();
    let mut r = Reference {
        out: vec![0.0; n],
        lse: vec![0.0; bh * t],
        dq: vec![0.0; n],
        dk: vec![0.0; nkv],
        dv: vec![0.0; nkv],
    };
    for h in 0..bh {
        let at = |m: &[f64], row: usize, c: usize| m[(h * t + row) * d + c];
        let kv = h / group;
        let kv_at = |m: &[f64], row: usize, c: usize| m[(kv * t + row) * d + c];
        for i in 0..t {
            let s: Vec<f64> = (0..=i)
                .map(|j| (0..d).map(|c| at(q, i, c) * kv_at(k, j, c)).sum::<f64>() * scale)
                .collect();
            let m = s
                .iter()
                .cloned()
                .fold(f64::NEG_INFINITY, stoker_testkit::nan_max);
            let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
            r.lse[h * t + i] = m + z.ln();
            let p: Vec<f64> = s.iter().map(|x| (x - m).exp() / z).collect();
            for c in 0..d {
                r.out[(h * t + i) * d + c] = (0..=i).map(|j| p[j] * kv_at(v, j, c)).sum();
            }
            let dp: Vec<f64> = (0..=i)
                .map(|j| (0..d).map(|c| at(dout, i, c) * kv_at(v, j, c)).sum())
                .collect();
            let corr: f64 = (0..d)
                .map(|c| at(dout, i, c) * r.out[(h * t + i) * d + c])
                .sum();
            for j in 0..=i {
                let ds = p[j] * (dp[j] - corr);
                for c in 0..d {
                    r.dq[(h * t + i) * d + c] += ds * kv_at(k, j, c) * scale;
                    r.dk[(kv * t + j) * d + c] += ds * at(q, i, c) * scale;
                    r.dv[(kv * t + j) * d + c] += p[j] * at(dout, i, c);
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
    // Shapes and query heads a kv head (grouped-query attention: 2 and 4).
    let cases = [
        ((3, 37, 16), 1),
        ((2, 64, 32), 1),
        ((2, 48, 64), 1),
        ((1, 5, 64), 1),
        ((2, 16, 16), 1),
        ((4, 37, 16), 2),
        ((8, 40, 64), 4),
    ];
    for (shape @ (bh, t, d), group) in cases {
        let what = format!("B*H {bh}, T {t}, D {d}, groups of {group}");
        let (n, nkv) = (bh * t * d, bh / group * t * d);
        let seed = (bh * 1000 + t * 10 + d) as u64;
        let (q, k, v, dout) = (
            bf16s(n, seed, 1.5),
            bf16s(nkv, seed + 1, 1.5),
            bf16s(nkv, seed + 2, 1.0),
            bf16s(n, seed + 3, 1.0),
        );
        let want = reference(
            &wide(&q),
            &wide(&k),
            &wide(&v),
            &wide(&dout),
            (shape, group),
        );
        let be = Host;
        let up = |x: &[bf16]| be.upload(x).unwrap();
        let (bq, bk, bv, bdo) = (up(&q), up(&k), up(&v), up(&dout));
        let out = be.zeros::<bf16>(n).unwrap();
        let lse = be.zeros::<f32>(bh * t).unwrap();
        let x = (be.all(&bq), be.all(&bk), be.all(&bv));
        flash::forward(&be, x, (be.all(&out), be.all(&lse)), (shape, group)).unwrap();
        let (dq, dk, dv) = (
            be.zeros::<bf16>(n).unwrap(),
            be.zeros::<bf16>(nkv).unwrap(),
            be.zeros::<bf16>(nkv).unwrap(),
        );
        let dsum = be.zeros::<f32>(bh * t).unwrap();
        flash::backward(
            &be,
            x,
            (be.all(&out), be.all(&bdo), be.all(&lse)),
            be.all(&dsum),
            (be.all(&dq), be.all(&dk), be.all(&dv)),
            (shape, group),
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
fn flash_attention_refuses_other_head_widths_aliased_outputs_and_odd_starts() {
    let be = Host;
    let (bh, t, d) = (1, 8, 8);
    let a = be.zeros::<bf16>(bh * t * d).unwrap();
    let o = be.zeros::<bf16>(bh * t * d).unwrap();
    let l = be.zeros::<f32>(bh * t).unwrap();
    let x = (be.all(&a), be.all(&a), be.all(&a));
    match flash::forward(&be, x, (be.all(&o), be.all(&l)), ((bh, t, d), 1)) {
        Err(GpuError::Shape { what, .. }) => assert!(what.contains("head width 8"), "{what}"),
        other => panic!("head width 8: {other:?}"),
    }
    let (bh, t, d) = (1, 8, 16);
    let a = be.zeros::<bf16>(bh * t * d).unwrap();
    let x = (be.all(&a), be.all(&a), be.all(&a));
    // The output written over q.
    match flash::forward(&be, x, (be.all(&a), be.all(&l)), ((bh, t, d), 1)) {
        Err(GpuError::Shape { what, .. }) => assert!(what.contains("overlap"), "{what}"),
        other => panic!("the output over q: {other:?}"),
    }
    // q starting at an odd element: its pairs are not 4-byte words.
    let wide = be.zeros::<bf16>(bh * t * d + 1).unwrap();
    let odd = be.view(&wide, 1..bh * t * d + 1).unwrap();
    let o16 = be.zeros::<bf16>(bh * t * d).unwrap();
    match flash::forward(
        &be,
        (odd, x.1, x.2),
        (be.all(&o16), be.all(&l)),
        ((bh, t, d), 1),
    ) {
        Err(GpuError::Shape { what, .. }) => assert!(what.contains("odd element"), "{what}"),
        other => panic!("q at an odd element: {other:?}"),
    }
}

/// Runs `plain` and `flash` (bf16 steps of one model, the scores kept and flash
/// attention) over the same two micro-batches over `vocab` and an evaluation: the summed
/// losses within 2e-3 and the gradients within 2.5e-2 of their largest (measured here:
/// 3e-4 and 1e-2; a mask off by one moves the losses 1.5%).
fn close_steps<S: Trainable<Host>>(what: &str, params: &[f32], vocab: usize, plain: &S, flash: &S) {
    let data: Vec<(Vec<i64>, Vec<i64>)> = (0..2u64)
        .map(|k| {
            let draw = |s| -> Vec<i64> {
                stoker_gpu::sample::ids(B * T, s, vocab)
                    .iter()
                    .map(|&x| x as i64)
                    .collect()
            };
            let mut targets = draw(60 + k);
            targets[2] = -1;
            (draw(50 + k), targets)
        })
        .collect();
    let (want, got) = (
        run_micro_batches(plain, params, &data),
        run_micro_batches(flash, params, &data),
    );
    assert_close(&got.0, &want.0, 2e-3, &format!("{what}: losses"));
    assert_close(&got.1, &want.1, 2.5e-2, &format!("{what}: gradients"));
    assert_close(
        &[got.2 .0],
        &[want.2 .0],
        2e-3,
        &format!("{what}: evaluation"),
    );
}

const B: usize = 2;
/// Positions of a micro-batch: one full tile of 16 and a partial one.
const T: usize = 19;

#[test]
fn flash_attention_in_the_steps_trains_what_the_kept_scores_train_in_less_memory() {
    let flash = StepOptions {
        flash_attention: true,
        ..StepOptions::default()
    };
    let dims = GptDims {
        vocab: 41,
        context: 24,
        d_model: 32,
        n_layer: 2,
        n_head: 2,
    };
    let g = gpt(&dims, 5, 0.3);
    let plain = GptGpuStep::<Host, bf16>::new(&Host, dims, g.offsets.clone(), 1e-5, B, T).unwrap();
    let fl =
        GptGpuStep::<Host, bf16>::with_options(&Host, dims, g.offsets.clone(), 1e-5, (B, T), flash)
            .unwrap();
    close_steps("gpt", &g.params, dims.vocab, &plain, &fl);
    // The probabilities and their gradient's scratch (bf16, aligned spans) give way to
    // each row's log-sum-exp and the backward's row sums (f32).
    let planned = gpt_step_sizes(&dims, g.offsets.end(), (B, T), flash).bytes(2);
    assert_eq!(
        fl.buffers().bytes(),
        planned,
        "gpt: counted against planned"
    );
    assert!(
        fl.buffers().bytes() < plain.buffers().bytes(),
        "gpt: flash holds less"
    );

    let dims = LlamaDims {
        vocab: 43,
        context: 24,
        d_model: 32,
        n_layer: 2,
        n_head: 2,
        n_kv_head: 1,
        ffn_hidden: 48,
    };
    let l = llama(&dims, 6, 0.3);
    let theta = 10_000.0;
    let plain =
        LlamaGpuStep::<Host, bf16>::new(&Host, dims, l.offsets.clone(), 1e-5, theta, B, T).unwrap();
    let fl = LlamaGpuStep::<Host, bf16>::with_options(
        &Host,
        dims,
        l.offsets.clone(),
        (1e-5, theta),
        (B, T),
        flash,
    )
    .unwrap();
    close_steps("llama", &l.params, dims.vocab, &plain, &fl);
    let planned = llama_step_sizes(&dims, l.offsets.end(), (B, T), flash).bytes(2);
    assert_eq!(
        fl.buffers().bytes(),
        planned,
        "llama: counted against planned"
    );
}

#[test]
fn flash_attention_is_refused_in_f32_with_other_head_widths_or_with_recompute() {
    let dims = GptDims {
        vocab: 41,
        context: 24,
        d_model: 32,
        n_layer: 1,
        n_head: 2,
    };
    let g = gpt(&dims, 5, 0.3);
    let flash = StepOptions {
        flash_attention: true,
        ..StepOptions::default()
    };
    let refusal = |r: Result<GptGpuStep<Host, f32>, GpuError>| match r {
        Err(e) => e.to_string(),
        Ok(_) => panic!("not refused"),
    };
    let e = refusal(GptGpuStep::with_options(
        &Host,
        dims,
        g.offsets.clone(),
        1e-5,
        (B, T),
        flash,
    ));
    assert!(e.contains("bf16"), "{e}");
    let narrow = GptDims { n_head: 4, ..dims };
    let g4 = gpt(&narrow, 5, 0.3);
    let r = GptGpuStep::<Host, bf16>::with_options(&Host, narrow, g4.offsets, 1e-5, (B, T), flash);
    assert!(
        matches!(&r, Err(e) if e.to_string().contains("8 wide")),
        "{:?}",
        r.err()
    );
    let both = StepOptions {
        recompute_attention: true,
        ..flash
    };
    let r = GptGpuStep::<Host, bf16>::with_options(&Host, dims, g.offsets, 1e-5, (B, T), both);
    assert!(
        matches!(&r, Err(e) if e.to_string().contains("recompute")),
        "{:?}",
        r.err()
    );
}

#[test]
fn the_device_check_s_flash_outputs_run_on_the_host_build() {
    // What `stoker bench gpu-kernels` compares on a GPU (device::flash_check): here the
    // host build's side, at the check's widest shape.
    let out = stoker_gpu::scenario::flash_outputs(&Host, ((4, 77, 64), 1)).unwrap();
    assert_eq!(out.len(), 5);
    for (name, x) in &out {
        assert_eq!(
            x.len(),
            if name.contains("lse") {
                4 * 77
            } else {
                4 * 77 * 64
            },
            "{name}"
        );
        assert!(x.iter().all(|v| v.is_finite()), "{name}: not finite");
        assert!(x.iter().any(|&v| v != 0.0), "{name}: all zero");
    }
}
