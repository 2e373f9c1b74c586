//! The GPU step, run by the host backend, against stoker-kernels' CPU step on the same
//! flat parameters, batch and loss scale: the summed loss and every parameter's gradient
//! agree within f32 rounding (f32 activations), or within bf16's or f16's precision
//! (16-bit activations; f16 under a loss scale, as fp16 training runs it). The step's orchestration (buffers, GEMM shapes, the residual stream,
//! the backward's order) is what this checks; the kernels have their own tests.

mod common;

use common::*;
use half::bf16;
use stoker_gpu::step::{GptGpuStep, TokenBatch};
use stoker_gpu::{Act, Host};
use stoker_kernels::{GptBatch, GptDims, GptOffsets, GptStep, TokenStep};
use stoker_testkit::{assert_close, assert_close_scalar};

const DIMS: GptDims = GptDims {
    vocab: 71,
    context: 16,
    d_model: 32,
    n_layer: 2,
    n_head: 4,
};
const BATCH: usize = 3;
const T: usize = 11;

/// Offsets, flat parameters, each parameter's name and range, tokens, targets.
type Setup = (
    GptOffsets,
    Vec<f32>,
    Vec<(String, std::ops::Range<usize>)>,
    Vec<i64>,
    Vec<i64>,
);

/// A seeded GPT and a batch with two ignored targets.
fn setup() -> Setup {
    let g = stoker_gpu::sample::gpt(&DIMS, 100, 0.2);
    let tokens: Vec<i64> = ids(BATCH * T, 1, DIMS.vocab)
        .iter()
        .map(|&x| x as i64)
        .collect();
    let mut targets: Vec<i64> = ids(BATCH * T, 2, DIMS.vocab)
        .iter()
        .map(|&x| x as i64)
        .collect();
    targets[4] = -1;
    targets[20] = -1;
    (g.offsets, g.params, g.ranges, tokens, targets)
}

/// The CPU step's loss and gradients.
fn cpu(
    offsets: &GptOffsets,
    params: &[f32],
    tokens: &[i64],
    targets: &[i64],
    scale: f32,
) -> (f64, Vec<f32>) {
    let mut step = GptStep::new(DIMS, offsets.clone(), false, 1e-5).unwrap();
    let mut grads = vec![0f32; params.len()];
    let batch = GptBatch {
        tokens,
        targets,
        batch: BATCH,
        t: T,
        ignore: -1,
    };
    let loss = step
        .forward_backward(params, batch, scale, &mut grads, &mut |_, _| {})
        .unwrap();
    (loss, grads)
}

/// The GPU step's on the host backend.
fn gpu<A: Act>(
    offsets: &GptOffsets,
    params: &[f32],
    tokens: &[i64],
    targets: &[i64],
    scale: f32,
) -> (f64, Vec<f32>) {
    let step = GptGpuStep::<Host, A>::new(&Host, DIMS, offsets.clone(), 1e-5, BATCH, T).unwrap();
    step.buffers().load_params(&Host, params).unwrap();
    let batch = TokenBatch {
        tokens,
        targets,
        ignore: -1,
    };
    let loss = step.forward_backward(&Host, batch, scale).unwrap();
    (loss, step.buffers().grads(&Host).unwrap())
}

#[test]
fn the_f32_step_gives_the_cpu_steps_loss_and_gradients() {
    let (offsets, params, ranges, tokens, targets) = setup();
    let scale = 1.0 / 31.0;
    let (want_loss, want) = cpu(&offsets, &params, &tokens, &targets, scale);
    let (loss, got) = gpu::<f32>(&offsets, &params, &tokens, &targets, scale);
    assert_close_scalar(loss, want_loss, 1e-5, "summed loss");
    assert_close_each(&got, &want, &ranges, 2e-5, |name| {
        format!("gradient of {name}")
    });
}

