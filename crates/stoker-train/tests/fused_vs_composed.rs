//! The models' gradients with stoker-kernels' fused ops equal those with the composed
//! candle ops: every parameter of a GPT and a Llama (with masked targets), CNN and MLP, f32 to 1e-5
//! relative (per tensor: max |fused - composed| / max |composed|), bf16 to bf16 rounding.

mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use stoker_train::accumulate::{accumulate, AccumulateOptions, MicroBatch};
use stoker_train::layout::FlatLayout;
use stoker_train::models::{Gpt, GptConfig, Llama, LlamaConfig, Model};
use stoker_train::precision::{Fx, Kernels, Precision};

fn grads(
    model: &dyn Model,
    precision: Precision,
    kernels: Kernels,
    mb: &MicroBatch,
) -> (Vec<f32>, f64) {
    let layout = FlatLayout::of(model.params()).unwrap();
    let mut g = vec![0f32; layout.total_len()];
    let fx = Fx::new(precision, None).with_kernels(kernels);
    let r = accumulate(
        model,
        &fx,
        std::slice::from_ref(mb),
        AccumulateOptions::default(),
        &layout,
        &mut g,
    )
    .unwrap();
    (g, r.loss)
}

/// Worst per-parameter relative difference, naming the parameter.
fn compare(model: &dyn Model, precision: Precision, mb: &MicroBatch, tol: f64) {
    compare_models(model, model, precision, mb, tol)
}

/// [`compare`] with the fused run on `fused` and the composed one on `composed` (the same
/// parameters, possibly in different variable dtypes).
fn compare_models(
    fused: &dyn Model,
    composed: &dyn Model,
    precision: Precision,
    mb: &MicroBatch,
    tol: f64,
) {
    let model = composed;
    let (f, lf) = grads(fused, precision, Kernels::Fused, mb);
    let (c, lc) = grads(composed, precision, Kernels::Composed, mb);
    assert!(
        (lf - lc).abs() <= tol * lc.abs(),
        "loss: fused {lf}, composed {lc}"
    );
    let layout = FlatLayout::of(model.params()).unwrap();
    assert_grads_close(
        &layout,
        &f,
        &c,
        tol,
        &format!("fused vs composed, {precision:?}"),
    );
}

/// A GPT big enough for every code path: several heads, T not a multiple of a vector,
/// vocab not a multiple of 16, masked targets.
fn gpt(precision: Precision) -> Gpt {
    gpt_in(precision.compute_dtype())
}

fn gpt_in(dtype: DType) -> Gpt {
    let c = GptConfig {
        vocab: 37,
        context: 19,
        d_model: 24,
        n_layer: 2,
        n_head: 3,
        init_from: None,
    };
    Gpt::new(c, &Device::Cpu, dtype, 17).unwrap()
}

#[test]
fn gpt_fused_equals_composed_f32() {
    let mb = token_batch(3, 4, 19, 37, &[0, 2, 19, 5]);
    compare(&gpt(Precision::Fp32), Precision::Fp32, &mb, 1e-5);
}

#[test]
fn gpt_fused_equals_composed_bf16() {
    let mb = token_batch(4, 4, 19, 37, &[1, 0, 3, 0]);
    // Each path as the trainer builds it: fused with the variables `Kernels::param_dtype`
    // gives (f32 on bf16 hardware, operands rounded inside the GEMM; bf16 otherwise),
    // composed with bf16 variables and bf16 activations. They round at different points;
    // 2^-5 of the largest gradient of each tensor.
    let fused = gpt_in(Kernels::Fused.param_dtype(Precision::Bf16));
    compare_models(
        &fused,
        &gpt(Precision::Bf16),
        Precision::Bf16,
        &mb,
        1.0 / 32.0,
    );
    // And the fused ops on bf16 variables (f32 activations, bf16 weights).
    compare(&gpt(Precision::Bf16), Precision::Bf16, &mb, 1.0 / 32.0);
}

/// A Llama with grouped-query attention (3 query heads per key/value head), heads of
/// width 4, T not a multiple of a vector, masked targets.
fn llama(dtype: DType) -> Llama {
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
    Llama::new(c, &Device::Cpu, dtype, 17).unwrap()
}

#[test]
fn llama_fused_equals_composed_f32_and_bf16() {
    let mb = token_batch(3, 4, 19, 37, &[0, 2, 19, 5]);
    compare(&llama(DType::F32), Precision::Fp32, &mb, 1e-5);
    let fused = llama(Kernels::Fused.param_dtype(Precision::Bf16));
    compare_models(
        &fused,
        &llama(Precision::Bf16.compute_dtype()),
        Precision::Bf16,
        &mb,
        1.0 / 32.0,
    );
}

#[test]
fn cnn_and_mlp_fused_equal_composed_f32() {
    let images = MicroBatch {
        input: Tensor::from_vec(floats(5, 6 * 64), (6, 1, 8, 8), &Device::Cpu).unwrap(),
        targets: ints(6, 6, 4),
    };
    compare(&tiny_cnn(Precision::Fp32), Precision::Fp32, &images, 1e-5);
    let vectors = MicroBatch {
        input: Tensor::from_vec(floats(7, 9 * 6), (9, 6), &Device::Cpu).unwrap(),
        targets: ints(8, 9, 3),
    };
    compare(&tiny_mlp(Precision::Fp32), Precision::Fp32, &vectors, 1e-5);
}
