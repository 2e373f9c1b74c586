//! The trainer: one model, its flat FP32 master buffer and gradient buffer, the optimizer,
//! the schedule, the loss scaler (fp16), the FP8 scalers (fp8) and the data-parallel
//! strategy; one optimizer step per accumulation window, in the phases of
//! [`crate::parallel`]: micro-batches (local sum, reductions as the strategy wants them),
//! window scalars summed over ranks, normalization by the global target count, unscale
//! and an overflow every rank agrees on, global norm and clipping, the optimizer on the
//! strategy's range, parameters brought up to date.

use candle_core::{Device, Tensor};
use stoker_data::SamplerState;
use stoker_precision::{LossScaler, ScalerConfig, StepDecision};

use crate::accumulate::{micro_batch, Backward, MicroBatch};
use crate::clip::clip_to;
use crate::config::{ModelConfig, OptimizerKind, TrainConfig};
use crate::error::{Result, TrainError};
use crate::grad_sum::{GradSum, SumOrder};
use crate::layout::FlatLayout;
use crate::loss::valid_count;
use crate::models::{Cnn, DirectStep, Gpt, LossKind, Mlp, Model};
use crate::offload::{HostStaging, MasterView};
use crate::optim::{segments, AdamW, Optimizer, Sgd};
use crate::parallel::units::UnitPlan;
use crate::parallel::{Single, Strategy, SyncStats};
use crate::pieces::Pieces;
use crate::precision::{Fp8State, Fx, Kernels, Precision};
use crate::schedule::Schedule;

/// What one optimizer step did.
#[derive(Debug, Clone, PartialEq)]
pub struct StepReport {
    /// The optimizer step just finished (1-based count of steps taken, skipped included).
    pub step: u64,
    /// Mean loss over the valid targets of the global batch (every rank's window).
    pub loss: f64,
    /// Valid targets (tokens or samples) in the global batch.
    pub count: usize,
    /// Global gradient norm after unscaling, before clipping.
    pub grad_norm: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Loss scale used (1 without scaling).
    pub loss_scale: f32,
    /// Why the step was skipped (fp16 overflow), if it was.
    pub skipped: Option<String>,
    /// What the data-parallel strategy did and waited for.
    pub sync: SyncStats,
}

/// Result of an evaluation pass.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvalReport {
    /// Mean loss over valid targets.
    pub loss: f64,
    /// Top-1 accuracy over valid targets.
    pub accuracy: f64,
    /// Valid targets seen.
    pub count: usize,
}

impl EvalReport {
    /// The means of `count` valid targets whose losses sum to `loss_sum`, `correct` of
    /// them predicted top-1.
    fn of(loss_sum: f64, correct: usize, count: usize) -> Self {
        let c = count.max(1) as f64;
        EvalReport {
            loss: loss_sum / c,
            accuracy: correct as f64 / c,
            count,
        }
    }
}

/// Builds the configured model with its variables in `kernels.param_dtype(precision)`,
/// in host memory.
pub fn build_model(
    model: &ModelConfig,
    precision: Precision,
    kernels: Kernels,
    seed: u64,
) -> Result<Box<dyn Model>> {
    build_model_on(model, precision, kernels, seed, &Device::Cpu)
}

/// [`build_model`] with its variables on `dev` (a GPU: the optimizer is offloaded to the
/// host, [`crate::offload`]).
pub fn build_model_on(
    model: &ModelConfig,
    precision: Precision,
    kernels: Kernels,
    seed: u64,
    dev: &Device,
) -> Result<Box<dyn Model>> {
    let dt = kernels.param_dtype(precision);
    Ok(match model {
        ModelConfig::Gpt(c) => Box::new(Gpt::new(c.clone(), dev, dt, seed)?),
        ModelConfig::Cnn(c) => Box::new(Cnn::new(*c, dev, dt, seed)?),
        ModelConfig::Mlp(c) => Box::new(Mlp::new(c.clone(), dev, dt, seed)?),
    })
}

/// The configured model declared without values (every variable an empty placeholder,
/// [`crate::params::ParamBuilder::meta`]) on `dev`: its flat layout, and a ZeRO-3 rank's
/// pieces of its initial values ([`crate::params::ParamSet::init_pieces`]), without the
/// whole model in memory.
pub fn build_meta_model_on(
    model: &ModelConfig,
    precision: Precision,
    kernels: Kernels,
    seed: u64,
    dev: &Device,
) -> Result<Box<dyn Model>> {
    let dt = kernels.param_dtype(precision);
    model_with_builder(
        model,
        crate::params::ParamBuilder::meta(dev.clone(), dt, seed),
    )
}

/// The model `config` describes, its parameters from `b`.
pub(crate) fn model_with_builder(
    model: &ModelConfig,
    b: crate::params::ParamBuilder,
) -> Result<Box<dyn Model>> {
    Ok(match model {
        ModelConfig::Gpt(c) => Box::new(Gpt::with_builder(c.clone(), b)?),
        ModelConfig::Cnn(c) => Box::new(Cnn::with_builder(*c, b)?),
        ModelConfig::Mlp(c) => Box::new(Mlp::with_builder(c.clone(), b)?),
    })
}

/// Bytes of `model`'s candle variables.
pub(crate) fn vars_bytes(model: &dyn Model) -> usize {
    model
        .params()
        .iter()
        .map(|p| p.var.elem_count() * p.var.dtype().size_in_bytes())
        .sum()
}