#[test]
fn the_bf16_step_tracks_the_cpu_f32_step() {
    let (offsets, params, ranges, tokens, targets) = setup();
    let scale = 1.0 / 31.0;
    let (want_loss, want) = cpu(&offsets, &params, &tokens, &targets, scale);
    let (loss, got) = gpu::<bf16>(&offsets, &params, &tokens, &targets, scale);
    assert_close_scalar(loss, want_loss, 1e-2, "summed loss, bf16 activations");
    assert_rel_l2_each(&got, &want, &ranges, 5e-2);
}

#[test]
fn the_f16_step_under_a_loss_scale_tracks_the_cpu_f32_step() {
    let (offsets, params, ranges, tokens, targets) = setup();
    // fp16's loss scale keeps the small gradients above f16's subnormals.
    let scale = 4096.0 / 31.0;
    let (want_loss, want) = cpu(&offsets, &params, &tokens, &targets, scale);
    let (loss, got) = gpu::<half::f16>(&offsets, &params, &tokens, &targets, scale);
    assert_close_scalar(loss, want_loss, 2e-3, "summed loss, f16 activations");
    // f16 keeps 11 significant bits to bf16's 8: a tighter bound than bf16's.
    assert_rel_l2_each(&got, &want, &ranges, 1e-2);
}

#[test]
fn an_f16_step_under_too_large_a_loss_scale_overflows_to_non_finite_gradients() {
    let (offsets, params, _, tokens, targets) = setup();
    // The logits' gradient alone is then far beyond f16's 65504.
    let (loss, grads) = gpu::<half::f16>(&offsets, &params, &tokens, &targets, 1e9);
    assert!(loss.is_finite(), "the loss is f32 and stays finite: {loss}");
    let bad = grads.iter().filter(|g| !g.is_finite()).count();
    assert!(
        bad > grads.len() / 2,
        "only {bad} of {} gradients overflowed: the scaler would not see it",
        grads.len()
    );
}

#[test]
fn a_zero_scale_adds_no_gradient_and_the_same_loss() {
    let (offsets, params, _, tokens, targets) = setup();
    let (want_loss, _) = cpu(&offsets, &params, &tokens, &targets, 1.0);
    let (loss, grads) = gpu::<f32>(&offsets, &params, &tokens, &targets, 0.0);
    assert_close_scalar(loss, want_loss, 1e-5, "summed loss at scale 0");
    assert!(
        grads.iter().all(|&g| g == 0.0),
        "a zero loss scale left a nonzero gradient"
    );
}

/// Segments as stoker-train makes them: weight decay on tensors of rank >= 2.
fn segments(ranges: &[(String, std::ops::Range<usize>)]) -> Vec<(std::ops::Range<usize>, bool)> {
    stoker_gpu::sample::segments(&stoker_kernels::gpt_params(&DIMS), ranges)
}

