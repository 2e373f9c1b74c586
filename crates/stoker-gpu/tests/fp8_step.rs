//! The GPT step with its linear layers in FP8 (`StepOptions::fp8_linears`), on the host
//! backend: its scalers follow the tensors they cast, an evaluation records nothing, its
//! gradients track the CPU's f32 step within FP8's precision once the scales are set,
//! and what Hopper's FP8 products cannot run is refused when the step is made.

mod common;

use common::*;
use half::{bf16, f16};
use stoker_gpu::step::options::StepOptions;
use stoker_gpu::step::{GptGpuStep, TokenBatch};
use stoker_gpu::{Act, GpuError, Host};
use stoker_kernels::{GptBatch, GptDims, GptOffsets, GptStep, TokenStep};
use stoker_testkit::rel_l2;

const DIMS: GptDims = GptDims {
    vocab: 71,
    context: 16,
    d_model: 32,
    n_layer: 2,
    n_head: 4,
};
const BATCH: usize = 4;
const T: usize = 12;

const FP8: StepOptions = StepOptions {
    offload_params: false,
    recompute_attention: false,
    recompute_mlp: false,
    grads_in_slots: false,
    shard_params: None,
    graph_micro_batches: false,
    flash_attention: false,
    fp8_linears: true,
};

struct Setup {
    offsets: GptOffsets,
    params: Vec<f32>,
    ranges: Vec<(String, std::ops::Range<usize>)>,
    tokens: Vec<i64>,
    targets: Vec<i64>,
}

fn setup() -> Setup {
    let g = stoker_gpu::sample::gpt(&DIMS, 100, 0.2);
    let seq = |seed| -> Vec<i64> {
        ids(BATCH * T, seed, DIMS.vocab)
            .iter()
            .map(|&x| x as i64)
            .collect()
    };
    Setup {
        offsets: g.offsets,
        params: g.params,
        ranges: g.ranges,
        tokens: seq(1),
        targets: seq(2),
    }
}

fn step<A: Act>(s: &Setup, opts: StepOptions) -> Result<GptGpuStep<Host, A>, GpuError> {
    let step = GptGpuStep::<Host, A>::with_options(
        &Host,
        DIMS,
        s.offsets.clone(),
        1e-5,
        (BATCH, T),
        opts,
    )?;
    step.buffers().load_params(&Host, &s.params)?;
    Ok(step)
}

fn batch(s: &Setup) -> TokenBatch<'_> {
    TokenBatch {
        tokens: &s.tokens,
        targets: &s.targets,
        ignore: -1,
    }
}

/// A weight's largest |w| as the scalers record it (stoker-precision's `amax`, the
/// reference), after checking that every weight is finite: a NaN would be ignored there,
/// and must fail here.
fn weight_amax(w: &[f32]) -> f32 {
    assert!(w.iter().all(|x| x.is_finite()), "a weight is not finite");
    stoker_precision::convert::amax(w)
}

