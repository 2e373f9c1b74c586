//! The resident path (`step = "resident"` under one rank, DDP or ZeRO-1 to -3): a whole window
//! (micro-batches, reductions, the optimizer) runs on the step's backend, a GPU's memory
//! or the host build's, where the FP32 master and the optimizer's moments live between
//! steps (llm.c's loop). The trainer keeps what surrounds the step: the schedule and the
//! optimizer's step count (each update's scalars come from the trainer's own optimizer,
//! so the arithmetic's constants have one definition), evaluation, sampling and
//! checkpoints.
//!
//! The trainer's master and optimizer buffers are a mirror, brought up to date only when
//! something on the host reads them ([`Trainer::sync_host`]: a checkpoint, the run's
//! closing CRC, sampling); whatever sets them (a checkpoint loaded) is sent down before
//! the next window.

use std::cell::Cell;
use std::rc::Rc;

use crate::accumulate::MicroBatch;
use crate::config::{OptimizerKind, StrategyKind, TrainConfig};
use crate::error::{Result, TrainError};
use crate::layout::FlatLayout;
use crate::models::resident_run::{ResidentBytes, ResidentOn, ResidentRun, RunSetup};
use crate::models::Model;
use crate::models::ModelConfig;
use crate::optim::{segments, OptimState};
use crate::parallel::Strategy;

use super::{StepReport, Trainer};

/// The resident path's loop and what the trainer knows of it.
pub struct ResidentPath {
    /// The loop, once made: by a run before its first step, or by the first window or
    /// evaluation. A trainer that only loads weights and reads them (`stoker export`)
    /// never makes it, nor opens a GPU.
    run: Option<Box<dyn ResidentRun>>,
    /// What making it takes from the config.
    plan: LoopPlan,
    /// The trainer's master and optimizer buffers lag the loop's (a window ran since).
    host_behind: bool,
    /// The loop lags the trainer's master and optimizer buffers (they were set).
    run_behind: bool,
    /// The model's candle variables lag the trainer's master.
    pub(super) vars_stale: Cell<bool>,
}

/// What making a resident loop takes from the config.
struct LoopPlan {
    on: ResidentOn,
    strategy: stoker_gpu::parallel::Strategy,
    optimizer: stoker_gpu::step::optimizer::Optimizer,
    shape: (usize, usize),
    /// The steps' activation type (f32, bf16, or fp16's f16).
    act: stoker_gpu::Dtype,
    /// How its steps are made (`parallel.offload_params`, `recompute`).
    options: stoker_gpu::step::options::StepOptions,
    timeout: std::time::Duration,
    /// `parallel.deterministic`: the batch whose accumulation steps size the trees.
    deterministic: Option<crate::config::BatchConfig>,
}

impl LoopPlan {
    /// Whether each rank's master is a shard of the flat buffer (ZeRO-1, -2 or -3,
    /// offloaded or not).
    fn sharded(&self) -> bool {
        !matches!(
            self.strategy,
            stoker_gpu::parallel::Strategy::Ddp | stoker_gpu::parallel::Strategy::Offload
        )
    }

