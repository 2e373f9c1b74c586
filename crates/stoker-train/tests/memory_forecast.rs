//! The run's memory forecast against the heap it really allocates, counted by this test
//! binary's allocator: for the GPT on the direct step (activations from
//! `stoker_kernels::activation_floats`), the GPT on the candle graph, the CNN and the MLP
//! (activations counted by one scratch micro-batch before training), at two sizes each,
//! the peak of live heap bytes over the training steps is within 10% of the forecast's
//! heap (the process's heap at start + model states + communication and accumulation
//! buffers + activations + loader buffers).
//!
//! One test in its own binary, so that nothing else allocates while it counts.

use std::alloc::System;
use std::path::Path;

use stoker_train::config::TrainConfig;
use stoker_train::heap::Counting;
use stoker_train::run::{run, RunOptions};

mod common;

/// The system allocator, counted.
#[global_allocator]
static ALLOC: Counting<System> = Counting::new(System);

/// Images `[n, 1, side, side]` u8 and labels over 4 classes, as `dir/name.*.npy`.
fn write_images(dir: &Path, name: &str, n: usize, side: usize) {
    let px: Vec<u8> = (0..n * side * side)
        .map(|i| ((i * 37 + i / 64 * 11) % 251) as u8)
        .collect();
    common::write_npy(
        &dir.join(format!("{name}.image.npy")),
        "|u1",
        &[n, 1, side, side],
        &px,
    );
    let labels: Vec<i64> = (0..n).map(|i| ((i * 7) % 4) as i64).collect();
    common::write_npy(
        &dir.join(format!("{name}.label.npy")),
        "<i8",
        &[n],
        bytemuck::cast_slice(&labels),
    );
}

/// Vectors `[n, width]` f32 and labels over 3 classes, as `dir/name.{x,y}.npy`.
fn write_vectors(dir: &Path, name: &str, n: usize, width: usize) {
    let v: Vec<f32> = (0..n * width)
        .map(|i| ((i * 13 % 17) as f32 - 8.0) / 8.0)
        .collect();
    common::write_npy(
        &dir.join(format!("{name}.x.npy")),
        "<f4",
        &[n, width],
        bytemuck::cast_slice(&v),
    );
    let l: Vec<i64> = (0..n).map(|i| ((i * 5) % 3) as i64).collect();
    common::write_npy(
        &dir.join(format!("{name}.y.npy")),
        "<i8",
        &[n],
        bytemuck::cast_slice(&l),
    );
}

/// A 20-step config: precision and kernels (`resident`: the resident step), `data` and
/// `model` tables' keys, micro-batch `micro`.
fn config(
    dir: &Path,
    name: &str,
    (precision, kernels): (&str, &str),
    data: &str,
    model: &str,
    micro: usize,
) -> TrainConfig {
    let step = match kernels {
        "resident" => "step = \"resident\"".to_string(),
        k => format!("kernels = \"{k}\""),
    };
    let text = format!(
        r#"
run_dir = "{run}"
seed = 5
precision = "{precision}"
{step}
[data]
num_workers = 0
{data}
[model]
{model}
[batch]
micro_batch = {micro}
accumulation_steps = 2
[optimizer]
kind = "adamw"
lr = 1e-3
[train]
steps = 20
log_every = 5
eval_every = 0
checkpoint_every = 0
"#,
        run = dir.join(name).display()
    );
    TrainConfig::parse(&text, Path::new(&format!("{name}.toml"))).unwrap()
}

