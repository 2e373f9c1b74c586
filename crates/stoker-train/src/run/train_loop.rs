//! The training loop, read as torchtitan's `train()` reads: while steps remain, take the
//! next window of micro-batches, run one optimizer step, log it, then evaluate and
//! checkpoint when due; every rank stops after the same step when any was signalled.

use std::rc::Rc;
use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use stoker_comm::Communicator;
use stoker_data::{AnyDataset, Dataset, Loader, SamplerState};

use crate::accumulate::MicroBatch;
use crate::checkpoint::{self, DataPosition};
use crate::config::TrainConfig;
use crate::data::{to_micro_batch, Subset};
use crate::error::Result;
use crate::metrics::Record;
use crate::trainer::{EvalReport, StepReport, Trainer};

use super::checks::same_weights_everywhere;
use super::evaluate::{evaluate, Evaluated};
use super::setup::Rank;
use super::telemetry::Telemetry;
use super::RunOptions;

/// What the loop measured and where it ended.
#[derive(Default)]
pub(super) struct LoopStats {
    /// Time the loop waited for the loader.
    pub wait: Duration,
    /// Evaluation and checkpoint time, kept out of the training throughput.
    pub eval_time: Duration,
    pub ckpt_time: Duration,
    /// Targets trained on.
    pub total_count: usize,
    /// Reductions waited for after the backward, bytes sent, step time, steps.
    pub comm_wait: Duration,
    pub bytes_sent: u64,
    pub step_time: Duration,
    pub steps_run: u32,
    /// Each step's seconds and exposed communication, in order.
    pub step_times: Vec<f64>,
    pub comm_waits: Vec<f64>,
    pub last_loss: f64,
    /// The last evaluation and the step it was made after.
    pub last_eval: Option<(u64, EvalReport)>,
    /// Stopped early by a signal (after writing a checkpoint).
    pub preempted: bool,
    /// The evaluation due at the current step was skipped or cut short by a signal: the
    /// checkpoint says so, and a resume runs it first.
    eval_owed: bool,
    /// The current logging interval: its loader wait, start, side work and targets.
    interval_wait: Duration,
    interval_start: Option<Instant>,
    interval_side: Duration,
    interval_count: usize,
}

impl LoopStats {
    /// One optimizer step over `window`, timed and counted.
    fn step(&mut self, trainer: &mut Trainer, window: &[MicroBatch]) -> Result<StepReport> {
        let t0 = Instant::now();
        let r = trainer.train_step(window)?;
        let took = t0.elapsed();
        self.step_time += took;
        self.step_times.push(took.as_secs_f64());
        self.comm_waits.push(r.sync.exposed_wait.as_secs_f64());
        self.steps_run += 1;
        self.comm_wait += r.sync.exposed_wait;
        self.bytes_sent += r.sync.bytes_sent;
        self.last_loss = r.loss;
        self.interval_count += r.count;
        self.total_count += r.count;
        Ok(r)
    }

    /// Mean of a per-step total over the steps run.
    pub fn per_step(&self, total: f64) -> f64 {
        total / self.steps_run.max(1) as f64
    }
}

/// Where the loop runs: the config, the run's options, the group and the progress bar.
pub(super) struct LoopContext<'a> {
    pub config: &'a TrainConfig,
    pub opts: &'a RunOptions,
    pub comm: &'a Rc<dyn Communicator>,
    pub bar: &'a ProgressBar,
    /// The step the run stops after.
    pub total: u64,
    /// `tokens/s` or `samples/s`.
    pub unit: &'static str,
    /// When this life of the run started.
    pub started: Instant,
}

impl LoopContext<'_> {
    /// The run's seconds so far, its earlier lives (`rank`'s resumed checkpoint's)
    /// included: `metrics.jsonl`'s `elapsed_s` goes on across resumes.
    fn run_elapsed_s(&self, rank: &Rank) -> f64 {
        rank.elapsed_before_s + self.started.elapsed().as_secs_f64()
    }
}