/// The communication and accumulation buffers a rank holds in steady state for windows of
/// `k` micro-batches, known before the first step: the strategy's (settled, as
/// [`Strategy::settle_grads`] leaves it), the running sum's extra gradient buffers of
/// `grad_len` elements, and ZeRO-3's graph-path units' workspace over this rank's `held`
/// pieces. [`Trainer::steady_buffer_bytes`] adds a GPU model's host staging; a dry run
/// calls it over a strategy on a communicator that moves no data.
pub fn steady_buffer_bytes(
    strategy: &dyn Strategy,
    grad_len: usize,
    k: usize,
    units: Option<&UnitPlan>,
    held: &Pieces,
) -> usize {
    let sums = GradSum::steady_extra_buffers(strategy.sum_order(), k);
    strategy.steady_buffer_bytes() + 4 * grad_len * sums + units.map_or(0, |u| u.peak_bytes(held))
}

/// The training state.
pub struct Trainer {
    /// The model (its variables hold compute-dtype copies of `master`; while the direct
    /// step trains they are refreshed on demand, see [`Trainer::sync_vars`]).
    pub model: Box<dyn Model>,
    /// Whether the model's variables lag `master` (the direct step does not read them).
    vars_stale: std::cell::Cell<bool>,
    /// The model's direct training step, where `kernels = "direct"` gives it one.
    direct: Option<Box<dyn DirectStep>>,
    /// Where the model's tensors live.
    device: Device,
    /// Host buffers for the gradients and parameters of a model on a GPU (the optimizer
    /// offloaded to the host); None on a CPU.
    staging: Option<HostStaging>,
    /// The flat layout of `master` and `grads`.
    pub layout: FlatLayout,
    /// FP32 master weights: the whole flat buffer, or under ZeRO-3 this rank's shard of
    /// it (the pieces [`Trainer::held`], end to end).
    pub master: Vec<f32>,
    grads: Vec<f32>,
    /// The parts of the flat buffer `master` holds.
    held: Pieces,
    /// The parts of the flat buffer `grads` holds: `held`, except where the strategy
    /// reduces the direct step's gradients group by group into this rank's shard.
    grad_held: Pieces,
    /// ZeRO-3: what builds a full model around gathered parameters for a forward (the
    /// graph path's step, evaluation, sampling); the rank's own model is a
    /// [`crate::models::Shell`].
    full_model: Option<ModelConfig>,
    /// ZeRO-3 on the graph path: the model's units, gathered one at a time
    /// ([`crate::parallel::units`]), and the most bytes of that workspace held so far.
    units: Option<UnitPlan>,
    unit_peak: usize,
    /// The optimizer over `master`.
    pub optimizer: Box<dyn Optimizer>,
    /// The learning-rate schedule.
    pub schedule: Schedule,
    /// Dynamic loss scaler (fp16 only).
    pub scaler: Option<LossScaler>,
    /// FP8 delayed scalers (fp8 only).
    pub fp8: Option<Fp8State>,
    precision: Precision,
    kernels: Kernels,
    /// bf16 copy of `master` the optimizer writes in its pass (bf16 precision only).
    bf16_copy: Option<Vec<half::bf16>>,
    grad_clip: f64,
    /// Optimizer steps taken (skipped ones included).
    pub step: u64,
    /// Where the training loader stands after the last step.
    pub sampler_state: SamplerState,
    /// How this rank meets the others.
    strategy: Box<dyn Strategy>,
    /// The running sum of a window's micro-batch gradients.
    sum: GradSum,
}

impl Trainer {
    /// Builds model, buffers, optimizer, schedule and scalers from `config`, for one rank.
    pub fn new(config: &TrainConfig) -> Result<Self> {
        let model = build_model(&config.model, config.precision, config.kernels, config.seed)?;
        Self::with_model(config, model)
    }

    /// As [`Trainer::new`] with an already built model.
    pub fn with_model(config: &TrainConfig, model: Box<dyn Model>) -> Result<Self> {
        let order = match config.parallel.deterministic {
            true => SumOrder::Tree,
            false => SumOrder::InPlace,
        };
        Self::with_strategy(config, model, Box::new(Single::new(order)))
    }

