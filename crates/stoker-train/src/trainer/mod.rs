//! The trainer: one model, its flat FP32 master buffer and gradient buffer, the optimizer,
//! the schedule, the loss scaler (fp16), the FP8 scalers (fp8) and the data-parallel
//! strategy; one optimizer step per accumulation window.
//!
//! - `path.rs`: the step path, chosen once when the strategy is set up ([`StepPath`]: the
//!   candle graph, the hand-written direct step, the direct step reduced group by group,
//!   ZeRO-3's units), and one micro-batch on it;
//! - `step.rs`: the optimizer step ([`Trainer::train_step`]) in the phases of
//!   [`crate::parallel`];
//! - `eval.rs`: evaluation and sampling, dispatched on the same path;
//! - `buffers.rs`: the parameter and gradient buffers a rank keeps.

mod buffers;
mod eval;
mod path;
mod resident;
mod state;
mod step;

use candle_core::Device;
use stoker_data::SamplerState;
use stoker_precision::LossScaler;

use crate::config::{OptimizerKind, TrainConfig};
use crate::error::{Result, TrainError};
use crate::grad_sum::{GradSum, SumOrder};
use crate::layout::FlatLayout;
use crate::models::factory::vars_bytes;
use crate::models::{build_meta_model_on, build_model, LossKind, Model};
use crate::offload::HostStaging;
use crate::optim::{segments, AdamW, Optimizer, Sgd};
use crate::parallel::units::UnitPlan;
use crate::parallel::{Single, Strategy, SyncStats};
use crate::pieces::Pieces;
use crate::precision::{Fp8State, Fx, Kernels, Precision};
use crate::schedule::Schedule;

use buffers::{GradBuffers, ParamBuffers};
pub use eval::EvalReport;
pub use path::StepPath;
pub use resident::{planned_resident_bytes, resident_blocks, ResidentPath};

/// What one optimizer step did.
#[derive(Debug, Clone, PartialEq)]
pub struct StepReport {
    /// The optimizer step just finished (1-based count of steps taken, skipped included).
    pub step: u64,
    /// Mean loss over the valid targets of the global batch (every rank's window).
    pub loss: f64,
    /// Valid targets (tokens or samples) in the global batch.
    pub count: usize,
    /// Global gradient norm after unscaling, before clipping; NaN on a step the fp16
    /// scaler skipped (its gradients overflowed: no norm is taken, and 0 would claim
    /// gradients that vanished). `metrics.jsonl` writes it as `null`.
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

/// The training state of one rank.
pub struct Trainer {
    /// The model: with its values, or, where this rank holds a shard of the parameters
    /// (ZeRO-3), declared without them (its shapes answer the data checks; a forward
    /// gathers the parameters unit by unit instead).
    model: Box<dyn Model>,
    /// How a micro-batch runs, and what that path keeps.
    path: StepPath,
    /// Where the model's tensors live.
    device: Device,
    params: ParamBuffers,
    grads: GradBuffers,
    optimizer: Box<dyn Optimizer>,
    schedule: Schedule,
    /// Dynamic loss scaler (fp16 only).
    scaler: Option<LossScaler>,
    /// An fp16 overflow at the scale's floor fails the step (`[loss_scale]`).
    stop_at_min_scale: bool,
    /// FP8 delayed scalers (fp8 only).
    fp8: Option<Fp8State>,
    precision: Precision,
    kernels: Kernels,
    grad_clip: f64,
    /// Optimizer steps taken (skipped ones included).
    step: u64,
    /// Where the training loader stands after the last step.
    sampler_state: SamplerState,
    /// How this rank meets the others.
    strategy: Box<dyn Strategy>,
    /// The model's config: ZeRO-3 builds unit models from it around gathered groups.
    model_config: crate::models::ModelConfig,
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
    /// at the same point), and the step path is chosen for it.
    pub fn with_strategy(
        config: &TrainConfig,
        model: Box<dyn Model>,
        strategy: Box<dyn Strategy>,
    ) -> Result<Self> {
        Self::with_strategy_on_gpu(config, model, strategy, 0)
    }

