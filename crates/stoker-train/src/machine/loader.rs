//! The loader's rate: on a config's own training set at its settings (a config's
//! calibration), and on a synthetic token shard at several worker counts (the machine's
//! profile, which plans a GPT config's loader without its data).

use std::time::Duration;

use stoker_plan::loader::{BenchPoint, LoaderBench};

use crate::config::TrainConfig;
use crate::error::{config_err, Result};

/// A loader trial as a point of the planner's loader benchmark.
pub fn bench_point(t: &stoker_data::measure::Trial) -> BenchPoint {
    BenchPoint {
        num_workers: t.num_workers as u64,
        prefetch_factor: t.prefetch_factor as u64,
        batch_size: Some(t.batch_size as u64),
        samples_per_s: t.samples_per_s,
        mb_per_s: Some(t.mb_per_s),
        consumer_wait_pct: Some(t.consumer_wait_pct),
        peak_rss_bytes: Some(t.peak_rss_bytes),
    }
}

/// `cfg`'s loader on its training set at its `[data]` settings and micro-batch, as fast as
/// the consumer takes batches; Err with the reason where the data cannot be opened.
pub(super) fn loader_rate(cfg: &TrainConfig) -> Result<(stoker_data::measure::Trial, u64)> {
    use stoker_data::{Dataset, Sampler, SamplerConfig};
    // The data is checked against the model's input shapes, which the model declared
    // without values knows without drawing any weights.
    let (p, k, seed) = (cfg.precision, cfg.kernels, cfg.seed);
    let shapes =
        crate::models::build_meta_model_on(&cfg.model, p, k, seed, &candle_core::Device::Cpu)?;
    let data = crate::data::open_datasets(cfg, &*shapes)?;
    let d = &cfg.data;
    let lc = d.train_loader(cfg.batch.micro_batch);
    let sampler = Sampler::new(
        data.train.len(),
        SamplerConfig {
            shuffle: d.shuffle,
            seed: cfg.seed,
            ..SamplerConfig::default()
        },
    )?;
    let budget = stoker_data::measure::TrialBudget {
        min_time: Duration::from_millis(500),
        max_batches: 100_000,
        step: None,
    };
    let bytes: usize = data.train.fields().iter().map(|f| f.sample_bytes()).sum();
    let trial = stoker_data::measure::measure_loader(data.train.clone(), sampler, lc, budget)?;
    Ok((trial, bytes as u64))
}

/// Context of the loader probe's token windows: the probe GPTs'.
pub const LOADER_PROBE_CONTEXT: usize = super::probe::PROBE_CONTEXT;

/// Worker counts the loader probe measures: 0, 1, 2 and 4, up to the cores.
fn probe_workers(cores: usize) -> Vec<usize> {
    [0, 1, 2, 4]
        .into_iter()
        .filter(|&w| w == 0 || w <= cores)
        .collect()
}

/// A file removed when dropped (the loader probe's shard, also on an error).
struct TempFile(std::path::PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The loader on a synthetic token shard (2M tokens in the temporary directory, removed
/// after) in windows of [`LOADER_PROBE_CONTEXT`] tokens, batches of 16, shuffled, prefetch
/// 2, at 0, 1, 2 and 4 workers up to `cores`: what this machine's loader delivers per
/// worker count, for plans of configs whose data it has not seen
/// (`MachineProfile::loader_for`).
pub fn probe_loader(cores: usize) -> Result<LoaderBench> {
    // This process's and this moment's: two calibrations at once write two files.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let shard = TempFile(std::env::temp_dir().join(format!(
        "stoker-loader-probe-{}-{now}.bin",
        std::process::id()
    )));
    let tokens: Vec<u16> = (0..2_000_000u32).map(|i| (i % 251) as u16).collect();
    stoker_data::tokens::write_tokens(&shard.0, &tokens, stoker_data::TokenFormat::Llmc)
        .map_err(|e| config_err("calibrate", e.to_string()))?;
    let mut points = Vec::new();
    let mut sample_bytes = None;
    for workers in probe_workers(cores) {
        let mut cfg = super::probe::probe_config("gpt", 64, 16, "fp32", "direct")?;
        cfg.data.train = shard.0.clone();
        cfg.data.num_workers = workers;
        cfg.data.prefetch_factor = 2;
        let (trial, bytes) = loader_rate(&cfg)?;
        points.push(bench_point(&trial));
        sample_bytes = Some(bytes);
    }
    Ok(LoaderBench {
        dataset: Some(format!(
            "a synthetic token shard, windows of {LOADER_PROBE_CONTEXT} tokens (machine \
             calibration)"
        )),
        sample_bytes,
        points,
    })
}