#[test]
fn the_heap_of_training_steps_is_within_10_percent_of_the_forecast() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    common::write_token_corpus(&dir.join("corpus.bin"), 20_000);
    // Many short windows: 4.5M tokens at context 16 give 253,000 training windows, whose
    // epoch indices (16 bytes each) outweigh the small model's states.
    std::fs::create_dir_all(dir.join("long")).unwrap();
    common::write_token_corpus(&dir.join("long/corpus.bin"), 4_500_000);
    write_images(dir, "small", 512, 12);
    write_images(dir, "large", 512, 28);
    write_vectors(dir, "narrow", 512, 32);
    write_vectors(dir, "wide", 512, 256);
    let corpus = format!(
        "train = \"{}\"\nvocab = \"{}\"",
        dir.join("corpus.bin").display(),
        dir.join("corpus.vocab.json").display()
    );
    let images = |n: &str| format!("train = \"{}\"", dir.join(n).display());
    let vectors = |n: &str| {
        format!(
            "train = \"{}\"\ninput_field = \"x\"\ntarget_field = \"y\"",
            dir.join(n).display()
        )
    };
    let gpt = |d: usize, l: usize| {
        format!(
            "kind = \"gpt\"\nvocab = 24\ncontext = 32\nd_model = {d}\nn_layer = {l}\nn_head = 4"
        )
    };
    let cnn = |side: usize, c1: usize, c2: usize, hidden: usize| {
        format!(
            "kind = \"cnn\"\nin_channels = 1\nimage_size = {side}\nchannels1 = {c1}\nchannels2 = {c2}\nhidden = {hidden}\nclasses = 4"
        )
    };
    let long = format!(
        "train = \"{}\"\nvocab = \"{}\"",
        dir.join("long/corpus.bin").display(),
        dir.join("long/corpus.vocab.json").display()
    );
    let runs = [
        (
            "gpt-direct-many-windows",
            ("fp32", "direct"),
            long,
            "kind = \"gpt\"\nvocab = 24\ncontext = 16\nd_model = 32\nn_layer = 1\nn_head = 2"
                .into(),
            8,
        ),
        (
            "gpt-direct-small",
            ("bf16", "direct"),
            corpus.clone(),
            gpt(32, 2),
            8,
        ),
        (
            "gpt-direct-large",
            ("bf16", "direct"),
            corpus.clone(),
            gpt(96, 4),
            16,
        ),
        // The resident loop on the host build: its master, optimizer and steps' buffers
        // are this process's heap (before, forecast as the direct step's: fp32 1.68).
        (
            "gpt-resident-fp32",
            ("fp32", "resident"),
            corpus.clone(),
            gpt(96, 4),
            16,
        ),
        (
            "llama-resident-bf16",
            ("bf16", "resident"),
            corpus.clone(),
            "kind = \"llama\"\nvocab = 24\ncontext = 32\nd_model = 64\nn_layer = 2\nn_head = 4"
                .into(),
            8,
        ),
        (
            "gpt-graph-small",
            ("fp32", "fused"),
            corpus.clone(),
            gpt(32, 2),
            8,
        ),
        (
            "gpt-graph-large",
            ("fp32", "fused"),
            corpus.clone(),
            gpt(96, 4),
            16,
        ),
        (
            "cnn-small",
            ("fp32", "direct"),
            images("small"),
            cnn(12, 4, 8, 32),
            16,
        ),
        (
            "cnn-large",
            ("fp32", "direct"),
            images("large"),
            cnn(28, 16, 32, 128),
            32,
        ),
        (
            "mlp-small",
            ("fp32", "direct"),
            vectors("narrow"),
            "kind = \"mlp\"\ninput_shape = [32]\nhidden = [64]\nclasses = 3".into(),
            16,
        ),
        (
            "mlp-large",
            ("fp32", "direct"),
            vectors("wide"),
            "kind = \"mlp\"\ninput_shape = [256]\nhidden = [1024, 512]\nclasses = 3".into(),
            64,
        ),
    ];
    let opts = RunOptions {
        heap: Some(&ALLOC),
        ..RunOptions::default()
    };
    let mut failures = Vec::new();
    for (name, kinds, data, model, micro) in runs {
        let cfg = config(dir, name, kinds, &data, &model, micro);
        let s = run(&cfg, &opts).unwrap();
        let f = s
            .forecast
            .as_ref()
            .unwrap_or_else(|| panic!("{name}: no forecast"));
        let planned = f
            .heap_bytes
            .unwrap_or_else(|| panic!("{name}: the forecast has no heap"));
        let counted = s.train_heap_bytes.expect("counted") as f64;
        let ratio = counted / planned;
        eprintln!(
            "{name}: heap of training steps planned {:.0} bytes (activations {:.0}), counted {counted:.0}, counted/planned {ratio:.3}",
            planned, f.activation_bytes
        );
        assert!(f.activation_bytes > 0.0, "{name}: activations counted");
        // A NaN ratio is contained in no range.
        if !(0.9..=1.1).contains(&ratio) {
            failures.push(format!("{name}: {ratio}"));
        }
    }
    assert!(failures.is_empty(), "outside 10%: {failures:?}");
}