    /// As [`Trainer::with_model`] for one rank of a data-parallel group: `strategy`
    /// starts it from rank 0's parameters (a collective: every rank builds its trainer
    /// at the same point).
    pub fn with_strategy(
        config: &TrainConfig,
        model: Box<dyn Model>,
        mut strategy: Box<dyn Strategy>,
    ) -> Result<Self> {
        let layout = FlatLayout::of(model.params())?;
        let device = match model.params().iter().next() {
            Some(p) => p.var.device().clone(),
            None => Device::Cpu,
        };
        let len = layout.total_len();
        let held = strategy.holds(len);
        let sharded = !held.is_whole(len);
        let meta = model.params().is_meta();
        let mut master = match &config.model {
            ModelConfig::Gpt(g) if g.init_from.is_some() => {
                crate::hf::import(g, &layout, g.init_from.as_deref().expect("checked"))?
            }
            // A model declared without values (ZeRO-3): this rank draws its pieces alone.
            // Every rank draws the same values from the same config (checked alike on
            // every rank), so there is nothing to broadcast.
            _ if meta && sharded => model.params().init_pieces(&layout, &held)?,
            _ if meta => {
                return Err(TrainError::Layout(format!(
                    "a model declared without values needs a strategy that shards the parameters (ZeRO-3), not {}",
                    strategy.name()
                )))
            }
            _ => layout.flatten(model.params())?,
        };
        if master.len() == len {
            strategy.start(&mut master)?;
        }
        if !sharded {
            layout.unflatten(&master, model.params())?;
        }
        let o = &config.optimizer;
        // The optimizer's moments cover the strategy's pieces alone (ZeRO: this rank's shard).
        let (segs, updates) = (segments(&layout, false), strategy.update_range(len));
        let optimizer: Box<dyn Optimizer> = match o.kind {
            OptimizerKind::Adamw => Box::new(AdamW::new(o.adamw(), &segs, updates)),
            OptimizerKind::Sgd => Box::new(Sgd::new(o.sgd(), &segs, updates)),
        };
        let scaler = match config.precision.needs_loss_scaling() {
            true => Some(LossScaler::new(ScalerConfig::torch())?),
            false => None,
        };
        let fp8 = (config.precision == Precision::Fp8).then(|| Fp8State::new(Default::default()));
        let direct = match config.kernels.direct_step(config.precision) {
            true => model.direct_step(&layout, config.direct_bf16_operands())?,
            false => None,
        };
        // ZeRO-3 on the graph path: each micro-batch runs the model unit by unit.
        let units = match (sharded, direct.is_none()) {
            (true, true) => Some(UnitPlan::of(
                &*model,
                &layout,
                config.parallel.reshard_after_forward,
                config.kernels.param_dtype(config.precision).size_in_bytes(),
            )?),
            _ => None,
        };
        // ZeRO-3: keep the shard; the model's full-size variables give way to a shell.
        let (model, full_model): (Box<dyn Model>, _) = match sharded {
            false => (model, None),
            true => {
                if master.len() == len {
                    master = held.take(&master);
                }
                let shell = Box::new(crate::models::Shell::new(config.model.clone()));
                (shell, Some(config.model.clone()))
            }
        };
        let keep = held.len();
        let grad_held = strategy.settle_grads(len, direct.is_some())?;
        // ZeRO-3's units build their own variables from the gathered groups.
        let staging = match (device.is_cpu(), sharded) {
            (false, false) => Some(HostStaging::for_params(model.params(), &layout)?),
            _ => None,
        };
        Ok(Trainer {
            model,
            vars_stale: std::cell::Cell::new(false),
            direct,
            device,
            staging,
            grads: vec![0.0; grad_held.len()],
            held,
            full_model,
            units,
            unit_peak: 0,
            layout,
            master,
            optimizer,
            schedule: config.schedule(),
            scaler,
            fp8,
            precision: config.precision,
            kernels: config.kernels,
            bf16_copy: (config.kernels.param_dtype(config.precision) == candle_core::DType::BF16)
                .then(|| vec![half::bf16::ZERO; keep]),
            grad_clip: o.grad_clip,
            step: 0,
            sampler_state: SamplerState::default(),
            sum: GradSum::new(strategy.sum_order(), grad_held.len()),
            grad_held,
            strategy,
        })
    }

    /// The data-parallel strategy.
    pub fn strategy(&self) -> &dyn Strategy {
        &*self.strategy
    }

    /// The parts of the flat buffer this rank's `master` holds: all of it, except under
    /// ZeRO-3 (its piece of every group).
    pub fn held(&self) -> &Pieces {
        &self.held
    }

    /// The parts of the flat buffer this rank's gradient sum holds: all of it, except
    /// under ZeRO-3 and under ZeRO-2 on the direct step (its shard).
    pub fn grad_held(&self) -> &Pieces {
        &self.grad_held
    }

    /// Whether this rank holds only a shard of the parameters (ZeRO-3).
    pub fn shards_params(&self) -> bool {
        self.full_model.is_some()
    }

    /// The whole FP32 parameter buffer: a copy of `master`, or under ZeRO-3 gathered from
    /// every rank's shard (a collective: every rank calls it).
    pub fn full_master(&mut self) -> Result<Vec<f32>> {
        Ok(match self.strategy.gather_params(&self.master)? {
            Some(full) => full,
            None => self.master.clone(),
        })
    }

    /// What rank `rank` of `world` saves of the FP32 parameters in a checkpoint, and
    /// its values: under ZeRO-3 what it holds (its piece of every group); otherwise (it
    /// holds everything) its range of [`ShardPlan`]'s split, so that every rank writes.
    ///
    /// [`ShardPlan`]: crate::parallel::ShardPlan
    pub fn master_shard(&self, world: usize, rank: usize) -> (Pieces, &[f32]) {
        if self.shards_params() {
            return (self.held.clone(), &self.master);
        }
        let layout = &self.layout;
        let own =
            crate::parallel::ShardPlan::new(layout.total_len(), world, layout.align()).range(rank);
        (Pieces::one(own.clone()), &self.master[own])
    }

    /// Sets the parameters from the whole FP32 buffer `full` (a checkpoint's): this rank
    /// keeps its part and its model's variables follow.
    pub fn set_master(&mut self, full: Vec<f32>) -> Result<()> {
        self.layout.check_len(full.len())?;
        match self.shards_params() {
            true => self.set_held_master(self.held.take(&full)),
            false => self.set_held_master(full),
        }
    }

    /// Sets the parameters this rank holds from `local`, its pieces of the flat buffer end
    /// to end ([`Trainer::held`]: the whole buffer, except under ZeRO-3), and its model's
    /// variables follow.
    pub fn set_held_master(&mut self, local: Vec<f32>) -> Result<()> {
        if local.len() != self.held.len() {
            return Err(TrainError::Layout(format!(
                "{} parameter values for the {} this rank holds",
                local.len(),
                self.held.len()
            )));
        }
        self.master = local;
        if self.shards_params() {
            return Ok(());
        }
        self.layout.unflatten(&self.master, self.model.params())?;
        self.vars_stale.set(false);
        Ok(())
    }

