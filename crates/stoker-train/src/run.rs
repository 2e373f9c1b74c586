//! The training loop: loader -> accumulation windows -> optimizer steps, with metrics,
//! evaluation, checkpoints and a progress bar; one rank of a data-parallel run
//! ([`run_rank`]), one rank alone ([`run`]), or a world of ranks as threads of this
//! process ([`run_threads`]).
//!
//! Every rank reads its share of each global batch (the world-size-independent sampler:
//! global batch `k` holds the same samples at any world size), evaluates its share of
//! the evaluation batches, and rank 0 alone writes the run directory: config, metrics,
//! checkpoints (with every rank's loader position) and the sample.

use std::path::PathBuf;
use std::rc::Rc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use stoker_comm::Communicator;
use stoker_data::pack::text::Vocab;
use stoker_data::{Dataset, Loader, LoaderConfig, Partition, Sampler, SamplerConfig, SamplerState};

use crate::checkpoint::{self, DataPosition};
use crate::config::{ModelConfig, OptimizerKind, TrainConfig};
use crate::data::{open_datasets, to_micro_batch, Datasets};
use crate::error::{io_err, Result, TrainError};
use crate::heap::HeapCount;
use crate::layout::FlatLayout;
use crate::memory::HeldBytes;
use crate::metrics::{MetricsLog, Record};
use crate::models::build_model_on;
use crate::models::LossKind;
use crate::parallel::{agree, ParallelDims};
use crate::trainer::{EvalReport, Trainer};
use stoker_plan::strategy::Stage;
use stoker_plan::trainer::{GroupSpans, TrainerPrediction, TrainerRun};

/// How to run (beyond the config).
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Resume from this checkpoint directory.
    pub resume: Option<PathBuf>,
    /// Show the progress bar.
    pub progress: bool,
    /// Stop after this many steps (an interruption, for resume tests); a checkpoint is
    /// written there.
    pub stop_after: Option<u64>,
    /// A crash to inject into checkpoint saves (tests of crash safety).
    pub save_fault: Option<checkpoint::SaveFault>,
    /// Raised by a signal handler (the CLI's, on SIGTERM / SIGINT): the run finishes the
    /// optimizer step under way, writes a checkpoint and returns with
    /// [`RunSummary::preempted`]. With a flag every step ends with a one-number
    /// all-reduce, so that every rank stops after the same step even when the signal
    /// reached only some of them.
    pub stop: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
    /// The process allocator's count of live heap bytes, where the binary has one: the
    /// run reports the peak of its training steps beside the forecast.
    pub heap: Option<&'static dyn HeapCount>,
    /// This machine's profile (`stoker plan --calibrate`'s figures), which the run's
    /// forecast uses where the config gives none of its own (profile::MachineProfile::apply).
    pub profile: Option<crate::profile::MachineProfile>,
}

/// What a run ended with.
#[derive(Debug, Clone)]
pub struct RunSummary {
    /// Steps taken.
    pub steps: u64,
    /// The run stopped early on [`RunOptions::stop`], after writing a checkpoint.
    pub preempted: bool,
    /// Last training loss.
    pub last_loss: f64,
    /// The last evaluation.
    pub eval: Option<EvalReport>,
    /// Loader wait as % of the loop's wall time.
    pub loader_wait_pct: f64,
    /// Mean training throughput (targets per second of the training loop, evaluation and
    /// checkpoint time excluded: they are [`RunSummary::eval_s`] and
    /// [`RunSummary::checkpoint_s`]).
    pub throughput: f64,
    /// Seconds spent in evaluation.
    pub eval_s: f64,
    /// Seconds spent writing checkpoints.
    pub checkpoint_s: f64,
    /// A text sample (GPT with a vocab and `train.sample_tokens`).
    pub sample: Option<String>,
    /// Trainable parameters.
    pub params: usize,
    /// The resolved parallel degrees.
    pub dims: ParallelDims,
    /// Mean seconds per step spent waiting for gradient reductions after the backward.
    pub comm_wait_s: f64,
    /// Mean bytes this rank sent per step (ring model).
    pub bytes_per_step: f64,
    /// Mean seconds per optimizer step (evaluation and checkpoints excluded).
    pub step_s: f64,
    /// Seconds of each optimizer step this run took, in order.
    pub step_times_s: Vec<f64>,
    /// Seconds each step waited for reductions after its backward, in order.
    pub comm_waits_s: Vec<f64>,
    /// CRC-32 of the final FP32 master weights' bytes (equal across ranks; equal across
    /// world sizes in deterministic mode).
    pub weights_crc32: u32,
    /// The strategy that ran (`none` at one rank).
    pub strategy: String,
    /// What the planner predicts this rank holds and sends.
    pub planned: TrainerPrediction,
    /// What this rank's trainer holds, counted from its buffers.
    pub held: HeldBytes,
    /// The planner's forecast of peak memory and step time (None where it cannot model
    /// the run).
    pub forecast: Option<crate::planned::RunForecast>,
    /// This process's peak resident set size (VmHWM), bytes; with the in-process backend
    /// all ranks share it.
    pub peak_rss_bytes: u64,
    /// Peak resident set size of the training steps until the first evaluation or
    /// checkpoint (what the forecast's peak is for), bytes: the kernel's peak mark (VmHWM,
    /// reset as training starts) read after each of those steps, so what a step holds
    /// between two samples counts too; where the mark cannot be reset, the largest VmRSS
    /// read after a step.
    pub train_rss_bytes: u64,
    /// The counting allocator's peak of live heap bytes over training steps before the
    /// first evaluation or checkpoint (None without a [`HeapCount`]).
    pub train_heap_bytes: Option<u64>,
    /// Bytes of the direct step's activation buffers at the end, counted from them.
    pub activation_bytes: usize,
}

