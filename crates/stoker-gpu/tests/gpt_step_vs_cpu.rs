//! The GPU step, run by the host backend, against stoker-kernels' CPU step on the same
//! flat parameters, batch and loss scale: the summed loss and every parameter's gradient
//! agree within f32 rounding (f32 activations), or within bf16's precision (bf16
//! activations). The step's orchestration (buffers, GEMM shapes, the residual stream,
//! the backward's order) is what this checks; the kernels have their own tests.

mod common;

use common::*;
use half::bf16;
use stoker_gpu::step::{GptGpuStep, TokenBatch};
use stoker_gpu::{Act, Host};
use stoker_kernels::{GptBatch, GptDims, GptOffsets, GptStep, TokenStep};
use stoker_testkit::{assert_close, assert_close_scalar, rel_l2};

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
    step.load_params(&Host, params).unwrap();
    let batch = TokenBatch {
        tokens,
        targets,
        ignore: -1,
    };
    let loss = step.forward_backward(&Host, batch, scale).unwrap();
    (loss, step.grads(&Host).unwrap())
}

#[test]
fn the_f32_step_gives_the_cpu_steps_loss_and_gradients() {
    let (offsets, params, ranges, tokens, targets) = setup();
    let scale = 1.0 / 31.0;
    let (want_loss, want) = cpu(&offsets, &params, &tokens, &targets, scale);
    let (loss, got) = gpu::<f32>(&offsets, &params, &tokens, &targets, scale);
    assert_close_scalar(loss, want_loss, 1e-5, "summed loss");
    for (name, r) in &ranges {
        assert_close(
            &got[r.clone()],
            &want[r.clone()],
            2e-5,
            &format!("gradient of {name}"),
        );
    }
}

#[test]
fn the_bf16_step_tracks_the_cpu_f32_step() {
    let (offsets, params, ranges, tokens, targets) = setup();
    let scale = 1.0 / 31.0;
    let (want_loss, want) = cpu(&offsets, &params, &tokens, &targets, scale);
    let (loss, got) = gpu::<bf16>(&offsets, &params, &tokens, &targets, scale);
    assert_close_scalar(loss, want_loss, 1e-2, "summed loss, bf16 activations");
    for (name, r) in &ranges {
        let e = rel_l2(&got[r.clone()], &want[r.clone()]);
        assert!(
            e < 5e-2,
            "gradient of {name}: relative L2 error {e} with bf16 activations"
        );
    }
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
