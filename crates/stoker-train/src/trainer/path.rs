//! The step path: how one micro-batch's forward and backward run, chosen once when the
//! strategy is set up, each variant holding exactly what its path needs (llm.c's `GPT2`
//! holds the buffers of its one path; candle picks its backend once with an enum over
//! devices). A new path is a new variant, and the compiler lists every place it must
//! touch: the micro-batch here, the scratch count, evaluation and sampling
//! ([`super::eval`]), and the parameter refresh after the optimizer ([`super::step`]).

use std::cell::Cell;

use candle_core::Device;

use crate::accumulate::{micro_batch, Backward, MicroBatch};
use crate::config::TrainConfig;
use crate::error::{Result, TrainError};
use crate::layout::FlatLayout;
use crate::models::{DirectStep, Model};
use crate::offload::HostStaging;
use crate::parallel::units::{Collective, Scratch, UnitPlan, UnitStep};
use crate::parallel::{GroupSource, ShardedParams, Strategy};
use crate::pieces::Pieces;
use crate::precision::{Fx, Kernels, Precision};

use super::buffers::ParamBuffers;
use super::resident::ResidentPath;

/// How a rank's micro-batch runs.
pub enum StepPath {
    /// Candle's autograd graph over the whole model (any model; one rank, DDP, ZeRO-1/2).
    Graph {
        /// Host buffers a GPU model's gradients come down and parameters go up through
        /// ([`crate::offload`]); None on a CPU.
        staging: Option<HostStaging>,
    },
    /// The model's hand-written step over the whole flat buffers, no autograd graph
    /// (`kernels = "direct"`; one rank, DDP, ZeRO-1, ZeRO-2 with `no_sync`).
    Direct {
        /// The step.
        step: Box<dyn DirectStep>,
        /// Whether the model's variables lag the master (the step does not read them).
        vars_stale: Cell<bool>,
    },
    /// The hand-written step with each parameter group from the strategy's source and
    /// its gradients reduced group by group into this rank's shard as the backward
    /// finishes them (ZeRO-2 reducing every micro-batch; ZeRO-3, which also gathers each
    /// group as the step needs it).
    DirectByGroup {
        /// The step.
        step: Box<dyn DirectStep>,
        /// Whether the model's variables lag the master (ZeRO-2; ZeRO-3 keeps none).
        vars_stale: Cell<bool>,
    },
    /// ZeRO-3 on candle's graph: the model run unit by unit, each unit's groups gathered
    /// as it runs and reduce-scattered as its backward finishes them
    /// ([`crate::parallel::units`]).
    Units {
        /// The units and their schedule.
        plan: UnitPlan,
        /// The most bytes of that workspace held so far.
        peak: usize,
    },
    /// The GPU-design step with the FP32 master, the optimizer and the reductions on its
    /// own backend (a GPU, or the host build on a CPU), a whole window at a time
    /// (`step = "resident"` under one rank, DDP or ZeRO-1; [`super::resident`]).
    Resident(ResidentPath),
}

/// What a micro-batch on any path reads besides the path itself.
pub(super) struct PathInputs<'a> {
    pub model: &'a dyn Model,
    pub model_config: &'a crate::models::ModelConfig,
    pub params: &'a ParamBuffers,
    pub fx: &'a Fx<'a>,
    pub device: &'a Device,
    pub precision: Precision,
    pub kernels: Kernels,
}

impl PathInputs<'_> {
    /// ZeRO-3's unit-by-unit step over `plan`.
    pub fn unit_step<'a>(&'a self, plan: &'a UnitPlan) -> UnitStep<'a> {
        UnitStep {
            plan,
            model: self.model_config,
            precision: self.precision,
            kernels: self.kernels,
            layout: &self.params.layout,
            fx: self.fx,
            own: &self.params.held,
            device: self.device,
        }
    }
}

/// The strategy's group-by-group source, which the direct-by-group path was chosen for.
pub(super) fn by_group(strategy: &mut dyn Strategy) -> Result<&mut dyn GroupSource> {
    let name = strategy.name();
    strategy.by_group().ok_or_else(|| {
        TrainError::Strategy(format!(
            "{name} does not serve the direct step group by group"
        ))
    })
}

