//! What a run measures of itself and holds against the plan: the process before the run
//! allocated anything ([`StartProbes`]), one scratch micro-batch under the heap count, the
//! planner's forecast built from the trainer's own count of its buffers and printed at
//! the start, and the training steps' memory until the first evaluation or checkpoint
//! ([`Telemetry`]), which the run's end writes beside the forecast.

use std::rc::Rc;

use indicatif::{ProgressBar, ProgressStyle};
use stoker_comm::Communicator;
use stoker_data::{Dataset, Loader, LoaderConfig, Sampler, SamplerConfig};

use crate::config::TrainConfig;
use crate::data::{to_micro_batch, Datasets};
use crate::error::{Result, TrainError};
use crate::heap::HeapCount;
use crate::models::ModelConfig;
use crate::parallel::ParallelDims;
use crate::planned::{OwnBytes, RunForecast};
use crate::trainer::Trainer;
use stoker_plan::trainer::TrainerPrediction;

use super::setup::Rank;
use super::RunOptions;

/// The process before the run allocated anything: code, libraries, the communicator.
pub(crate) struct StartProbes {
    /// Resident bytes.
    pub(crate) rss: u64,
    /// Resident bytes of code.
    pub(crate) code: u64,
    /// Live heap bytes (None without a heap count).
    pub(crate) heap: Option<u64>,
}

impl StartProbes {
    /// Reads them now, with the binary's heap count where it has one. gemm's per-thread
    /// slabs are made first: they belong to the process at start, not to whichever step
    /// first lands a product on a fresh thread (stoker_kernels::gemm_slab).
    pub fn now(heap: Option<&dyn HeapCount>) -> Self {
        stoker_kernels::gemm_slab::prime_gemm_slabs();
        StartProbes {
            rss: stoker_data::measure::rss_bytes(),
            code: stoker_data::measure::code_rss_bytes(),
            heap: heap.map(|h| h.live()),
        }
    }
}

/// The plan a run is held to, and the memory of its training steps.
pub(super) struct Telemetry {
    /// What the planner predicts this rank holds and sends (as `--dry-run` prints it).
    pub planned: TrainerPrediction,
    /// The planner's forecast of peak memory and step time, None where it cannot model
    /// the run.
    pub forecast: Option<RunForecast>,
    heap: Option<&'static dyn HeapCount>,
    /// Whether the kernel's peak mark was reset as training started.
    peak_mark: bool,
    /// An evaluation or checkpoint has run: its pages stay, so later steps' memory is
    /// no longer the training steps' alone.
    side_work_done: bool,
    /// The training steps' resident peak, bytes.
    pub train_rss_max: u64,
    /// The training steps' heap peak, bytes (None without a heap count).
    pub train_heap_peak: Option<u64>,
}

/// What one scratch micro-batch counted, with the process before the run: the forecast's
/// measured part.
pub(super) struct StepCount {
    /// The process before the run, with the code the step made resident, bytes.
    baseline: u64,
    /// Heap bytes live before the run (None without a heap count).
    heap: Option<u64>,
    /// Activation bytes: predicted for the direct step, counted on the graph path.
    activations: Option<usize>,
    /// The kernels' scratch beyond the activations, counted.
    workspace: Option<usize>,
    /// The resident loop's own state on the host build, planned ([`OwnBytes::backend`]).
    backend: usize,
}

impl StepCount {
    /// Counts one scratch micro-batch on `rank`'s trainer, before the loader starts its
    /// workers (whose allocations the count would see).
    pub fn measure(
        config: &TrainConfig,
        opts: &RunOptions,
        comm: &Rc<dyn Communicator>,
        rank: &mut Rank,
        probes: StartProbes,
    ) -> Result<StepCount> {
        let dims = &rank.dims;
        let threads = comm.backend() == "local" && dims.world > 1;
        let scratch = step_scratch_heap(
            &mut rank.trainer,
            &rank.data,
            dims.micro_batch,
            opts.heap,
            threads,
        )?;
        // The code the step runs (candle's ops, the kernels, the collectives' libraries)
        // becomes resident as it first runs, which no allocation counts: measured across
        // the setup and the scratch micro-batch.
        let code_grown = stoker_data::measure::code_rss_bytes().saturating_sub(probes.code);
        // The direct step's activation and packing buffers are predicted; what its scratch run
        // held beyond them is its kernels' workspace. On the graph path it is all candle's.
        let len = rank.trainer.layout().total_len();
        let (activations, workspace) =
            match (predicted_activation_bytes(config, dims, len), scratch) {
                (Some(a), s) => (Some(a), s.map(|s| s.saturating_sub(a))),
                (None, s) => (s, None),
            };
        Ok(StepCount {
            baseline: probes.rss + code_grown,
            heap: probes.heap,
            activations,
            workspace,
            backend: resident_host_bytes(config, dims, len).map_or(0, |b| b.state + b.host),
        })
    }
}