/// The planner's prediction of one rank's bytes for `config` at `dims`.
pub fn predicted(
    config: &TrainConfig,
    dims: &ParallelDims,
    layout: &FlatLayout,
) -> TrainerPrediction {
    let p = &config.parallel;
    let stage = dims.strategy.stage();
    let dtype = config.kernels.param_dtype(config.precision);
    let bf16_copy = if dtype == candle_core::DType::BF16 {
        2
    } else {
        0
    };
    // ZeRO-3 gathers by group: the root groups (first and last) once per micro-batch,
    // the blocks between them once or twice.
    let spans: Vec<u64> = layout
        .group_ranges()
        .iter()
        .map(|(_, r)| r.len() as u64)
        .collect();
    let root = spans.first().copied().unwrap_or(0) + spans.last().copied().unwrap_or(0);
    let direct = config.direct_step();
    let groups = match direct {
        true => GroupSpans {
            root: if spans.len() > 1 { root } else { root / 2 },
            blocks: spans.iter().sum::<u64>().saturating_sub(root),
            reshard_after_forward: p.reshard_after_forward,
        },
        // The graph path gathers unit by unit (parallel::units): the groups its schedule
        // gathers once count as root, those gathered twice as blocks.
        false => {
            let plan = crate::parallel::units::UnitPlan::for_model(
                &config.model,
                config.precision,
                config.kernels,
                layout,
                p.reshard_after_forward,
            );
            let (mut once, mut twice) = (0u64, 0u64);
            match plan {
                Ok(plan) => {
                    for (n, s) in plan.gathers().into_iter().zip(&plan.spans) {
                        match n {
                            1 => once += s.len() as u64,
                            _ => twice += s.len() as u64,
                        }
                    }
                }
                // A model whose units cannot be planned fails the trainer's build first;
                // here it counts as one unit.
                Err(_) => once = layout.total_len() as u64,
            }
            GroupSpans {
                root: once,
                blocks: twice,
                reshard_after_forward: true,
            }
        }
    };
    stoker_plan::trainer::predict(&TrainerRun {
        flat_len: layout.total_len() as u64,
        world: dims.world as u64,
        stage,
        moments: match config.optimizer.kind {
            OptimizerKind::Adamw => 2,
            OptimizerKind::Sgd => 1,
        },
        // Under ZeRO-3 the model's candle variables give way to a shell.
        copy_bytes: match stage {
            Stage::Zero3 if dims.world > 1 => bf16_copy as u64,
            _ => (dtype.size_in_bytes() + bf16_copy) as u64,
        },
        accumulation: dims.accumulation_steps as u64,
        reduce_every_micro_batch: match stage {
            Stage::Zero1 => false,
            Stage::Zero2 => p.sync_every_micro_batch.unwrap_or(true),
            _ => p.sync_every_micro_batch.unwrap_or(false),
        },
        deterministic: p.deterministic,
        groups,
        direct,
    })
}

/// Trains as `config` says on one rank (no launcher).
pub fn run(config: &TrainConfig, opts: &RunOptions) -> Result<RunSummary> {
    let comm = stoker_comm::local_group(1, stoker_comm::DEFAULT_TIMEOUT).remove(0);
    run_rank(config, opts, Rc::new(comm), "this process")
}

