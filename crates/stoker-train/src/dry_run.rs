//! `stoker train CONFIG --dry-run`: everything a run checks before its first step, and the
//! plan it will be measured against, without training. The config is validated, the batch
//! resolved for the world size, the model declared (its flat layout counted, no values
//! drawn), the datasets opened and checked against the model, and the per-rank bytes
//! predicted by the same function the run's end compares with its buffers
//! ([`crate::planned::predicted`]).
//!
//! It also answers the decision flow's first question, "will it fit?", with the run's own
//! forecast of peak memory per rank ([`crate::planned::forecast`] over [`OwnBytes`]). The
//! strategy is set up over a communicator that moves no data, so its buffers (buckets,
//! shards, ZeRO-3's gathered groups) are sized as the run sizes them. Where one rank's
//! model states fit in this machine's memory, the dry run then builds that rank's trainer
//! (ZeRO-3 drawing only its own pieces; the other strategies one rank's, whose step holds
//! the same activations) and runs one scratch micro-batch through the binary's heap count,
//! as the run does at its start: activations and kernel scratch are counted, not
//! estimated. A model this machine cannot hold is counted without allocating: the direct
//! step's activations predicted from its shapes, the graph path's from the planner's formula.
//! [`Fit`] holds the ranks of one host against this machine's memory, or against the
//! `[plan.hardware]` the config gives.

use std::rc::Rc;

use crate::config::TrainConfig;
use crate::data::open_datasets;
use crate::error::Result;
use crate::heap::HeapCount;
use crate::layout::FlatLayout;
use crate::models::build_meta_model_on;
use crate::parallel::units::UnitPlan;
use crate::parallel::ParallelDims;
use crate::planned::predicted;
use crate::planned::OwnBytes;
use crate::run::{predicted_activation_bytes, resident_host_bytes, step_scratch_heap, StartProbes};
use crate::trainer::{steady_buffer_bytes, Trainer};
use stoker_data::{Dataset, Loader, Sampler, SamplerConfig};
use stoker_plan::trainer::TrainerPrediction;

/// What a dry run found.
#[derive(Debug, Clone)]
pub struct DryRun {
    /// Batch and parallel degrees at the requested world size.
    pub dims: ParallelDims,
    /// Trainable parameters.
    pub params: usize,
    /// Training samples (windows, images or rows) after the eval split.
    pub train_samples: usize,
    /// Evaluation samples.
    pub eval_samples: usize,
    /// What each rank will hold and send (the run prints the same beside what it counted).
    pub planned: TrainerPrediction,
    /// What one rank will hold, counted as the run counts it at its start (see the module
    /// doc for what a model too large for this machine leaves out).
    pub own: OwnBytes,
    /// Whether a scratch micro-batch counted the activations and kernel scratch, and if
    /// not, why.
    pub scratch: ScratchStep,
    /// The data's warnings, as the run prints them.
    pub data_notes: Vec<String>,
}

/// Whether a dry run's scratch micro-batch ran, and if not, why: what the dry run then
/// leaves uncounted is said with its reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScratchStep {
    /// It ran: the step's activations and kernel scratch are counted.
    Measured,
    /// A rank's model states and the step's activations do not fit in this machine's
    /// memory twice over.
    DoesNotFit,
    /// The resident step: a step changes its backend's state (its buffers are planned
    /// from their shapes instead).
    Resident,
    /// No allocation count to measure with (the binary's counting allocator).
    NoHeapCount,
}

impl ScratchStep {
    /// Why no scratch micro-batch ran, as the dry run prints it (None where one did).
    pub fn why_not(self) -> Option<&'static str> {
        match self {
            ScratchStep::Measured => None,
            ScratchStep::DoesNotFit => Some("a rank's model states do not fit here"),
            ScratchStep::Resident => Some(
                "step = \"resident\": a step would change its backend's state; its buffers \
                 are planned from their shapes",
            ),
            ScratchStep::NoHeapCount => Some("this build counts no allocations"),
        }
    }
}