/// The strategy's parameter hooks, which a sharded path was chosen for.
pub(super) fn sharded(strategy: &mut dyn Strategy) -> Result<&mut dyn ShardedParams> {
    let name = strategy.name();
    strategy
        .sharded()
        .ok_or_else(|| TrainError::Strategy(format!("{name} does not shard the parameters")))
}

/// A micro-batch whose gradients go into the whole buffer `target`, each group reported
/// to the strategy as it is final where `reduce` (DDP's buckets start as the backward
/// goes).
fn whole_buffers(
    backward: &mut Backward<'_>,
    strategy: &mut dyn Strategy,
    mb: &MicroBatch,
    factor: Option<f64>,
    reduce: bool,
    target: &mut [f32],
) -> Result<f64> {
    let mut failed = None;
    let mut ready = |group: usize, buf: &[f32]| {
        if reduce && failed.is_none() {
            if let Err(e) = strategy.group_ready(group, buf) {
                failed = Some(e);
            }
        }
    };
    let loss = micro_batch(backward, mb, factor, target, &mut ready)?;
    match failed {
        Some(e) => Err(e),
        None => Ok(loss),
    }
}

impl StepPath {
    /// The path `config` asks for with `strategy` (its gradients settled here: where they
    /// go decides between the direct step's two forms), for `model` laid out by `layout`,
    /// its parameters `sharded` over the ranks or not; and the pieces of the flat buffer
    /// the rank's gradient sum holds (none on the resident path, whose gradients stay on
    /// its backend). The resident path runs on GPU `gpu` where the config's device is
    /// `cuda` without an index.
    pub(super) fn choose(
        config: &TrainConfig,
        model: &dyn Model,
        layout: &FlatLayout,
        strategy: &mut dyn Strategy,
        sharded: bool,
        device: &Device,
        gpu: usize,
    ) -> Result<(StepPath, Pieces)> {
        if config.resident_loop() {
            let path = ResidentPath::new(config, gpu)?;
            return Ok((StepPath::Resident(path), Pieces::new([])));
        }
        let direct = match (
            config.resident_step(),
            config.kernels.direct_step(config.precision),
        ) {
            (true, _) => Some(
                model
                    .resident_step(
                        layout,
                        (
                            crate::precision::resident_activations(config.precision)?,
                            config.resident_options(),
                        ),
                    )?
                    .ok_or_else(|| {
                        TrainError::Strategy(
                            "step = \"resident\": this model has no GPU step".into(),
                        )
                    })?,
            ),
            (false, true) => model.direct_step(layout, config.direct_bf16_operands())?,
            (false, false) => None,
        };
        let grad_held = strategy.settle_grads(layout.total_len(), direct.is_some())?;
        let vars_stale = Cell::new(false);
        let path = match (direct, sharded) {
            (Some(step), _) if strategy.by_group().is_some() => {
                StepPath::DirectByGroup { step, vars_stale }
            }
            (Some(step), false) => StepPath::Direct { step, vars_stale },
            (Some(_), true) => {
                return Err(TrainError::Strategy(format!(
                    "{} shards the parameters but does not reduce the direct step by group",
                    strategy.name()
                )))
            }
            (None, true) => StepPath::Units {
                plan: UnitPlan::of(
                    model,
                    layout,
                    config.parallel.reshard_after_forward,
                    config.kernels.param_dtype(config.precision).size_in_bytes(),
                )?,
                peak: 0,
            },
            (None, false) => StepPath::Graph {
                staging: match device.is_cpu() {
                    true => None,
                    false => Some(HostStaging::for_params(model.params(), layout)?),
                },
            },
        };
        Ok((path, grad_held))
    }

