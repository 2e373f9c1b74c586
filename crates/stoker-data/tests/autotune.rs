//! The autotune search against synthetic throughput curves (deterministic: no timing).

use stoker_data::autotune::{tune, TuneConfig};
use stoker_data::measure::Trial;

fn trial(w: usize, p: usize, sps: f64) -> Trial {
    Trial {
        num_workers: w,
        prefetch_factor: p,
        batch_size: 64,
        batches: 100,
        samples_per_s: sps,
        mb_per_s: sps * 0.01,
        consumer_wait_pct: 0.0,
        worker_busy_pct: 90.0,
        peak_rss_bytes: (100 + 50 * w as u64) * 1_000_000,
    }
}

fn run(
    cfg: &TuneConfig,
    curve: impl Fn(usize, usize) -> f64,
) -> (usize, usize, Vec<(usize, usize)>, Option<bool>) {
    let r = tune(cfg, |w, p| Ok(trial(w, p, curve(w, p)))).unwrap();
    (
        r.chosen.num_workers,
        r.chosen.prefetch_factor,
        r.trials
            .iter()
            .map(|t| (t.num_workers, t.prefetch_factor))
            .collect(),
        r.target_met,
    )
}

/// Two cores: more than two workers only add contention.
fn contended(w: usize, p: usize) -> f64 {
    let base = w.min(2) as f64 * 1000.0 * (1.0 - 0.02 * w as f64);
    if p == 1 {
        base * 0.97
    } else {
        base
    }
}

/// Scales linearly to 16 workers.
fn scalable(w: usize, _p: usize) -> f64 {
    500.0 * w.min(16) as f64
}

#[test]
fn shrinks_when_workers_only_add_contention() {
    let (w, p, trials, met) = run(&TuneConfig::default(), contended);
    assert_eq!(
        (w, p),
        (2, 1),
        "2 workers; prefetch 1 is within 5% of the best"
    );
    assert_eq!(trials, vec![(4, 2), (8, 2), (2, 2), (1, 2), (2, 1), (2, 4)]);
    assert_eq!(met, None);
}

#[test]
fn grows_while_gains_exceed_five_percent() {
    let (w, p, trials, _) = run(&TuneConfig::default(), scalable);
    assert_eq!((w, p), (16, 1));
    assert_eq!(trials[..4].to_vec(), vec![(4, 2), (8, 2), (16, 2), (32, 2)]);
}

#[test]
fn stops_at_the_target_or_the_memory_budget() {
    let cfg = TuneConfig {
        target_samples_per_s: Some(3000.0),
        ..TuneConfig::default()
    };
    let (w, _, _, met) = run(&cfg, scalable);
    assert_eq!((w, met), (8, Some(true)));
    let cfg = TuneConfig {
        memory_budget_bytes: Some(500_000_000),
        ..TuneConfig::default()
    };
    let (w, _, _, _) = run(&cfg, scalable);
    assert_eq!(w, 8, "16 workers would peak at 900 MB");
    // Target already met at 4 workers: shrink to the cheapest setting that still meets it.
    let cfg = TuneConfig {
        target_samples_per_s: Some(1000.0),
        ..TuneConfig::default()
    };
    let (w, _, _, met) = run(&cfg, scalable);
    assert_eq!((w, met), (2, Some(true)));
    // Unreachable target: reported as not met.
    let cfg = TuneConfig {
        target_samples_per_s: Some(1e9),
        ..TuneConfig::default()
    };
    let r = tune(&cfg, |w, p| Ok(trial(w, p, contended(w, p)))).unwrap();
    assert_eq!(r.target_met, Some(false));
    assert!(r.reasons.last().unwrap().contains("NOT met"));
}

#[test]
fn bad_tune_configs() {
    let cfg = TuneConfig {
        start_workers: 64,
        ..TuneConfig::default()
    };
    assert!(tune(&cfg, |w, p| Ok(trial(w, p, 1.0)))
        .unwrap_err()
        .to_string()
        .contains("start_workers"));
    let cfg = TuneConfig {
        min_gain: 1.5,
        ..TuneConfig::default()
    };
    assert!(tune(&cfg, |w, p| Ok(trial(w, p, 1.0)))
        .unwrap_err()
        .to_string()
        .contains("min_gain"));
}