/// Runs `batch.world_size` ranks as threads of this process (`parallel.backend =
/// "local"`), each with a compute pool of `parallel.threads_per_rank` threads (0: this
/// machine's cores divided by the ranks); results in rank order. A rank that fails ends
/// the others (they see it gone at their next collective).
pub fn run_threads(config: &TrainConfig, opts: &RunOptions) -> Result<Vec<Result<RunSummary>>> {
    let world = config.batch.world_size.ok_or_else(|| {
        crate::error::config_err(
            "batch.world_size",
            "parallel.backend = \"local\" runs this many ranks as threads: give it",
        )
    })?;
    let threads = threads_per_rank(config.parallel.threads_per_rank, world);
    let timeout = stoker_comm::communicator::timeout_from_secs(
        config.parallel.timeout_s,
        stoker_comm::DEFAULT_TIMEOUT,
    );
    Ok(stoker_comm::run_local(world, timeout, |comm| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(move |i| format!("rank-compute-{i}"))
            .build()
            .map_err(|e| TrainError::Layout(format!("building a compute pool: {e}")))?;
        pool.install(|| run_rank(config, opts, Rc::new(comm), "parallel.backend = \"local\""))
    }))
}

/// Compute threads for each of `ranks` ranks on this machine: `configured`, or the
/// cores divided among the ranks (at least 1).
pub fn threads_per_rank(configured: usize, ranks: usize) -> usize {
    if configured > 0 {
        return configured;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / ranks.max(1)).max(1)
}

