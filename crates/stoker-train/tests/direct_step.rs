//! The GPT's and the Llama's direct training steps (`kernels = "direct"`: stoker-kernels'
//! `GptStep` and `LlamaStep` over
//! the flat buffers, no autograd graph) gives the gradients of the candle graph built
//! from the composed reference ops: every parameter, over a window of micro-batches of
//! different lengths with masked targets, f32 to 1e-5 relative per tensor (max |direct -
//! composed| / max |composed|); bf16 autocast to bf16 rounding. And whole trainers with
//! `direct` and `composed` kernels take the same steps.

mod common;

use candle_core::{DType, Device};
use common::*;
use stoker_train::accumulate::{
    accumulate, accumulate_direct, AccumulateOptions, MicroBatch, Normalization,
};
use stoker_train::layout::FlatLayout;
use stoker_train::models::{Gpt, GptConfig, Llama, LlamaConfig, Model};
use stoker_train::precision::{Fx, Kernels, Precision};
use stoker_train::trainer::Trainer;

const CONFIG: GptConfig = GptConfig {
    vocab: 37,
    context: 19,
    d_model: 24,
    n_layer: 2,
    n_head: 3,
    init_from: None,
};

fn gpt(dtype: DType) -> Gpt {
    Gpt::new(CONFIG, &Device::Cpu, dtype, 17).unwrap()
}

/// Windows covering every code path: T not a multiple of a vector and shorter than the
/// context, a second micro-batch of another length, masked targets (one row all masked).
fn window() -> Vec<MicroBatch> {
    vec![
        token_batch(3, 4, 19, 37, &[0, 2, 19, 5]),
        token_batch(9, 3, 7, 37, &[1, 0, 3]),
    ]
}

/// (direct gradients, direct loss, composed gradients, composed loss) of the GPT.
fn both(
    precision: Precision,
    norm: Normalization,
    loss_scale: f64,
) -> (Vec<f32>, f64, Vec<f32>, f64, FlatLayout) {
    both_of(&|d| Box::new(gpt(d)), precision, norm, loss_scale)
}

/// A Llama with grouped-query attention (3 query heads per key/value head) on the same
/// windows, its weights drawn as `dtype`.
fn llama(dtype: DType) -> Box<dyn Model> {
    let c = LlamaConfig {
        vocab: 37,
        context: 19,
        d_model: 24,
        n_layer: 2,
        n_head: 6,
        n_kv_head: Some(2),
        ffn_hidden: Some(40),
        rope_theta: 10_000.0,
        norm_eps: 1e-5,
        init_from: None,
    };
    Box::new(Llama::new(c, &Device::Cpu, dtype, 17).unwrap())
}

/// [`both`] for the model `make` draws in a dtype.
fn both_of(
    make: &dyn Fn(DType) -> Box<dyn Model>,
    precision: Precision,
    norm: Normalization,
    loss_scale: f64,
) -> (Vec<f32>, f64, Vec<f32>, f64, FlatLayout) {
    let composed = make(precision.compute_dtype());
    let layout = FlatLayout::of(composed.params()).unwrap();
    // Not the initial weights: every bias and gain moved, so reading a neighbouring
    // tensor (or alignment padding) instead of the right one shows.
    let mut master = layout.flatten(make(DType::F32).params()).unwrap();
    for (m, n) in master.iter_mut().zip(floats(78, layout.total_len())) {
        *m += 0.05 * n;
    }
    layout.unflatten(&master, composed.params()).unwrap();
    let opts = AccumulateOptions {
        norm,
        loss_scale,
        check_grads: true,
    };
    let mut gc = vec![0f32; layout.total_len()];
    let fx = Fx::new(precision, None).with_kernels(Kernels::Composed);
    let rc = accumulate(&*composed, &fx, &window(), opts, &layout, &mut gc).unwrap();
    // The direct step reads the FP32 master: the same values.
    let direct = make(DType::F32);
    let mut step = direct
        .direct_step(&layout, precision == Precision::Bf16)
        .unwrap()
        .expect("the model has a direct step");
    let mut gd = vec![0f32; layout.total_len()];
    let rd = accumulate_direct(&mut *step, &window(), opts, &master, &mut gd).unwrap();
    (gd, rd.loss, gc, rc.loss, layout)
}

#[test]
fn direct_step_equals_composed_graph_f32() {
    for (norm, scale) in [
        (Normalization::WindowCount, 1.0),
        (Normalization::StepCount, 1.0),
        (Normalization::WindowCount, 1024.0),
    ] {
        let (gd, ld, gc, lc, layout) = both(Precision::Fp32, norm, scale);
        assert!(
            (ld - lc).abs() <= 1e-6 * lc.abs(),
            "loss: direct {ld}, composed {lc}"
        );
        assert_grads_close(&layout, &gd, &gc, 1e-5, "direct vs composed, f32");
    }
}