/// Five training steps (forward, backward, norm, clipping, AdamW) of the GPU step on the
/// host backend against the CPU direct step with stoker-kernels' AdamW and stoker-train's
/// clipping rule: the same losses step by step and the same weights after, within f32
/// rounding of the sums (the norm's too, so the clipping coefficients differ in the last
/// bits).
#[test]
fn five_training_steps_track_the_cpu_steps_losses_and_weights() {
    use stoker_gpu::step::optimizer::{OptimizerState, Scalars};
    use stoker_kernels::AdamWStep;
    let (offsets, params0, ranges, tokens, targets) = setup();
    let segs = segments(&ranges);
    let (scale, clip) = (1.0 / 31.0, 0.5);
    let adam = |t: u64| AdamWStep::new(3e-3, 0.9, 0.95, 1e-8, 0.1, t);
    let batch = GptBatch {
        tokens: &tokens,
        targets: &targets,
        batch: BATCH,
        t: T,
        ignore: -1,
    };

    let mut cpu = GptStep::new(DIMS, offsets.clone(), false, 1e-5).unwrap();
    let mut p = params0.clone();
    let cpu_losses = cpu_train(&mut cpu, &mut p, batch, scale, clip, &segs, adam, 5);

    let step = GptGpuStep::<Host, f32>::new(&Host, DIMS, offsets, 1e-5, BATCH, T).unwrap();
    step.buffers().load_params(&Host, &params0).unwrap();
    let opt = OptimizerState::adamw(&Host, &params0, &segs).unwrap();
    let tb = TokenBatch {
        tokens: &tokens,
        targets: &targets,
        ignore: -1,
    };
    for (t, want) in (1..=5).zip(&cpu_losses) {
        step.buffers().zero_grads(&Host).unwrap();
        let loss = step.forward_backward(&Host, tb, scale).unwrap();
        assert_close_scalar(loss, *want, 1e-5, &format!("loss at step {t}"));
        let norm = step
            .update(&Host, &opt, &Scalars::AdamW(adam(t)), 1.0, Some(clip))
            .unwrap();
        assert!(
            norm > clip,
            "step {t}: norm {norm} does not exercise clipping"
        );
    }
    assert!(
        cpu_losses[4] < cpu_losses[0],
        "the loss did not fall: {cpu_losses:?}"
    );
    let got = opt.master(&Host).unwrap();
    let c = DIMS.d_model;
    for (name, r) in &ranges {
        // The key bias's true gradient is 0 (it shifts every score of a query's row by the
        // same amount, which the softmax ignores): both steps compute rounding noise of
        // about 1e-9 there, and AdamW turns noise into steps of about lr. Compare its
        // query and value thirds only, and require the key third to have barely moved.
        if name.ends_with("attn.qkv.bias") {
            let (q, k, v) = (
                r.start..r.start + c,
                r.start + c..r.start + 2 * c,
                r.start + 2 * c..r.end,
            );
            for (part, rr) in [("q", q), ("v", v)] {
                assert_close(
                    &got[rr.clone()],
                    &p[rr.clone()],
                    1e-5,
                    &format!("{name} ({part}) after 5 steps"),
                );
            }
            // NaN-aware: a NaN movement fails the bound instead of folding away.
            let moved: Vec<f32> = k.clone().map(|i| got[i] - params0[i]).collect();
            let moved = stoker_testkit::max_abs(&moved);
            assert!(
                moved <= 5.0 * 3e-3 * 1.01,
                "{name} (k) moved {moved}, more than 5 steps of lr"
            );
            continue;
        }
        // AdamW divides each gradient by its own running RMS, so an element whose gradient
        // is a near-cancelling sum carries its sums' relative rounding difference straight
        // into its steps: the two steps sum rows in different orders (the CPU's in
        // sequence, the GPU's by lanes of packs), and 5 steps of lr 3e-3 then part by a few
        // 1e-6 on a handful of elements (2e-5 of the largest weight).
        assert_close(
            &got[r.clone()],
            &p[r.clone()],
            5e-5,
            &format!("{name} after 5 steps"),
        );
    }
    // The compute copy is the master.
    stoker_testkit::assert_bits_eq(
        &step.buffers().params(&Host).unwrap(),
        &got,
        "compute copy after the update",
    );
}