    /// One micro-batch's forward and backward: its gradients of `factor x (summed loss)`
    /// added into `target` (the gradient sum's buffer for it), or reduced group by group
    /// into it; the strategy hears of each group as it is final where `reduce`, and
    /// completes the micro-batch's reductions. Returns the summed loss. `check_grads`
    /// fails naming a parameter no gradient reached (the graph's first step).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn micro_batch(
        &mut self,
        on: &PathInputs<'_>,
        strategy: &mut dyn Strategy,
        mb: &MicroBatch,
        factor: Option<f64>,
        reduce: bool,
        target: &mut [f32],
        check_grads: bool,
    ) -> Result<f64> {
        let master = &on.params.master;
        let loss = match self {
            StepPath::Resident(_) => {
                return Err(TrainError::Strategy(
                    "the resident path runs whole windows (Trainer::train_step), not one \
                     micro-batch"
                        .into(),
                ))
            }
            StepPath::DirectByGroup { step, .. } => {
                let mut source = by_group(strategy)?.step_source(master, target);
                let mut backward = Backward::Sharded {
                    step: &mut **step,
                    source: &mut *source,
                };
                micro_batch(&mut backward, mb, factor, &mut [], &mut |_, _| {})?
            }
            StepPath::Units { plan, peak } => {
                let unit_step = on.unit_step(plan);
                let mut source = Collective::new(sharded(strategy)?, master, target);
                crate::parallel::units::micro_batch(
                    &unit_step,
                    &mut source,
                    mb,
                    factor,
                    check_grads,
                    peak,
                )?
            }
            StepPath::Direct { step, .. } => {
                let mut backward = Backward::Direct {
                    step: &mut **step,
                    master,
                };
                whole_buffers(&mut backward, strategy, mb, factor, reduce, target)?
            }
            StepPath::Graph { staging } => {
                let mut backward = Backward::Graph {
                    model: on.model,
                    fx: on.fx,
                    layout: &on.params.layout,
                    check_grads,
                    staging: staging.as_mut(),
                };
                whole_buffers(&mut backward, strategy, mb, factor, reduce, target)?
            }
        };
        if reduce {
            strategy.finish_micro_batch(target)?;
        }
        Ok(loss)
    }

    /// Runs micro-batch `mb`'s forward and backward into `grads` and changes no state:
    /// no collective (a strategy reducing by group runs its schedule over a communicator
    /// that moves no data, [`GroupSource::scratch_source`](crate::parallel::GroupSource::scratch_source); ZeRO-3's units run on zeros), for a
    /// caller that counts what one step allocates. Returns the bytes of predicted workspace
    /// held meanwhile (the strategy's groups, ZeRO-3's units), which a count must not
    /// take twice.
    pub(super) fn scratch(
        &mut self,
        on: &PathInputs<'_>,
        strategy: &mut dyn Strategy,
        mb: &MicroBatch,
        factor: Option<f64>,
        grads: &mut [f32],
    ) -> Result<usize> {
        let f = factor.unwrap_or(0.0) as f32;
        let master = &on.params.master;
        match self {
            StepPath::Resident(_) => Err(TrainError::Strategy(
                "the resident path's steps change its backend's state: no scratch step".into(),
            )),
            StepPath::DirectByGroup { step, .. } => {
                let (mut source, predicted) = by_group(strategy)?.scratch_source(master, grads)?;
                step.forward_backward_groups(&mut *source, &mb.input, &mb.targets, f)?;
                Ok(predicted)
            }
            StepPath::Direct { step, .. } => {
                step.forward_backward(master, &mb.input, &mb.targets, f, grads, &mut |_, _| {})?;
                Ok(0)
            }
            StepPath::Units { plan, .. } => {
                let unit_step = on.unit_step(plan);
                let mut scratch = Scratch::new(&on.params.held);
                let mut peak = 0;
                crate::parallel::units::micro_batch(
                    &unit_step,
                    &mut scratch,
                    mb,
                    factor,
                    true,
                    &mut peak,
                )?;
                Ok(plan.peak_bytes(&on.params.held))
            }
            StepPath::Graph { staging } => {
                let mut backward = Backward::Graph {
                    model: on.model,
                    fx: on.fx,
                    layout: &on.params.layout,
                    check_grads: false,
                    staging: staging.as_mut(),
                };
                micro_batch(&mut backward, mb, factor, grads, &mut |_, _| {})?;
                Ok(0)
            }
        }
    }

    /// The direct step, on either of its paths.
    pub(super) fn direct_step(&mut self) -> Option<&mut dyn DirectStep> {
        match self {
            StepPath::Direct { step, .. } | StepPath::DirectByGroup { step, .. } => {
                Some(&mut **step)
            }
            _ => None,
        }
    }

    /// Whether the path runs the hand-written direct step.
    pub fn is_direct(&self) -> bool {
        matches!(
            self,
            StepPath::Direct { .. } | StepPath::DirectByGroup { .. }
        )
    }

    /// A name for logs: `graph`, `direct`, `direct by group`, `units`, `resident`.
    pub fn name(&self) -> &'static str {
        match self {
            StepPath::Graph { .. } => "graph",
            StepPath::Direct { .. } => "direct",
            StepPath::DirectByGroup { .. } => "direct by group",
            StepPath::Units { .. } => "units",
            StepPath::Resident(_) => "resident",
        }
    }

    /// ZeRO-3's units on the graph path.
    pub(super) fn units(&self) -> Option<&UnitPlan> {
        match self {
            StepPath::Units { plan, .. } => Some(plan),
            _ => None,
        }
    }

    /// The most bytes ZeRO-3's units held at once so far (0 on other paths).
    pub(super) fn unit_peak(&self) -> usize {
        match self {
            StepPath::Units { peak, .. } => *peak,
            _ => 0,
        }
    }

    /// Bytes of the direct step's activation buffers now (0 elsewhere).
    pub(super) fn activation_bytes(&self) -> usize {
        match self {
            StepPath::Direct { step, .. } | StepPath::DirectByGroup { step, .. } => {
                step.activation_bytes()
            }
            StepPath::Resident(r) => r.bytes().map_or(0, |b| b.steps),
            _ => 0,
        }
    }

    /// The host staging of a GPU model on the graph path.
    pub(super) fn staging(&self) -> Option<&HostStaging> {
        match self {
            StepPath::Graph { staging } => staging.as_ref(),
            _ => None,
        }
    }

    /// The host staging, mutably.
    pub(super) fn staging_mut(&mut self) -> Option<&mut HostStaging> {
        match self {
            StepPath::Graph { staging } => staging.as_mut(),
            _ => None,
        }
    }

    /// Sends the graph path's gradients and parameters through `staging`.
    pub(super) fn stage_through(&mut self, staging: HostStaging) -> Result<()> {
        match self {
            StepPath::Graph { staging: s } => {
                *s = Some(staging);
                Ok(())
            }
            other => Err(TrainError::Strategy(format!(
                "host staging serves the graph path of an unsharded model, not the {} path",
                other.name()
            ))),
        }
    }

    /// The trainer set its master or optimizer state: the resident loop takes them before
    /// its next window.
    pub(super) fn host_changed(&mut self) {
        if let StepPath::Resident(r) = self {
            r.host_changed();
        }
    }

    /// The resident path.
    pub(super) fn resident(&mut self) -> Option<&mut ResidentPath> {
        match self {
            StepPath::Resident(r) => Some(r),
            _ => None,
        }
    }

    /// Whether the model's variables lag the master.
    pub(super) fn vars_stale(&self) -> bool {
        match self {
            StepPath::Direct { vars_stale, .. } | StepPath::DirectByGroup { vars_stale, .. } => {
                vars_stale.get()
            }
            StepPath::Resident(r) => r.vars_stale.get(),
            _ => false,
        }
    }

    /// The model's variables were just refreshed from the master.
    pub(super) fn vars_fresh(&self) {
        self.mark_vars(false)
    }

    /// The direct step moved the master on without the model's variables.
    pub(super) fn vars_left_behind(&self) {
        self.mark_vars(true)
    }

    fn mark_vars(&self, stale: bool) {
        match self {
            StepPath::Direct { vars_stale, .. } | StepPath::DirectByGroup { vars_stale, .. } => {
                vars_stale.set(stale)
            }
            StepPath::Resident(r) => r.vars_stale.set(stale),
            _ => {}
        }
    }
}