    /// As [`Trainer::with_strategy`], for the rank that takes GPU `gpu` where the config's
    /// device is `cuda` without an index and the step is resident (its loop opens the GPU
    /// itself; the model's candle variables stay on the host).
    pub fn with_strategy_on_gpu(
        config: &TrainConfig,
        model: Box<dyn Model>,
        mut strategy: Box<dyn Strategy>,
        gpu: usize,
    ) -> Result<Self> {
        let layout = FlatLayout::of(model.params())?;
        let device = match model.params().iter().next() {
            Some(p) => p.var.device().clone(),
            None => Device::Cpu,
        };
        let len = layout.total_len();
        let held = strategy.holds(len);
        let sharded = !held.is_whole(len);
        let master = ParamBuffers::initial(config, &*model, &layout, &held, &mut *strategy)?;
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
            true => Some(LossScaler::new(config.loss_scaler()?)?),
            false => None,
        };
        let fp8 = (config.precision == Precision::Fp8).then(|| Fp8State::new(Default::default()));
        // A rank holding a shard keeps the model declared without values: no full-size
        // variables.
        let model = match sharded && !model.params().is_meta() {
            true => {
                let (p, k, seed) = (config.precision, config.kernels, config.seed);
                build_meta_model_on(&config.model, p, k, seed, &device)?
            }
            false => model,
        };
        let (path, grad_held) = StepPath::choose(
            config,
            &*model,
            &layout,
            &mut *strategy,
            sharded,
            &device,
            gpu,
        )?;
        let bf16 = config.kernels.param_dtype(config.precision) == candle_core::DType::BF16;
        let params = ParamBuffers::new(layout, master, held, bf16);
        Ok(Trainer {
            model,
            path,
            device,
            grads: GradBuffers::new(grad_held, strategy.sum_order()),
            params,
            optimizer,
            schedule: config.schedule(),
            scaler,
            stop_at_min_scale: config.stops_at_min_scale(),
            fp8,
            precision: config.precision,
            kernels: config.kernels,
            grad_clip: o.grad_clip,
            step: 0,
            sampler_state: SamplerState::default(),
            strategy,
            model_config: config.model.clone(),
        })
    }

    /// The model (under ZeRO-3 declared without values: shapes, not weights).
    pub fn model(&self) -> &dyn Model {
        &*self.model
    }

    /// The step path this rank runs.
    pub fn path(&self) -> &StepPath {
        &self.path
    }

    /// The data-parallel strategy.
    pub fn strategy(&self) -> &dyn Strategy {
        &*self.strategy
    }

    /// The flat layout of the parameter and gradient buffers.
    pub fn layout(&self) -> &FlatLayout {
        &self.params.layout
    }

    /// This rank's FP32 master weights: the whole flat buffer, or under ZeRO-3 its pieces
    /// of it ([`Trainer::held`]) end to end. On the resident path, after
    /// [`Trainer::sync_host`]: a read of a master that lags the loop's fails loudly
    /// rather than hand over stale weights.
    pub fn master(&self) -> &[f32] {
        assert!(
            !self.host_behind(),
            "Trainer::master on the resident path lags the loop: call Trainer::sync_host first"
        );
        &self.params.master
    }

    /// The optimizer over the master weights.
    pub fn optimizer(&self) -> &dyn Optimizer {
        &*self.optimizer
    }

    /// The learning-rate schedule.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// The dynamic loss scaler (fp16 only).
    pub fn scaler(&self) -> Option<&LossScaler> {
        self.scaler.as_ref()
    }

    /// The dynamic loss scaler, to restore its state from a checkpoint.
    pub fn scaler_mut(&mut self) -> Option<&mut LossScaler> {
        self.scaler.as_mut()
    }

    /// The FP8 delayed scalers (fp8 only).
    pub fn fp8(&self) -> Option<&Fp8State> {
        self.fp8.as_ref()
    }

    /// Optimizer steps taken (skipped ones included).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Where the training loader stands after the last step.
    pub fn sampler_state(&self) -> SamplerState {
        self.sampler_state
    }

    /// Sets where the training loader stands (a run records it after each step).
    pub fn set_sampler_state(&mut self, state: SamplerState) {
        self.sampler_state = state;
    }

    /// The parts of the flat buffer this rank's `master` holds: all of it, except under
    /// ZeRO-3 (its piece of every group).
    pub fn held(&self) -> &Pieces {
        &self.params.held
    }

    /// The parts of the flat buffer this rank's gradient sum holds: all of it, except
    /// under ZeRO-3 and under ZeRO-2 on the direct step (its shard).
    pub fn grad_held(&self) -> &Pieces {
        &self.grads.held
    }

    /// Whether this rank holds only a shard of the parameters (ZeRO-3).
    pub fn shards_params(&self) -> bool {
        self.params.sharded()
    }

    /// The whole FP32 parameter buffer: a copy of `master`, or under ZeRO-3 gathered from
    /// every rank's shard (a collective: every rank calls it).
    pub fn full_master(&mut self) -> Result<Vec<f32>> {
        self.sync_host()?;
        match self.strategy.sharded() {
            Some(s) => s.gather_params(&self.params.master),
            None => Ok(self.params.master.clone()),
        }
    }

    /// Sets the parameters from the whole FP32 buffer `full` (a checkpoint's): this rank
    /// keeps its part and its model's variables follow.
    pub fn set_master(&mut self, full: Vec<f32>) -> Result<()> {
        self.params.layout.check_len(full.len())?;
        match self.shards_params() {
            true => self.set_held_master(self.params.held.take(&full)),
            false => self.set_held_master(full),
        }
    }