/// Data parallelism with the GPU step: 2 and 3 in-process ranks, each with its own step on
/// its share of the sequences and the global token count's scale, their gradients summed
/// through the communicator, give 1 rank's gradients on the whole batch (within f32
/// rounding: the sums are bracketed differently), and their losses add up to its loss.
#[test]
fn n_ranks_reduced_through_the_communicator_equal_one_rank() {
    use stoker_comm::{run_local, Communicator, DEFAULT_TIMEOUT};
    use stoker_gpu::parallel::{Collectives, ThroughHost};
    let g = stoker_gpu::sample::gpt(&DIMS, 300, 0.2);
    let seqs = 6;
    let tokens: Vec<i64> = ids(seqs * T, 11, DIMS.vocab)
        .iter()
        .map(|&x| x as i64)
        .collect();
    let targets: Vec<i64> = ids(seqs * T, 12, DIMS.vocab)
        .iter()
        .map(|&x| x as i64)
        .collect();
    let scale = 1.0 / (seqs * T) as f32;
    let run = |from: usize, count: usize| {
        let step =
            GptGpuStep::<Host, f32>::new(&Host, DIMS, g.offsets.clone(), 1e-5, count, T).unwrap();
        step.buffers().load_params(&Host, &g.params).unwrap();
        let (a, b) = (from * T, (from + count) * T);
        let batch = TokenBatch {
            tokens: &tokens[a..b],
            targets: &targets[a..b],
            ignore: -1,
        };
        let loss = step.forward_backward(&Host, batch, scale).unwrap();
        (step, loss)
    };
    let (one, want_loss) = run(0, seqs);
    let want = one.buffers().grads(&Host).unwrap();
    for world in [2, 3] {
        let per = seqs / world;
        let out = run_local(world, DEFAULT_TIMEOUT, |comm| {
            let (step, loss) = run(comm.rank() * per, per);
            ThroughHost(&comm)
                .all_reduce(&Host, step.buffers().grads_view(&Host).unwrap())
                .unwrap();
            (loss, step.buffers().grads(&Host).unwrap())
        });
        let loss: f64 = out.iter().map(|(l, _)| l).sum();
        assert_close_scalar(
            loss,
            want_loss,
            1e-5,
            &format!("summed loss over {world} ranks"),
        );
        for (rank, (_, grads)) in out.iter().enumerate() {
            stoker_testkit::assert_bits_eq(
                grads,
                &out[0].1,
                &format!("rank {rank}'s reduced gradients against rank 0's"),
            );
        }
        assert_close_each(&out[0].1, &want, &g.ranges, 2e-5, |name| {
            format!("{name} over {world} ranks")
        });
    }
}

/// Evaluation (the forward, losses and top-1 hits, no gradient) against the CPU step's.
#[test]
fn evaluation_gives_the_cpu_steps_loss_hits_and_count() {
    let (offsets, params, _, tokens, targets) = setup();
    let mut cpu = GptStep::new(DIMS, offsets.clone(), false, 1e-5).unwrap();
    let b = GptBatch {
        tokens: &tokens,
        targets: &targets,
        batch: BATCH,
        t: T,
        ignore: -1,
    };
    let (want_loss, want_hits, want_count) = cpu.evaluate(&params, b).unwrap();
    let step = GptGpuStep::<Host, f32>::new(&Host, DIMS, offsets, 1e-5, BATCH, T).unwrap();
    step.buffers().load_params(&Host, &params).unwrap();
    let (loss, hits, count) = step
        .evaluate(
            &Host,
            TokenBatch {
                tokens: &tokens,
                targets: &targets,
                ignore: -1,
            },
        )
        .unwrap();
    assert_close_scalar(loss, want_loss, 1e-5, "evaluated loss");
    assert_eq!(
        (hits, count),
        (want_hits, want_count),
        "top-1 hits and valid targets"
    );
}

/// The GPU step as a stoker-kernels `TokenStep` (what stoker-train's direct path runs):
/// the same loss and gradients as the CPU step through the whole-buffer entry point, the
/// groups reported final in the same order, and evaluation alike.
#[test]
fn as_a_token_step_it_matches_the_cpu_step_and_its_group_order() {
    use stoker_gpu::step::token_step::AsTokenStep;
    let (offsets, params, ranges, tokens, targets) = setup();
    let b = GptBatch {
        tokens: &tokens,
        targets: &targets,
        batch: BATCH,
        t: T,
        ignore: -1,
    };
    let (groups, end) = (offsets.group_ranges().to_vec(), offsets.end());
    let o = offsets.clone();
    let make = Box::new(move |be: &Host, batch: usize, t: usize| {
        GptGpuStep::<Host, f32>::new(be, DIMS, o.clone(), 1e-5, batch, t)
    });
    let mut gpu = AsTokenStep::new(Host, make, groups, end);
    let mut cpu = GptStep::new(DIMS, offsets, false, 1e-5).unwrap();
    let run = |s: &mut dyn TokenStep| {
        let (mut grads, mut order) = (vec![0.5f32; params.len()], Vec::new());
        let loss = s
            .forward_backward(&params, b, 1.0 / 31.0, &mut grads, &mut |g, _| {
                order.push(g)
            })
            .unwrap();
        (loss, grads, order)
    };
    let (want_loss, want, want_order) = run(&mut cpu);
    let (loss, got, order) = run(&mut gpu);
    assert_close_scalar(loss, want_loss, 1e-5, "loss through TokenStep");
    assert_eq!(order, want_order, "groups reported final");
    assert_close_each(&got, &want, &ranges, 2e-5, |name| {
        format!("{name} (added to 0.5)")
    });
    let (l1, h1, c1) = cpu.evaluate(&params, b).unwrap();
    let (l2, h2, c2) = gpu.evaluate(&params, b).unwrap();
    assert_close_scalar(l2, l1, 1e-5, "evaluation through TokenStep");
    assert_eq!((h2, c2), (h1, c1));
    assert!(gpu.activation_bytes() > 0);
}