/// Checks `config` for a run on `world` ranks and predicts its per-rank bytes; with
/// `heap` (the binary's allocation count), measures one scratch micro-batch where a rank's
/// model states fit in `budget` bytes.
pub fn dry_run(
    config: &TrainConfig,
    world: usize,
    heap: Option<&dyn HeapCount>,
    budget: Option<f64>,
) -> Result<DryRun> {
    config.validate()?;
    let dims = ParallelDims::resolve(config, world, 0, "dry run")?;
    // Declared without values: the layout and the data checks need the model's shapes
    // alone, so a dry run of a model no machine can hold costs nothing.
    let (p, k, seed) = (config.precision, config.kernels, config.seed);
    let model = build_meta_model_on(&config.model, p, k, seed, &candle_core::Device::Cpu)?;
    let layout = FlatLayout::of(model.params())?;
    let data = open_datasets(config, &*model)?;
    let planned = predicted(config, &dims, &layout);
    // The strategy as the run sets it up, over a communicator that moves no data.
    let mut strategy = crate::parallel::for_config(config, &layout, null_comm(world)?)?;
    let len = layout.total_len();
    let held = strategy.holds(len);
    let direct = config.direct_step();
    let grad_held = strategy.settle_grads(len, direct)?;
    let units = match (held.is_whole(len), direct) {
        (false, false) => Some(UnitPlan::of(
            &*model,
            &layout,
            config.parallel.reshard_after_forward,
            k.param_dtype(p).size_in_bytes(),
        )?),
        _ => None,
    };
    let buffers = steady_buffer_bytes(
        &*strategy,
        grad_held.len(),
        dims.accumulation_steps,
        units.as_ref(),
        &held,
    );
    let sampler = Sampler::new(data.train.len(), SamplerConfig::default())?;
    let loader = Loader::new(
        data.train.clone(),
        sampler,
        config.data.train_loader(dims.micro_batch),
    )?;
    // As the run measures its start.
    let start = StartProbes::now(None);
    let (baseline, code_at_start) = (start.rss, start.code);
    let predicted = predicted_activation_bytes(config, &dims, len);
    // One scratch micro-batch on the rank's own trainer, where it fits here: its model
    // states with room to spare, and the direct step's activations, known from the
    // shapes (a micro-batch of 8,192 would otherwise allocate 39 GB to find out). Candle's
    // graph keeps more than the planner's formula counts: twice the formula's, where the
    // planner has a row (a GPT-2 124M at 32 x 1,024 the planner fit in 20 GB took this
    // machine's 23 GB and was killed). The room is this machine's, where the scratch runs,
    // whatever `[plan.hardware]` describes.
    let activations = match predicted {
        Some(a) => a as f64,
        None => {
            crate::planned::planner_row(config, world, 1).map_or(0.0, |r| 2.0 * r.activation_bytes)
        }
    };
    let here = stoker_data::measure::memory_limit_bytes().map(|b| b as f64);
    let room = match (budget, here) {
        (Some(b), Some(h)) => Some(b.min(h)),
        (b, h) => b.or(h),
    };
    let fits_here = room.is_some_and(|b| 2.0 * planned.model_states() + activations < b);
    let skipped = match (heap, fits_here) {
        _ if config.resident_step() => Some(ScratchStep::Resident),
        (None, _) => Some(ScratchStep::NoHeapCount),
        (_, false) => Some(ScratchStep::DoesNotFit),
        (Some(_), true) => None,
    };
    let scratch = match (heap, skipped) {
        (Some(h), None) => {
            let trainer = match held.is_whole(len) {
                true => Trainer::new(config),
                false => Trainer::with_strategy(
                    config,
                    model,
                    crate::parallel::for_config(config, &layout, null_comm(world)?)?,
                ),
            };
            step_scratch_heap(&mut trainer?, &data, dims.micro_batch, Some(h), false)?
        }
        _ => None,
    };
    // As the run splits it: the direct step's predicted activations, the rest its kernels'.
    let (activations, workspace) = match (predicted, scratch) {
        (Some(a), s) => (Some(a), s.map_or(0, |s| s.saturating_sub(a))),
        (None, s) => (s, 0),
    };
    // The code the step runs becomes resident as it first runs (as the run counts it).
    let code_grown = stoker_data::measure::code_rss_bytes().saturating_sub(code_at_start);
    let own = OwnBytes {
        baseline: (baseline + code_grown) as f64,
        model_states: planned.model_states(),
        buffers: buffers as f64,
        activations: activations.map(|b| b as f64),
        workspace: workspace as f64,
        backend: resident_host_bytes(config, &dims, len).map_or(0.0, |b| (b.state + b.host) as f64),
        loader: loader.steady_bytes() as f64,
        mapped: data.mapped_bytes() as f64,
        baseline_heap: None,
    };
    Ok(DryRun {
        planned,
        own,
        scratch: match (scratch, skipped) {
            (Some(_), _) => ScratchStep::Measured,
            (None, why) => why.unwrap_or(ScratchStep::DoesNotFit),
        },
        params: layout.numel(),
        train_samples: data.train.len(),
        eval_samples: data.eval.len(),
        data_notes: data.notes.clone(),
        dims,
    })
}

