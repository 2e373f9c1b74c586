//! Loader autotune: pick `num_workers` and `prefetch_factor` for what training needs.
//!
//! No loader among PyTorch, FFCV, DALI, Mosaic or SPDL picks its worker count; users guess,
//! and guess high (the chapter's "4 workers" costs cores and memory where fewer suffice: on
//! 2 cores a memory-mapped token shard is fastest read in the consumer's own thread). The
//! search climbs the ladder 0, 1, 2, 4, 8, ... workers (prefetch 2):
//! - with a target (the plan's consumption rate): it stops at the first, so fewest, worker
//!   count that sustains the target with a margin, then takes the smallest prefetch_factor
//!   that still does; if none does, the fastest setting, with the target reported not met.
//!   What "sustains" means depends on how the trials ran ([`TuneConfig::simulated_step`]):
//!   beside a simulated step, the consumer waits at most `margin` of each step; flat out,
//!   workers (which load while the step runs) must reach the target plus the margin, and
//!   0 workers (loading in series with the step) must leave the consumer waiting at most
//!   `margin` of each step: a rate of `target / margin`;
//! - without a target: it measures 0, 1 and 2 workers, doubles further while a doubling gains
//!   more than `min_gain`, and takes the fewest workers within `min_gain` of the fastest,
//!   then the smallest prefetch_factor within `min_gain` of the best.
//!
//! Settings over the memory budget are never chosen and stop the climb. The trial function
//! is a parameter, so the search is tested against synthetic throughput curves.

use serde::Serialize;

use crate::measure::Trial;
use crate::{DataError, Result};

/// Search settings.
#[derive(Debug, Clone, PartialEq)]
pub struct TuneConfig {
    /// Upper bound on workers.
    pub max_workers: usize,
    /// Relative throughput gain that justifies more workers or prefetch (0.05 = 5%).
    pub min_gain: f64,
    /// Headroom over the target a setting must reach to count as sustaining it (0.1 = 10%):
    /// workers' rate over the target, or the consumer's wait per step where it loads in
    /// series with the step (0 workers, or any trial beside a simulated step).
    pub margin: f64,
    /// Peak RSS a setting may use, bytes.
    pub memory_budget_bytes: Option<u64>,
    /// Samples/s the training step needs (the plan's consumption rate).
    pub target_samples_per_s: Option<f64>,
    /// prefetch_factor values tried after the worker count is chosen.
    pub prefetch_candidates: Vec<usize>,
    /// Whether the trials ran beside a simulated step of the target's length (batch /
    /// target): their rate is then the one training would reach, capped at the target.
    /// Otherwise they ran flat out, and their rate is the loader's alone.
    pub simulated_step: bool,
}