/// Three training steps with SGD (Nesterov momentum, weight decay on matrices) through
/// the step's update, against the CPU step with stoker-kernels' SGD: the same weights.
#[test]
fn sgd_training_steps_track_the_cpu_steps() {
    use stoker_gpu::step::optimizer::{OptimizerState, Scalars};
    use stoker_kernels::optim::sgd_update_scalar;
    use stoker_kernels::SgdStep;
    let (offsets, params0, ranges, tokens, targets) = setup();
    let segs = segments(&ranges);
    let sgd = |t: u64| SgdStep {
        lr: 0.05,
        momentum: 0.9,
        weight_decay: 0.01,
        nesterov: true,
        first: t == 1,
    };
    let b = GptBatch {
        tokens: &tokens,
        targets: &targets,
        batch: BATCH,
        t: T,
        ignore: -1,
    };
    let mut cpu = GptStep::new(DIMS, offsets.clone(), false, 1e-5).unwrap();
    let (mut p, mut buf) = (params0.clone(), vec![0f32; params0.len()]);
    for t in 1..=3 {
        let mut g = vec![0f32; p.len()];
        cpu.forward_backward(&p, b, 1.0 / 31.0, &mut g, &mut |_, _| {})
            .unwrap();
        for (r, decay) in &segs {
            sgd_update_scalar(
                &sgd(t),
                *decay,
                &mut p[r.clone()],
                &g[r.clone()],
                &mut buf[r.clone()],
            );
        }
    }
    let step = GptGpuStep::<Host, f32>::new(&Host, DIMS, offsets, 1e-5, BATCH, T).unwrap();
    step.buffers().load_params(&Host, &params0).unwrap();
    let opt = OptimizerState::sgd(&Host, &params0, &segs, true).unwrap();
    for t in 1..=3 {
        step.buffers().zero_grads(&Host).unwrap();
        step.forward_backward(
            &Host,
            TokenBatch {
                tokens: &tokens,
                targets: &targets,
                ignore: -1,
            },
            1.0 / 31.0,
        )
        .unwrap();
        step.update(&Host, &opt, &Scalars::Sgd(sgd(t)), 1.0, None)
            .unwrap();
    }
    let got = opt.master(&Host).unwrap();
    assert_close_each(&got, &p, &ranges, 1e-5, |name| {
        format!("{name} after 3 SGD steps")
    });
    let wrong = step.update(
        &Host,
        &opt,
        &Scalars::AdamW(stoker_kernels::AdamWStep::new(
            1e-3, 0.9, 0.99, 1e-8, 0.0, 1,
        )),
        1.0,
        None,
    );
    assert!(wrong.unwrap_err().to_string().contains("other optimizer"));
}

