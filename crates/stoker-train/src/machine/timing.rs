//! Timing a config's training step as the run will run it: one or several ranks at once on
//! this host, each on its share of the cores, and the step time from their timings.

use std::time::Instant;

use candle_core::{Device, Tensor};
use stoker_comm::communicator::{CommExt, Communicator};

use crate::accumulate::MicroBatch;
use crate::config::TrainConfig;
use crate::error::{config_err, Result};
use crate::trainer::Trainer;

/// Seconds of each of `runs` calls of `f`.
fn time_runs(runs: usize, mut f: impl FnMut() -> Result<()>) -> Result<Vec<f64>> {
    let mut t = Vec::with_capacity(runs);
    for _ in 0..runs {
        let t0 = Instant::now();
        f()?;
        t.push(t0.elapsed().as_secs_f64());
    }
    Ok(t)
}

/// Seconds of `runs` calls of `f` after one warm-up call.
fn timings(runs: usize, mut f: impl FnMut() -> Result<()>) -> Result<Vec<f64>> {
    f()?;
    time_runs(runs, f)
}

/// How many timed steps a step's measurement takes.
#[derive(Clone, Copy, Debug)]
pub(super) enum Runs {
    /// This many.
    Fixed(usize),
    /// As many as fill `seconds` at the warm-up step's time (rank 0's, which every rank
    /// then runs), within `min..=max`: a short step is timed often enough to outlast a
    /// busy moment of the machine, a long one no more than `min` times.
    Budget {
        seconds: f64,
        min: usize,
        max: usize,
    },
}

/// The median of `t` (not empty).
fn median(mut t: Vec<f64>) -> f64 {
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

/// Median of `runs` timings of `f` after one warm-up call.
pub(super) fn median_s(runs: usize, f: impl FnMut() -> Result<()>) -> Result<f64> {
    Ok(median(timings(runs.max(1), f)?))
}

/// `cfg` as one rank stepping one micro-batch at a time: what the calibration times and
/// plans.
pub(super) fn one_micro_batch(cfg: &TrainConfig) -> TrainConfig {
    let mut one = cfg.clone();
    one.batch.world_size = Some(1);
    one.batch.accumulation_steps = Some(1);
    one.batch.global_batch = Some(one.batch.micro_batch);
    one
}

/// Timed training steps per rank (after one warm-up step): enough runs, after the ranks
/// meet, that two ranks timing one step at once agree (docs/benchmarks.md, "Measurements
/// behind code constants").
pub(super) const STEP_RUNS: usize = 11;

/// A trainer for `cfg` on one rank and one micro-batch of synthetic tokens, for
/// [`concurrent_step_times`].
fn step_trainer(cfg: &TrainConfig) -> Result<(Trainer, Vec<MicroBatch>)> {
    let (Some(context), Some(vocab)) = (cfg.model.context(), cfg.model.vocab()) else {
        return Err(config_err(
            "model.kind",
            "calibration times a transformer's training step, the GPT's or the Llama's \
             (the planner models transformers)",
        ));
    };
    let one = one_micro_batch(cfg);
    let trainer = Trainer::new(&one)?;
    let (b, t) = (one.batch.micro_batch, context);
    let ids = |salt: u64| -> Vec<i64> {
        (0..(b * t) as u64)
            .map(|i| (crate::params::mix64(i ^ salt) % vocab as u64) as i64)
            .collect()
    };
    let window = vec![MicroBatch {
        input: Tensor::from_vec(ids(1), (b, t), &Device::Cpu)?,
        targets: ids(2),
    }];
    Ok((trainer, window))
}

/// `cfg`'s step as `ranks` ranks of `threads` compute threads each run it on this host at
/// once (the ranks of an in-process group, each with its own pool and trainer, as
/// `parallel.backend = "local"` runs them): the ranks share the cores' caches and memory
/// bandwidth as the run's processes will. Each rank's `runs` timings after a warm-up
/// step, in rank order. The ranks build their trainers, then meet (a barrier) so that
/// their timed steps overlap: a rank stepping while another still builds runs alone,
/// faster. A rank that fails leaves the group, and the others' barrier ends with an error.
pub(super) fn concurrent_step_times(
    cfg: &TrainConfig,
    ranks: usize,
    threads: usize,
    runs: Runs,
) -> Result<Vec<Vec<f64>>> {
    let times = stoker_comm::run_local(ranks, stoker_comm::DEFAULT_TIMEOUT, |comm| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .map_err(|e| config_err("calibrate", format!("a pool of {threads} threads: {e}")))?;
        // The trainer stays on the pool's thread (it is not `Send`).
        pool.install(move || {
            let (mut trainer, window) = step_trainer(cfg)?;
            let comm_err = |e: stoker_comm::CommError| config_err("calibrate", e.to_string());
            comm.barrier().map_err(comm_err)?;
            let mut step = || trainer.train_step(&window).map(|_| ());
            let t0 = Instant::now();
            step()?;
            let warm = t0.elapsed().as_secs_f64();
            let n = match runs {
                Runs::Fixed(n) => n,
                Runs::Budget { seconds, min, max } => {
                    let mut n = [(seconds / warm).ceil().clamp(min as f64, max as f64)];
                    comm.broadcast(&mut n, 0).map_err(comm_err)?;
                    n[0] as usize
                }
            };
            time_runs(n.max(1), step)
        })
    });
    times.into_iter().collect()
}

/// The step time of [`concurrent_step_times`] (see [`step_time`]).
pub(super) fn concurrent_step_s(
    cfg: &TrainConfig,
    ranks: usize,
    threads: usize,
    runs: usize,
) -> Result<f64> {
    Ok(step_time(concurrent_step_times(
        cfg,
        ranks,
        threads,
        Runs::Fixed(runs),
    )?))
}

/// A step's time from each rank's timings: the slowest rank's median (a synchronous step
/// waits for the slowest rank). The run's measured step is the mean of all its steps,
/// busy spells of a shared machine included; the median is the typical step, which a
/// spell over less than half the timings does not move (the lower quartile, the step on a
/// quiet machine, planned runs' mean steps fast: docs/benchmarks.md, "Measurements behind
/// code constants").
pub(super) fn step_time(per_rank: Vec<Vec<f64>>) -> f64 {
    per_rank.into_iter().map(median).fold(0f64, f64::max)
}