    /// Gradient-sized buffers beyond the gradient buffer that the step holds (the
    /// deterministic tree, per-micro-batch reduction), for the memory accounting.
    pub fn extra_grad_buffers(&self) -> usize {
        self.sum.extra_buffers()
    }

    /// The bytes this rank's trainer holds in model states and communication buffers,
    /// counted from the buffers themselves.
    pub fn held_bytes(&self) -> crate::memory::HeldBytes {
        let vars = vars_bytes(&*self.model);
        crate::memory::HeldBytes {
            params: 4 * self.master.len() + 2 * self.bf16_copy.as_ref().map_or(0, Vec::len) + vars,
            grads: 4 * self.grads.len() + self.strategy.grad_bytes(),
            optimizer: self.optimizer.state_bytes(),
            buffers: self.strategy.buffer_bytes()
                + self.step_buffer_bytes(self.sum.extra_buffers())
                + self.unit_peak
                + self.staging_bytes(),
        }
    }

    /// Sends the gradients and parameters through host staging buffers as a model on a
    /// GPU does ([`crate::offload`]), whatever the device: on a CPU the copies are plain,
    /// so tests hold the offload path's step to the ordinary one bit for bit. Not for the
    /// direct step (no candle gradients) or ZeRO-3 (its units build their own variables).
    pub fn stage_through_host(&mut self) -> Result<()> {
        if self.direct.is_some() || self.shards_params() {
            return Err(TrainError::Layout(
                "host staging serves the graph path of an unsharded model".into(),
            ));
        }
        self.staging = Some(HostStaging::for_params(self.model.params(), &self.layout)?);
        Ok(())
    }

    /// The host staging's upload counts (all, and those made as the optimizer finished
    /// each parameter), where the model is staged: see [`HostStaging::upload_counts`].
    pub fn staging_upload_counts(&self) -> Option<(usize, usize)> {
        self.staging.as_ref().map(HostStaging::upload_counts)
    }

    /// Bytes of the host staging buffers of a model on a GPU (0 on a CPU).
    pub fn staging_bytes(&self) -> usize {
        self.staging.as_ref().map_or(0, HostStaging::bytes)
    }

    /// Where the model's tensors live: micro-batches go there.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The accumulation's buffers: `sum_buffers` gradient-sized ones.
    fn step_buffer_bytes(&self, sum_buffers: usize) -> usize {
        4 * self.grads.len() * sum_buffers
    }

    /// [`HeldBytes::buffers`](crate::memory::HeldBytes) in steady state for windows of
    /// `k` micro-batches, known before the first step (the strategy's buckets and the
    /// accumulation's partial sums are allocated by the first window).
    pub fn steady_buffer_bytes(&self, k: usize) -> usize {
        steady_buffer_bytes(
            &*self.strategy,
            self.grads.len(),
            k,
            self.units.as_ref(),
            &self.held,
        ) + self.staging_bytes()
    }

    /// ZeRO-3 on the graph path: the most bytes its units' gathered groups, gradient buffers
    /// and variables hold at once in a micro-batch, told from the schedule (0 otherwise).
    pub fn unit_workspace_bytes(&self) -> usize {
        self.units.as_ref().map_or(0, |u| u.peak_bytes(&self.held))
    }

    /// Bytes of the direct step's activation buffers now (0 on the graph path, whose
    /// candle tensors live only during a step), counted from them.
    pub fn activation_bytes(&self) -> usize {
        self.direct.as_ref().map_or(0, |d| d.activation_bytes())
    }

