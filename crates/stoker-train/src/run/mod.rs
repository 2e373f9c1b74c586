//! A training run: one rank of a data-parallel run ([`run_rank`]), one rank alone
//! ([`run`]), or a world of ranks as threads of this process ([`run_threads`]). A rank's
//! run reads as a story: set up (`setup.rs`: model, strategy, data, resume), measure what
//! it will hold and print the plan (`telemetry.rs`), train (`train_loop.rs`: windows,
//! steps, logging, evaluation and checkpoints when due), and finish (the sample, the
//! weights' CRC, planned against measured).
//!
//! Every rank reads its share of each global batch (the world-size-independent sampler:
//! global batch `k` holds the same samples at any world size), evaluates its share of
//! the evaluation batches (`evaluate.rs`), and rank 0 alone writes the run directory:
//! config, metrics, checkpoints (with every rank's loader position) and the sample.

mod checks;
mod evaluate;
mod run_dir_lock;
mod setup;
mod telemetry;
mod train_loop;

use std::path::PathBuf;
use std::rc::Rc;
use std::time::Instant;

use stoker_comm::Communicator;
use stoker_data::{Dataset, Loader, Partition, Sampler, SamplerConfig};

use crate::checkpoint;
use crate::config::TrainConfig;
use crate::error::{Result, TrainError};
use crate::heap::HeapCount;
use crate::memory::HeldBytes;
use crate::metrics::Record;
use crate::models::LossKind;
use crate::parallel::{agree, ParallelDims};
use crate::trainer::EvalReport;
use stoker_plan::trainer::TrainerPrediction;

pub use checks::combine_crcs;
pub use telemetry::{
    direct_activation_bytes, forecast_line, predicted_activation_bytes, resident_host_bytes,
};
pub(crate) use telemetry::{step_scratch_heap, StartProbes};

use setup::Rank;
use telemetry::{StepCount, Telemetry};
use train_loop::{LoopContext, LoopStats};

/// Which checkpoint a run resumes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resume {
    /// This checkpoint directory (`--resume DIR`).
    From(PathBuf),
    /// The newest intact checkpoint under this `checkpoints/` folder (`--resume latest`):
    /// the ranks split its verification ([`checkpoint::latest_intact_on`]) and pass over
    /// a corrupt one together; none there yet starts from step 0.
    Latest(PathBuf),
}

/// How to run (beyond the config).
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Resume from a checkpoint.
    pub resume: Option<Resume>,
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
    /// Raises [`RunOptions::stop`] once an evaluation has run this many batches (tests of
    /// a signal during an evaluation, which the ranks agree on between chunks of batches).
    pub stop_in_eval: Option<usize>,
    /// The process allocator's count of live heap bytes, where the binary has one: the
    /// run reports the peak of its training steps beside the forecast.
    pub heap: Option<&'static dyn HeapCount>,
    /// This machine's profile (`stoker plan --calibrate`'s figures), which the run's
    /// forecast uses where the config gives none of its own (profile::MachineProfile::apply).
    pub profile: Option<crate::machine::profile::MachineProfile>,
}

/// What a run ended with.
#[derive(Debug, Clone)]
pub struct RunSummary {
    /// Steps taken, the resumed checkpoint's included.
    pub steps: u64,
    /// The run stopped early on [`RunOptions::stop`], after writing a checkpoint.
    pub preempted: bool,
    /// Last training loss.
    pub last_loss: f64,
    /// The last evaluation.
    pub eval: Option<EvalReport>,
    /// The step [`RunSummary::eval`] was made after: a run stopped by a signal ends
    /// after a later step.
    pub eval_step: Option<u64>,
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
    /// Bytes of the direct step's activation buffers at the end, counted from them (on
    /// the resident path: its steps' buffers, on the loop's backend).
    pub activation_bytes: usize,
    /// On the resident path, its loop's memory on its backend (rank 0's).
    pub resident: Option<ResidentMemory>,
}

impl RunSummary {
    /// Steps this run took (one time each in [`RunSummary::step_times_s`]): 0 where it
    /// resumed a checkpoint already at `train.steps` (a finished job resubmitted), which
    /// leaves nothing to train.
    pub fn steps_run(&self) -> usize {
        self.step_times_s.len()
    }
}