/// The weight scalers (the second of each layer's three) recorded each layer's largest
/// |W|, in the layers' order (`qkv`, `proj`, `fc`, `fc_proj` per block), and an
/// evaluation recorded nothing.
#[test]
fn the_scalers_follow_the_layers_they_cast() {
    let s = setup();
    let step = step::<f32>(&s, FP8).unwrap();
    let scalers = step.fp8_scalers().expect("an FP8 step has scalers");
    assert_eq!(scalers.count(), 3 * 4 * DIMS.n_layer);
    // An evaluation first: nothing recorded, so its end of step keeps every scale at 1.
    step.evaluate(&Host, batch(&s)).unwrap();
    scalers.end_step(&Host).unwrap();
    for (i, v) in scalers.read(&Host).unwrap().iter().enumerate() {
        assert_eq!(v.scale, 1.0, "scaler {i} after an evaluation");
        assert!(
            v.history.iter().all(|&a| a == 0.0),
            "scaler {i} recorded an evaluation"
        );
    }
    step.forward_backward(&Host, batch(&s), 1.0).unwrap();
    scalers.end_step(&Host).unwrap();
    let read = scalers.read(&Host).unwrap();
    let names = ["attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"];
    let mut checked = 0;
    for block in 0..DIMS.n_layer {
        let bo = &s.offsets.blocks()[block];
        let weights = [bo.qkv[0], bo.proj[0], bo.fc[0], bo.fc_proj[0]];
        let c = DIMS.d_model;
        let sizes = [3 * c * c, c * c, 4 * c * c, 4 * c * c];
        for j in 0..4 {
            let w = &s.params[weights[j]..weights[j] + sizes[j]];
            let amax = weight_amax(w);
            let v = &read[3 * (4 * block + j) + 1];
            let what = format!("block {block} {}'s weight scaler", names[j]);
            assert_eq!(v.history.last().copied(), Some(0.0), "{what}: the new slot");
            let recorded = v.history[v.history.len() - 2];
            assert_eq!(recorded, amax, "{what}: the recorded amax");
            assert_eq!(v.scale, 448.0 / amax, "{what}: the scale");
            // The input's and the output gradient's scalers recorded something too.
            for (k, role) in [(0, "input"), (2, "output gradient")] {
                let h = &read[3 * (4 * block + j) + k].history;
                assert!(
                    h[h.len() - 2] > 0.0,
                    "block {block} {} {role}: no amax",
                    names[j]
                );
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 4 * DIMS.n_layer);
}

/// The CPU's f32 gradients on the same parameters and batch.
fn cpu_grads(s: &Setup) -> (f64, Vec<f32>) {
    let mut cpu = GptStep::new(DIMS, s.offsets.clone(), false, 1e-5).unwrap();
    let mut grads = vec![0f32; s.params.len()];
    let b = GptBatch {
        tokens: &s.tokens,
        targets: &s.targets,
        batch: BATCH,
        t: T,
        ignore: -1,
    };
    let loss = cpu
        .forward_backward(&s.params, b, 1.0, &mut grads, &mut |_, _| {})
        .unwrap();
    (loss, grads)
}

/// The loss and gradients of a second micro-batch of `s` on an FP8 step with `A`
/// activations, the first having set the scales.
fn second_micro_batch<A: Act>(s: &Setup) -> (f64, Vec<f32>) {
    let step = step::<A>(s, FP8).unwrap();
    step.forward_backward(&Host, batch(s), 1.0).unwrap();
    step.fp8_scalers().unwrap().end_step(&Host).unwrap();
    step.buffers().zero_grads(&Host).unwrap();
    let loss = step.forward_backward(&Host, batch(s), 1.0).unwrap();
    (loss, step.buffers().grads(&Host).unwrap())
}

/// Asserts an FP8 step's summed loss within 2% of the f32 step's, every parameter's
/// gradient within 0.3 relative L2 of its f32 gradient, and at least `moved` of them
/// more than 1e-3 from it (the layers did run in FP8).
fn assert_tracks_f32(
    what: &str,
    (loss, got): (f64, &[f32]),
    (want_loss, want): (f64, &[f32]),
    ranges: &[(String, std::ops::Range<usize>)],
    moved: usize,
) {
    let rel = (loss - want_loss).abs() / want_loss.abs();
    assert!(
        rel < 2e-2,
        "{what}: summed loss {loss} against {want_loss} ({rel:.2e})"
    );
    let mut fp8_moved = 0;
    for (name, r) in ranges {
        let e = rel_l2(&got[r.clone()], &want[r.clone()]);
        assert!(e < 0.3, "{what}: gradient of {name}: relative L2 {e:.3e}");
        fp8_moved += (e > 1e-3) as usize;
    }
    assert!(
        fp8_moved >= moved,
        "{what}: only {fp8_moved} gradients differ from f32's by more than 1e-3"
    );
}

/// Once a first micro-batch has set the scales (the first casts run at scale 1, as
/// Transformer Engine's do), a second's loss and every parameter's gradient track the
/// CPU's f32 step within what E4M3 and E5M2 keep (3 and 2 mantissa bits): the FP8
/// products are wired to the right operands in the right layouts (a wrong one is off
/// by the gradient's own size). And they do differ from it: the layers did run in FP8.
#[test]
fn an_fp8_step_tracks_the_f32_step_within_fp8_s_precision() {
    let s = setup();
    let (want_loss, want) = cpu_grads(&s);
    for (what, (loss, got)) in [
        ("f32 activations", second_micro_batch::<f32>(&s)),
        ("bf16 activations", second_micro_batch::<bf16>(&s)),
    ] {
        assert_tracks_f32(
            what,
            (loss, &got),
            (want_loss, &want),
            &s.ranges,
            4 * DIMS.n_layer,
        );
    }
}

/// Rows of a micro-batch that are not a multiple of 16 and f16 activations are refused
/// when the step is made, naming why.
#[test]
fn what_fp8_products_cannot_run_is_refused_when_the_step_is_made() {
    let s = setup();
    let says = |r: Result<(), GpuError>, what: &str| match r {
        Err(e) => assert!(e.to_string().contains(what), "{e} should say {what:?}"),
        Ok(()) => panic!("expected a refusal saying {what:?}"),
    };
    let odd =
        GptGpuStep::<Host, f32>::with_options(&Host, DIMS, s.offsets.clone(), 1e-5, (3, 11), FP8);
    says(odd.map(|_| ()), "multiples of 16");
    says(step::<f16>(&s, FP8).map(|_| ()), "not f16");
}

/// The step's plan counts what its FP8 layers hold (their scalers and the casts'
/// scratch), to the byte, as it counts its buffers.
#[test]
fn the_plan_counts_what_the_fp8_layers_hold() {
    use stoker_gpu::step::gpt::gpt_step_sizes;
    let s = setup();
    let step = step::<bf16>(&s, FP8).unwrap();
    let planned = gpt_step_sizes(&DIMS, s.params.len(), (BATCH, T), FP8).bytes(2);
    let plain = gpt_step_sizes(&DIMS, s.params.len(), (BATCH, T), StepOptions::default()).bytes(2);
    assert_eq!(planned, step.buffers().bytes() + step.fp8_bytes());
    // 24 scalers of (3 + 1,024 + 1,024 + 1) f32s (values, history, partials, the step's
    // amax); four casts of 48 rows x 128; two of 4,096.
    let want = 4 * 24 * (3 + 1024 + 1024 + 1) + 4 * 48 * 128 + 2 * 4096;
    assert_eq!(step.fp8_bytes(), want);
    assert_eq!(planned - plain, want);
}

/// The Llama's seven linear layers a block in FP8: the weight scalers follow `q`, `k`, `v`,
/// `o`, `gate`, `up`, `down` in that order, and once the scales are set the loss and every
/// gradient track the CPU's f32 Llama step within FP8's precision.
#[test]
fn the_llama_s_fp8_layers_follow_its_weights_and_track_the_f32_step() {
    use stoker_gpu::step::llama::LlamaGpuStep;
    use stoker_kernels::{LlamaDims, LlamaStep};
    const LLAMA: LlamaDims = stoker_gpu::sample::SMALL_LLAMA;
    let g = stoker_gpu::sample::llama(&LLAMA, 200, 0.2);
    let s = setup();
    let (tokens, targets): (Vec<i64>, Vec<i64>) = (
        s.tokens.iter().map(|&x| x % LLAMA.vocab as i64).collect(),
        s.targets.iter().map(|&x| x % LLAMA.vocab as i64).collect(),
    );
    let batch = TokenBatch {
        tokens: &tokens,
        targets: &targets,
        ignore: -1,
    };
    let step = LlamaGpuStep::<Host, f32>::with_options(
        &Host,
        LLAMA,
        g.offsets.clone(),
        (1e-5, 10_000.0),
        (BATCH, T),
        FP8,
    )
    .unwrap();
    step.buffers().load_params(&Host, &g.params).unwrap();
    step.forward_backward(&Host, batch, 1.0).unwrap();
    let scalers = step.fp8_scalers().expect("an FP8 step has scalers");
    scalers.end_step(&Host).unwrap();
    let read = scalers.read(&Host).unwrap();
    assert_eq!(read.len(), 3 * 7 * LLAMA.n_layer);
    let (c, f) = (LLAMA.d_model, LLAMA.ffn_hidden);
    let kv = LLAMA.n_kv_head * (c / LLAMA.n_head);
    for (block, bo) in g.offsets.blocks().iter().enumerate() {
        let weights = [
            (bo.q, c * c),
            (bo.k, kv * c),
            (bo.v, kv * c),
            (bo.o, c * c),
            (bo.gate, f * c),
            (bo.up, f * c),
            (bo.down, c * f),
        ];
        for (j, (at, len)) in weights.into_iter().enumerate() {
            let amax = weight_amax(&g.params[at..at + len]);
            let h = &read[3 * (7 * block + j) + 1].history;
            assert_eq!(
                h[h.len() - 2],
                amax,
                "block {block} layer {j}: the weight's amax"
            );
        }
    }
    // A second micro-batch at the scales the first set, against the CPU's f32 step.
    step.buffers().zero_grads(&Host).unwrap();
    let loss = step.forward_backward(&Host, batch, 1.0).unwrap();
    let got = step.buffers().grads(&Host).unwrap();
    let mut cpu = LlamaStep::new(LLAMA, g.offsets.clone(), false, 1e-5, 10_000.0).unwrap();
    let mut want = vec![0f32; g.params.len()];
    let b = stoker_kernels::GptBatch {
        tokens: &tokens,
        targets: &targets,
        batch: BATCH,
        t: T,
        ignore: -1,
    };
    let want_loss = cpu
        .forward_backward(&g.params, b, 1.0, &mut want, &mut |_, _| {})
        .unwrap();
    assert_tracks_f32(
        "the Llama",
        (loss, &got),
        (want_loss, &want),
        &g.ranges,
        7 * LLAMA.n_layer,
    );
    // The plan counts what the layers hold: the widest layer is the MLP's (48 wide) and
    // the largest weight C x F.
    let planned =
        stoker_gpu::step::llama::llama_step_sizes(&LLAMA, g.params.len(), (BATCH, T), FP8);
    assert_eq!(planned.bytes(4), step.buffers().bytes() + step.fp8_bytes());
    let want = 4 * 42 * (3 + 1024 + 1024 + 1) + 4 * 48 * 48 + 2 * 32 * 48;
    assert_eq!(step.fp8_bytes(), want);
}