    /// The loop of `model` laid out by `layout`, rank `strategy.rank()` of its group,
    /// starting from the whole flat `master`, its optimizer covering the strategy's range.
    fn make(
        &self,
        model: &dyn Model,
        layout: &FlatLayout,
        strategy: &dyn Strategy,
        master: &[f32],
    ) -> Result<Box<dyn ResidentRun>> {
        if self.options.offload_params
            && strategy.world_size() > 1
            && !self.strategy.shards_params()
        {
            return Err(crate::error::config_err(
                "parallel.offload_params",
                format!(
                    "runs on one rank, or sharded under \"zero3\"; this job has {}: \
                     offloaded whole parameters with several ranks are not built",
                    strategy.world_size()
                ),
            ));
        }
        let comm = match strategy.communicator() {
            Some(c) => c,
            None => Rc::new(stoker_comm::local_group(1, self.timeout).remove(0)),
        };
        let setup = RunSetup {
            strategy: self.strategy,
            optimizer: self.optimizer,
            master,
            segments: segments(layout, false)
                .iter()
                .map(|s| (s.offset..s.offset + s.len, s.decay))
                .collect(),
            rank_world: (strategy.rank(), strategy.world_size()),
            comm,
            shape: self.shape,
            on: self.on,
            options: self.options,
            deterministic: match &self.deterministic {
                Some(batch) => Some(batch.resolve(strategy.world_size())?.0),
                None => None,
            },
        };
        let run = model
            .resident_run(layout, self.act, &setup)?
            .ok_or_else(|| {
                TrainError::Strategy("step = \"resident\": this model has no GPU step".into())
            })?;
        // The trainer's optimizer covers the strategy's range: the loop's must be the same
        // (ZeRO-1's shard: both split by stoker-comm's ShardPlan at one alignment).
        let want = strategy.update_range(layout.total_len());
        if want.ranges() != as_pieces(&run.range()) {
            return Err(TrainError::Layout(format!(
                "the resident loop's optimizer would cover {:?} of the flat buffer, the \
                 strategy's range is {:?}",
                run.range(),
                want.ranges()
            )));
        }
        Ok(run)
    }
}

/// `range` as the pieces of a flat buffer it covers (none when it is empty): how the
/// trainer's `Pieces` name an optimizer's range.
fn as_pieces(range: &std::ops::Range<usize>) -> &[std::ops::Range<usize>] {
    match range.is_empty() {
        true => &[],
        false => std::slice::from_ref(range),
    }
}

impl ResidentPath {
    /// The resident path of `config`, on GPU `gpu` where `config.device` is `cuda`
    /// without an index; its loop is made later ([`Trainer::make_resident_loop`]).
    pub(super) fn new(config: &TrainConfig, gpu: usize) -> Result<Self> {
        let on = match crate::device::TrainDevice::parse(&config.device)? {
            crate::device::TrainDevice::Cpu => ResidentOn::Host,
            crate::device::TrainDevice::Cuda(n) => ResidentOn::Cuda {
                gpu: n.unwrap_or(gpu),
                own: n.is_none(),
            },
        };
        let (strategy_kind, optimizer, shape) = loop_kinds(config);
        Ok(ResidentPath {
            run: None,
            plan: LoopPlan {
                on,
                strategy: strategy_kind,
                optimizer,
                shape,
                act: crate::precision::resident_activations(config.precision)?,
                options: config.resident_options(),
                timeout: std::time::Duration::from_secs_f64(config.parallel.timeout_s),
                deterministic: config.parallel.deterministic.then_some(config.batch),
            },
            host_behind: false,
            run_behind: false,
            vars_stale: Cell::new(false),
        })
    }

    /// The loop, once made.
    fn run(&mut self) -> Result<&mut Box<dyn ResidentRun>> {
        self.run.as_mut().ok_or_else(|| {
            TrainError::Strategy(
                "the resident loop is not made yet (Trainer::make_resident_loop)".into(),
            )
        })
    }

    /// The trainer set its master or optimizer buffers: send them down before the next
    /// window.
    pub(super) fn host_changed(&mut self) {
        self.run_behind = true;
        self.host_behind = false;
    }

    /// Whether the trainer's master lags the loop's.
    pub(super) fn host_behind(&self) -> bool {
        self.host_behind
    }

    /// Whether the loop's forward is a collective (ZeRO-3: each block gathered from every
    /// rank), so that every rank must evaluate as many batches.
    pub(super) fn forward_gathers(&self) -> bool {
        self.plan.strategy.shards_params()
    }

    /// One micro-batch's evaluation on the loop's backend.
    pub(super) fn evaluate(&mut self, mb: &MicroBatch) -> Result<(f64, usize, usize)> {
        self.run()?.evaluate((&mb.input, &mb.targets))
    }

    /// Bytes the loop holds on its backend, counted from its buffers (None before it is
    /// made).
    pub(super) fn bytes(&self) -> Option<ResidentBytes> {
        self.run.as_ref().map(|r| r.bytes())
    }

