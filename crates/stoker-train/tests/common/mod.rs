//! Helpers shared by the integration tests: tiny models and deterministic data.
#![allow(dead_code)]

use candle_core::{DType, Device, Tensor};
use stoker_train::accumulate::{accumulate, MicroBatch, Normalization};
use stoker_train::layout::FlatLayout;
use stoker_train::models::{Cnn, CnnConfig, Gpt, GptConfig, Mlp, MlpConfig, Model};
use stoker_train::params::mix64;
use stoker_train::precision::{Fx, Precision};

pub fn tiny_gpt(precision: Precision) -> Gpt {
    let c = GptConfig {
        vocab: 11,
        context: 6,
        d_model: 8,
        n_layer: 2,
        n_head: 2,
    };
    Gpt::new(c, &Device::Cpu, precision.compute_dtype(), 5).unwrap()
}

pub fn tiny_cnn(precision: Precision) -> Cnn {
    let c = CnnConfig {
        in_channels: 1,
        image_size: 8,
        channels1: 2,
        channels2: 3,
        hidden: 5,
        classes: 4,
    };
    Cnn::new(c, &Device::Cpu, precision.compute_dtype(), 9).unwrap()
}

pub fn tiny_mlp(precision: Precision) -> Mlp {
    let c = MlpConfig {
        input_shape: vec![6],
        hidden: vec![7],
        classes: 3,
    };
    Mlp::new(c, &Device::Cpu, precision.compute_dtype(), 2).unwrap()
}

/// Deterministic pseudo-random integers in `0..n`.
pub fn ints(seed: u64, len: usize, n: u64) -> Vec<i64> {
    (0..len)
        .map(|i| (mix64(seed ^ mix64(i as u64)) % n) as i64)
        .collect()
}

/// Deterministic pseudo-random floats in [-1, 1).
pub fn floats(seed: u64, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (mix64(seed ^ mix64(i as u64)) >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
        .collect()
}

/// The flat gradient of `window` under `norm`.
pub fn window_grads(
    model: &dyn Model,
    precision: Precision,
    window: &[MicroBatch],
    norm: Normalization,
) -> (Vec<f32>, f64) {
    let layout = FlatLayout::of(model.params()).unwrap();
    let mut g = vec![0f32; layout.total_len()];
    let fx = Fx::new(precision, None);
    let r = accumulate(model, &fx, window, norm, 1.0, &layout, &mut g, true).unwrap();
    (g, r.loss)
}

/// Token micro-batch of `rows` sequences of `t` tokens; `masked[r]` trailing targets of row `r` masked.
pub fn token_batch(seed: u64, rows: usize, t: usize, vocab: u64, masked: &[usize]) -> MicroBatch {
    let input = ints(seed, rows * t, vocab);
    let mut targets = ints(seed + 1, rows * t, vocab);
    for (r, &m) in masked.iter().enumerate() {
        for j in t - m..t {
            targets[r * t + j] = stoker_train::loss::IGNORE_INDEX;
        }
    }
    MicroBatch {
        input: Tensor::from_vec(input, (rows, t), &Device::Cpu).unwrap(),
        targets,
    }
}

/// Relative L2 difference ||a - b|| / ||b||.
pub fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let d: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let n: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (d / n).sqrt()
}

pub fn dtype_of(p: Precision) -> DType {
    p.compute_dtype()
}
