//! Loader autotune: search `num_workers` and `prefetch_factor` for a throughput target.
//!
//! No loader among PyTorch, FFCV, DALI, Mosaic or SPDL picks its worker count; users guess.
//! The search starts at 4 workers (the chapter's advice), doubles while throughput gains more
//! than `min_gain` and memory stays under budget, stops growing once a target is met, and
//! halves while fewer workers lose less than `min_gain` (extra workers only add contention).
//! Then it picks the smallest prefetch_factor within `min_gain` of the best. The trial
//! function is a parameter, so the search is tested against a synthetic throughput curve.

use serde::Serialize;

use crate::measure::Trial;
use crate::{DataError, Result};

/// Search settings.
#[derive(Debug, Clone, PartialEq)]
pub struct TuneConfig {
    /// First worker count tried.
    pub start_workers: usize,
    /// Upper bound on workers.
    pub max_workers: usize,
    /// Relative throughput gain that justifies more workers or prefetch (0.05 = 5%).
    pub min_gain: f64,
    /// Peak RSS a setting may use, bytes.
    pub memory_budget_bytes: Option<u64>,
    /// Samples/s the training step needs; growth stops once a setting reaches it.
    pub target_samples_per_s: Option<f64>,
    /// prefetch_factor values tried after the worker count is chosen.
    pub prefetch_candidates: Vec<usize>,
}

impl Default for TuneConfig {
    fn default() -> Self {
        TuneConfig {
            start_workers: 4,
            max_workers: 32,
            min_gain: 0.05,
            memory_budget_bytes: None,
            target_samples_per_s: None,
            prefetch_candidates: vec![1, 2, 4],
        }
    }
}

/// The measured curve and the choice.
#[derive(Debug, Clone, Serialize)]
pub struct TuneResult {
    /// Every trial, in the order run.
    pub trials: Vec<Trial>,
    /// The chosen setting.
    pub chosen: Trial,
    /// Whether the chosen setting meets the target (None without a target).
    pub target_met: Option<bool>,
    /// One line per decision, with its numbers.
    pub reasons: Vec<String>,
}

/// Runs the search, calling `trial(num_workers, prefetch_factor)` for each measurement.
pub fn tune(
    config: &TuneConfig,
    mut trial: impl FnMut(usize, usize) -> Result<Trial>,
) -> Result<TuneResult> {
    if config.start_workers > config.max_workers {
        return Err(DataError::Config {
            field: "start_workers",
            message: format!(
                "{} exceeds max_workers {}",
                config.start_workers, config.max_workers
            ),
        });
    }
    if !(config.min_gain >= 0.0 && config.min_gain < 1.0) {
        return Err(DataError::Config {
            field: "min_gain",
            message: format!("{}: expected a fraction in [0, 1)", config.min_gain),
        });
    }
    let mut trials = Vec::new();
    let mut reasons = Vec::new();
    let mut run = |w: usize, p: usize, trials: &mut Vec<Trial>| -> Result<Trial> {
        let t = trial(w, p)?;
        trials.push(t.clone());
        Ok(t)
    };
    let meets = |t: &Trial| {
        config
            .target_samples_per_s
            .is_some_and(|x| t.samples_per_s >= x)
    };
    let fits = |t: &Trial| {
        config
            .memory_budget_bytes
            .is_none_or(|b| t.peak_rss_bytes <= b)
    };
    let gain = config.min_gain;

    let mut best = run(config.start_workers, 2, &mut trials)?;
    reasons.push(format!(
        "start: {} workers -> {:.0} samples/s",
        best.num_workers, best.samples_per_s
    ));
    let mut grew = false;
    if !meets(&best) && fits(&best) {
        let mut w = best.num_workers.max(1) * 2;
        while w <= config.max_workers {
            let t = run(w, 2, &mut trials)?;
            if !fits(&t) {
                reasons.push(format!(
                    "stop growing: {w} workers peak at {:.0} MB, over the budget",
                    t.peak_rss_bytes as f64 / 1e6
                ));
                break;
            }
            if t.samples_per_s > best.samples_per_s * (1.0 + gain) {
                reasons.push(format!(
                    "grow: {w} workers -> {:.0} samples/s (+{:.0}%)",
                    t.samples_per_s,
                    pct(t.samples_per_s, best.samples_per_s)
                ));
                best = t;
                grew = true;
                if meets(&best) {
                    reasons.push("stop growing: target met".into());
                    break;
                }
                w *= 2;
            } else {
                reasons.push(format!(
                    "stop growing: {w} workers gain {:+.1}% (< {:.0}%)",
                    pct(t.samples_per_s, best.samples_per_s),
                    gain * 100.0
                ));
                break;
            }
        }
    }
    if !grew {
        // Shrink while fewer workers keep throughput (or the target) and memory fits better.
        let mut w = best.num_workers;
        while w > 0 {
            w /= 2;
            let t = run(w, 2, &mut trials)?;
            let keeps = match config.target_samples_per_s {
                Some(x) if meets(&best) => t.samples_per_s >= x,
                _ => t.samples_per_s >= best.samples_per_s * (1.0 - gain),
            };
            if keeps || !fits(&best) {
                reasons.push(format!(
                    "shrink: {w} workers -> {:.0} samples/s ({:+.1}%), fewer threads suffice",
                    t.samples_per_s,
                    pct(t.samples_per_s, best.samples_per_s)
                ));
                best = t;
            } else {
                reasons.push(format!(
                    "stop shrinking: {w} workers -> {:.0} samples/s ({:+.1}%)",
                    t.samples_per_s,
                    pct(t.samples_per_s, best.samples_per_s)
                ));
                break;
            }
        }
    }
    if best.num_workers > 0 {
        let mut cands: Vec<Trial> = vec![best.clone()];
        for &p in config
            .prefetch_candidates
            .iter()
            .filter(|&&p| p != best.prefetch_factor && p > 0)
        {
            cands.push(run(best.num_workers, p, &mut trials)?);
        }
        let top = cands.iter().map(|t| t.samples_per_s).fold(0.0, f64::max);
        cands.retain(|t| t.samples_per_s >= top * (1.0 - gain) && fits(t));
        cands.sort_by_key(|t| t.prefetch_factor);
        if let Some(c) = cands.first() {
            reasons.push(format!(
                "prefetch_factor {}: within {:.0}% of the best ({:.0} samples/s)",
                c.prefetch_factor,
                gain * 100.0,
                top
            ));
            best = c.clone();
        }
    }
    let target_met = config.target_samples_per_s.map(|_| meets(&best));
    if target_met == Some(false) {
        reasons.push(format!(
            "target {:.0} samples/s NOT met: best {:.0}; the loader is the bottleneck (more cores, cheaper transforms, or pre-decoded data)",
            config.target_samples_per_s.unwrap(),
            best.samples_per_s
        ));
    }
    Ok(TuneResult {
        trials,
        chosen: best,
        target_met,
        reasons,
    })
}

fn pct(new: f64, old: f64) -> f64 {
    100.0 * (new / old.max(1e-12) - 1.0)
}