    /// Device memory the loop has taken, from the driver (None on the host build, and
    /// before it is made).
    pub(super) fn measured_bytes(&self) -> Option<usize> {
        self.run.as_ref().and_then(|r| r.measured_bytes())
    }
}

/// The resident loop's strategy, optimizer and training micro-batch shape for `config`.
fn loop_kinds(
    config: &TrainConfig,
) -> (
    stoker_gpu::parallel::Strategy,
    stoker_gpu::step::optimizer::Optimizer,
    (usize, usize),
) {
    let strategy = match (config.parallel.strategy, config.parallel.offload_optimizer) {
        (StrategyKind::Zero1, false) => stoker_gpu::parallel::Strategy::Zero1,
        (StrategyKind::Zero1, true) => stoker_gpu::parallel::Strategy::Zero1Offload,
        (StrategyKind::Zero2, false) => stoker_gpu::parallel::Strategy::Zero2,
        (StrategyKind::Zero2, true) => stoker_gpu::parallel::Strategy::Zero2Offload,
        (StrategyKind::Zero3, false) => stoker_gpu::parallel::Strategy::Zero3,
        (StrategyKind::Zero3, true) => stoker_gpu::parallel::Strategy::Zero3Offload,
        (_, true) => stoker_gpu::parallel::Strategy::Offload,
        _ => stoker_gpu::parallel::Strategy::Ddp,
    };
    let optimizer = match config.optimizer.kind {
        OptimizerKind::Adamw => stoker_gpu::step::optimizer::Optimizer::AdamW,
        // The trainer's SGD keeps its momentum buffer whatever the factor (a checkpoint
        // always has one), so the loop's does too.
        OptimizerKind::Sgd => stoker_gpu::step::optimizer::Optimizer::Sgd { momentum: true },
    };
    let shape = (
        config.batch.micro_batch,
        config.model.context().unwrap_or(1),
    );
    (strategy, optimizer, shape)
}

/// The blocks of `model` as the resident step sizes them: how many, and the elements of
/// one (stoker-gpu's `gpt_block_len`, `llama_block_len`). None for models the step does
/// not run.
pub fn resident_blocks(model: &ModelConfig) -> Option<(usize, usize)> {
    match model {
        ModelConfig::Gpt(g) => {
            let d = g.dims();
            Some((d.n_layer, stoker_gpu::step::gpt::gpt_block_len(&d)))
        }
        ModelConfig::Llama(l) => {
            let d = l.dims();
            Some((d.n_layer, stoker_gpu::step::llama::llama_block_len(&d)))
        }
        ModelConfig::Cnn(_) | ModelConfig::Mlp(_) => None,
    }
}

/// What the resident loop of `config` holds on its backend at rank `rank_world.0` of
/// `rank_world.1`, over a flat layout of `len` elements, planned before it exists from
/// the sizes its buffers are made with (stoker-gpu's `gpt_step_sizes`,
/// `llama_step_sizes`, `DataParallel::planned_bytes`): the optimizer's state and one
/// training step. None where `config` does not run the resident loop.
pub fn planned_resident_bytes(
    config: &TrainConfig,
    len: usize,
    rank_world: (usize, usize),
) -> Option<ResidentBytes> {
    if !config.resident_loop() {
        return None;
    }
    let (strategy, optimizer, (b, t)) = loop_kinds(config);
    let opts = strategy.step_options(config.resident_options(), rank_world);
    let (_, block) = resident_blocks(&config.model)?;
    let sizes = match &config.model {
        ModelConfig::Gpt(g) => stoker_gpu::step::gpt::gpt_step_sizes(&g.dims(), len, (b, t), opts),
        ModelConfig::Llama(l) => {
            stoker_gpu::step::llama::llama_step_sizes(&l.dims(), len, (b, t), opts)
        }
        ModelConfig::Cnn(_) | ModelConfig::Mlp(_) => return None,
    };
    let act_bytes = crate::precision::resident_activations(config.precision)
        .ok()?
        .bytes();
    // A batch that does not resolve at this world fails when the run starts; planned as
    // one micro-batch meanwhile, so a search over micro-batches still sees every size.
    let tree = match config.parallel.deterministic {
        true => stoker_gpu::parallel::grad_tree::GradTree::<stoker_gpu::Host>::planned_bytes(
            len,
            config.batch.resolve(rank_world.1).map_or(1, |r| r.0),
            rank_world.1,
            stoker_gpu::parallel::grad_tree::chunk_for(rank_world.1),
        ),
        false => 0,
    };
    let host = stoker_gpu::parallel::DataParallel::<stoker_gpu::Host>::planned_host_bytes(
        strategy,
        optimizer,
        len,
        rank_world,
        (act_bytes, config.parallel.offload_params),
    ) + sizes.host_bytes(act_bytes);
    Some(ResidentBytes {
        state: stoker_gpu::parallel::DataParallel::<stoker_gpu::Host>::planned_bytes(
            strategy, optimizer, len, rank_world, block,
        ) + tree,
        steps: sizes.bytes(act_bytes),
        host,
    })
}

