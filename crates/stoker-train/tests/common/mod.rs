//! Helpers shared by the integration tests: tiny models and deterministic data.
#![allow(dead_code)]

pub mod hf_layout;
pub mod hf_python;
pub mod ranks;

use candle_core::{DType, Device, Tensor};
use stoker_train::accumulate::{accumulate, AccumulateOptions, MicroBatch, Normalization};
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
        init_from: None,
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
    let opts = AccumulateOptions {
        norm,
        ..Default::default()
    };
    let r = accumulate(model, &fx, window, opts, &layout, &mut g).unwrap();
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

/// Per parameter of `layout`: max |got - want| <= tol * max |want|, every value finite,
/// and no gradient all zero; the message names the parameter and `what` was compared.
pub fn assert_grads_close(layout: &FlatLayout, got: &[f32], want: &[f32], tol: f64, what: &str) {
    for slot in layout.slots() {
        let r = slot.offset..slot.offset + slot.len;
        let scale = stoker_testkit::max_abs(&want[r.clone()]);
        assert!(
            scale > 0.0,
            "{}: zero (or non-finite) gradient ({what})",
            slot.name
        );
        stoker_testkit::assert_close(
            &got[r.clone()],
            &want[r],
            tol,
            &format!("{} ({what})", slot.name),
        );
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

#[allow(unused_imports)]
pub use stoker_testkit::write_npy;

/// A char-level corpus with learnable structure: repeated phrases, as llm.c u16 tokens.
pub fn write_token_corpus(path: &std::path::Path, n: usize) {
    let phrases = [
        "the cat sat on the mat. ",
        "a dog ran in the fog. ",
        "we go to sea. ",
    ];
    let mut text = String::new();
    let mut i = 0u64;
    while text.len() < n {
        text.push_str(phrases[(mix64(i) % 3) as usize]);
        i += 1;
    }
    let vocab: Vec<char> = {
        let mut v: Vec<char> = text.chars().collect();
        v.sort();
        v.dedup();
        v
    };
    let toks: Vec<u16> = text
        .chars()
        .take(n)
        .map(|c| vocab.iter().position(|&v| v == c).unwrap() as u16)
        .collect();
    stoker_data::tokens::write_tokens(path, &toks, stoker_data::TokenFormat::Llmc).unwrap();
    let tokens: Vec<String> = vocab.iter().map(|c| c.to_string()).collect();
    let json = serde_json::json!({"kind": "char", "tokens": tokens});
    std::fs::write(path.with_extension("vocab.json"), json.to_string()).unwrap();
}

/// A GPT config over the corpus in `dir`.
pub fn gpt_config(dir: &std::path::Path, precision: &str, steps: u64, extra: &str) -> String {
    format!(
        r#"
run_dir = "{run}"
seed = 3
precision = "{precision}"
[data]
train = "{data}"
vocab = "{vocab}"
[model]
kind = "gpt"
vocab = 24
context = 16
d_model = 32
n_layer = 2
n_head = 4
[batch]
micro_batch = 4
accumulation_steps = 2
[optimizer]
kind = "adamw"
lr = 3e-3
min_lr = 3e-4
warmup_steps = 5
grad_clip = 1.0
[train]
steps = {steps}
log_every = 1
eval_batches = 4
{extra}
"#,
        run = dir.join("run").display(),
        data = dir.join("corpus.bin").display(),
        vocab = dir.join("corpus.vocab.json").display(),
    )
}