/// Trains as `config` says as one rank of `comm`'s group (started by `launcher`, named
/// in errors). The configs of all ranks, the parallel degrees, data, model and checkpoint
/// are all checked before the first step.
pub fn run_rank(
    config: &TrainConfig,
    opts: &RunOptions,
    comm: Rc<dyn Communicator>,
    launcher: &str,
) -> Result<RunSummary> {
    // The process before this run allocates anything: code, libraries, the communicator.
    let baseline_rss = stoker_data::measure::rss_bytes();
    let code_at_start = stoker_data::measure::code_rss_bytes();
    let baseline_heap = opts.heap.map(|h| h.live());
    agree::check_same_config(&*comm, config)?;
    let comm: Rc<dyn Communicator> = match config.parallel.check_collectives {
        true => Rc::new(stoker_comm::Checked::new(comm)),
        false => comm,
    };
    let dims = ParallelDims::resolve(config, comm.world_size(), comm.rank(), launcher)?;
    let lead = dims.rank == 0;
    if lead {
        if let Some(why) = slow_precision(config) {
            tracing::warn!("{why}");
        }
    }
    // A GPU (`device = "cuda"`): the rank's own, one per rank on its host.
    let (launched, per_host) = (comm.backend() != "local", comm.ranks_on_this_host());
    let local = crate::device::local_rank(dims.rank, per_host, launched);
    let device = crate::device::TrainDevice::parse(&config.device)?.open(local)?;
    let (p, k, seed) = (config.precision, config.kernels, config.seed);
    // The model declared first without values: its layout sets the strategy up, and a
    // strategy that shards the parameters (ZeRO-3) draws this rank's pieces from it
    // alone; every other gets the model built whole.
    let meta = crate::models::build_meta_model_on(&config.model, p, k, seed, &device)?;
    let layout = FlatLayout::of(meta.params())?;
    let strategy = crate::parallel::for_config(config, &layout, comm.clone())?;
    let model = match strategy
        .holds(layout.total_len())
        .is_whole(layout.total_len())
    {
        true => build_model_on(&config.model, p, k, seed, &device)?,
        false => meta,
    };
    let mut trainer = Trainer::with_strategy(config, model, strategy)?;
    let context = config.model.context().unwrap_or(0);
    let vocab = load_vocab(config)?;
    let data = open_datasets(config, trainer.model())?;
    let resumed_at = match &opts.resume {
        Some(dir) => {
            let state = checkpoint::load(&mut trainer, dir)?;
            let pos = state.data.clone().unwrap_or_else(|| {
                // Version 1: written by one rank, k = global_batch / micro_batch.
                let k = dims.global_batch / dims.micro_batch;
                DataPosition::of(state.sampler, dims.global_batch, 1, k)
            });
            trainer.set_sampler_state(pos.resume_at(dims.global_batch, dims.accumulation_steps)?);
            Some(state.step)
        }
        None => None,
    };
    let run_dir = &config.run_dir;
    let mut log = match lead {
        true => {
            std::fs::create_dir_all(run_dir).map_err(|e| io_err(run_dir, e))?;
            let cfg_text =
                toml::to_string(config).map_err(|e| TrainError::Layout(e.to_string()))?;
            std::fs::write(run_dir.join("config.toml"), cfg_text)
                .map_err(|e| io_err(run_dir, e))?;
            Some(MetricsLog::open(run_dir, resumed_at)?)
        }
        false => None,
    };
    let ckpt_root = run_dir.join("checkpoints");
    let params = trainer.layout().numel();
    let mib = |elems: usize| elems as f64 * 4.0 / (1 << 20) as f64;
    let accounting = format!(
        "{params} parameters in {} tensors; FP32 master {:.2} MiB + gradients {:.2} MiB + optimizer {:.2} MiB (align {}) per rank; \
         {} x {} rank(s), micro_batch {} x accumulation_steps {} x world_size {} = global_batch {}; eval: {}",
        trainer.layout().slots().len(),
        mib(trainer.master().len()),
        mib(trainer.grad_held().len() * (1 + trainer.extra_grad_buffers())),
        mib(trainer.optimizer().state_bytes() / 4),
        trainer.layout().align(),
        trainer.strategy().name(),
        dims.world,
        dims.micro_batch,
        dims.accumulation_steps,
        dims.world,
        dims.global_batch,
        data.eval_note
    );
    tracing::info!("{accounting}");

    let d = &config.data;
    if data.train.len() < dims.global_batch {
        return Err(TrainError::Data {
            what: d.train.display().to_string(),
            message: format!(
                "{} training samples, fewer than one global batch of {} (batch.global_batch)",
                data.train.len(),
                dims.global_batch
            ),
        });
    }
    // Before the loader starts its workers, whose allocations the count would see.
    let threads = comm.backend() == "local" && dims.world > 1;
    let scratch = step_scratch_heap(&mut trainer, &data, dims.micro_batch, opts.heap, threads)?;
    // The code the step runs (candle's ops, the kernels, the collectives' libraries)
    // becomes resident as it first runs, which no allocation counts: measured across the
    // setup and the scratch micro-batch (ZeRO-3 on candle's graph, 2 MPI ranks: 3.6 MiB of
    // a 61 MiB forecast).
    let code_grown = stoker_data::measure::code_rss_bytes().saturating_sub(code_at_start);
    // The direct step's activation and packing buffers are told; what its scratch run
    // held beyond them is its kernels' workspace. On the graph path it is all candle's.
    let (activations, workspace) = match (direct_activation_bytes(config, &dims), scratch) {
        (Some(a), s) => (Some(a), s.map(|s| s.saturating_sub(a))),
        (None, s) => (s, None),
    };
    let sampler = Sampler::new(
        data.train.len(),
        SamplerConfig {
            shuffle: d.shuffle,
            seed: config.seed,
            rank: dims.rank,
            world: dims.world,
            drop_last: true,
            partition: Partition::GlobalBatch {
                global_batch: dims.global_batch,
            },
        },
    )?;
    let mut loader = Loader::new(
        data.train.clone(),
        sampler,
        d.train_loader(dims.micro_batch),
    )?;
    let total = opts
        .stop_after
        .unwrap_or(config.train.steps)
        .min(config.train.steps);
    let bar = progress_bar(opts.progress && lead, total, trainer.step());
    // The plan this run is checked against at its end (as `--dry-run` prints it).
    let planned = predicted(config, &dims, trainer.layout());
    // The planner's whole forecast (peak memory, step time) for this run as configured,
    // its memory from the trainer's own count of its buffers.
    let own = crate::planned::OwnBytes {
        baseline: (baseline_rss + code_grown) as f64,
        model_states: planned.model_states(),
        // Communication and accumulation buffers, as the trainer sized them.
        buffers: trainer.steady_buffer_bytes(dims.accumulation_steps) as f64,
        activations: activations.map(|b| b as f64),
        workspace: workspace.map_or(0.0, |b| b as f64),
        loader: loader.steady_bytes() as f64,
        mapped: data.mapped_bytes() as f64,
        baseline_heap: baseline_heap.map(|b| b as f64),
    };
    // Planned on this machine's profile where it applies (the config itself is untouched).
    let mut planned_config = config.clone();
    let profile_line = opts.profile.as_ref().map(|p| {
        let threads = rayon::current_num_threads();
        p.line(&p.apply(&mut planned_config, per_host, threads))
    });
    let forecast = crate::planned::forecast(&planned_config, dims.world, per_host, Some(&own));
    if lead {
        bar.println(&accounting);
        bar.suspend(|| {
            if let Some(line) = &profile_line {
                println!("{line}");
            }
            println!("plan per rank: {}", planned.summary());
            match &forecast {
                Ok(f) => println!("{}", forecast_line(f)),
                Err(e) => println!("planner forecast: none ({e})"),
            }
        });
    }
    let forecast = forecast.ok();
    let unit = match trainer.loss_kind() {
        LossKind::Token => "tokens/s",
        LossKind::Sample => "samples/s",
    };
    let started = Instant::now();
    let (mut train_rss_max, mut side_work_done) = (0u64, false);
    // The kernel's peak mark from here on is the training steps' (until side work).
    let peak_mark = stoker_data::measure::reset_peak_rss();
    let mut train_heap_peak = None;
    if let Some(h) = opts.heap {
        h.reset_peak();
    }
    let (mut wait, mut window_wait, mut window_t0) =
        (Duration::ZERO, Duration::ZERO, Instant::now());
    // Evaluation and checkpoint time, kept out of the training throughput (in total and in
    // the current logging interval) and reported on their own.
    let (mut eval_time, mut ckpt_time, mut window_side) =
        (Duration::ZERO, Duration::ZERO, Duration::ZERO);
    let (mut interval_count, mut total_count) = (0usize, 0usize);
    let (mut comm_wait, mut bytes_sent, mut step_time, mut steps_run) =
        (Duration::ZERO, 0u64, Duration::ZERO, 0u32);
    let (mut step_times, mut comm_waits) = (Vec::new(), Vec::new());
    let mut last_loss = f64::NAN;
    let mut last_eval = None;
    let k = dims.accumulation_steps;
    let mut window = Vec::with_capacity(k);
    let mut state = trainer.sampler_state();
    let mut preempted = false;
    'outer: while trainer.step() < total {
        let mut it = loader.resume(state);
        while let Some(batch) = it.next() {
            let batch = batch?;
            wait += batch.wait();
            window_wait += batch.wait();
            window.push(to_micro_batch(
                &batch,
                &data.input,
                &data.target,
                trainer.device(),
            )?);
            drop(batch);
            if window.len() < k {
                continue;
            }
            let t_step = Instant::now();
            let r = trainer.train_step(&window)?;
            let this_step = t_step.elapsed();
            step_time += this_step;
            step_times.push(this_step.as_secs_f64());
            comm_waits.push(r.sync.exposed_wait.as_secs_f64());
            steps_run += 1;
            comm_wait += r.sync.exposed_wait;
            bytes_sent += r.sync.bytes_sent;
            window.clear();
            trainer.set_sampler_state(it.state());
            last_loss = r.loss;
            interval_count += r.count;
            total_count += r.count;
            let step = trainer.step();
            // The resident set where a record logs it.
            let logged = step % config.train.log_every == 0 || step == total;
            let rss = logged.then(stoker_data::measure::rss_bytes);
            if let (Some(why), true) = (&r.skipped, lead) {
                tracing::warn!("step {step}: skipped (fp16 overflow): {why}");
            }
            if logged {
                let dt = window_t0
                    .elapsed()
                    .saturating_sub(window_side)
                    .as_secs_f64();
                let rec = Record::Train {
                    step,
                    loss: r.loss,
                    lr: r.lr,
                    grad_norm: r.grad_norm,
                    loss_scale: r.loss_scale,
                    throughput: interval_count as f64 / dt,
                    unit: unit.into(),
                    loader_wait_pct: 100.0 * window_wait.as_secs_f64() / dt,
                    skipped: r.skipped.is_some(),
                    elapsed_s: started.elapsed().as_secs_f64(),
                    world: dims.world,
                    comm_wait_s: r.sync.exposed_wait.as_secs_f64(),
                    bytes_sent: r.sync.bytes_sent,
                    calls_before_last: r.sync.calls_before_last,
                    step_s: this_step.as_secs_f64(),
                    rss_bytes: rss.unwrap_or(0),
                };
                if let Some(log) = &mut log {
                    log.write(&rec)?;
                }
                bar.set_message(format!(
                    "loss {:.4} | {:.0} {unit} | wait {:.1}% | scale {} | lr {:.2e}",
                    r.loss,
                    interval_count as f64 / dt,
                    100.0 * window_wait.as_secs_f64() / dt,
                    r.loss_scale,
                    r.lr
                ));
                (interval_count, window_wait, window_t0, window_side) =
                    (0, Duration::ZERO, Instant::now(), Duration::ZERO);
            }
            bar.set_position(step);
            // Preemption: every rank stops after this step if any rank was signalled.
            if let Some(flag) = &opts.stop {
                let here = flag.load(std::sync::atomic::Ordering::SeqCst);
                preempted = stoker_comm::CommExt::sum(&*comm, here as u64)? > 0 && step < total;
            }
            let every = |n: u64| n > 0 && step % n == 0;
            // Training steps' memory, until the first evaluation or checkpoint (whose pages
            // stay after): the heap's peak, and the resident set's (the kernel's peak mark
            // where it was reset, else the largest resident set read after a step).
            if !side_work_done {
                train_heap_peak = opts.heap.map(|h| h.peak());
                let resident = match peak_mark {
                    true => stoker_data::measure::peak_rss_bytes(),
                    false => stoker_data::measure::rss_bytes(),
                };
                train_rss_max = train_rss_max.max(resident);
            }
            if every(config.train.eval_every) || step == config.train.steps {
                side_work_done = true;
                let t_eval = Instant::now();
                let e = evaluate(&mut trainer, &data, config, &dims)?;
                eval_time += t_eval.elapsed();
                window_side += t_eval.elapsed();
                if let Some(log) = &mut log {
                    log.write(&Record::Eval {
                        step,
                        loss: e.loss,
                        accuracy: e.accuracy,
                    })?;
                }
                bar.println(format!(
                    "step {step}: eval loss {:.4}, accuracy {:.2}%",
                    e.loss,
                    100.0 * e.accuracy
                ));
                last_eval = Some(e);
            }
            if every(config.train.checkpoint_every) || step == total || preempted {
                side_work_done = true;
                let t_save = Instant::now();
                same_weights_everywhere(&*comm, &trainer, step)?;
                let pos =
                    DataPosition::of(trainer.sampler_state(), dims.global_batch, dims.world, k);
                checkpoint::save(
                    &trainer,
                    &*comm,
                    &ckpt_root,
                    config.seed,
                    pos,
                    opts.save_fault,
                )?;
                ckpt_time += t_save.elapsed();
                window_side += t_save.elapsed();
            }
            if step >= total || preempted {
                break 'outer;
            }
        }
        state = SamplerState {
            epoch: it.state().epoch + 1,
            batches_done: 0,
        };
    }
    bar.finish();
    let elapsed = started.elapsed().as_secs_f64();
    let training_s = (elapsed - eval_time.as_secs_f64() - ckpt_time.as_secs_f64()).max(1e-9);
    let held = trainer.held_bytes();
    // Under ZeRO-3 sampling gathers each unit as it runs: every rank takes part.
    let sample = match (&vocab, config.train.sample_tokens) {
        (Some(v), n) if n > 0 && (lead || trainer.shards_params()) => {
            let toks = trainer.sample(&[0], n, context, config.seed)?;
            let ids: Vec<u32> = toks.iter().map(|&t| t as u32).collect();
            lead.then(|| v.decode(&ids))
        }
        _ => None,
    };
    let weights_crc32 = weights_crc32(&*comm, &trainer)?;
    // The process's peak over the whole run: training, evaluation, checkpoints, sampling.
    let peak_rss_bytes = stoker_data::measure::peak_rss_bytes();
    let step_s = step_time.as_secs_f64() / steps_run.max(1) as f64;
    if let (Some(log), Some(f)) = (&mut log, &forecast) {
        log.write(&Record::Forecast {
            step: trainer.step(),
            forecast: f.clone(),
            peak_rss_bytes,
            train_rss_bytes: train_rss_max,
            train_heap_bytes: train_heap_peak,
            step_s,
            loader_wait_pct: 100.0 * wait.as_secs_f64() / training_s,
        })?;
    }
    if let Some(log) = &mut log {
        log.write(&Record::States {
            step: trainer.step(),
            strategy: trainer.strategy().name().into(),
            world: dims.world,
            planned,
            held,
            bytes_sent_per_step: bytes_sent as f64 / steps_run.max(1) as f64,
        })?;
    }
    if preempted && lead {
        tracing::warn!("stopped by a signal after step {}", trainer.step());
    }
    Ok(RunSummary {
        steps: trainer.step(),
        preempted,
        last_loss,
        eval: last_eval,
        loader_wait_pct: 100.0 * wait.as_secs_f64() / training_s,
        throughput: total_count as f64 / training_s,
        eval_s: eval_time.as_secs_f64(),
        checkpoint_s: ckpt_time.as_secs_f64(),
        sample,
        params,
        dims,
        comm_wait_s: comm_wait.as_secs_f64() / steps_run.max(1) as f64,
        bytes_per_step: bytes_sent as f64 / steps_run.max(1) as f64,
        step_s,
        step_times_s: step_times,
        comm_waits_s: comm_waits,
        weights_crc32,
        strategy: trainer.strategy().name().into(),
        planned,
        held,
        forecast,
        peak_rss_bytes,
        train_rss_bytes: train_rss_max,
        train_heap_bytes: train_heap_peak,
        activation_bytes: trainer.activation_bytes(),
    })
}

