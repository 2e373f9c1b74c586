//! Metrics: one JSON object per line in `RUN_DIR/metrics.jsonl`, appended as training runs.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{io_err, Result};

/// One line of `metrics.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Record {
    /// A training step.
    Train {
        /// Optimizer steps taken.
        step: u64,
        /// Window mean loss.
        loss: f64,
        /// Learning rate.
        lr: f64,
        /// Global gradient norm before clipping.
        grad_norm: f64,
        /// Loss scale (1 without scaling).
        loss_scale: f32,
        /// Targets (tokens or samples) per second over the log interval.
        throughput: f64,
        /// `tokens/s` or `samples/s`.
        unit: String,
        /// Time spent waiting for the loader, % of wall time over the log interval.
        loader_wait_pct: f64,
        /// Whether this step was skipped (fp16 overflow).
        skipped: bool,
        /// Seconds since the run (or resume) started.
        elapsed_s: f64,
        /// Data-parallel ranks.
        #[serde(default = "one")]
        world: usize,
        /// Seconds this step waited for gradient reductions after its backward.
        #[serde(default)]
        comm_wait_s: f64,
        /// Bytes this rank sent this step (ring model).
        #[serde(default)]
        bytes_sent: u64,
        /// Collectives called before the window's last micro-batch (0 unless
        /// `parallel.sync_every_micro_batch`).
        #[serde(default)]
        calls_before_last: u64,
        /// Seconds this optimizer step took (forward, backward, reduction, update).
        #[serde(default)]
        step_s: f64,
        /// Resident set size of rank 0's process after this step, bytes.
        #[serde(default)]
        rss_bytes: u64,
    },
    /// Planned vs measured bytes at the end of a run (rank 0's), see
    /// [`stoker_plan::trainer`].
    States {
        /// Optimizer steps taken.
        step: u64,
        /// The strategy.
        strategy: String,
        /// Ranks.
        world: usize,
        /// What the planner predicts for one rank.
        planned: stoker_plan::trainer::TrainerPrediction,
        /// What rank 0's trainer holds, counted from its buffers.
        held: crate::memory::HeldBytes,
        /// Mean bytes rank 0 sent per step (the communicator's count, ring model).
        bytes_sent_per_step: f64,
    },
    /// The planner's forecast for this run beside what the run measured (rank 0's).
    Forecast {
        /// Optimizer steps taken.
        step: u64,
        /// What the planner forecast for one rank.
        forecast: crate::planned::RunForecast,
        /// Peak resident set size of rank 0's process over the whole run (evaluation,
        /// checkpoints and sampling included), bytes.
        peak_rss_bytes: u64,
        /// Peak resident set size of the training steps before the first evaluation or
        /// checkpoint (`RunSummary::train_rss_bytes`), bytes.
        #[serde(default)]
        train_rss_bytes: u64,
        /// Peak live heap bytes over those steps, counted by the binary's allocator.
        #[serde(default)]
        train_heap_bytes: Option<u64>,
        /// Mean measured seconds per optimizer step.
        step_s: f64,
        /// Share of training time the step waited on the loader, percent.
        loader_wait_pct: f64,
    },
    /// An evaluation.
    Eval {
        /// Optimizer steps taken.
        step: u64,
        /// Mean eval loss.
        loss: f64,
        /// Top-1 accuracy.
        accuracy: f64,
    },
}

/// Appends records to a JSONL file.
pub struct MetricsLog {
    path: PathBuf,
    file: std::fs::File,
}

impl MetricsLog {
    /// Opens `dir/metrics.jsonl` for appending. A fresh run (`resumed_at` None) starts
    /// an empty file; a resumed run keeps the records up to the checkpoint's step and
    /// drops later ones (they belong to the interrupted continuation).
    pub fn open(dir: &Path, resumed_at: Option<u64>) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
        let path = dir.join("metrics.jsonl");
        let kept: Vec<Record> = match resumed_at {
            Some(at) if path.exists() => read(dir)?
                .into_iter()
                .filter(|r| match r {
                    Record::Train { step, .. }
                    | Record::Eval { step, .. }
                    | Record::States { step, .. }
                    | Record::Forecast { step, .. } => *step <= at,
                })
                .collect(),
            _ => Vec::new(),
        };
        let mut text = String::new();
        for r in &kept {
            text.push_str(&serde_json::to_string(r).expect("records serialize"));
            text.push('\n');
        }
        std::fs::write(&path, text).map_err(|e| io_err(&path, e))?;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| io_err(&path, e))?;
        Ok(MetricsLog { path, file })
    }

    /// Appends one record.
    pub fn write(&mut self, r: &Record) -> Result<()> {
        let mut line = serde_json::to_string(r).expect("records serialize");
        line.push('\n');
        self.file
            .write_all(line.as_bytes())
            .map_err(|e| io_err(&self.path, e))
    }
}

/// Reads every record of `dir/metrics.jsonl`.
pub fn read(dir: &Path) -> Result<Vec<Record>> {
    let path = dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&path).map_err(|e| io_err(&path, e))?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|e| crate::error::TrainError::Data {
                what: format!("{} line {}", path.display(), i + 1),
                message: e.to_string(),
            })
        })
        .collect()
}

fn one() -> usize {
    1
}