impl Trainer {
    /// The resident path's optimizer step: the window on the loop's backend at this
    /// step's learning rate, clipped as configured; under fp16 at the loss scaler's scale,
    /// skipped (as the CPU step skips) where the scaled gradients overflowed.
    pub(super) fn resident_step(&mut self, window: &[MicroBatch]) -> Result<StepReport> {
        let step = self.step;
        let lr = self.schedule.lr_at(step);
        self.make_resident_loop()?;
        self.send_down()?;
        let super::StepPath::Resident(path) = &mut self.path else {
            return Err(TrainError::Strategy("not on the resident path".into()));
        };
        // The scalars from the trainer's own optimizer, which counts the update once it
        // has run.
        let scalars = self.optimizer.next_scalars(lr as f32);
        let loss_scale = self.scaler.as_ref().map(|s| s.scale());
        let rule = stoker_gpu::parallel::GradRule {
            clip: (self.grad_clip > 0.0).then_some(self.grad_clip),
            loss_scale,
        };
        // The strategy's statistics count this window's traffic from here: the loop's
        // collectives go through the same communicator (through host memory; NCCL's
        // are not counted).
        self.strategy.begin_window(window.len())?;
        let ids: Vec<_> = window.iter().map(|m| (&m.input, &m.targets[..])).collect();
        let report = path.run()?.window(&ids, &scalars, rule)?;
        self.step += 1;
        let skipped = match &mut self.scaler {
            Some(scaler) => {
                // Every rank saw the same global norm, so every rank decides alike.
                if report.skipped {
                    scaler.note_nonfinite(
                        "(a gradient on the resident loop: its norm overflowed; the loop \
                         does not name parameters)",
                    );
                }
                super::step::scaler_verdict(scaler, report.skipped, self.stop_at_min_scale, step)?
            }
            None => None,
        };
        if !report.skipped {
            self.optimizer.count_update();
            path.host_behind = true;
            path.vars_stale.set(true);
        }
        // A step the scaler skips reports no norm (NaN), as the CPU step does; otherwise a
        // non-finite loss or norm fails it.
        let grad_norm = match skipped {
            Some(_) => f64::NAN,
            None if !report.loss.is_finite() || !report.grad_norm.is_finite() => {
                return Err(TrainError::NonFinite {
                    // Counted from 1, as the step lines, metrics and checkpoints count.
                    step: step + 1,
                    what: match report.loss.is_finite() {
                        true => "gradient",
                        false => "loss",
                    }
                    .into(),
                    param: "(not named: the resident path keeps its gradients on its backend)"
                        .into(),
                });
            }
            None => report.grad_norm,
        };
        Ok(StepReport {
            step: step + 1,
            loss: report.loss,
            count: report.tokens as usize,
            grad_norm,
            lr,
            loss_scale: loss_scale.unwrap_or(1.0),
            skipped,
            sync: self.strategy.stats(),
        })
    }