/// The heap one micro-batch's step allocates beyond the buffers the trainer tells
/// (candle's activations, gradient store and casts on the graph path; the direct step's
/// activation buffers and its kernels' scratch: gemm's per-thread packing slabs and
/// per-call packs), counted: the train set's first micro-batch runs once before training
/// under the binary's heap counter, its gradients thrown away
/// ([`Trainer::scratch_micro_batch`]: no state changes, no collective). None in fp8 (where
/// the scratch step cannot run), without a heap counter, and with ranks as threads of one
/// process (one counter for all of them).
pub(crate) fn step_scratch_heap(
    trainer: &mut Trainer,
    data: &Datasets,
    micro: usize,
    heap: Option<&dyn HeapCount>,
    threads: bool,
) -> Result<Option<usize>> {
    let Some(h) = heap.filter(|_| !threads) else {
        return Ok(None);
    };
    let sampler = Sampler::new(data.train.len(), SamplerConfig::default())?;
    let lc = LoaderConfig {
        batch_size: micro,
        drop_last: true,
        ..Default::default()
    };
    let mut loader = Loader::new(data.train.clone(), sampler, lc)?;
    let first = loader.epoch(0).next().ok_or_else(|| TrainError::Data {
        what: "data.train".into(),
        message: format!("no micro-batch of {micro} samples in the training set"),
    })??;
    let mb = to_micro_batch(&first, &data.input, &data.target, trainer.device())?;
    drop((first, loader));
    h.reset_peak();
    let before = h.live();
    let told = trainer.scratch_micro_batch(&mb)?;
    let step = h.peak().saturating_sub(before) as usize;
    // The strategy's told workspace is counted with its buffers already.
    Ok(told.map(|t| step.saturating_sub(t)))
}