/// Trains `rank` from its loader position until `ctx.total` steps (or a signal).
pub(super) fn train(
    ctx: &LoopContext<'_>,
    rank: &mut Rank,
    loader: &mut Loader<Subset<AnyDataset>>,
    telemetry: &mut Telemetry,
) -> Result<LoopStats> {
    let mut stats = LoopStats {
        last_loss: f64::NAN,
        ..LoopStats::default()
    };
    let k = rank.dims.accumulation_steps;
    let mut window = Vec::with_capacity(k);
    let mut position = rank.trainer.sampler_state();
    // The resumed checkpoint's evaluation, which a signal stopped: run first (a finished
    // run resubmitted runs it and trains nothing). Stopped again, the checkpoint still
    // says it is owed.
    if rank.eval_pending {
        telemetry.side_work();
        evaluate_now(ctx, rank, &mut stats)?;
        if stats.preempted {
            ctx.bar.finish();
            return Ok(stats);
        }
    }
    'outer: while rank.trainer.step() < ctx.total {
        let mut it = loader.resume(position);
        while let Some(batch) = it.next() {
            let batch = batch?;
            stats.wait += batch.wait();
            stats.interval_wait += batch.wait();
            let (input, target, dev) = (&rank.data.input, &rank.data.target, rank.trainer.device());
            window.push(to_micro_batch(&batch, input, target, dev)?);
            drop(batch);
            if window.len() < k {
                continue;
            }
            let r = stats.step(&mut rank.trainer, &window)?;
            window.clear();
            rank.trainer.set_sampler_state(it.state());
            let step = rank.trainer.step();
            log_step(ctx, rank, &mut stats, &r)?;
            stats.preempted = signalled(ctx, step)?;
            telemetry.after_step();
            let every = |n: u64| n > 0 && step.is_multiple_of(n);
            // A signal during an evaluation or a scheduled checkpoint stops the run at this
            // step too, not after another step and a second checkpoint (the asking is a
            // collective: every rank asks after the same side work, which the step decides).
            // A run already stopping skips its evaluation, and one signalled during it
            // stops within a chunk of batches: a preempted job has seconds, not minutes.
            let eval_due = every(ctx.config.train.eval_every) || step == ctx.config.train.steps;
            stats.eval_owed = eval_due;
            if eval_due && !stats.preempted {
                telemetry.side_work();
                evaluate_now(ctx, rank, &mut stats)?;
                stats.preempted = stats.preempted || signalled(ctx, step)?;
            }
            let scheduled = every(ctx.config.train.checkpoint_every) || step == ctx.total;
            if scheduled || stats.preempted {
                telemetry.side_work();
                checkpoint_now(ctx, rank, &mut stats)?;
            }
            if scheduled && !stats.preempted {
                stats.preempted = signalled(ctx, step)?;
            }
            if step >= ctx.total || stats.preempted {
                break 'outer;
            }
        }
        position = SamplerState {
            epoch: it.state().epoch + 1,
            batches_done: 0,
        };
    }
    ctx.bar.finish();
    Ok(stats)
}

/// Logs step `r` where due (metrics record, progress bar), and warns of a skipped one.
fn log_step(
    ctx: &LoopContext<'_>,
    rank: &mut Rank,
    stats: &mut LoopStats,
    r: &StepReport,
) -> Result<()> {
    let step = rank.trainer.step();
    if let (Some(why), true) = (&r.skipped, rank.lead) {
        tracing::warn!("step {step}: skipped (fp16 overflow): {why}");
    }
    ctx.bar.set_position(step);
    if !step.is_multiple_of(ctx.config.train.log_every) && step != ctx.total {
        return Ok(());
    }
    let dt = stats
        .interval_start
        .unwrap_or(ctx.started)
        .elapsed()
        .saturating_sub(stats.interval_side)
        .as_secs_f64();
    let throughput = stats.interval_count as f64 / dt;
    let wait_pct = 100.0 * stats.interval_wait.as_secs_f64() / dt;
    let rec = Record::Train {
        step,
        loss: r.loss,
        lr: r.lr,
        grad_norm: r.grad_norm,
        loss_scale: r.loss_scale,
        throughput,
        unit: ctx.unit.into(),
        loader_wait_pct: wait_pct,
        skipped: r.skipped.is_some(),
        elapsed_s: ctx.run_elapsed_s(rank),
        world: rank.dims.world,
        comm_wait_s: r.sync.exposed_wait.as_secs_f64(),
        bytes_sent: r.sync.bytes_sent,
        calls_before_last: r.sync.calls_before_last,
        step_s: stats.step_times.last().copied().unwrap_or(0.0),
        rss_bytes: stoker_data::measure::rss_bytes(),
    };
    if let Some(log) = &mut rank.log {
        log.write(&rec)?;
    }
    ctx.bar.set_message(format!(
        "loss {:.4} | {throughput:.0} {} | wait {wait_pct:.1}% | scale {} | lr {:.2e}",
        r.loss,
        ctx.unit,
        stoker_precision::ShownScale(r.loss_scale),
        r.lr
    ));
    stats.interval_count = 0;
    stats.interval_wait = Duration::ZERO;
    stats.interval_start = Some(Instant::now());
    stats.interval_side = Duration::ZERO;
    Ok(())
}

