//! One timed loader trial: throughput, consumer wait, worker busy time and peak RSS.
//!
//! The building block of `stoker bench loader` and of [`autotune`](crate::autotune).

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::{Dataset, Loader, LoaderConfig, Result, Sampler};

/// How long a trial runs.
#[derive(Debug, Clone, Copy)]
pub struct TrialBudget {
    /// Stop after at least this much wall time (whole batches)...
    pub min_time: Duration,
    /// ...or after this many batches, whichever comes first.
    pub max_batches: usize,
    /// Simulated step: the consumer sleeps this long per batch, as a training step would
    /// keep it busy. `None`: consume as fast as possible (loader-bound).
    pub step: Option<Duration>,
}

/// The result of one trial.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Trial {
    /// Worker threads.
    pub num_workers: usize,
    /// Batches in flight per worker.
    pub prefetch_factor: usize,
    /// Samples per batch.
    pub batch_size: usize,
    /// Batches timed.
    pub batches: u64,
    /// Samples per second.
    pub samples_per_s: f64,
    /// Megabytes (1e6) per second.
    pub mb_per_s: f64,
    /// Share of wall time the consumer waited for data, percent.
    pub consumer_wait_pct: f64,
    /// Mean share of wall time each worker was busy, percent.
    pub worker_busy_pct: f64,
    /// Peak resident set size of the process during the trial, bytes (0 if unknown).
    pub peak_rss_bytes: u64,
}

/// Runs `config` over `dataset` for `budget` (after one warm-up batch) and measures it.
pub fn measure_loader<D: Dataset>(
    dataset: Arc<D>,
    sampler: Sampler,
    config: LoaderConfig,
    budget: TrialBudget,
) -> Result<Trial> {
    reset_peak_rss();
    let (workers, prefetch, batch) = (
        config.num_workers,
        config.prefetch_factor,
        config.batch_size,
    );
    let mut loader = Loader::new(dataset, sampler, config)?;
    let mut epoch = 0;
    let mut warm = true;
    let mut done = 0usize;
    let mut started = Instant::now();
    'outer: loop {
        let mut it = loader.epoch(epoch);
        for b in it.by_ref() {
            let b = b?;
            std::hint::black_box(b.field_at(0).bytes.first());
            if let Some(step) = budget.step {
                std::thread::sleep(step);
            }
            drop(b);
            if warm {
                warm = false;
                drop(it);
                loader.reset_stats();
                started = Instant::now();
                continue 'outer;
            }
            done += 1;
            if done >= budget.max_batches || started.elapsed() >= budget.min_time {
                break 'outer;
            }
        }
        epoch += 1;
    }
    let s = loader.stats();
    // The interrupted epoch's wall time is added when its iterator drops; use our own clock.
    let wall = started.elapsed();
    let stats = crate::LoaderStats { wall, ..s };
    Ok(Trial {
        num_workers: workers,
        prefetch_factor: prefetch,
        batch_size: batch,
        batches: stats.batches,
        samples_per_s: stats.samples_per_s(),
        mb_per_s: stats.mb_per_s(),
        consumer_wait_pct: stats.wait_pct(),
        worker_busy_pct: stats.worker_busy_pct(),
        peak_rss_bytes: peak_rss_bytes(),
    })
}

/// Resets the kernel's peak-RSS mark for this process (Linux `clear_refs` 5); best effort:
/// false where it could not (no such file, not permitted), and VmHWM then still holds the
/// process's peak since its start.
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Peak resident set size (VmHWM) of this process in bytes, 0 where unavailable.
pub fn peak_rss_bytes() -> u64 {
    status_kib("VmHWM:") * 1024
}

/// Resident bytes of this process's code and constant data: its executable's and shared
/// libraries' file mappings (`/proc/self/smaps`), 0 where unavailable. They grow as code
/// runs for the first time: part of what a run holds that no allocation counts.
pub fn code_rss_bytes() -> u64 {
    let Ok(smaps) = std::fs::read_to_string("/proc/self/smaps") else {
        return 0;
    };
    let exe = std::fs::read_link("/proc/self/exe").ok();
    let mut code = false;
    let mut kib = 0u64;
    for line in smaps.lines() {
        let mut fields = line.split_whitespace();
        match fields.next() {
            Some(range) if range.contains('-') && !range.ends_with(':') => {
                let path = fields.nth(4).unwrap_or("");
                code = path.contains(".so")
                    || exe
                        .as_deref()
                        .is_some_and(|e| std::path::Path::new(path) == e);
            }
            Some("Rss:") if code => kib += fields.next().and_then(|v| v.parse().ok()).unwrap_or(0),
            _ => {}
        }
    }
    kib * 1024
}

/// Resident set size (VmRSS) of this process now, in bytes, 0 where unavailable.
pub fn rss_bytes() -> u64 {
    status_kib("VmRSS:") * 1024
}

/// The memory this process's machine gives it, bytes: `MemTotal` of /proc/meminfo, or the
/// cgroup's limit (`memory.max`, v2; `memory.limit_in_bytes`, v1) where that is lower;
/// None where neither can be read.
pub fn memory_limit_bytes() -> Option<u64> {
    let total = std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| {
        let line = s.lines().find(|l| l.starts_with("MemTotal:"))?;
        line.split_whitespace().nth(1)?.parse::<u64>().ok()
    });
    let total = total.map(|kib| kib * 1024);
    let cgroup = [
        "/sys/fs/cgroup/memory.max",
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
    ]
    .iter()
    .find_map(|p| std::fs::read_to_string(p).ok()?.trim().parse::<u64>().ok());
    match (total, cgroup) {
        (Some(t), Some(c)) => Some(t.min(c)),
        (t, c) => t.or(c),
    }
}

/// A `kB` field of /proc/self/status, 0 where unavailable.
fn status_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with(field))?;
            line.split_whitespace().nth(1)?.parse().ok()
        })
        .unwrap_or(0)
}