/// A step's id buffers are made once and rewritten per micro-batch: run on a batch of
/// many distinct tokens and then on one of few (the groups shrink), the step gives for
/// the second what a fresh step gives, bit for bit, and the CPU step's gradients.
#[test]
fn a_step_reused_across_batches_equals_a_fresh_one() {
    let (offsets, params, ranges, tokens, targets) = setup();
    let few: Vec<i64> = tokens.iter().map(|&t| t % 3).collect();
    let run = |step: &GptGpuStep<Host, f32>, tokens: &[i64]| {
        step.buffers().zero_grads(&Host).unwrap();
        let batch = TokenBatch {
            tokens,
            targets: &targets,
            ignore: -1,
        };
        let loss = step.forward_backward(&Host, batch, 0.25).unwrap();
        (loss, step.buffers().grads(&Host).unwrap())
    };
    let reused =
        GptGpuStep::<Host, f32>::new(&Host, DIMS, offsets.clone(), 1e-5, BATCH, T).unwrap();
    reused.buffers().load_params(&Host, &params).unwrap();
    run(&reused, &tokens);
    let (loss, grads) = run(&reused, &few);
    let fresh = GptGpuStep::<Host, f32>::new(&Host, DIMS, offsets.clone(), 1e-5, BATCH, T).unwrap();
    fresh.buffers().load_params(&Host, &params).unwrap();
    let (want_loss, want) = run(&fresh, &few);
    assert_eq!(loss.to_bits(), want_loss.to_bits(), "the loss");
    stoker_testkit::assert_bits_eq(&grads, &want, "gradients of the second batch");
    let (cpu_loss, cpu_grads) = cpu(&offsets, &params, &few, &targets, 0.25);
    assert_close_scalar(loss, cpu_loss, 1e-5, "the CPU step's loss");
    assert_close_each(&grads, &cpu_grads, &ranges, 2e-5, str::to_string);
}

/// A window's next micro-batch's ids go up beside the launches (`prefetch_ids`, the
/// copy stream's `Work::Transfer`) into the step's other set of id buffers: the
/// micro-batch that then runs finds them there and writes nothing in the stream's order,
/// where one whose set holds other ids writes its own; and the prefetched window gives
/// the one queued without, bit for bit (until each wait its id buffers hold -1, which
/// with an ignore index of -100 no kernel takes for an ignored target). An evaluation
/// that loaded a set without groups, then a micro-batch of the same ids on it, and a
/// prefetch refused for a bad id, then the window, give a fresh step's bits too.
#[test]
fn prefetched_ids_go_up_beside_the_launches_and_change_no_bit() {
    use stoker_gpu::counting::{CountingBackend, Work};
    let (offsets, params, _, tokens, targets) = setup();
    let targets: Vec<i64> = targets
        .iter()
        .enumerate()
        .map(|(i, &t)| if t == -1 || i % 4 == 3 { -100 } else { t })
        .collect();
    let few: Vec<i64> = tokens.iter().map(|&t| t % 3).collect();
    let other: Vec<i64> = tokens.iter().map(|&t| (t + 1) % 5).collect();
    let batch = |tokens| TokenBatch {
        tokens,
        targets: &targets,
        ignore: -100,
    };
    let micro = [batch(&tokens), batch(&few), batch(&other)];
    // Bytes written in the stream's order (uploads) and beside it (transfers).
    let be = CountingBackend::new();
    let step = GptGpuStep::<CountingBackend, f32>::new(&be, DIMS, offsets.clone(), 1e-5, BATCH, T)
        .unwrap();
    let moved = |work: Vec<Work>| {
        work.iter().fold((0, 0), |(up, beside), w| match w {
            Work::Upload { bytes } => (up + bytes, beside),
            Work::Transfer { bytes, .. } => (up, beside + bytes),
            _ => (up, beside),
        })
    };
    // What queueing micro-batch `j` moved.
    let queued = |j: usize| {
        step.queue_micro_batch(&be, (micro[j], 0.25), j > 0, Default::default())
            .unwrap();
        moved(be.take())
    };
    be.take();
    step.prefetch_ids(&be, micro[1]).unwrap();
    let prefetched = moved(be.take());
    assert!(prefetched.0 == 0 && prefetched.1 > 0, "{prefetched:?}");
    let first = queued(0);
    assert!(
        first.0 > 0 && first.1 == 0,
        "the first micro-batch: {first:?}"
    );
    assert_eq!(queued(1), (0, 0), "the prefetched micro-batch");
    // Its set held the first micro-batch's ids: a third one writes its own.
    let third = queued(2);
    assert!(
        third.0 > 0 && third.1 == 0,
        "a micro-batch not prefetched: {third:?}"
    );
    // The host build: the same window with and without the prefetches, and after a
    // prefetch refused for a token outside the vocabulary and an evaluation of the second
    // micro-batch's ids (their set then holds them without their groups).
    let bad: Vec<i64> = tokens.iter().map(|&t| t + DIMS.vocab as i64).collect();
    let run = |prefetch: bool, before: bool| {
        let step =
            GptGpuStep::<Host, f32>::new(&Host, DIMS, offsets.clone(), 1e-5, BATCH, T).unwrap();
        step.buffers().load_params(&Host, &params).unwrap();
        if before {
            // Refused into the second set, which then holds nothing known; the evaluation
            // loads the second micro-batch's ids into the first set without groups, where
            // the window's second micro-batch comes to need them with.
            assert!(step.prefetch_ids(&Host, batch(&bad)).is_err());
            step.evaluate(&Host, micro[1]).unwrap();
        }
        step.buffers().zero_grads(&Host).unwrap();
        for (j, m) in micro.iter().enumerate() {
            if let Some(next) = micro.get(j + 1).filter(|_| prefetch) {
                step.prefetch_ids(&Host, *next).unwrap();
            }
            step.queue_micro_batch(&Host, (*m, 0.25), j > 0, Default::default())
                .unwrap();
        }
        (
            step.loss_sum(&Host).unwrap(),
            step.buffers().grads(&Host).unwrap(),
        )
    };
    let (want_loss, want) = run(false, false);
    for (prefetch, before) in [(true, false), (true, true), (false, true)] {
        let (loss, grads) = run(prefetch, before);
        let what = format!("prefetched {prefetch}, after an evaluation {before}");
        assert_eq!(
            loss.to_bits(),
            want_loss.to_bits(),
            "{what}: the window's loss"
        );
        stoker_testkit::assert_bits_eq(&grads, &want, &format!("{what}: gradients"));
    }
}