    /// The trainer's master and optimizer buffers into the resident loop, where they were
    /// set since it last ran.
    pub(super) fn send_down(&mut self) -> Result<()> {
        let super::StepPath::Resident(path) = &mut self.path else {
            return Ok(());
        };
        let Some(run) = path.run.as_mut().filter(|_| path.run_behind) else {
            return Ok(());
        };
        let state = self.optimizer.state_ref();
        let moments: Vec<(&str, &[f32])> = state.buffers.iter().map(|(n, b)| (*n, *b)).collect();
        run.load(&self.params.master, &moments, state.step)?;
        // fp8: the checkpoint's scalers (the trainer keeps them by layer, as the CPU's).
        let names = crate::models::resident_fp8::Fp8Names::of(&self.model_config);
        if let (Some(fp8), Some(now), Some(names)) = (&self.fp8, run.fp8_values()?, names) {
            let values = crate::models::resident_fp8::to_values(&fp8.state(), now.len(), names)?;
            run.load_fp8(&values)?;
        }
        path.run_behind = false;
        Ok(())
    }

    /// On the resident path, brings the trainer's master and optimizer buffers up to the
    /// loop's (under ZeRO-1 a collective: the shards are all-gathered into the master, so
    /// every rank calls it at the same point); elsewhere nothing. Whatever reads
    /// [`Trainer::master`] or the optimizer's state after training steps calls it first
    /// (the run does before its checks, checkpoints and sampling).
    pub fn sync_host(&mut self) -> Result<()> {
        let super::StepPath::Resident(path) = &mut self.path else {
            return Ok(());
        };
        if !path.host_behind {
            return Ok(());
        }
        let state = path.run()?.state()?;
        // fp8: the step's scalers into the trainer's, which checkpoints keep; layers the
        // step has none of (the CPU path's head, from a checkpoint it wrote) are kept.
        let names = crate::models::resident_fp8::Fp8Names::of(&self.model_config);
        if let (Some(fp8), Some(values), Some(names)) =
            (&self.fp8, path.run()?.fp8_values()?, names)
        {
            let mut layers = fp8.state();
            layers.extend(crate::models::resident_fp8::to_layers(&values, names)?);
            fp8.restore(layers);
        }
        let master = &mut self.params.master;
        let pieces = self.optimizer.pieces().clone();
        if pieces.ranges() != as_pieces(&state.range) {
            return Err(TrainError::Layout(format!(
                "the resident loop's optimizer covers {:?}, the trainer's {:?}",
                state.range,
                pieces.ranges()
            )));
        }
        master[state.range.clone()].copy_from_slice(&state.master);
        // ZeRO-1 beyond one rank: the shards all-gathered, a collective every rank joins
        // (decided from the config and the world, the same on every rank).
        if path.plan.sharded() && self.strategy.world_size() > 1 {
            self.strategy.after_update(master)?;
        }
        let step = self.optimizer.state_ref().step;
        let buffers = state
            .moments
            .into_iter()
            .map(|(n, b)| (n.to_string(), b))
            .collect();
        self.optimizer
            .restore(OptimState {
                step,
                pieces,
                buffers,
            })
            .map_err(TrainError::Layout)?;
        path.host_behind = false;
        // The candle variables follow the master on their next use.
        path.vars_stale.set(true);
        Ok(())
    }

    /// On the resident path, makes its loop where it is not made yet: from the trainer's
    /// master, with the optimizer's moments sent down before its first window. A run
    /// calls it before its first step, so that a GPU that cannot be opened fails the run
    /// at once; otherwise the first window or evaluation does.
    pub fn make_resident_loop(&mut self) -> Result<()> {
        let super::StepPath::Resident(path) = &mut self.path else {
            return Ok(());
        };
        if path.run.is_some() {
            return Ok(());
        }
        let (layout, master) = (&self.params.layout, &self.params.master);
        path.run = Some(
            path.plan
                .make(&*self.model, layout, &*self.strategy, master)?,
        );
        // Made with zero moments: a restored optimizer's go down with the master.
        path.run_behind = self.optimizer.state_ref().step > 0;
        path.host_behind = false;
        Ok(())
    }

    /// Whether the trainer's master and optimizer buffers lag the resident loop's (a
    /// window ran since [`Trainer::sync_host`]).
    pub(super) fn host_behind(&self) -> bool {
        matches!(&self.path, super::StepPath::Resident(r) if r.host_behind())
    }
}