impl Telemetry {
    /// Builds the planner's forecast from the trainer's own count of its buffers, the
    /// scratch micro-batch's `count` and the loader's `loader_bytes`, prints the
    /// accounting, the plan and the forecast (rank 0), and starts the training steps'
    /// memory marks.
    pub fn start(
        config: &TrainConfig,
        opts: &RunOptions,
        rank: &Rank,
        count: StepCount,
        loader_bytes: usize,
        bar: &ProgressBar,
    ) -> Telemetry {
        let dims = &rank.dims;
        let planned = crate::planned::predicted(config, dims, rank.trainer.layout());
        let own = OwnBytes {
            baseline: count.baseline as f64,
            model_states: planned.model_states(),
            // Communication and accumulation buffers, as the trainer sized them.
            buffers: rank.trainer.steady_buffer_bytes(dims.accumulation_steps) as f64,
            activations: count.activations.map(|b| b as f64),
            workspace: count.workspace.map_or(0.0, |b| b as f64),
            backend: count.backend as f64,
            loader: loader_bytes as f64,
            mapped: rank.data.mapped_bytes() as f64,
            baseline_heap: count.heap.map(|b| b as f64),
        };
        // Planned on this machine's profile where it applies (the config is untouched).
        let mut planned_config = config.clone();
        let profile_line = opts.profile.as_ref().map(|p| {
            let threads = rayon::current_num_threads();
            p.line(&p.apply(&mut planned_config, rank.per_host, threads))
        });
        let forecast =
            crate::planned::forecast(&planned_config, dims.world, rank.per_host, Some(&own));
        if rank.lead {
            bar.println(&rank.accounting);
            bar.suspend(|| {
                // Which checkpoint this life goes on from (`--resume latest` picks one).
                if let Some(dir) = &rank.resumed_from {
                    println!(
                        "resumed from {} at step {}",
                        dir.display(),
                        rank.trainer.step()
                    );
                }
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
        // The kernel's peak mark from here on is the training steps' (until side work).
        let peak_mark = stoker_data::measure::reset_peak_rss();
        if let Some(h) = opts.heap {
            h.reset_peak();
        }
        Telemetry {
            planned,
            forecast: forecast.ok(),
            heap: opts.heap,
            peak_mark,
            side_work_done: false,
            train_rss_max: 0,
            train_heap_peak: None,
        }
    }

    /// After a training step: until the first evaluation or checkpoint (whose pages stay
    /// after), the heap's peak and the resident set's (the kernel's peak mark where it was
    /// reset, else the largest resident set read after a step).
    pub fn after_step(&mut self) {
        if self.side_work_done {
            return;
        }
        self.train_heap_peak = self.heap.map(|h| h.peak());
        let resident = match self.peak_mark {
            true => stoker_data::measure::peak_rss_bytes(),
            false => stoker_data::measure::rss_bytes(),
        };
        self.train_rss_max = self.train_rss_max.max(resident);
    }

    /// An evaluation or checkpoint is about to run: the training steps' memory is final.
    pub fn side_work(&mut self) {
        self.side_work_done = true;
    }
}

/// The heap one micro-batch's step allocates beyond the buffers the trainer tells
/// (candle's activations, gradient store and casts on the graph path; the direct step's
/// activation buffers and its kernels' scratch: gemm's per-call packs, its per-thread
/// slabs being made before the start probes), counted: the train set's first micro-batch
/// runs once before training
/// under the binary's heap counter, its gradients thrown away
/// ([`Trainer::scratch_micro_batch`]: no state changes, no collective; in fp8 the scalers
/// put back after it). None without a heap counter, and with ranks as threads of one
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
    let predicted = trainer.scratch_micro_batch(&mb)?;
    let step = h.peak().saturating_sub(before) as usize;
    // The strategy's predicted workspace is counted with its buffers already.
    Ok(predicted.map(|t| step.saturating_sub(t)))
}

/// Bytes of the direct step's activation buffers for this run's micro-batch, with its
/// bf16 GEMMs' packing buffers (the GPT or the Llama on the direct step; None on the graph path, whose
/// candle tensors the trainer does not count).
pub fn direct_activation_bytes(config: &TrainConfig, dims: &ParallelDims) -> Option<usize> {
    if !config.direct_step() {
        return None;
    }
    let rows = dims.micro_batch * config.model.context()?;
    let (floats, packs) = match &config.model {
        ModelConfig::Gpt(g) => (
            stoker_kernels::activation_floats(rows, g.dims()),
            stoker_kernels::gemm_pack_bytes(rows, g.dims()),
        ),
        ModelConfig::Llama(l) => (
            stoker_kernels::llama::activation_floats(rows, l.dims()),
            stoker_kernels::llama::gemm_pack_bytes(rows, l.dims()),
        ),
        ModelConfig::Cnn(_) | ModelConfig::Mlp(_) => return None,
    };
    // The packing buffers are the bf16 GEMM's only.
    let packs = if config.direct_bf16_operands() {
        packs
    } else {
        0
    };
    Some(4 * floats + packs)
}

/// The activation buffers a run's step holds, predicted from the shapes, over a flat
/// layout of `len` elements: on the resident loop of a CPU run its steps' buffers
/// ([`resident_host_bytes`]), else [`direct_activation_bytes`].
pub fn predicted_activation_bytes(
    config: &TrainConfig,
    dims: &ParallelDims,
    len: usize,
) -> Option<usize> {
    match resident_host_bytes(config, dims, len) {
        Some(b) => Some(b.steps),
        None if config.resident_loop() => None,
        None => direct_activation_bytes(config, dims),
    }
}

/// What the resident loop of a CPU run holds on its backend, over a flat layout of `len`
/// elements ([`crate::trainer::planned_resident_bytes`]): on the host build that is this
/// process's heap, its steps' buffers beside its own master, optimizer state and offload
/// buffers (a GPU run's are device memory, which the forecast does not cover yet). None
/// off the resident loop or off the CPU.
pub fn resident_host_bytes(
    config: &TrainConfig,
    dims: &ParallelDims,
    len: usize,
) -> Option<crate::models::resident_run::ResidentBytes> {
    let cpu = matches!(
        crate::device::TrainDevice::parse(&config.device),
        Ok(crate::device::TrainDevice::Cpu)
    );
    match cpu {
        true => crate::trainer::planned_resident_bytes(config, len, (dims.rank, dims.world)),
        false => None,
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

pub(super) fn progress_bar(show: bool, total: u64, start: u64) -> ProgressBar {
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