/// The resident loop's memory on its backend: planned before it existed
/// ([`crate::trainer::planned_resident_bytes`]: the optimizer's state and one training
/// step), counted from its buffers at the run's end (the steps kept for other batch
/// shapes included), and on a GPU taken from the device as its driver reports it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ResidentMemory {
    /// Planned.
    pub planned: Option<crate::models::resident_run::ResidentBytes>,
    /// Counted from the buffers.
    pub counted: crate::models::resident_run::ResidentBytes,
    /// Measured by the GPU's driver (None on the host build).
    pub measured: Option<usize>,
}

/// Trains as `config` says on one rank (no launcher).
pub fn run(config: &TrainConfig, opts: &RunOptions) -> Result<RunSummary> {
    let comm = stoker_comm::local_group(1, stoker_comm::DEFAULT_TIMEOUT).remove(0);
    run_rank(config, opts, Rc::new(comm), "this process")
}

/// Runs `batch.world_size` ranks as threads of this process (`parallel.backend =
/// "local"`), each with a compute pool of `RAYON_NUM_THREADS` threads where set, else
/// `parallel.threads_per_rank` (0: this machine's cores divided by the ranks); results in
/// rank order. A rank that fails ends
/// the others (they see it gone at their next collective).
pub fn run_threads(config: &TrainConfig, opts: &RunOptions) -> Result<Vec<Result<RunSummary>>> {
    let world = config.batch.world_size.ok_or_else(|| {
        crate::error::config_err(
            "batch.world_size",
            "parallel.backend = \"local\" runs this many ranks as threads: give it",
        )
    })?;
    let threads = crate::machine::rank_threads(config, world);
    let timeout = stoker_comm::communicator::timeout_from_secs(
        config.parallel.timeout_s,
        stoker_comm::DEFAULT_TIMEOUT,
    );
    Ok(stoker_comm::run_local(world, timeout, |comm| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(move |i| format!("rank-compute-{i}"))
            .build()
            .map_err(|e| TrainError::Setup(format!("building a compute pool: {e}")))?;
        pool.install(|| run_rank(config, opts, Rc::new(comm), "parallel.backend = \"local\""))
    }))
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
    let probes = StartProbes::now(opts.heap);
    agree::check_same_config(&*comm, config)?;
    let comm: Rc<dyn Communicator> = match config.parallel.check_collectives {
        true => Rc::new(stoker_comm::Checked::new(comm)),
        false => comm,
    };
    let mut rank = Rank::set_up(config, opts, &comm, launcher)?;
    let count = StepCount::measure(config, opts, &comm, &mut rank, probes)?;
    let mut loader = training_loader(config, &rank)?;
    let total = opts
        .stop_after
        .unwrap_or(config.train.steps)
        .min(config.train.steps);
    let bar = telemetry::progress_bar(opts.progress && rank.lead, total, rank.trainer.step());
    let mut telemetry = Telemetry::start(config, opts, &rank, count, loader.steady_bytes(), &bar);
    let ctx = LoopContext {
        config,
        opts,
        comm: &comm,
        bar: &bar,
        total,
        unit: match rank.trainer.loss_kind() {
            LossKind::Token => "tokens/s",
            LossKind::Sample => "samples/s",
        },
        started: Instant::now(),
    };
    let stats = train_loop::train(&ctx, &mut rank, &mut loader, &mut telemetry)?;
    finish(&ctx, rank, stats, telemetry)
}

