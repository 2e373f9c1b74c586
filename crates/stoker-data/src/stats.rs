//! Stall accounting: how long the consumer waited and how busy each worker was.

use std::time::Duration;

use serde::Serialize;

/// Counters of a loader since creation or the last reset.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct LoaderStats {
    /// Batches delivered.
    pub batches: u64,
    /// Samples delivered.
    pub samples: u64,
    /// Bytes delivered (all fields).
    pub bytes: u64,
    /// Batches handed out as zero-copy views of the mapped file.
    pub zero_copy_batches: u64,
    /// Time the consumer spent blocked in `next()` (with 0 workers: loading itself).
    pub consumer_wait: Duration,
    /// Wall time of the epochs iterated.
    pub wall: Duration,
    /// Time each worker spent producing batches.
    pub worker_busy: Vec<Duration>,
}

impl LoaderStats {
    /// Fraction of wall time the consumer waited for data, in percent.
    pub fn wait_pct(&self) -> f64 {
        pct(self.consumer_wait, self.wall)
    }

    /// Mean fraction of wall time the workers were busy, in percent.
    pub fn worker_busy_pct(&self) -> f64 {
        if self.worker_busy.is_empty() {
            return 0.0;
        }
        let total: Duration = self.worker_busy.iter().sum();
        pct(total, self.wall) / self.worker_busy.len() as f64
    }

    /// Samples per second of wall time.
    pub fn samples_per_s(&self) -> f64 {
        self.samples as f64 / self.wall.as_secs_f64().max(1e-12)
    }

    /// Megabytes (1e6) per second of wall time.
    pub fn mb_per_s(&self) -> f64 {
        self.bytes as f64 / 1e6 / self.wall.as_secs_f64().max(1e-12)
    }
}

fn pct(part: Duration, whole: Duration) -> f64 {
    100.0 * part.as_secs_f64() / whole.as_secs_f64().max(1e-12)
}