/// 1,000 positions: attention's queries in 3 chunks (334, 334 and 332 rows), each chunk's
/// products over the keys up to its last query, the key-side gradients by key chunk.
/// The loss and every gradient are still the CPU step's, whose attention is whole.
#[test]
fn a_long_context_s_chunked_attention_gives_the_cpu_steps_loss_and_gradients() {
    let dims = GptDims {
        vocab: 37,
        context: 1000,
        d_model: 16,
        n_layer: 1,
        n_head: 2,
    };
    let t = 1000;
    assert_eq!(stoker_gpu::step::attention::query_chunk(t), 334);
    let g = stoker_gpu::sample::gpt(&dims, 101, 0.3);
    let tokens: Vec<i64> = ids(t, 5, dims.vocab).iter().map(|&x| x as i64).collect();
    let targets: Vec<i64> = ids(t, 6, dims.vocab).iter().map(|&x| x as i64).collect();
    let scale = 1.0 / t as f32;
    let mut cpu = GptStep::new(dims, g.offsets.clone(), false, 1e-5).unwrap();
    let mut want = vec![0f32; g.params.len()];
    let batch = GptBatch {
        tokens: &tokens,
        targets: &targets,
        batch: 1,
        t,
        ignore: -1,
    };
    let want_loss = cpu
        .forward_backward(&g.params, batch, scale, &mut want, &mut |_, _| {})
        .unwrap();
    let step = GptGpuStep::<Host, f32>::new(&Host, dims, g.offsets.clone(), 1e-5, 1, t).unwrap();
    step.buffers().load_params(&Host, &g.params).unwrap();
    let tb = TokenBatch {
        tokens: &tokens,
        targets: &targets,
        ignore: -1,
    };
    let loss = step.forward_backward(&Host, tb, scale).unwrap();
    let got = step.buffers().grads(&Host).unwrap();
    assert_close_scalar(loss, want_loss, 1e-5, "summed loss, 1,000 positions");
    assert_close_each(&got, &want, &g.ranges, 2e-5, |name| {
        format!("gradient of {name}, 1,000 positions")
    });
}