/// Bytes of the direct step's activation buffers for this run's micro-batch, with its
/// bf16 GEMMs' packing buffers (GPT on the direct step; None on the graph path, whose
/// candle tensors the trainer does not count).
pub fn direct_activation_bytes(config: &TrainConfig, dims: &ParallelDims) -> Option<usize> {
    match &config.model {
        ModelConfig::Gpt(g) if config.direct_step() => {
            let rows = dims.micro_batch * g.context;
            let packs = match config.direct_bf16_operands() {
                true => stoker_kernels::gemm_pack_bytes(rows, g.dims()),
                false => 0,
            };
            Some(4 * stoker_kernels::activation_floats(rows, g.dims()) + packs)
        }
        _ => None,
    }
}

/// The planner's forecast in one line (the run's start; its end adds what it measured).
pub fn forecast_line(f: &crate::planned::RunForecast) -> String {
    let mib = |b: f64| b / (1 << 20) as f64;
    let time = match (f.step_s, f.required_samples_per_s) {
        (Some(t), Some(need)) => format!("step {:.1} ms, loader need {need:.0} samples/s", t * 1e3),
        _ => format!("no step time ({})", f.why_no_step_time()),
    };
    format!(
        "planner forecast per rank ({}): peak memory {:.1} MiB (activations {:.1} MiB, kernel \
         scratch {:.1} MiB, mapped data files {:.1} MiB), {time}",
        f.basis(),
        mib(f.peak_bytes),
        mib(f.activation_bytes),
        mib(f.workspace_bytes),
        mib(f.mapped_bytes),
    )
}

