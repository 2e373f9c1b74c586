//! The Llama's GPU step, run by the host backend, against stoker-kernels' `LlamaStep` on
//! the same flat parameters, batch and loss scale (grouped-query attention: 4 query heads
//! over 2 kv heads): the summed loss and every parameter's gradient within f32 rounding,
//! or within bf16's precision with bf16 activations; and five training steps with AdamW
//! and clipping against the CPU's.

mod common;

use common::*;
use half::bf16;
use stoker_gpu::step::llama::LlamaGpuStep;
use stoker_gpu::step::optimizer::{OptimizerState, Scalars};
use stoker_gpu::step::TokenBatch;
use stoker_gpu::{Act, Host};
use stoker_kernels::{AdamWStep, GptBatch, LlamaDims, LlamaStep, TokenStep};
use stoker_testkit::assert_close_scalar;

const DIMS: LlamaDims = stoker_gpu::sample::SMALL_LLAMA;
const BATCH: usize = 3;
const T: usize = 11;
const THETA: f64 = 10_000.0;

fn batch() -> (Vec<i64>, Vec<i64>) {
    let tokens: Vec<i64> = ids(BATCH * T, 1, DIMS.vocab)
        .iter()
        .map(|&x| x as i64)
        .collect();
    let mut targets: Vec<i64> = ids(BATCH * T, 2, DIMS.vocab)
        .iter()
        .map(|&x| x as i64)
        .collect();
    targets[5] = -1;
    (tokens, targets)
}

fn cpu_step() -> LlamaStep {
    LlamaStep::new(
        DIMS,
        stoker_gpu::sample::llama(&DIMS, 200, 0.2).offsets,
        false,
        1e-5,
        THETA,
    )
    .unwrap()
}

fn gpu<A: Act>(params: &[f32], tokens: &[i64], targets: &[i64], scale: f32) -> (f64, Vec<f32>) {
    let offsets = stoker_gpu::sample::llama(&DIMS, 200, 0.2).offsets;
    let step = LlamaGpuStep::<Host, A>::new(&Host, DIMS, offsets, 1e-5, THETA, BATCH, T).unwrap();
    step.buffers().load_params(&Host, params).unwrap();
    let loss = step
        .forward_backward(
            &Host,
            TokenBatch {
                tokens,
                targets,
                ignore: -1,
            },
            scale,
        )
        .unwrap();
    (loss, step.buffers().grads(&Host).unwrap())
}

#[test]
fn the_llama_step_gives_the_cpu_steps_loss_and_gradients() {
    let g = stoker_gpu::sample::llama(&DIMS, 200, 0.2);
    let (tokens, targets) = batch();
    let scale = 1.0 / 32.0;
    let mut want = vec![0f32; g.params.len()];
    let b = GptBatch {
        tokens: &tokens,
        targets: &targets,
        batch: BATCH,
        t: T,
        ignore: -1,
    };
    let want_loss = cpu_step()
        .forward_backward(&g.params, b, scale, &mut want, &mut |_, _| {})
        .unwrap();
    let (loss, got) = gpu::<f32>(&g.params, &tokens, &targets, scale);
    assert_close_scalar(loss, want_loss, 1e-5, "summed loss");
    assert_close_each(&got, &want, &g.ranges, 2e-5, |name| {
        format!("gradient of {name}")
    });
    let (loss16, got16) = gpu::<bf16>(&g.params, &tokens, &targets, scale);
    assert_close_scalar(loss16, want_loss, 1e-2, "summed loss, bf16 activations");
    assert_rel_l2_each(&got16, &want, &g.ranges, 5e-2);
}

#[test]
fn five_llama_training_steps_track_the_cpu_steps() {
    let g = stoker_gpu::sample::llama(&DIMS, 200, 0.2);
    let (tokens, targets) = batch();
    let (scale, clip) = (1.0 / 32.0, 0.5);
    let segs: Vec<_> =
        stoker_gpu::sample::segments(&stoker_kernels::llama_params(&DIMS), &g.ranges);
    let adam = |t: u64| AdamWStep::new(3e-3, 0.9, 0.95, 1e-8, 0.1, t);
    let b = GptBatch {
        tokens: &tokens,
        targets: &targets,
        batch: BATCH,
        t: T,
        ignore: -1,
    };

    let mut cpu = cpu_step();
    let mut p = g.params.clone();
    let losses = cpu_train(&mut cpu, &mut p, b, scale, clip, &segs, adam, 5);

    let step =
        LlamaGpuStep::<Host, f32>::new(&Host, DIMS, g.offsets.clone(), 1e-5, THETA, BATCH, T)
            .unwrap();
    step.buffers().load_params(&Host, &g.params).unwrap();
    let opt = OptimizerState::adamw(&Host, &g.params, &segs).unwrap();
    for (t, want) in (1..=5).zip(&losses) {
        step.buffers().zero_grads(&Host).unwrap();
        let loss = step
            .forward_backward(
                &Host,
                TokenBatch {
                    tokens: &tokens,
                    targets: &targets,
                    ignore: -1,
                },
                scale,
            )
            .unwrap();
        assert_close_scalar(loss, *want, 1e-5, &format!("loss at step {t}"));
        step.update(&Host, &opt, &Scalars::AdamW(adam(t)), 1.0, Some(clip))
            .unwrap();
    }
    assert!(losses[4] < losses[0], "the loss did not fall: {losses:?}");
    let got = opt.master(&Host).unwrap();
    assert_close_each(&got, &p, &g.ranges, 1e-5, |name| {
        format!("{name} after 5 steps")
    });
}

