//! Deterministic mode holds its bits across world sizes only if one micro-batch's
//! gradient does not depend on how many compute threads a rank has (1 rank of 2 threads
//! against 2 ranks of 1). Checked at sizes where the GEMMs and row loops do split work
//! across threads: the direct step (f32 and bf16 operands) and the candle graph of the
//! GPT, CNN and MLP, at 1, 2 and 3 threads, bit for bit.

mod common;

use candle_core::{Device, Tensor};
use common::*;
use stoker_train::accumulate::{accumulate, accumulate_direct, AccumulateOptions, MicroBatch};
use stoker_train::layout::FlatLayout;
use stoker_train::models::{Cnn, CnnConfig, Gpt, GptConfig, Mlp, MlpConfig, Model};
use stoker_train::precision::{Fx, Kernels, Precision};

fn in_pool<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
        .install(f)
}

const GPT: GptConfig = GptConfig {
    vocab: 65,
    context: 64,
    d_model: 128,
    n_layer: 2,
    n_head: 4,
    init_from: None,
};

fn gpt_batch() -> Vec<MicroBatch> {
    vec![token_batch(5, 4, 64, 65, &[0, 3, 0, 64])]
}

fn same_at_every_thread_count(what: &str, grads: impl Fn() -> Vec<f32> + Sync) {
    let one = in_pool(1, &grads);
    assert!(stoker_testkit::max_abs(&one) > 0.0, "{what}: zero gradient");
    for threads in [2, 3] {
        let g = in_pool(threads, &grads);
        stoker_testkit::assert_bits_eq(&g, &one, &format!("{what}: {threads} threads vs 1"));
    }
}

#[test]
fn the_direct_step_gradient_does_not_depend_on_the_thread_count() {
    for bf16 in [false, true] {
        let gpt = Gpt::new(GPT, &Device::Cpu, candle_core::DType::F32, 3).unwrap();
        let layout = FlatLayout::of(gpt.params()).unwrap();
        let master = layout.flatten(gpt.params()).unwrap();
        same_at_every_thread_count(&format!("direct step, bf16 operands {bf16}"), || {
            let mut step = gpt.direct_step(&layout, bf16).unwrap().unwrap();
            let mut g = vec![0f32; layout.total_len()];
            accumulate_direct(
                &mut *step,
                &gpt_batch(),
                AccumulateOptions::default(),
                &master,
                &mut g,
            )
            .unwrap();
            g
        });
    }
}

fn graph_grads(model: &dyn Model, precision: Precision, window: &[MicroBatch]) -> Vec<f32> {
    let layout = FlatLayout::of(model.params()).unwrap();
    let mut g = vec![0f32; layout.total_len()];
    let fx = Fx::new(precision, None).with_kernels(Kernels::Fused);
    accumulate(
        model,
        &fx,
        window,
        AccumulateOptions::default(),
        &layout,
        &mut g,
    )
    .unwrap();
    g
}

#[test]
fn the_graph_gradient_does_not_depend_on_the_thread_count() {
    for precision in [Precision::Fp32, Precision::Bf16, Precision::Fp16] {
        let gpt = Gpt::new(GPT, &Device::Cpu, precision.compute_dtype(), 3).unwrap();
        same_at_every_thread_count(&format!("GPT graph {precision:?}"), || {
            graph_grads(&gpt, precision, &gpt_batch())
        });
        let cnn = Cnn::new(
            CnnConfig {
                in_channels: 1,
                image_size: 28,
                channels1: 8,
                channels2: 16,
                hidden: 64,
                classes: 10,
            },
            &Device::Cpu,
            precision.compute_dtype(),
            4,
        )
        .unwrap();
        let images = MicroBatch {
            input: Tensor::from_vec(floats(7, 16 * 784), (16, 1, 28, 28), &Device::Cpu).unwrap(),
            targets: ints(8, 16, 10),
        };
        same_at_every_thread_count(&format!("CNN graph {precision:?}"), || {
            graph_grads(&cnn, precision, std::slice::from_ref(&images))
        });
        let mlp = Mlp::new(
            MlpConfig {
                input_shape: vec![784],
                hidden: vec![256],
                classes: 10,
            },
            &Device::Cpu,
            precision.compute_dtype(),
            5,
        )
        .unwrap();
        let vectors = MicroBatch {
            input: Tensor::from_vec(floats(9, 32 * 784), (32, 784), &Device::Cpu).unwrap(),
            targets: ints(10, 32, 10),
        };
        same_at_every_thread_count(&format!("MLP graph {precision:?}"), || {
            graph_grads(&mlp, precision, std::slice::from_ref(&vectors))
        });
    }
}