/// Fails on every rank unless all ranks hold the same weights (a CRC-32 of the FP32
/// master buffer each): data parallelism trusts the reduction to give every rank the same
/// bits, and a checkpoint written by rank 0 stands for all of them.
fn same_weights_everywhere(comm: &dyn Communicator, trainer: &Trainer, step: u64) -> Result<()> {
    let n = comm.world_size();
    if n == 1 || trainer.shards_params() {
        // ZeRO-3's ranks hold different shards by design; each writes its own.
        return Ok(());
    }
    let mine = crc32fast::hash(bytemuck::cast_slice(trainer.master())) as u64;
    let mut all = vec![0u64; n];
    stoker_comm::CommExt::all_gather(comm, &[mine], &vec![1; n], &mut all)?;
    if all.iter().any(|&c| c != all[0]) {
        return Err(TrainError::Mismatch(format!(
            "after step {step} the ranks' weights differ (CRC-32 by rank: {:?}): the gradient reductions gave ranks different bits",
            all.iter().map(|c| format!("{c:08x}")).collect::<Vec<_>>()
        )));
    }
    Ok(())
}

/// CRC-32 of the whole FP32 master's bytes, the same at every world size and strategy.
/// Under ZeRO-3 each rank hashes each of its pieces and the pieces' CRCs are combined in
/// buffer order, so no rank gathers the whole buffer for it (4 bytes per parameter on
/// its peak).
fn weights_crc32(comm: &dyn Communicator, trainer: &Trainer) -> Result<u32> {
    if !trainer.shards_params() {
        return Ok(crc32fast::hash(bytemuck::cast_slice(trainer.master())));
    }
    // [start, crc, bytes] of each piece.
    let mine: Vec<u64> = trainer
        .held()
        .with_starts()
        .flat_map(|(r, at)| {
            let values = &trainer.master()[at..at + r.len()];
            [
                r.start as u64,
                crc32fast::hash(bytemuck::cast_slice(values)) as u64,
                4 * r.len() as u64,
            ]
        })
        .collect();
    let all = stoker_comm::CommExt::all_gather_varying(comm, &mine)?;
    let mut parts: Vec<&[u64]> = all.iter().flat_map(|p| p.chunks(3)).collect();
    parts.sort_by_key(|p| p[0]);
    Ok(combine_crcs(parts.iter().map(|p| (p[1] as u32, p[2]))))
}

