//! The GPU step, run by the host backend, against stoker-kernels' CPU step on the same
//! flat parameters, batch and loss scale: the summed loss and every parameter's gradient
//! agree within f32 rounding (f32 activations), or within bf16's precision (bf16
//! activations). The step's orchestration (buffers, GEMM shapes, the residual stream,
//! the backward's order) is what this checks; the kernels have their own tests.

mod common;

use std::collections::HashMap;

use common::*;
use half::bf16;
use stoker_gpu::step::{GptGpuStep, TokenBatch};
use stoker_gpu::{Act, Host};
use stoker_kernels::{gpt_params, GptBatch, GptDims, GptOffsets, GptStep, SpecInit, TokenStep};
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

/// Contiguous offsets in table order, parameters drawn around their initialization, a
/// batch with two ignored targets.
fn setup() -> Setup {
    let table = gpt_params(&DIMS);
    let (mut at, mut ranges, mut end) = (HashMap::new(), Vec::new(), 0);
    let mut params = Vec::new();
    for (i, p) in table.iter().enumerate() {
        let len: usize = p.shape.iter().product();
        at.insert(p.name.clone(), end);
        ranges.push((p.name.clone(), end..end + len));
        let u = uniform(len, 100 + i as u64, 1.0);
        params.extend(u.iter().map(|x| match p.init {
            SpecInit::Ones => 1.0 + 0.1 * x,
            _ => 0.2 * x,
        }));
        end += len;
    }
    let offsets = GptOffsets::from_table(&DIMS, |name| at.get(name).copied()).unwrap();
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
    (offsets, params, ranges, tokens, targets)
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
