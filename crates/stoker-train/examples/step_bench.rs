//! Times stoker's GPT training step (forward, backward, clip, AdamW; with `fused` or
//! `composed` kernels also the gradient gather and the variable refresh) on
//! random tokens; prints one JSON line. Driven by scripts/bench/step.py, which times the
//! same model in PyTorch in the same run.
//!
//! cargo run --release -p stoker-train --example step_bench -- fp32 16 128 128 4 4 96 10 [direct|fused|composed]

use std::path::Path;
use std::time::Instant;

use candle_core::{Device, Tensor};
use stoker_train::accumulate::MicroBatch;
use stoker_train::config::TrainConfig;
use stoker_train::params::mix64;
use stoker_train::trainer::Trainer;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The binary's allocator setup (as in `stoker`): glibc keeps freed memory for reuse
    // instead of returning it to the OS, so per-step tensors do not page-fault every step.
    let tuning = stoker_train::malloc_tuning::keep_freed_memory();
    if let stoker_train::malloc_tuning::MallocTuning::Refused(what) = tuning {
        eprintln!("warning: glibc refused {what}");
    }
    let a: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, d: &str| a.get(i).cloned().unwrap_or_else(|| d.to_string());
    let precision = arg(0, "fp32");
    let n = |i: usize, d: &str| arg(i, d).parse::<usize>().expect("integer argument");
    let (batch, context, d_model, layers, heads, vocab, steps) = (
        n(1, "16"),
        n(2, "128"),
        n(3, "128"),
        n(4, "4"),
        n(5, "4"),
        n(6, "96"),
        n(7, "10"),
    );
    let kernels = arg(8, "direct");
    let toml = format!(
        r#"run_dir = "unused"
precision = "{precision}"
kernels = "{kernels}"
[data]
train = "unused"
[model]
kind = "gpt"
vocab = {vocab}
context = {context}
d_model = {d_model}
n_layer = {layers}
n_head = {heads}
[batch]
micro_batch = {batch}
[optimizer]
kind = "adamw"
lr = 1e-3
weight_decay = 0.1
grad_clip = 1.0
[train]
steps = {steps}
"#
    );
    let config = TrainConfig::parse(&toml, Path::new("step_bench"))?;
    let mut trainer = Trainer::new(&config)?;
    let tokens = |seed: u64| -> Vec<i64> {
        (0..batch * context)
            .map(|i| (mix64(seed ^ mix64(i as u64)) % vocab as u64) as i64)
            .collect()
    };
    let mut times = Vec::new();
    let warmup = 2;
    for s in 0..warmup + steps {
        let mb = MicroBatch {
            input: Tensor::from_vec(tokens(2 * s as u64), (batch, context), &Device::Cpu)?,
            targets: tokens(2 * s as u64 + 1),
        };
        let t0 = Instant::now();
        trainer.train_step(&[mb])?;
        if s >= warmup {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    let list = times
        .iter()
        .map(|t| t.to_string())
        .collect::<Vec<_>>()
        .join(", ");
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let median = times[times.len() / 2];
    println!(
        "{{\"impl\": \"stoker\", \"precision\": \"{precision}\", \"kernels\": \"{kernels}\", \"params\": {}, \"median_step_s\": {median}, \"tokens_per_s\": {}, \"step_s\": [{list}]}}",
        trainer.layout().numel(),
        (batch * context) as f64 / median
    );
    Ok(())
}