/// Preemption: whether this run stops after step `step` because some rank was signalled
/// (a one-number all-reduce every step, so that every rank stops after the same one).
/// After the last step there is nothing left to stop.
fn signalled(ctx: &LoopContext<'_>, step: u64) -> Result<bool> {
    Ok(any_rank_signalled(ctx)? && step < ctx.total)
}

/// Whether some rank's stop flag is up (a one-number all-reduce, every rank alike).
fn any_rank_signalled(ctx: &LoopContext<'_>) -> Result<bool> {
    let Some(flag) = &ctx.opts.stop else {
        return Ok(false);
    };
    let here = flag.load(std::sync::atomic::Ordering::SeqCst);
    Ok(stoker_comm::CommExt::sum(&**ctx.comm, here as u64)? > 0)
}

/// Evaluates on every rank's share of the evaluation batches, and logs it; a signal
/// during it (agreed between chunks of batches, the last step's evaluation too) leaves
/// it unlogged and owed, and the run stopping.
fn evaluate_now(ctx: &LoopContext<'_>, rank: &mut Rank, stats: &mut LoopStats) -> Result<()> {
    let t0 = Instant::now();
    let step = rank.trainer.step();
    let stop_in_eval = ctx.opts.stop_in_eval;
    let asked = |done: usize| {
        if let (Some(at), Some(flag)) = (stop_in_eval, &ctx.opts.stop) {
            if done >= at {
                flag.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
        any_rank_signalled(ctx)
    };
    let outcome = evaluate(&mut rank.trainer, &rank.data, ctx.config, &rank.dims, asked)?;
    stats.eval_time += t0.elapsed();
    stats.interval_side += t0.elapsed();
    let e = match outcome {
        Evaluated::Done(e) => e,
        Evaluated::Stopped { done, of } => {
            (stats.preempted, stats.eval_owed) = (true, true);
            if rank.lead {
                tracing::warn!(
                    "step {step}: evaluation stopped by a signal after {done} of {of} \
                     batches; not logged"
                );
            }
            return Ok(());
        }
    };
    if let Some(log) = &mut rank.log {
        log.write(&Record::Eval {
            step,
            loss: e.loss,
            accuracy: e.accuracy,
        })?;
    }
    ctx.bar.println(format!(
        "step {step}: eval loss {:.4}, accuracy {:.2}%",
        e.loss,
        100.0 * e.accuracy
    ));
    stats.last_eval = Some((step, e));
    stats.eval_owed = false;
    Ok(())
}

/// Every rank's shard of a checkpoint, after checking that the ranks hold the same
/// weights.
fn checkpoint_now(ctx: &LoopContext<'_>, rank: &mut Rank, stats: &mut LoopStats) -> Result<()> {
    let t0 = Instant::now();
    rank.trainer.sync_host()?;
    let (trainer, dims) = (&rank.trainer, &rank.dims);
    same_weights_everywhere(&**ctx.comm, trainer, trainer.step())?;
    let mut pos = DataPosition::of(
        trainer.sampler_state(),
        dims.global_batch,
        dims.world,
        dims.accumulation_steps,
        Some(rank.data.train.len()),
    );
    pos.train_crc32 = Some(rank.train_fingerprint);
    pos.shuffle = Some(ctx.config.data.shuffle);
    let root = ctx.config.run_dir.join("checkpoints");
    let run = checkpoint::RunRecord::of(ctx.config);
    let at = checkpoint::RunProgress {
        data: pos,
        elapsed_s: ctx.run_elapsed_s(rank),
        eval_pending: stats.eval_owed,
    };
    checkpoint::save(trainer, &**ctx.comm, &root, &run, at, ctx.opts.save_fault)?;
    if rank.lead {
        let keep = ctx.config.train.keep_checkpoints;
        for (dir, why) in checkpoint::retain::remove_older(&root, keep) {
            tracing::warn!(
                "train.keep_checkpoints = {keep}: could not remove {}: {why}",
                dir.display()
            );
        }
    }
    stats.ckpt_time += t0.elapsed();
    stats.interval_side += t0.elapsed();
    Ok(())
}