/// The CRC-32 of consecutive byte ranges' concatenation from each range's CRC-32 and
/// length, in order.
pub fn combine_crcs(parts: impl IntoIterator<Item = (u32, u64)>) -> u32 {
    let mut whole = crc32fast::Hasher::new();
    for (crc, len) in parts {
        whole.combine(&crc32fast::Hasher::new_with_initial_len(crc, len));
    }
    whole.finalize()
}

/// The first `train.eval_batches` evaluation batches, shared round-robin among the ranks,
/// summed over them: the same numbers at every world size.
fn evaluate(
    trainer: &mut Trainer,
    data: &Datasets,
    config: &TrainConfig,
    dims: &ParallelDims,
) -> Result<EvalReport> {
    // Whole micro-batches only (when there is one): evaluation then runs on the training
    // step's buffers as they are, with no second batch shape to allocate (nanoGPT too
    // evaluates fixed-size batches).
    let whole = data.eval.len() >= config.batch.micro_batch;
    let sampler = Sampler::new(
        data.eval.len(),
        SamplerConfig {
            drop_last: whole,
            ..SamplerConfig::default()
        },
    )?;
    let lc = LoaderConfig {
        batch_size: config.batch.micro_batch,
        drop_last: whole,
        ..Default::default()
    };
    let mut loader = Loader::new(data.eval.clone(), sampler, lc)?;
    let mut batches = Vec::new();
    let wanted = config.train.eval_batches.max(1);
    let mut first = None;
    for (i, b) in loader.epoch(0).take(wanted).enumerate() {
        let b = b?;
        let dev = trainer.device();
        if i % dims.world == dims.rank {
            batches.push(to_micro_batch(&b, &data.input, &data.target, dev)?);
        } else if i == 0 {
            first = Some(to_micro_batch(&b, &data.input, &data.target, dev)?);
        }
    }
    // Fewer batches than ranks: under ZeRO-3 (a collective forward per batch) a rank
    // without one still joins, counting nothing; the trainer pads the other shortfalls.
    if let (true, Some(b)) = (batches.is_empty(), first) {
        batches.push(b.masked());
    }
    trainer.evaluate(&batches)
}

/// Why `config`'s precision runs far slower here than fp32, where it does: bf16 on a CPU
/// without bf16 hardware (no AMX, no AVX512-BF16) runs candle's graph on emulated bf16
/// (the ZeRO demo's GPT on an AVX2 Zen 2: 2,254 ms a step in bf16, 453 in fp32).
pub fn slow_precision(config: &TrainConfig) -> Option<String> {
    let cpu = !crate::device::TrainDevice::parse(&config.device)
        .map(|d| d.is_cuda())
        .unwrap_or(false);
    let emulated =
        config.precision == crate::precision::Precision::Bf16 && !config.kernels.bf16_on_hardware();
    (cpu && emulated).then(|| {
        "precision = \"bf16\" on a CPU without bf16 hardware (no AMX or AVX512-BF16): \
         candle emulates bf16 on its graph path, about 5x slower than fp32 here; \
         precision = \"fp32\" trains faster on this CPU"
            .to_string()
    })
}

/// The vocabulary `data.vocab` names (what `stoker pack` wrote beside the shard: the
/// characters, or GPT-2's BPE), checked against the model's vocabulary size.
fn load_vocab(config: &TrainConfig) -> Result<Option<Vocab>> {
    let Some(path) = &config.data.vocab else {
        return Ok(None);
    };
    let vocab = Vocab::load(path)?;
    if let ModelConfig::Gpt(g) = &config.model {
        if vocab.size() > g.vocab {
            return Err(crate::error::config_err(
                "model.vocab",
                format!(
                    "{} < {} tokens in {} (data.vocab)",
                    g.vocab,
                    vocab.size(),
                    path.display()
                ),
            ));
        }
    }
    Ok(Some(vocab))
}

fn progress_bar(show: bool, total: u64, start: u64) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total).with_position(start);
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
        )
        .expect("valid template"),
    );
    bar
}

#[cfg(test)]
mod tests {
    use super::combine_crcs;

    #[test]
    fn combined_crcs_of_consecutive_parts_are_the_whole_s_crc() {
        let bytes: Vec<u8> = (0..10_007u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        let whole = crc32fast::hash(&bytes);
        for cuts in [
            vec![],
            vec![0],
            vec![1],
            vec![4000],
            vec![3, 3, 9000],
            vec![10_007],
        ] {
            let mut parts = Vec::new();
            let mut at = 0;
            for &c in cuts.iter().chain([&bytes.len()]) {
                parts.push((crc32fast::hash(&bytes[at..c]), (c - at) as u64));
                at = c;
            }
            assert_eq!(combine_crcs(parts), whole, "cuts {cuts:?}");
        }
    }
}
