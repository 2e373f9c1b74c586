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
        #[serde(deserialize_with = "f64_or_nan")]
        loss: f64,
        /// Learning rate.
        #[serde(deserialize_with = "f64_or_nan")]
        lr: f64,
        /// Global gradient norm before clipping; `null` (NaN) on a skipped step.
        #[serde(deserialize_with = "f64_or_nan")]
        grad_norm: f64,
        /// Loss scale (1 without scaling).
        #[serde(deserialize_with = "f32_or_nan")]
        loss_scale: f32,
        /// Targets (tokens or samples) per second over the log interval.
        #[serde(deserialize_with = "f64_or_nan")]
        throughput: f64,
        /// `tokens/s` or `samples/s`.
        unit: String,
        /// Time spent waiting for the loader, % of wall time over the log interval.
        #[serde(deserialize_with = "f64_or_nan")]
        loader_wait_pct: f64,
        /// Whether this step was skipped (fp16 overflow).
        skipped: bool,
        /// Seconds of the run so far: since its start, its earlier lives included where
        /// it resumed a checkpoint that recorded them (the time between lives is not).
        #[serde(deserialize_with = "f64_or_nan")]
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
        #[serde(deserialize_with = "f64_or_nan")]
        loss: f64,
        /// Top-1 accuracy.
        #[serde(deserialize_with = "f64_or_nan")]
        accuracy: f64,
    },
}

/// Appends records to a JSONL file.
pub struct MetricsLog {
    path: PathBuf,
    file: std::fs::File,
    /// Whether the kept records hold an evaluation at the resumed step.
    eval_at_resume: bool,
}

impl MetricsLog {
    /// Opens `dir/metrics.jsonl` for appending. A fresh run (`resumed_at` None) starts
    /// an empty file; a resumed run keeps the records up to the checkpoint's step and
    /// drops later ones (they belong to the interrupted continuation).
    pub fn open(dir: &Path, resumed_at: Option<u64>) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
        let path = dir.join("metrics.jsonl");
        let kept: Vec<Record> = match resumed_at {
            Some(at) if path.exists() => read_resumable(&path)?
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
        let eval_at_resume = resumed_at.is_some_and(|at| {
            kept.iter()
                .any(|r| matches!(r, Record::Eval { step, .. } if *step == at))
        });
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
        Ok(MetricsLog {
            path,
            file,
            eval_at_resume,
        })
    }

    /// Whether the log holds an evaluation at the step the run resumed at: one a
    /// checkpoint owed, run by an earlier resume, needs no second run.
    pub fn has_eval_at_resume(&self) -> bool {
        self.eval_at_resume
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

/// Reads every record of `dir/metrics.jsonl`, but a last line cut short (a run that
/// crashed mid-write), which is dropped with a warning. A value JSON cannot hold (a NaN or
/// an infinite loss, written as `null`) reads back as NaN.
pub fn read(dir: &Path) -> Result<Vec<Record>> {
    read_resumable(&dir.join("metrics.jsonl"))
}

/// Each non-blank line of `text` (read from `path`) as a record; an error names the
/// file and the line's number in it.
fn parse(path: &Path, text: &str) -> Result<Vec<Record>> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|e| crate::error::TrainError::Data {
                what: format!("{} line {}", path.display(), i + 1),
                message: format!("not a metrics record: {e}"),
            })
        })
        .collect()
}

/// The records a resumed run keeps: all of them, except a last line cut short (a
/// crash or a full disk in the middle of its write), which is dropped with a warning
/// rather than making the checkpoint unusable.
fn read_resumable(path: &Path) -> Result<Vec<Record>> {
    let text = std::fs::read_to_string(path).map_err(|e| io_err(path, e))?;
    if text.is_empty() || text.ends_with('\n') {
        return parse(path, &text);
    }
    let cut = text.rfind('\n').map_or(0, |i| i + 1);
    let (whole, last) = text.split_at(cut);
    if serde_json::from_str::<Record>(last).is_ok() {
        return parse(path, &text);
    }
    tracing::warn!(
        "{}: its last line is cut short ({} bytes, no newline); dropped",
        path.display(),
        last.len()
    );
    parse(path, whole)
}

/// A float that `null` (a NaN or an infinity, which JSON cannot hold) reads back as NaN.
fn f64_or_nan<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// [`f64_or_nan`] for an f32.
fn f32_or_nan<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<f32, D::Error> {
    Ok(Option::<f32>::deserialize(d)?.unwrap_or(f32::NAN))
}

fn one() -> usize {
    1
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eval(step: u64, loss: f64) -> Record {
        Record::Eval {
            step,
            loss,
            accuracy: 0.5,
        }
    }

    #[test]
    fn a_nan_loss_reads_back_as_nan_and_a_cut_last_line_does_not_stop_a_resume() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = MetricsLog::open(dir.path(), None).unwrap();
        for r in [eval(1, 2.0), eval(2, f64::NAN), eval(3, f64::INFINITY)] {
            log.write(&r).unwrap();
        }
        drop(log);
        let back = read(dir.path()).unwrap();
        assert_eq!(back[0], eval(1, 2.0));
        for (r, step) in back[1..].iter().zip([2, 3]) {
            match r {
                Record::Eval { step: s, loss, .. } => assert!(*s == step && loss.is_nan()),
                other => panic!("{other:?}"),
            }
        }
        // A write cut short: the resume keeps the records before it, with a warning.
        let path = dir.path().join("metrics.jsonl");
        let mut text = std::fs::read_to_string(&path).unwrap();
        text.push_str("{\"kind\":\"eval\",\"step\":4,\"lo");
        std::fs::write(&path, &text).unwrap();
        assert_eq!(read(dir.path()).unwrap().len(), 3, "the reader drops it");
        let log = MetricsLog::open(dir.path(), Some(10)).unwrap();
        assert_eq!(read(dir.path()).unwrap().len(), 3);
        assert!(!log.has_eval_at_resume());
        // A resume at step 3 keeps its evaluation record, and says so.
        assert!(MetricsLog::open(dir.path(), Some(3))
            .unwrap()
            .has_eval_at_resume());
        assert_eq!(read(dir.path()).unwrap().len(), 3);
        // A bad line is named by its number in the file, blank lines counted.
        std::fs::write(
            &path,
            "{\"kind\":\"eval\",\"step\":1,\"loss\":1.0,\"accuracy\":0.5}\n\n\nnot json\n",
        )
        .unwrap();
        let e = read(dir.path()).unwrap_err().to_string();
        assert!(e.contains("metrics.jsonl line 4"), "{e}");
    }
}