/// This rank's loader of its share of every global batch.
fn training_loader(
    config: &TrainConfig,
    rank: &Rank,
) -> Result<Loader<crate::data::Subset<stoker_data::AnyDataset>>> {
    let (d, dims) = (&config.data, &rank.dims);
    let sampler = Sampler::new(
        rank.data.train.len(),
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
    Ok(Loader::new(
        rank.data.train.clone(),
        sampler,
        d.train_loader(dims.micro_batch),
    )?)
}

/// The run's end: the text sample (under ZeRO-3 every rank takes part), the weights'
/// CRC-32, the forecast and the model states planned against measured in rank 0's
/// metrics, and the summary.
fn finish(
    ctx: &LoopContext<'_>,
    mut rank: Rank,
    stats: LoopStats,
    telemetry: Telemetry,
) -> Result<RunSummary> {
    let (config, trainer) = (ctx.config, &mut rank.trainer);
    let elapsed = ctx.started.elapsed().as_secs_f64();
    let training_s =
        (elapsed - stats.eval_time.as_secs_f64() - stats.ckpt_time.as_secs_f64()).max(1e-9);
    let held = trainer.held_bytes();
    // Every rank (under ZeRO-1 on the resident path a collective), before rank 0 alone
    // samples.
    trainer.sync_host()?;
    let sample = match (&rank.data.vocab, config.train.sample_tokens) {
        (Some(v), n) if n > 0 && (rank.lead || trainer.shards_params()) => {
            let context = config.model.context().unwrap_or(0);
            let toks = trainer.sample(&[0], n, context, config.seed, Some(v.size()))?;
            let ids: Vec<u32> = toks.iter().map(|&t| t as u32).collect();
            rank.lead.then(|| v.decode(&ids))
        }
        _ => None,
    };
    let weights_crc32 = checks::weights_crc32(&**ctx.comm, trainer)?;
    // The process's peak over the whole run: training, evaluation, checkpoints, sampling.
    let peak_rss_bytes = stoker_data::measure::peak_rss_bytes();
    let step_s = stats.per_step(stats.step_time.as_secs_f64());
    let loader_wait_pct = 100.0 * stats.wait.as_secs_f64() / training_s;
    let bytes_per_step = stats.per_step(stats.bytes_sent as f64);
    // A run that took no step (a finished one resumed) measured nothing to record.
    if let (Some(log), true) = (&mut rank.log, stats.steps_run > 0) {
        if let Some(f) = &telemetry.forecast {
            log.write(&Record::Forecast {
                step: trainer.step(),
                forecast: f.clone(),
                peak_rss_bytes,
                train_rss_bytes: telemetry.train_rss_max,
                train_heap_bytes: telemetry.train_heap_peak,
                step_s,
                loader_wait_pct,
            })?;
        }
        log.write(&Record::States {
            step: trainer.step(),
            strategy: trainer.strategy().name().into(),
            world: rank.dims.world,
            planned: telemetry.planned,
            held,
            bytes_sent_per_step: bytes_per_step,
        })?;
    }
    if stats.preempted && rank.lead {
        tracing::warn!("stopped by a signal after step {}", trainer.step());
    }
    Ok(RunSummary {
        steps: trainer.step(),
        preempted: stats.preempted,
        last_loss: stats.last_loss,
        eval: stats.last_eval.map(|(_, e)| e),
        eval_step: stats.last_eval.map(|(step, _)| step),
        loader_wait_pct,
        throughput: stats.total_count as f64 / training_s,
        eval_s: stats.eval_time.as_secs_f64(),
        checkpoint_s: stats.ckpt_time.as_secs_f64(),
        sample,
        params: trainer.layout().numel(),
        dims: rank.dims,
        comm_wait_s: stats.per_step(stats.comm_wait.as_secs_f64()),
        bytes_per_step,
        step_s,
        step_times_s: stats.step_times,
        comm_waits_s: stats.comm_waits,
        weights_crc32,
        strategy: trainer.strategy().name().into(),
        planned: telemetry.planned,
        held,
        forecast: telemetry.forecast,
        peak_rss_bytes,
        train_rss_bytes: telemetry.train_rss_max,
        train_heap_bytes: telemetry.train_heap_peak,
        activation_bytes: trainer.activation_bytes(),
        resident: trainer
            .resident_bytes()
            .map(|(counted, measured)| ResidentMemory {
                planned: crate::trainer::planned_resident_bytes(
                    config,
                    trainer.layout().total_len(),
                    (rank.dims.rank, rank.dims.world),
                ),
                counted,
                measured,
            }),
    })
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
    // Two causes: `kernels = "composed"` (candle's own ops, whatever the CPU), or a CPU
    // without bf16 instructions.
    (cpu && emulated).then(|| match stoker_kernels::bf16_native() {
        true => "precision = \"bf16\" with kernels = \"composed\": candle's composed ops \
                 emulate bf16, about 5x slower than fp32, although this CPU has bf16 \
                 instructions; kernels = \"fused\" or the handwritten step runs bf16 on them"
            .to_string(),
        false => "precision = \"bf16\" on a CPU without bf16 instructions (no AMX or \
                  AVX512-BF16): candle emulates bf16 on its graph path, several times slower \
                  than fp32 here; precision = \"fp32\" trains faster on this CPU (`stoker plan \
                  --precision auto` picks it)"
            .to_string(),
    })
}