#[test]
fn direct_step_bf16_autocast_within_bf16_rounding() {
    // On CPUs without bf16 instructions the direct step runs the bf16 GEMM's portable
    // kernel (same results, only slower), so this runs everywhere.
    // Direct rounds only the matmul operands to bf16; the composed reference keeps bf16
    // variables and activations. 2^-5 of each tensor's largest gradient, as the fused ops.
    let (gd, ld, gc, lc, layout) = both(Precision::Bf16, Normalization::WindowCount, 1.0);
    assert!(
        (ld - lc).abs() <= 0.02 * lc.abs(),
        "loss: direct {ld}, composed {lc}"
    );
    assert_grads_close(&layout, &gd, &gc, 1.0 / 32.0, "direct vs composed, bf16");
}

/// The Llama's direct step (RMSNorm, rotary q and k, grouped-query attention through
/// repeated key/value heads, SwiGLU, untied head) against its composed graph.
#[test]
fn llama_direct_step_equals_composed_graph_f32_and_bf16() {
    for (norm, scale) in [
        (Normalization::WindowCount, 1.0),
        (Normalization::StepCount, 1024.0),
    ] {
        let (gd, ld, gc, lc, layout) = both_of(&llama, Precision::Fp32, norm, scale);
        assert!(
            (ld - lc).abs() <= 1e-6 * lc.abs(),
            "loss: direct {ld}, composed {lc}"
        );
        assert_grads_close(&layout, &gd, &gc, 1e-5, "llama direct vs composed, f32");
    }
    let (gd, ld, gc, lc, layout) =
        both_of(&llama, Precision::Bf16, Normalization::WindowCount, 1.0);
    assert!(
        (ld - lc).abs() <= 0.02 * lc.abs(),
        "loss: direct {ld}, composed {lc}"
    );
    assert_grads_close(
        &layout,
        &gd,
        &gc,
        1.0 / 32.0,
        "llama direct vs composed, bf16",
    );
}

fn trainer(kernels: &str) -> Trainer {
    let toml = format!(
        r#"run_dir = "unused"
precision = "fp32"
kernels = "{kernels}"
[data]
train = "unused"
[model]
kind = "gpt"
vocab = 37
context = 19
d_model = 24
n_layer = 2
n_head = 3
[batch]
micro_batch = 4
[optimizer]
kind = "adamw"
lr = 1e-2
weight_decay = 0.1
grad_clip = 1.0
[train]
steps = 3
"#
    );
    let config =
        stoker_train::config::TrainConfig::parse(&toml, std::path::Path::new("t")).unwrap();
    Trainer::new(&config).unwrap()
}

#[test]
fn trainers_with_direct_and_composed_kernels_take_the_same_steps() {
    let (mut d, mut c) = (trainer("direct"), trainer("composed"));
    assert!(d.direct() && !c.direct());
    for s in 0..3u64 {
        let w = vec![
            token_batch(20 + s, 4, 19, 37, &[0, 1, 2, 3]),
            token_batch(40 + s, 4, 11, 37, &[0, 0, 11, 0]),
        ];
        let (rd, rc) = (d.train_step(&w).unwrap(), c.train_step(&w).unwrap());
        assert!(
            (rd.loss - rc.loss).abs() <= 1e-5 * rc.loss,
            "step {s}: loss"
        );
        assert!(
            (rd.grad_norm - rc.grad_norm).abs() <= 1e-5 * rc.grad_norm,
            "step {s}: norm"
        );
    }
    let diff = stoker_testkit::max_abs_diff(d.master(), c.master());
    // AdamW moves every weight by about lr = 1e-2 per step whatever the gradient's size,
    // so gradients equal to 1e-5 relative can move a weight differently by more than
    // 1e-5; 1% of one step's size (1e-4) still catches any wrong gradient.
    assert!(
        diff <= 1e-4,
        "master weights differ by {diff:e} after 3 steps"
    );
    // Evaluation runs the candle forward: the direct trainer's variables must have been
    // refreshed from its master buffer.
    let eval = [token_batch(77, 3, 19, 37, &[0, 4, 0])];
    let (ed, ec) = (d.evaluate(&eval).unwrap(), c.evaluate(&eval).unwrap());
    assert!(
        (ed.loss - ec.loss).abs() <= 1e-5 * ec.loss,
        "eval {ed:?} vs {ec:?}"
    );
}

