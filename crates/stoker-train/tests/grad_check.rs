//! Per-parameter gradients of the GPT, Llama, CNN and MLP against central finite differences in
//! f64 on tiny sizes, and the check that catches a detached (fused) op.

mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use stoker_train::accumulate::{accumulate, AccumulateOptions, MicroBatch};
use stoker_train::layout::FlatLayout;
use stoker_train::loss::{cross_entropy_sum, scalar};
use stoker_train::models::Model;
use stoker_train::params::{Init, ParamBuilder};
use stoker_train::precision::{Fx, Precision};
use stoker_train::TrainError;

fn loss_of(model: &dyn Model, mb: &MicroBatch) -> f64 {
    let fx = Fx::new(Precision::Fp64, None);
    let logits = model.forward(&fx, &mb.input).unwrap();
    let (sum, n) = cross_entropy_sum(&fx, &logits, &mb.targets).unwrap();
    scalar(&sum).unwrap() / n as f64
}

/// Checks up to `per_param` elements of every parameter; returns the worst error.
fn finite_difference_check(model: &dyn Model, mb: MicroBatch, per_param: usize) {
    let fx = Fx::new(Precision::Fp64, None);
    let layout = FlatLayout::of(model.params()).unwrap();
    let mut grads = vec![0f32; layout.total_len()];
    // The analytic gradient in f64, read directly from candle (the flat buffer is f32).
    let logits = model.forward(&fx, &mb.input).unwrap();
    let (sum, n) = cross_entropy_sum(&fx, &logits, &mb.targets).unwrap();
    let g = (sum / n as f64).unwrap().backward().unwrap();
    stoker_train::check::every_param_has_grad(&g, model.params()).unwrap();
    let opts = AccumulateOptions::default();
    accumulate(
        model,
        &fx,
        std::slice::from_ref(&mb),
        opts,
        &layout,
        &mut grads,
    )
    .unwrap();
    let eps = 1e-5;
    for p in model.params().iter() {
        let analytic = g
            .get(p.var.as_tensor())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f64>()
            .unwrap();
        let base = p
            .var
            .as_tensor()
            .flatten_all()
            .unwrap()
            .to_vec1::<f64>()
            .unwrap();
        let step = (base.len() / per_param).max(1);
        for i in (0..base.len()).step_by(step) {
            let at = |delta: f64| {
                let mut v = base.clone();
                v[i] += delta;
                p.var
                    .set(&Tensor::from_vec(v, p.var.shape(), &Device::Cpu).unwrap())
                    .unwrap();
                loss_of(model, &mb)
            };
            let fd = (at(eps) - at(-eps)) / (2.0 * eps);
            at(0.0);
            let err = (fd - analytic[i]).abs();
            assert!(
                err <= 1e-7 + 1e-5 * analytic[i].abs(),
                "{}[{i}]: finite difference {fd:e}, autograd {:e}",
                p.name,
                analytic[i]
            );
        }
    }
}

#[test]
fn gpt_gradients_match_finite_differences_f64() {
    let model = tiny_gpt(Precision::Fp64);
    let mut mb = token_batch(3, 2, 6, 11, &[0, 2]);
    mb.input = mb.input.to_dtype(DType::I64).unwrap();
    finite_difference_check(&model, mb, 8);
}

/// The Llama's composed graph (f64: RMSNorm, rotary embeddings, grouped-query attention
/// with its repeated key/value heads, SwiGLU, untied head).
#[test]
fn llama_gradients_match_finite_differences_f64() {
    let c = stoker_train::models::LlamaConfig {
        vocab: 11,
        context: 6,
        d_model: 8,
        n_layer: 2,
        n_head: 2,
        n_kv_head: Some(1),
        ffn_hidden: Some(12),
        rope_theta: 100.0,
        norm_eps: 1e-5,
        init_from: None,
    };
    let model = stoker_train::models::Llama::new(c, &Device::Cpu, DType::F64, 5).unwrap();
    let mut mb = token_batch(3, 2, 6, 11, &[0, 2]);
    mb.input = mb.input.to_dtype(DType::I64).unwrap();
    finite_difference_check(&model, mb, 8);
}

#[test]
fn cnn_gradients_match_finite_differences_f64() {
    let model = tiny_cnn(Precision::Fp64);
    let x = floats(4, 3 * 64)
        .into_iter()
        .map(|v| v as f64)
        .collect::<Vec<_>>();
    let mb = MicroBatch {
        input: Tensor::from_vec(x, (3, 1, 8, 8), &Device::Cpu).unwrap(),
        targets: vec![1, 3, 0],
    };
    finite_difference_check(&model, mb, 8);
}

#[test]
fn mlp_gradients_match_finite_differences_f64() {
    let model = tiny_mlp(Precision::Fp64);
    let x = floats(5, 4 * 6)
        .into_iter()
        .map(|v| v as f64)
        .collect::<Vec<_>>();
    let mb = MicroBatch {
        input: Tensor::from_vec(x, (4, 6), &Device::Cpu).unwrap(),
        targets: vec![2, 0, 1, 2],
    };
    finite_difference_check(&model, mb, 100);
}

#[test]
fn fused_layer_norm_is_caught_naming_the_parameter() {
    let mut b = ParamBuilder::new(Device::Cpu, DType::F32, 1);
    let w = b.param("proj.weight", &[4, 4], Init::Normal(0.5)).unwrap();
    let gain = b.param("norm.weight", &[4], Init::Ones).unwrap();
    let bias = b.param("norm.bias", &[4], Init::Zeros).unwrap();
    let params = b.finish();
    let x = Tensor::from_vec(floats(1, 8), (2, 4), &Device::Cpu).unwrap();
    let h = x.matmul(&w.as_tensor().t().unwrap()).unwrap();
    // candle-nn's fused layer_norm has no backward: its output is detached, so nothing
    // before it gets a gradient either; the first parameter (declaration order) is named.
    let y = candle_nn::ops::layer_norm(&h, gain.as_tensor(), bias.as_tensor(), 1e-5).unwrap();
    let grads = y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
    let err = stoker_train::check::every_param_has_grad(&grads, &params).unwrap_err();
    assert!(
        matches!(&err, TrainError::NoGradient { name } if name == "proj.weight"),
        "{err}"
    );
    assert!(err.to_string().contains("HINT"));
}