    /// Sets the parameters this rank holds from `local`, its pieces of the flat buffer end
    /// to end ([`Trainer::held`]: the whole buffer, except under ZeRO-3), and its model's
    /// variables follow.
    pub fn set_held_master(&mut self, local: Vec<f32>) -> Result<()> {
        // On the resident path the optimizer's moments go down with the master: bring
        // them up first, so that setting the weights keeps them (a collective under
        // ZeRO-1, as setting a checkpoint's weights is on every rank).
        self.sync_host()?;
        if local.len() != self.params.held.len() {
            return Err(TrainError::Layout(format!(
                "{} parameter values for the {} this rank holds",
                local.len(),
                self.params.held.len()
            )));
        }
        self.params.master = local;
        self.path.host_changed();
        if self.shards_params() {
            return Ok(());
        }
        self.params
            .layout
            .unflatten(&self.params.master, self.model.params())?;
        self.path.vars_fresh();
        Ok(())
    }

    /// Gradient-sized buffers beyond the gradient buffer that the step holds (the
    /// deterministic tree, per-micro-batch reduction), for the memory accounting.
    pub fn extra_grad_buffers(&self) -> usize {
        self.grads.sum.extra_buffers()
    }

    /// The bytes this rank's trainer holds in model states and communication buffers,
    /// counted from the buffers themselves (the resident loop's, on its backend, apart:
    /// [`Trainer::resident_bytes`]).
    pub fn held_bytes(&self) -> crate::memory::HeldBytes {
        crate::memory::HeldBytes {
            params: self.params.bytes() + vars_bytes(&*self.model),
            grads: 4 * self.grads.buf.len() + self.strategy.grad_bytes(),
            optimizer: self.optimizer.state_bytes(),
            buffers: self.strategy.buffer_bytes()
                + 4 * self.grads.buf.len() * self.grads.sum.extra_buffers()
                + self.path.unit_peak()
                + self.staging_bytes(),
        }
    }

    /// On the resident path once its loop is made, what the loop holds on its backend
    /// (counted from its buffers) and, on a GPU, the device memory it took as the driver
    /// reports it.
    pub fn resident_bytes(
        &self,
    ) -> Option<(crate::models::resident_run::ResidentBytes, Option<usize>)> {
        match &self.path {
            StepPath::Resident(r) => r.bytes().map(|b| (b, r.measured_bytes())),
            _ => None,
        }
    }

    /// Sends the gradients and parameters through host staging buffers as a model on a
    /// GPU does ([`crate::offload`]), whatever the device: on a CPU the copies are plain,
    /// so tests hold the offload path's step to the ordinary one bit for bit. Only on the
    /// graph path of an unsharded model (the direct step has no candle gradients, ZeRO-3's
    /// units build their own variables).
    pub fn stage_through_host(&mut self) -> Result<()> {
        let staging = HostStaging::for_params(self.model.params(), &self.params.layout)?;
        self.path.stage_through(staging)
    }

    /// The host staging's upload counts (all, and those made as the optimizer finished
    /// each parameter), where the model is staged: see [`HostStaging::upload_counts`].
    pub fn staging_upload_counts(&self) -> Option<(usize, usize)> {
        self.path.staging().map(HostStaging::upload_counts)
    }

    /// Bytes of the host staging buffers of a model on a GPU (0 on a CPU).
    pub fn staging_bytes(&self) -> usize {
        self.path.staging().map_or(0, HostStaging::bytes)
    }

    /// Where the model's tensors live: micro-batches go there.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// [`HeldBytes::buffers`](crate::memory::HeldBytes) in steady state for windows of
    /// `k` micro-batches, known before the first step (the strategy's buckets and the
    /// accumulation's partial sums are allocated by the first window).
    pub fn steady_buffer_bytes(&self, k: usize) -> usize {
        steady_buffer_bytes(
            &*self.strategy,
            self.grads.buf.len(),
            k,
            self.path.units(),
            &self.params.held,
        ) + self.staging_bytes()
    }

    /// ZeRO-3 on the graph path: the most bytes its units' gathered groups, gradient buffers
    /// and variables hold at once in a micro-batch, predicted from the schedule (0 otherwise).
    pub fn unit_workspace_bytes(&self) -> usize {
        self.path
            .units()
            .map_or(0, |u| u.peak_bytes(&self.params.held))
    }

    /// Bytes of the direct step's activation buffers now (0 on the graph path, whose
    /// candle tensors live only during a step), counted from them.
    pub fn activation_bytes(&self) -> usize {
        self.path.activation_bytes()
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
        self.path.is_direct()
    }

    /// Whether the model's loss is per token or per sample.
    pub fn loss_kind(&self) -> LossKind {
        self.model.loss_kind()
    }

    /// Copies `master` into the model's variables if the direct step has left them
    /// behind; [`Trainer::evaluate`] and [`Trainer::sample`] call it, and so must anything
    /// else that runs the model's candle forward after training steps.
    pub fn sync_vars(&self) -> Result<()> {
        if self.host_behind() {
            return Err(TrainError::Strategy(
                "the model's variables would follow a master that lags the resident loop: \
                 call Trainer::sync_host first"
                    .into(),
            ));
        }
        if self.path.vars_stale() && !self.shards_params() {
            self.params
                .layout
                .unflatten(&self.params.master, self.model.params())?;
            self.path.vars_fresh();
        }
        Ok(())
    }
}