/// Rank 0 of `world` over a communicator that moves no data.
fn null_comm(world: usize) -> Result<Rc<dyn stoker_comm::Communicator>> {
    Ok(Rc::new(stoker_comm::NullComm::new(0, world)?))
}

/// The memory a host's ranks must fit in, and where the figure comes from.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryBudget {
    /// Bytes.
    pub bytes: f64,
    /// `this machine's memory` or `[plan.hardware] (...)`, for the message.
    pub source: String,
}

impl MemoryBudget {
    /// The host memory of `config`'s `[plan.hardware]` where it gives one (a preset or
    /// `host_memory_gib`), else this machine's (its memory, or its cgroup's limit where
    /// lower); None where neither is known.
    pub fn of(config: &TrainConfig) -> Result<Option<MemoryBudget>> {
        let given = config
            .plan
            .as_ref()
            .map(|p| &p.hardware)
            .filter(|h| **h != stoker_plan::input::HardwareInput::default());
        if let Some(h) = given {
            let hw = stoker_plan::resolve::resolve_hardware(h)
                .map_err(|e| crate::error::config_err("plan.hardware", e.to_string()))?;
            if hw.host_memory > 0.0 {
                return Ok(Some(MemoryBudget {
                    bytes: hw.host_memory,
                    source: format!("[plan.hardware] ({} host memory)", hw.name),
                }));
            }
        }
        Ok(
            stoker_data::measure::memory_limit_bytes().map(|b| MemoryBudget {
                bytes: b as f64,
                source: "this machine's memory".into(),
            }),
        )
    }
}

/// Whether the ranks of one host fit in its memory.
#[derive(Debug, Clone, PartialEq)]
pub struct Fit {
    /// Ranks sharing the host.
    pub ranks: usize,
    /// Forecast peak per rank, bytes.
    pub per_rank: f64,
    /// Bytes within `per_rank` that the host's ranks share: the data files they map, one
    /// copy in the page cache however many ranks (processes or threads) map them.
    pub shared: f64,
    /// What they must fit in.
    pub budget: MemoryBudget,
}

impl Fit {
    /// Bytes the host's ranks need together.
    pub fn needed(&self) -> f64 {
        self.per_rank * self.ranks as f64 - self.shared * self.ranks.saturating_sub(1) as f64
    }

    /// Whether they fit.
    pub fn fits(&self) -> bool {
        self.needed() <= self.budget.bytes
    }

    /// `fits: 3 ranks x 52.1 MiB = 156.3 MiB of 23.5 GiB (this machine's memory)`.
    pub fn line(&self) -> String {
        let mib = |b: f64| b / (1u64 << 20) as f64;
        let once = match self.ranks > 1 && self.shared > 0.0 {
            true => format!(
                " less {} x {:.1} MiB of data files mapped once",
                self.ranks - 1,
                mib(self.shared)
            ),
            false => String::new(),
        };
        format!(
            "{}: {} rank(s) on this host x {:.1} MiB{once} = {:.1} MiB of {:.1} MiB ({})",
            if self.fits() { "fits" } else { "does not fit" },
            self.ranks,
            mib(self.per_rank),
            mib(self.needed()),
            mib(self.budget.bytes),
            self.budget.source
        )
    }
}
