//! Reading a `stoker bench loader --json` / `stoker tune loader --json` result and picking the
//! cheapest loader setting that feeds one device at the rate a step needs.
//!
//! Assumption: one loader per device (each data-parallel rank reads its own shard, as with
//! a DistributedSampler), so a measured point must reach the node's rate divided by the
//! devices per node.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{PlanError, Result};

/// One measured loader setting.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
pub struct BenchPoint {
    /// Worker threads/processes.
    pub num_workers: u64,
    /// Batches prefetched per worker.
    pub prefetch_factor: u64,
    /// Batch size of the measurement.
    #[serde(default)]
    pub batch_size: Option<u64>,
    /// Samples per second delivered.
    pub samples_per_s: f64,
    /// MB per second delivered.
    #[serde(default)]
    pub mb_per_s: Option<f64>,
    /// Percentage of time the consumer waited.
    #[serde(default)]
    pub consumer_wait_pct: Option<f64>,
    /// Peak resident memory, bytes.
    #[serde(default)]
    pub peak_rss_bytes: Option<u64>,
}

/// A whole benchmark result.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
pub struct LoaderBench {
    /// Dataset measured.
    #[serde(default)]
    pub dataset: Option<String>,
    /// Bytes per sample.
    #[serde(default)]
    pub sample_bytes: Option<u64>,
    /// Measured settings.
    pub points: Vec<BenchPoint>,
}

impl LoaderBench {
    /// Parses a benchmark's JSON; `path` names it in errors.
    pub fn from_json_str(path: &str, text: &str) -> Result<Self> {
        let bench: LoaderBench = serde_json::from_str(text).map_err(|source| PlanError::Json {
            path: path.to_string(),
            source,
        })?;
        if bench.points.is_empty() {
            return Err(crate::error::invalid(
                &format!("{path}: points"),
                "at least one measured point",
                "an empty list",
            ));
        }
        for (i, p) in bench.points.iter().enumerate() {
            if !p.samples_per_s.is_finite() || p.samples_per_s < 0.0 {
                return Err(crate::error::invalid(
                    &format!("{path}: points[{i}].samples_per_s"),
                    "a non-negative number",
                    p.samples_per_s,
                ));
            }
        }
        Ok(bench)
    }

    /// Reads a benchmark file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| PlanError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json_str(&path.display().to_string(), &text)
    }
}

/// The loader setting chosen for a required rate.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LoaderChoice {
    /// The cheapest point meeting the rate, if any.
    pub chosen: Option<BenchPoint>,
    /// The fastest point measured (reported when none meets the rate).
    pub fastest: Option<BenchPoint>,
    /// Samples/s one loader (one device) must deliver.
    pub required_per_loader: f64,
}

/// The share of each step a loader with 0 workers may add by loading in the training
/// thread, in series with the step (`stoker tune loader`'s default margin).
pub const SERIAL_LOAD_SHARE: f64 = 0.1;

/// The rate a point of `workers` must have measured (flat out) to deliver `required`
/// samples/s: workers load while the step runs, so `required`; 0 workers load in series
/// with it, so `required / SERIAL_LOAD_SHARE` (before 2026-12-07, `required`, where the step
/// would have waited for data about half the time).
pub fn needed_rate(workers: u64, required: f64) -> f64 {
    match workers {
        0 => required / SERIAL_LOAD_SHARE,
        _ => required,
    }
}

/// Picks the point with the fewest workers, then the smallest prefetch factor, whose
/// samples/s delivers `required_per_loader` ([`needed_rate`]).
pub fn pick(bench: &LoaderBench, required_per_loader: f64) -> LoaderChoice {
    let mut ok: Vec<&BenchPoint> = bench
        .points
        .iter()
        .filter(|p| p.samples_per_s >= needed_rate(p.num_workers, required_per_loader))
        .collect();
    ok.sort_by(|a, b| {
        (a.num_workers, a.prefetch_factor)
            .cmp(&(b.num_workers, b.prefetch_factor))
            .then(b.samples_per_s.total_cmp(&a.samples_per_s))
    });
    let fastest = bench
        .points
        .iter()
        .max_by(|a, b| a.samples_per_s.total_cmp(&b.samples_per_s))
        .cloned();
    LoaderChoice {
        chosen: ok.first().map(|p| (*p).clone()),
        fastest,
        required_per_loader,
    }
}