impl Default for TuneConfig {
    fn default() -> Self {
        TuneConfig {
            max_workers: 32,
            min_gain: 0.05,
            margin: 0.10,
            memory_budget_bytes: None,
            target_samples_per_s: None,
            prefetch_candidates: vec![1, 2, 4],
            simulated_step: false,
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
    for (field, v) in [("min_gain", config.min_gain), ("margin", config.margin)] {
        if !(0.0..1.0).contains(&v) {
            return Err(DataError::Config {
                field,
                message: format!("{v}: expected a fraction in [0, 1)"),
            });
        }
    }
    if let Some(t) = config.target_samples_per_s {
        if !(t.is_finite() && t > 0.0) {
            return Err(DataError::Config {
                field: "target_samples_per_s",
                message: format!("{t}: expected a positive number"),
            });
        }
    }
    let mut trials: Vec<Trial> = Vec::new();
    let mut reasons = Vec::new();
    let mut run = |w: usize, p: usize, trials: &mut Vec<Trial>| -> Result<Trial> {
        let t = trial(w, p)?;
        if t.samples_per_s.is_nan() {
            return Err(DataError::Config {
                field: "samples_per_s",
                message: format!("trial of {w} workers measured NaN"),
            });
        }
        trials.push(t.clone());
        Ok(t)
    };
    let need = |t: &Trial| {
        config
            .target_samples_per_s
            .map(|target| needed_rate(t.num_workers, target, config))
    };
    let sustains = |t: &Trial| need(t).is_some_and(|n| t.samples_per_s >= n);
    let fits = |t: &Trial| {
        config
            .memory_budget_bytes
            .is_none_or(|b| t.peak_rss_bytes <= b)
    };
    let gain = config.min_gain;

    // Climb 0, 1, 2, 4, ... workers.
    let mut climbed: Vec<Trial> = Vec::new();
    let mut w = 0;
    let mut chosen = None;
    while w <= config.max_workers {
        let t = run(w, 2, &mut trials)?;
        if !fits(&t) {
            reasons.push(format!(
                "stop: {w} workers peak at {:.0} MB, over the memory budget",
                t.peak_rss_bytes as f64 / 1e6
            ));
            break;
        }
        if sustains(&t) {
            reasons.push(format!(
                "{w} workers -> {:.0} samples/s: the fewest that sustain the target with {:.0}% margin ({:.0} needed{})",
                t.samples_per_s,
                config.margin * 100.0,
                need(&t).unwrap_or_default(),
                Loading::of(w, config).why()
            ));
            chosen = Some(t);
            break;
        }
        let prev_best = climbed
            .iter()
            .map(|c| c.samples_per_s)
            .fold(f64::NEG_INFINITY, f64::max);
        match need(&t) {
            Some(n) => reasons.push(format!(
                "{w} workers -> {:.0} samples/s, {n:.0} needed{}",
                t.samples_per_s,
                Loading::of(w, config).why()
            )),
            None => reasons.push(format!("{w} workers -> {:.0} samples/s", t.samples_per_s)),
        }
        climbed.push(t.clone());
        // 0, 1 and 2 are always measured; beyond, a doubling must gain more than min_gain.
        if w >= 2 && t.samples_per_s <= prev_best * (1.0 + gain) {
            reasons.push(format!(
                "stop: {w} workers gain {:+.1}% over the best fewer (< {:.0}%)",
                pct(t.samples_per_s, prev_best),
                gain * 100.0
            ));
            break;
        }
        w = if w == 0 { 1 } else { w * 2 };
    }
    let mut best = match chosen {
        Some(t) => t,
        None => {
            // Compared by the rate training would reach with each (0 workers' loading in
            // series with the step), where there is a target.
            let rate = |t: &Trial| {
                config
                    .target_samples_per_s
                    .map_or(t.samples_per_s, |target| {
                        Loading::of(t.num_workers, config).training_rate(t.samples_per_s, target)
                    })
            };
            let top = climbed.iter().map(rate).fold(0.0, f64::max);
            let Some(c) = climbed
                .iter()
                .filter(|t| rate(t) >= top * (1.0 - gain))
                .min_by_key(|t| t.num_workers)
            else {
                return Err(DataError::Config {
                    field: "memory_budget_bytes",
                    message: "no setting fits the memory budget, not even 0 workers".into(),
                });
            };
            reasons.push(format!(
                "{} workers: the fewest within {:.0}% of the fastest ({top:.0} samples/s{})",
                c.num_workers,
                gain * 100.0,
                match config.target_samples_per_s {
                    Some(_) => " of training, step included",
                    None => "",
                }
            ));
            c.clone()
        }
    };
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
        cands.retain(|t| {
            fits(t)
                && if sustains(&best) {
                    sustains(t)
                } else {
                    t.samples_per_s >= top * (1.0 - gain)
                }
        });
        cands.sort_by_key(|t| t.prefetch_factor);
        if let Some(c) = cands.first() {
            reasons.push(format!(
                "prefetch_factor {}: the smallest that {}",
                c.prefetch_factor,
                if sustains(&best) {
                    "still sustains the target".to_string()
                } else {
                    format!(
                        "stays within {:.0}% of the best ({top:.0} samples/s)",
                        gain * 100.0
                    )
                }
            ));
            best = c.clone();
        }
    }
    let target_met = config.target_samples_per_s.map(|_| sustains(&best));
    if target_met == Some(false) {
        reasons.push(format!(
            "target {:.0} samples/s ({:.0}% margin) NOT met: best {:.0}, {:.0} needed{}; the loader is the bottleneck (more cores, cheaper transforms, or pre-decoded data)",
            config.target_samples_per_s.unwrap_or_default(),
            config.margin * 100.0,
            best.samples_per_s,
            need(&best).unwrap_or_default(),
            Loading::of(best.num_workers, config).why()
        ));
    }
    Ok(TuneResult {
        trials,
        chosen: best,
        target_met,
        reasons,
    })
}

/// Where a trial's loading ran against the training step, which says what its rate means.
#[derive(Clone, Copy)]
enum Loading {
    /// Beside a simulated step: the trial's rate is training's, capped at the target.
    BesideTheStep,
    /// Flat out with 0 workers: in the training thread, in series with the step.
    InSeries,
    /// Flat out with workers: loading while the step runs.
    Alongside,
}

impl Loading {
    fn of(workers: usize, config: &TuneConfig) -> Self {
        match (config.simulated_step, workers) {
            (true, _) => Loading::BesideTheStep,
            (false, 0) => Loading::InSeries,
            (false, _) => Loading::Alongside,
        }
    }

    /// See [`needed_rate`].
    fn needed(self, target: f64, margin: f64) -> f64 {
        match self {
            Loading::BesideTheStep => target / (1.0 + margin),
            Loading::InSeries => target / margin,
            Loading::Alongside => target * (1.0 + margin),
        }
    }

    /// The rate a step consuming `target` samples/s trains at beside loading measured at
    /// `rate`: that rate beside the step, `1 / (1 / rate + 1 / target)` in series with it,
    /// `min(rate, target)` alongside it.
    fn training_rate(self, rate: f64, target: f64) -> f64 {
        match self {
            Loading::BesideTheStep => rate,
            Loading::InSeries => 1.0 / (1.0 / rate + 1.0 / target),
            Loading::Alongside => rate.min(target),
        }
    }

    /// Why [`Loading::needed`] is what it is, for the reasons' lines.
    fn why(self) -> &'static str {
        match self {
            Loading::BesideTheStep => " beside the simulated step",
            Loading::InSeries => ": loading in series with the step",
            Loading::Alongside => "",
        }
    }
}

/// The rate a trial of `workers` must measure to keep a step consuming `target`
/// samples/s fed within `config.margin`:
/// - beside a simulated step, the trial's rate is training's: the consumer may wait
///   `margin` of each step, so `target / (1 + margin)`;
/// - flat out with workers, which load while the step runs: `target * (1 + margin)`;
/// - flat out with 0 workers, loading in series with the step: training's rate is
///   `1 / (1 / rate + 1 / target)`, within the margin of the target where
///   `rate >= target / margin` (infinite at margin 0: any loading is waited for).
pub fn needed_rate(workers: usize, target: f64, config: &TuneConfig) -> f64 {
    Loading::of(workers, config).needed(target, config.margin)
}

fn pct(new: f64, old: f64) -> f64 {
    100.0 * (new / old.max(1e-12) - 1.0)
}