/// Evaluation against the CPU step's: the loss, top-1 hits and count.
#[test]
fn llama_evaluation_gives_the_cpu_steps_loss_hits_and_count() {
    let g = stoker_gpu::sample::llama(&DIMS, 200, 0.2);
    let (tokens, targets) = batch();
    let b = GptBatch {
        tokens: &tokens,
        targets: &targets,
        batch: BATCH,
        t: T,
        ignore: -1,
    };
    let (want_loss, want_hits, want_count) = cpu_step().evaluate(&g.params, b).unwrap();
    let step =
        LlamaGpuStep::<Host, f32>::new(&Host, DIMS, g.offsets.clone(), 1e-5, THETA, BATCH, T)
            .unwrap();
    step.buffers().load_params(&Host, &g.params).unwrap();
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

/// 600 positions: grouped-query attention's queries in 2 chunks of 300, each chunk's
/// products over the keys up to its last query, the key-side gradients by key chunk
/// (summed back over the repeated kv heads after). The loss and every gradient are still
/// the CPU step's, whose attention is whole; bf16 activations within bf16's precision.
#[test]
fn a_long_context_llama_s_chunked_attention_gives_the_cpu_steps_loss_and_gradients() {
    let dims = LlamaDims {
        vocab: 29,
        context: 600,
        d_model: 16,
        n_layer: 1,
        n_head: 4,
        n_kv_head: 2,
        ffn_hidden: 24,
    };
    let t = 600;
    assert_eq!(stoker_gpu::step::attention::query_chunk(t), 300);
    let g = stoker_gpu::sample::llama(&dims, 201, 0.3);
    let tokens: Vec<i64> = ids(t, 7, dims.vocab).iter().map(|&x| x as i64).collect();
    let targets: Vec<i64> = ids(t, 8, dims.vocab).iter().map(|&x| x as i64).collect();
    let scale = 1.0 / t as f32;
    let mut want = vec![0f32; g.params.len()];
    let b = GptBatch {
        tokens: &tokens,
        targets: &targets,
        batch: 1,
        t,
        ignore: -1,
    };
    let want_loss = LlamaStep::new(dims, g.offsets.clone(), false, 1e-5, THETA)
        .unwrap()
        .forward_backward(&g.params, b, scale, &mut want, &mut |_, _| {})
        .unwrap();
    fn run<A: Act>(
        dims: LlamaDims,
        g: &stoker_gpu::sample::SampleLlama,
        (tokens, targets): (&[i64], &[i64]),
        scale: f32,
    ) -> (f64, Vec<f32>) {
        let step =
            LlamaGpuStep::<Host, A>::new(&Host, dims, g.offsets.clone(), 1e-5, THETA, 1, 600)
                .unwrap();
        step.buffers().load_params(&Host, &g.params).unwrap();
        let tb = TokenBatch {
            tokens,
            targets,
            ignore: -1,
        };
        let loss = step.forward_backward(&Host, tb, scale).unwrap();
        (loss, step.buffers().grads(&Host).unwrap())
    }
    let (loss, got) = run::<f32>(dims, &g, (&tokens, &targets), scale);
    assert_close_scalar(loss, want_loss, 1e-5, "summed loss, 600 positions");
    assert_close_each(&got, &want, &g.ranges, 2e-5, |name| {
        format!("gradient of {name}, 600 positions")
    });
    let (loss16, got16) = run::<bf16>(dims, &g, (&tokens, &targets), scale);
    assert_close_scalar(loss16, want_loss, 1e-2, "summed loss, bf16, 600 positions");
    assert_rel_l2_each(&got16, &want, &g.ranges, 5e-2);
}