    /// The forward context.
    pub fn fx(&self) -> Fx<'_> {
        Fx::new(self.precision, self.fp8.as_ref()).with_kernels(self.kernels)
    }

    /// The precision mode.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// Whether training steps run the model's direct step (no autograd graph).
    pub fn direct(&self) -> bool {
        self.direct.is_some()
    }

    /// Runs micro-batch `mb`'s forward and backward and throws its gradients away,
    /// changing no state (no optimizer step, no loss-scaler call, no collective, the
    /// gradient buffer zeroed after), so that a caller can count what one step allocates.
    /// The direct step runs over the whole buffers or, where the strategy reduces by
    /// group, its schedule over a communicator that moves no data
    /// ([`Strategy::dry_source`]); its activation buffers stay (the step keeps them). The
    /// graph path runs candle's graph (under ZeRO-3 its units on zeros, without
    /// collectives). Returns the bytes of told workspace the run held meanwhile (the
    /// strategy's groups, ZeRO-3's units), which a count must not take twice; None without
    /// running in fp8 (whose forward records amax history).
    pub fn scratch_micro_batch(&mut self, mb: &MicroBatch) -> Result<Option<usize>> {
        if self.fp8.is_some() {
            return Ok(None);
        }
        let fx = Fx::new(self.precision, None).with_kernels(self.kernels);
        let scale = self.scaler.as_ref().map_or(1.0, |s| s.scale()) as f64;
        let factor = (!mb.targets.is_empty()).then(|| scale / mb.targets.len() as f64);
        if let Some(step) = self.direct.as_deref_mut() {
            let f = factor.unwrap_or(0.0) as f32;
            let told = match self.strategy.reduces_by_group() {
                true => {
                    let (mut source, told) = self
                        .strategy
                        .dry_source(&self.master, &mut self.grads)?
                        .ok_or_else(|| {
                            TrainError::Layout(
                                "a strategy reducing by group has no dry source".into(),
                            )
                        })?;
                    step.forward_backward_groups(&mut *source, &mb.input, &mb.targets, f)?;
                    told
                }
                false => {
                    let (master, grads) = (&self.master, &mut self.grads);
                    step.forward_backward(
                        master,
                        &mb.input,
                        &mb.targets,
                        f,
                        grads,
                        &mut |_, _| {},
                    )?;
                    0
                }
            };
            stoker_kernels::flat::zero(&mut self.grads);
            return Ok(Some(told));
        }
        if let (Some(plan), Some(config)) = (&self.units, &self.full_model) {
            let step = crate::parallel::units::UnitStep {
                plan,
                model: config,
                precision: self.precision,
                kernels: self.kernels,
                layout: &self.layout,
                fx: &fx,
                own: &self.held,
                device: &self.device,
            };
            let mut scratch = crate::parallel::units::Scratch::new(&self.held);
            let mut peak = 0;
            crate::parallel::units::micro_batch(&step, &mut scratch, mb, factor, true, &mut peak)?;
            return Ok(Some(self.unit_workspace_bytes()));
        }
        let mut backward = Backward::Graph {
            model: &*self.model,
            fx: &fx,
            layout: &self.layout,
            check_grads: false,
            staging: self.staging.as_mut(),
        };
        micro_batch(&mut backward, mb, factor, &mut self.grads, &mut |_, _| {})?;
        stoker_kernels::flat::zero(&mut self.grads);
        Ok(Some(0))
    }

    /// One optimizer step over this rank's accumulation window (its part of the global
    /// batch; every rank's window has the same shapes).
    pub fn train_step(&mut self, window: &[MicroBatch]) -> Result<StepReport> {
        let step = self.step;
        let k = window.len();
        // The global batch's target capacity, which every rank knows without asking: the
        // backward divides by it, the count over all ranks corrects it afterwards.
        let capacity =
            self.strategy.world_size() * window.iter().map(|m| m.targets.len()).sum::<usize>();
        let local_count: usize = window.iter().map(|m| valid_count(&m.targets)).sum();
        let loss_scale = self.scaler.as_ref().map_or(1.0, |s| s.scale());
        let factor = (capacity > 0).then(|| loss_scale as f64 / capacity as f64);
        self.strategy.begin_window(k)?;
        self.sum.begin(&mut self.grads);
        let fx = Fx::new(self.precision, self.fp8.as_ref()).with_kernels(self.kernels);
        let Trainer {
            sum,
            grads,
            strategy,
            direct,
            model,
            layout,
            master,
            full_model,
            units,
            unit_peak,
            precision,
            kernels,
            held,
            device,
            staging,
            ..
        } = self;
        let by_group = strategy.reduces_by_group();
        // ZeRO-3 on the graph path: the model run unit by unit, each unit's groups gathered
        // as it runs and reduce-scattered as its backward finishes them.
        let unit_step = match (units.as_ref(), full_model.as_ref()) {
            (Some(plan), Some(config)) => Some(crate::parallel::units::UnitStep {
                plan,
                model: config,
                precision: *precision,
                kernels: *kernels,
                layout,
                fx: &fx,
                own: held,
                device,
            }),
            _ => None,
        };
        for (j, mb) in window.iter().enumerate() {
            let reduce = strategy.begin_micro_batch(j, k)?;
            let target = sum.target(grads);
            let mut failed = None;
            let mut ready = |group: usize, buf: &[f32]| {
                if reduce && failed.is_none() {
                    if let Err(e) = strategy.group_ready(group, buf) {
                        failed = Some(e);
                    }
                }
            };
            if let (Some(s), true) = (direct.as_deref_mut(), by_group) {
                // ZeRO-2/3: gradients reduced group by group into this rank's shard of the
                // running sum; ZeRO-3 also gathers each group as the step needs it.
                let mut source = strategy
                    .step_source(master, target)
                    .expect("a strategy that shards a direct step's gradients gives a source");
                let mut backward = Backward::Sharded {
                    step: s,
                    source: &mut *source,
                };
                let loss = micro_batch(&mut backward, mb, factor, &mut [], &mut |_, _| {})?;
                drop(source);
                strategy.finish_micro_batch(target)?;
                sum.push(grads, loss);
                continue;
            }
            if let Some(unit_step) = &unit_step {
                let mut source =
                    crate::parallel::units::Collective::new(&mut **strategy, master, target);
                let loss = crate::parallel::units::micro_batch(
                    unit_step,
                    &mut source,
                    mb,
                    factor,
                    step == 0,
                    unit_peak,
                )?;
                strategy.finish_micro_batch(target)?;
                sum.push(grads, loss);
                continue;
            }
            let mut backward = match direct {
                Some(s) => Backward::Direct {
                    step: &mut **s,
                    master,
                },
                None => Backward::Graph {
                    model: &**model,
                    fx: &fx,
                    layout,
                    check_grads: step == 0,
                    staging: staging.as_mut(),
                },
            };
            let loss = micro_batch(&mut backward, mb, factor, target, &mut ready)?;
            if let Some(e) = failed {
                return Err(e);
            }
            if reduce {
                strategy.finish_micro_batch(target)?;
            }
            sum.push(grads, loss);
        }
        let loss_sum = self.sum.finish(&mut self.grads);
        self.strategy.finish_window(&mut self.grads)?;
        let mut scalars = [loss_sum, local_count as f64];
        self.strategy.sum_scalars(&mut scalars)?;
        let [loss_sum, count] = scalars;
        if count > 0.0 && count != capacity as f64 {
            stoker_kernels::flat::scale(&mut self.grads, (capacity as f64 / count) as f32);
        }
        let loss = if count > 0.0 { loss_sum / count } else { 0.0 };
        let r = (loss, count as usize);
        let lr = self.schedule.lr_at(step);
        let mut report = StepReport {
            step: step + 1,
            loss: r.0,
            count: r.1,
            grad_norm: 0.0,
            lr,
            loss_scale,
            skipped: None,
            sync: self.strategy.stats(),
        };
        if let Some(scaler) = &mut self.scaler {
            let table = self.layout.param_table();
            let whole = self.grads.len() == self.layout.total_len();
            let here = scaler.unscale_and_check(&mut self.grads, whole.then_some(&table))?;
            // Every rank skips together (their gradients are the same sums, but a sharded
            // strategy's are not: agree explicitly).
            let found_inf = self.strategy.any_rank(here)?;
            if found_inf && !here {
                scaler.note_nonfinite("(a gradient on another rank)");
            }
            if let StepDecision::Skip(rep) = scaler.update(found_inf) {
                report.skipped = Some(format!("{rep:?}"));
                report.sync = self.strategy.stats();
                self.step += 1;
                return Ok(report);
            }
        }
        // One pass: the f64 norm is finite exactly when every gradient is, so the scan for
        // the offending parameter runs only on failure.
        let norm = self.strategy.sum_of_squares(&self.grads)?.sqrt();
        let loss = r.0;
        if self.scaler.is_none() && (!loss.is_finite() || !norm.is_finite()) {
            let param = self
                .layout
                .first_nonfinite_in(&self.grads, &self.grad_held)
                .unwrap_or("(none: loss only)");
            return Err(TrainError::NonFinite {
                step,
                what: if loss.is_finite() { "gradient" } else { "loss" }.into(),
                param: param.into(),
            });
        }
        if self.grad_clip > 0.0 {
            clip_to(&mut self.grads, norm, self.grad_clip);
        }
        report.grad_norm = norm;
        // The optimizer's pieces of the flat buffer, within what `master` and `grads` hold
        // (all of either, or one range of the whole buffer).
        let updated = self.optimizer.pieces().clone();
        let (local, local_grads) = match (
            self.held.local_of(&updated),
            self.grad_held.local_of(&updated),
        ) {
            (Some(l), Some(g)) => (l, g),
            _ => {
                return Err(TrainError::Layout(format!(
                    "the optimizer updates {:?}, the parameters hold {:?} and the gradients {:?}",
                    updated.ranges(),
                    self.held.ranges(),
                    self.grad_held.ranges()
                )))
            }
        };
        // A model on a GPU whose optimizer updates the whole buffer (one rank, DDP): each
        // parameter's copy up is queued as soon as the optimizer is done with it, so the
        // copies run while the optimizer steps the rest. Sharded updates go up after their
        // all-gather. A non-finite parameter is not sent (the check below fails the step),
        // and unless every parameter went up the whole upload runs after all.
        let upload_each = self.staging.is_some() && updated.is_whole(self.layout.total_len());
        let (mut upload_failed, mut uploaded) = (None, 0usize);
        let Trainer {
            optimizer,
            master,
            grads,
            bf16_copy,
            staging,
            model,
            ..
        } = self;
        let mut each = staging.as_mut().filter(|_| upload_each);
        let mut done = |r: std::ops::Range<usize>, v: &[f32], b: Option<&[half::bf16]>| {
            let Some(st) = each.as_mut() else { return };
            if upload_failed.is_some() || !v.iter().all(|x| x.is_finite()) {
                return;
            }
            match st.upload_segment(local.start + r.start, v, b, model.params()) {
                Ok(()) => uploaded += 1,
                Err(e) => upload_failed = Some(e),
            }
        };
        optimizer.step_each(
            &mut master[local.clone()],
            &grads[local_grads],
            lr as f32,
            bf16_copy.as_deref_mut().map(|c| &mut c[local.clone()]),
            &mut done,
        );
        if let Some(e) = upload_failed {
            return Err(e);
        }
        self.strategy.after_update(&mut self.master)?;
        if let (Some(copy), true) = (&mut self.bf16_copy, local.len() < self.master.len()) {
            // The other ranks' shards arrived in FP32: round them as the optimizer does.
            for r in [0..local.start, local.end..self.master.len()] {
                stoker_kernels::flat::to_bf16(&self.master[r.clone()], &mut copy[r]);
            }
        }
        if let Some(param) = self.layout.first_nonfinite_in(&self.master, &self.held) {
            return Err(TrainError::NonFinite {
                step,
                what: "value".into(),
                param: param.into(),
            });
        }
        match (&self.bf16_copy, &self.direct) {
            _ if self.shards_params() => {}
            // A model on a GPU: its new values queued up from pinned host buffers (already,
            // parameter by parameter, where the optimizer updated the whole buffer).
            _ if upload_each && Some(uploaded) == self.staging.as_ref().map(|s| s.nonempty()) => {}
            (copy, _) if self.staging.is_some() => {
                let src = match copy {
                    Some(c) => MasterView::Bf16(c),
                    None => MasterView::F32(&self.master),
                };
                let staging = self.staging.as_mut().expect("checked");
                staging.upload(src, &self.layout, self.model.params())?;
            }
            (Some(copy), _) => self.layout.unflatten_bf16(copy, self.model.params())?,
            (None, Some(_)) => self.vars_stale.set(true),
            (None, None) => self.layout.unflatten(&self.master, self.model.params())?,
        }
        if let Some(f) = &self.fp8 {
            f.update();
        }
        // After the parameter refresh: its all-gather (ZeRO) belongs to this step.
        report.sync = self.strategy.stats();
        self.step += 1;
        Ok(report)
    }

    /// Copies `master` into the model's variables if the direct step has left them
    /// behind; [`Trainer::evaluate`] and [`Trainer::sample`] call it, and so must anything
    /// else that runs the model's candle forward after training steps.
    pub fn sync_vars(&self) -> Result<()> {
        if self.vars_stale.get() && !self.shards_params() {
            self.layout.unflatten(&self.master, self.model.params())?;
            self.vars_stale.set(false);
        }
        Ok(())
    }

    /// Mean loss and top-1 accuracy over every rank's `batches` (each rank passes its
    /// share; a collective), without gradients.
    pub fn evaluate(&mut self, batches: &[MicroBatch]) -> Result<EvalReport> {
        // Under ZeRO-3 the direct step runs group by group, the graph path unit by unit.
        let local = match (self.shards_params(), self.direct.is_some()) {
            (false, _) => self.evaluate_local(batches)?,
            (true, direct) => {
                let padded = self.same_batch_count(batches)?;
                match direct {
                    true => self.evaluate_by_group(&padded)?,
                    false => self.evaluate_by_unit(&padded)?,
                }
            }
        };
        let mut x = [
            local.loss * local.count as f64,
            local.count as f64,
            local.accuracy * local.count as f64,
        ];
        self.strategy.sum_scalars(&mut x)?;
        let c = x[1].max(1.0);
        Ok(EvalReport {
            loss: x[0] / c,
            accuracy: x[2] / c,
            count: x[1] as usize,
        })
    }

    /// `batches` padded with masked copies of its last one to the most any rank passed:
    /// under ZeRO-3 every forward is a collective (each group gathered from every rank), so
    /// every rank must run as many as the others, whatever share of the evaluation set it
    /// drew (16 batches over 3 ranks give 6, 5 and 5). The counts are agreed through
    /// [`Strategy::sum_scalars`]; a rank with no batch at all while another has some
    /// cannot pad (it knows no shape), and every rank fails alike, naming the counts.
    fn same_batch_count(&mut self, batches: &[MicroBatch]) -> Result<Vec<MicroBatch>> {
        let (rank, world) = (self.strategy.rank(), self.strategy.world_size());
        let mut counts = vec![0f64; world];
        counts[rank] = batches.len() as f64;
        self.strategy.sum_scalars(&mut counts)?;
        let most = counts.iter().fold(0f64, |a, &b| a.max(b)) as usize;
        if counts.contains(&0.0) && most > 0 {
            return Err(TrainError::Layout(format!(
                "evaluation under ZeRO-3 runs a collective forward per batch, and the ranks \
                 passed {counts:?} batches: a rank with none cannot join (pass it a masked \
                 batch, MicroBatch::masked)"
            )));
        }
        let mut padded = batches.to_vec();
        if let Some(last) = batches.last() {
            padded.extend((batches.len()..most).map(|_| last.masked()));
        }
        Ok(padded)
    }

    /// ZeRO-3 on the direct step: the training forward through the step's own source, each
    /// parameter group gathered as it needs it and freed after (a collective: every rank
    /// calls it), so evaluation holds what a training step holds, not the whole model (FSDP
    /// evaluates unit by unit too). The forward reduces nothing, so the gradient shard is
    /// empty; the statistics it adds are the next window's to reset.
    fn evaluate_by_group(&mut self, batches: &[MicroBatch]) -> Result<EvalReport> {
        let Trainer {
            direct,
            strategy,
            master,
            ..
        } = self;
        let step = direct.as_deref_mut().ok_or_else(|| {
            TrainError::Layout("evaluation by group needs the direct step".into())
        })?;
        let name = strategy.name();
        let (mut sum, mut correct, mut count) = (0f64, 0usize, 0usize);
        for mb in batches {
            let result = {
                let mut source = strategy.step_source(master, &mut []).ok_or_else(|| {
                    TrainError::Layout(format!(
                        "{name} gives no step source for evaluation by group"
                    ))
                })?;
                step.evaluate_groups(&mut *source, &mb.input, &mb.targets)
            };
            strategy.finish_micro_batch(&mut [])?;
            let (s, c, n) = result?;
            (sum, correct, count) = (sum + s, correct + c, count + n);
        }
        Ok(EvalReport::of(sum, correct, count))
    }

    /// ZeRO-3 on the graph path: candle's forward unit by unit, each unit's groups
    /// gathered as it needs them and freed after their last unit (a collective: every
    /// rank calls it), instead of the whole model at once.
    fn evaluate_by_unit(&mut self, batches: &[MicroBatch]) -> Result<EvalReport> {
        self.by_unit(None, |step, strategy, master| {
            let (mut sum, mut correct, mut count) = (0f64, 0usize, 0usize);
            for mb in batches {
                // Evaluation reduces nothing: no gradient shard to scatter into.
                let mut source = crate::parallel::units::Collective::new(strategy, master, &mut []);
                let (s, c, n) = crate::parallel::units::evaluate(step, &mut source, mb)?;
                (sum, correct, count) = (sum + s, correct + c, count + n);
            }
            Ok(EvalReport::of(sum, correct, count))
        })
    }

    /// ZeRO-3: `f` with a unit-by-unit step over `plan` (else the trainer's own units,
    /// those of the graph path), the strategy and this rank's shard of the parameters, for
    /// a forward run unit by unit.
    fn by_unit<R>(
        &mut self,
        plan: Option<&UnitPlan>,
        f: impl FnOnce(&crate::parallel::units::UnitStep<'_>, &mut dyn Strategy, &[f32]) -> Result<R>,
    ) -> Result<R> {
        let Trainer {
            units,
            full_model,
            strategy,
            master,
            precision,
            kernels,
            layout,
            held,
            device,
            fp8,
            ..
        } = self;
        let (Some(plan), Some(config)) = (plan.or(units.as_ref()), full_model.as_ref()) else {
            return Err(TrainError::Layout(
                "a forward by unit needs ZeRO-3 and its units".into(),
            ));
        };
        let fx = Fx::new(*precision, fp8.as_ref()).with_kernels(*kernels);
        let step = crate::parallel::units::UnitStep {
            plan,
            model: config,
            precision: *precision,
            kernels: *kernels,
            layout,
            fx: &fx,
            own: held,
            device,
        };
        f(&step, &mut **strategy, master)
    }

    /// Mean loss and top-1 accuracy over this rank's `batches` alone (not under ZeRO-3,
    /// whose forward needs the other ranks: use [`Trainer::evaluate`]). With a direct step
    /// it runs the training forward on its own buffers (no autograd graph, nothing more
    /// to hold than a training step); else candle's forward.
    pub fn evaluate_local(&mut self, batches: &[MicroBatch]) -> Result<EvalReport> {
        let sharded = self.shards_params();
        if let (Some(step), false) = (self.direct.as_mut(), sharded) {
            let (mut sum, mut correct, mut count) = (0f64, 0usize, 0usize);
            for mb in batches {
                let (s, c, n) = step.evaluate(&self.master, &mb.input, &mb.targets)?;
                (sum, correct, count) = (sum + s, correct + c, count + n);
            }
            return Ok(EvalReport::of(sum, correct, count));
        }
        self.sync_vars()?;
        eval_with(&*self.model, &self.fx(), batches)
    }

    /// Whether the model's loss is per token or per sample.
    pub fn loss_kind(&self) -> LossKind {
        self.model.loss_kind()
    }

    /// Samples `n` tokens after `prompt` (GPT), with temperature 1 and a seeded generator.
    /// Under ZeRO-3 a collective (every rank calls it and gets the same tokens): each
    /// token's forward runs unit by unit, gathering each unit's groups as it needs them, so
    /// no rank holds the whole model (FSDP's generation through its wrapped units).
    pub fn sample(
        &mut self,
        prompt: &[i64],
        n: usize,
        context: usize,
        seed: u64,
    ) -> Result<Vec<i64>> {
        if let Some(config) = self.full_model.clone() {
            let (p, k) = (self.precision, self.kernels);
            let plan = UnitPlan::for_model(&config, p, k, &self.layout, true)?;
            return self.by_unit(Some(&plan), |step, strategy, master| {
                let mut forward = |x: &Tensor| {
                    let mut source =
                        crate::parallel::units::Collective::new(&mut *strategy, master, &mut []);
                    crate::parallel::units::forward(step, &mut source, x)
                };
                sample_with(&mut forward, step.fx, prompt, n, context, seed, step.device)
            });
        }
        self.sync_vars()?;
        let (model, fx) = (&*self.model, self.fx());
        let mut forward = |x: &Tensor| Ok(model.forward(&fx, x)?.detach());
        sample_with(&mut forward, &fx, prompt, n, context, seed, &self.device)
    }
}