#[test]
fn direct_step_names_a_bad_token() {
    let model = gpt(DType::F32);
    let layout = FlatLayout::of(model.params()).unwrap();
    let master = layout.flatten(model.params()).unwrap();
    let mut step = model.direct_step(&layout, false).unwrap().unwrap();
    let mut g = vec![0f32; layout.total_len()];
    let mut mb = token_batch(1, 2, 5, 37, &[0, 0]);
    mb.input =
        candle_core::Tensor::from_vec(vec![1i64, 2, 3, 99, 4, 0, 1, 2, 3, 4], (2, 5), &Device::Cpu)
            .unwrap();
    let e = step
        .forward_backward(&master, &mb.input, &mb.targets, 1.0, &mut g, &mut |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("id 99 at position 3"), "{e}");
    // Through a window whose only micro-batch has every target masked: still checked.
    mb.targets = vec![stoker_train::loss::IGNORE_INDEX; 10];
    let opts = AccumulateOptions::default();
    let e = accumulate_direct(&mut *step, &[mb], opts, &master, &mut g)
        .unwrap_err()
        .to_string();
    assert!(e.contains("id 99 at position 3"), "{e}");
    // An empty batch is an error naming what was expected, not a division by zero.
    let empty = candle_core::Tensor::zeros((0, 5), DType::I64, &Device::Cpu).unwrap();
    let e = step
        .forward_backward(&master, &empty, &[], 1.0, &mut g, &mut |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("batch 0 x 5"), "{e}");
}

/// Serves each parameter group from a buffer of its own that starts at the group's first
/// flat element, as ZeRO-3 does, and records the order of the step's calls.
struct PerGroup {
    spans: Vec<std::ops::Range<usize>>,
    params: Vec<Vec<f32>>,
    grads: Vec<Vec<f32>>,
    done: Vec<(usize, stoker_kernels::Phase)>,
    calls: Vec<stoker_kernels::GroupCall>,
}

impl stoker_kernels::StepParams for PerGroup {
    fn group(
        &mut self,
        group: usize,
        phase: stoker_kernels::Phase,
    ) -> Result<stoker_kernels::GroupView<'_>, stoker_kernels::KernelError> {
        self.calls
            .push(stoker_kernels::GroupCall::Open(group, phase));
        Ok(stoker_kernels::GroupView {
            base: self.spans[group].start,
            params: &self.params[group],
            grads: &mut self.grads[group],
        })
    }

    fn done(
        &mut self,
        group: usize,
        phase: stoker_kernels::Phase,
    ) -> Result<(), stoker_kernels::KernelError> {
        self.done.push((group, phase));
        self.calls
            .push(stoker_kernels::GroupCall::Done(group, phase));
        Ok(())
    }
}

/// The step over per-group buffers (ZeRO-3's view of the parameters) gives the bits of
/// the step over the whole flat buffer, with weights that are not the initial ones (every
/// bias and gain moved, so an offset into the wrong tensor shows), and makes its calls
/// in the documented order (`stoker_kernels::group_calls`).
#[test]
fn the_step_over_per_group_buffers_gives_the_whole_buffers_bits() {
    use stoker_kernels::Phase::{Backward, Forward};
    let model = gpt(DType::F32);
    let layout = FlatLayout::of(model.params()).unwrap();
    let mut master = layout.flatten(model.params()).unwrap();
    for (m, n) in master.iter_mut().zip(floats(77, layout.total_len())) {
        *m += 0.1 * n;
    }
    let mut step = model.direct_step(&layout, false).unwrap().unwrap();
    let spans: Vec<_> = layout.group_ranges().into_iter().map(|(_, r)| r).collect();
    for mb in window() {
        let mut whole = vec![0f32; layout.total_len()];
        let mut ready = Vec::new();
        let lw = step
            .forward_backward(
                &master,
                &mb.input,
                &mb.targets,
                0.5,
                &mut whole,
                &mut |g, _| ready.push(g),
            )
            .unwrap();
        let mut per = PerGroup {
            params: spans.iter().map(|r| master[r.clone()].to_vec()).collect(),
            grads: spans.iter().map(|r| vec![0f32; r.len()]).collect(),
            spans: spans.clone(),
            done: Vec::new(),
            calls: Vec::new(),
        };
        let lg = step
            .forward_backward_groups(&mut per, &mb.input, &mb.targets, 0.5)
            .unwrap();
        assert_eq!(lw.to_bits(), lg.to_bits(), "loss");
        let mut gathered = vec![0f32; layout.total_len()];
        for (r, g) in spans.iter().zip(&per.grads) {
            gathered[r.clone()].copy_from_slice(g);
        }
        stoker_testkit::assert_bits_eq(&gathered, &whole, "per-group vs whole gradients");
        // Backward: the final norm, the blocks last first, the embeddings; as `ready`.
        let last = CONFIG.n_layer + 1;
        let backward: Vec<usize> = per
            .done
            .iter()
            .filter(|(_, p)| *p == Backward)
            .map(|(g, _)| *g)
            .collect();
        assert_eq!(backward, (0..=last).rev().collect::<Vec<_>>());
        assert_eq!(backward, ready);
        let forward: Vec<usize> = per
            .done
            .iter()
            .filter(|(_, p)| *p == Forward)
            .map(|(g, _)| *g)
            .collect();
        assert_eq!(forward, [0, 1, 2, last, 0]);
        // Every call, as the kernels state them for sources that replay the schedule.
        assert_eq!(per.calls, stoker_kernels::group_calls(spans.len()));
    }
}