/// Mean loss and top-1 accuracy of `model` over `batches`.
fn eval_with(model: &dyn Model, fx: &Fx, batches: &[MicroBatch]) -> Result<EvalReport> {
    let (mut sum, mut count, mut correct) = (0f64, 0usize, 0usize);
    for mb in batches {
        let logits = model.forward(fx, &mb.input)?.detach();
        let (s, c, n) = crate::loss::loss_and_hits(fx, &logits, &mb.targets)?;
        (sum, correct, count) = (sum + s, correct + c, count + n);
    }
    Ok(EvalReport::of(sum, correct, count))
}

/// `n` tokens sampled after `prompt` from the logits `forward` gives for a `[1, t]`
/// input.
fn sample_with(
    forward: &mut dyn FnMut(&Tensor) -> Result<Tensor>,
    fx: &Fx,
    prompt: &[i64],
    n: usize,
    context: usize,
    seed: u64,
    dev: &Device,
) -> Result<Vec<i64>> {
    let mut toks = prompt.to_vec();
    for i in 0..n {
        let start = toks.len().saturating_sub(context);
        let x = Tensor::new(&toks[start..], dev)?.unsqueeze(0)?;
        let logits = forward(&x)?;
        let last = logits.get(logits.dim(0)? - 1)?;
        let p = crate::ops::softmax_last(fx, &last)?
            .to_dtype(candle_core::DType::F64)?
            .to_vec1::<f64>()?;
        let u = (crate::params::mix64(seed ^ crate::params::mix64(i as u64)) >> 11) as f64
            / (1u64 << 53) as f64;
        let mut acc = 0.0;
        let next = p
            .iter()
            .position(|&q| {
                acc += q;
                acc > u
            })
            .unwrap_or(p.len() - 1);
        toks.push(next as i64);
    }
    Ok(toks[prompt.len()..].to_vec())
}
