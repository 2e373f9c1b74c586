//! One rank's resident training (the resident path of the chapter's 4.3 and 4.4): a
//! step at one batch shape, its optimizer state under a data-parallel strategy, and a
//! window of micro-batches run as the CPU trainer runs one (stoker-train's
//! `accumulate`): nothing is communicated before the last micro-batch. Each
//! micro-batch's gradient is scaled by 1 / C, C the window's target capacity over every
//! rank (ranks x micro-batches x rows, known to all without asking); the update's one
//! scalar collective sums the valid targets, and the optimizer's multiplier rescales by
//! C / valid, so the step is the mean over the window's valid targets on every rank,
//! whatever the ranks' and micro-batches' shares of them.

use std::ops::Range;

use super::data_parallel::{DataParallel, Strategy};
use super::grad_rule::GradRule;
use super::tally::Tally;
use crate::backend::Backend;
use crate::collectives::Collectives;
use crate::elem::{Act, Dtype};
use crate::error::{check_len, GpuError};
use crate::step::block_runs::outside_blocks;
use crate::step::buffers::{BlockHooks, StepBuffers};
use crate::step::optimizer::{ComputeViews, Optimizer, Scalars, UpdateViews};
use crate::step::sharded_params::ShardedParams;
use crate::step::{GptGpuStep, LlamaGpuStep, TokenBatch};

/// What a replica needs of a step.
pub trait Trainable<B: Backend> {
    /// The compute copy's element type.
    type T: Act;
    /// The step's buffers: where its parameters and gradients live (offloaded, in slots,
    /// sharded).
    fn buffers(&self) -> &StepBuffers<B, Self::T>;
    /// Target positions of one micro-batch (sequences x positions).
    fn rows(&self) -> usize;
    /// Copies the flat FP32 `params` into the compute copy.
    fn load(&self, be: &B, params: &[f32]) -> Result<(), GpuError>;
    /// Sets every gradient to 0.
    fn zero_grads(&self, be: &B) -> Result<(), GpuError>;
    /// Queues one micro-batch: adds its gradient of `grad_scale x (summed loss)`, and
    /// writes its summed loss to the step's loss sum (or adds it, with `add_loss`),
    /// without waiting for the backend; `hooks` run before each block and after each
    /// block's backward has queued its last gradient.
    fn queue_micro_batch(
        &self,
        be: &B,
        micro: (TokenBatch, f32),
        add_loss: bool,
        hooks: BlockHooks<'_>,
    ) -> Result<(), GpuError>;
    /// Starts `batch`'s ids up beside the launches, for the micro-batch after the next
    /// one queued (called before queueing the micro-batch before it).
    fn prefetch_ids(&self, be: &B, batch: TokenBatch) -> Result<(), GpuError>;
    /// Each block's parameters as runs of the flat buffer.
    fn block_runs(&self) -> &[Vec<Range<usize>>];
    /// The loss sum of the micro-batches queued since the last without `add_loss`.
    fn loss_sum(&self, be: &B) -> Result<f64, GpuError>;
    /// That loss sum on the backend (one f32), to copy without waiting.
    fn loss_view(&self, be: &B) -> Result<crate::View<'_, f32>, GpuError>;
    /// The views an update works on.
    fn update_views(&self, be: &B) -> Result<UpdateViews<'_, Self::T>, GpuError>;
    /// One micro-batch's evaluation: the summed loss of its valid targets, how many are
    /// the top-1 logit, how many there are; `hooks` run before each block.
    fn evaluate(
        &self,
        be: &B,
        batch: TokenBatch,
        hooks: BlockHooks<'_>,
    ) -> Result<(f64, usize, usize), GpuError>;
    /// Bytes of the step's buffers on the backend (parameters, gradients, activations,
    /// ids).
    fn buffer_bytes(&self) -> usize;
    /// Bytes of the step's buffers in host memory (an offload's).
    fn buffer_host_bytes(&self) -> usize;
    /// Elements of the flat buffer.
    fn flat_len(&self) -> usize;
    /// Copies `other`'s compute copy (the same model at another batch shape).
    fn copy_params_from(&self, be: &B, other: &Self) -> Result<(), GpuError>;
    /// With the blocks' parameters offloaded, the views an update on the host works on
    /// (the whole gradient gathered there); None without.
    fn host_update_views(&self, be: &B) -> Result<Option<UpdateViews<'_, Self::T>>, GpuError>;
    /// After an update on the host, the backend's part of the compute copy brought up.
    fn after_host_update(&self, be: &B) -> Result<(), GpuError>;
    /// The compute copy and the norm's scratch, for an update from a shard's gradients.
    fn compute_views(&self, be: &B) -> Result<ComputeViews<'_, Self::T>, GpuError>;
    /// ZeRO-3: this rank's shard of the compute copy and the norm's scratch.
    fn shard_compute_views(&self, be: &B) -> Result<ComputeViews<'_, Self::T>, GpuError>;
    /// The FP8 scalers, where the linear layers run in FP8.
    fn fp8_scalers(&self) -> Option<&crate::fp8::Fp8Scalers<B>>;
}

macro_rules! trainable {
    ($t:ident) => {
        impl<B: Backend, T: Act> Trainable<B> for $t<B, T> {
            type T = T;
            fn buffers(&self) -> &StepBuffers<B, T> {
                $t::buffers(self)
            }
            fn rows(&self) -> usize {
                crate::step::buffers::TokenModel::rows_and_vocab(self).0
            }
            fn load(&self, be: &B, params: &[f32]) -> Result<(), GpuError> {
                self.buffers().load_params(be, params)
            }
            fn zero_grads(&self, be: &B) -> Result<(), GpuError> {
                self.buffers().zero_grads(be)
            }
            fn queue_micro_batch(
                &self,
                be: &B,
                micro: (TokenBatch, f32),
                add_loss: bool,
                hooks: BlockHooks<'_>,
            ) -> Result<(), GpuError> {
                $t::queue_micro_batch(self, be, micro, add_loss, hooks)
            }
            fn prefetch_ids(&self, be: &B, batch: TokenBatch) -> Result<(), GpuError> {
                $t::prefetch_ids(self, be, batch)
            }
            fn block_runs(&self) -> &[Vec<Range<usize>>] {
                $t::block_runs(self)
            }
            fn loss_sum(&self, be: &B) -> Result<f64, GpuError> {
                $t::loss_sum(self, be)
            }
            fn loss_view(&self, be: &B) -> Result<crate::View<'_, f32>, GpuError> {
                $t::loss_view(self, be)
            }
            fn update_views(&self, be: &B) -> Result<UpdateViews<'_, T>, GpuError> {
                $t::update_views(self, be)
            }
            fn evaluate(
                &self,
                be: &B,
                batch: TokenBatch,
                hooks: BlockHooks<'_>,
            ) -> Result<(f64, usize, usize), GpuError> {
                $t::evaluate_with(self, be, batch, hooks)
            }
            fn buffer_bytes(&self) -> usize {
                self.buffers().bytes() + $t::fp8_bytes(self)
            }
            fn buffer_host_bytes(&self) -> usize {
                self.buffers().host_bytes()
            }
            fn flat_len(&self) -> usize {
                self.buffers().flat_len()
            }
            fn copy_params_from(&self, be: &B, other: &Self) -> Result<(), GpuError> {
                self.buffers().copy_params_from(be, other.buffers())?;
                // The FP8 scalers belong to the model, not the batch shape: they go on.
                match ($t::fp8_scalers(self), $t::fp8_scalers(other)) {
                    (Some(ours), Some(theirs)) => ours.copy_from(be, theirs),
                    _ => Ok(()),
                }
            }
            fn host_update_views(&self, be: &B) -> Result<Option<UpdateViews<'_, T>>, GpuError> {
                self.buffers().host_update_views(be)
            }
            fn after_host_update(&self, be: &B) -> Result<(), GpuError> {
                self.buffers().after_host_update(be)
            }
            fn compute_views(&self, be: &B) -> Result<ComputeViews<'_, T>, GpuError> {
                $t::compute_views(self, be)
            }
            fn shard_compute_views(&self, be: &B) -> Result<ComputeViews<'_, T>, GpuError> {
                $t::shard_compute_views(self, be)
            }
            fn fp8_scalers(&self) -> Option<&crate::fp8::Fp8Scalers<B>> {
                $t::fp8_scalers(self)
            }
        }
    };
}

trainable!(GptGpuStep);
trainable!(LlamaGpuStep);

/// What one window did, the same on every rank.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WindowReport {
    /// The mean loss over the window's valid targets on every rank.
    pub loss: f64,
    /// The window's valid targets on every rank.
    pub tokens: u64,
    /// The norm of the summed (mean) gradients, before clipping (not finite where an
    /// fp16 overflow skipped the update).
    pub grad_norm: f64,
    /// Whether the update was skipped: under a loss scale, the gradients overflowed
    /// (every rank skips together; the master, moments and compute copy are as they were).
    pub skipped: bool,
}

impl WindowReport {
    /// The report of a window whose summed tally is `total`, whose mean gradient had
    /// norm `grad_norm`, updated under `rule`.
    pub(super) fn of(total: Tally, grad_norm: f64, rule: GradRule) -> Self {
        WindowReport {
            loss: total.loss / total.valid,
            tokens: total.valid as u64,
            grad_norm,
            skipped: rule.skips(grad_norm),
        }
    }
}

/// One rank's resident training.
pub struct Replica<B: Backend, S: Trainable<B>> {
    pub(super) step: S,
    pub(super) state: DataParallel<B>,
    /// The parameters outside every block (embeddings, final norm, head), as runs.
    rest: Vec<Range<usize>>,
    /// Whether DDP's buckets overlap the backward (on by default).
    overlap: bool,
    /// Deterministic mode's sums (`super::deterministic`), if it is on.
    pub(super) tree: Option<std::cell::RefCell<super::grad_tree::GradTree<B>>>,
}

/// Starts the ids of `micro[j + 1]`, if there is one, up beside the launches before
/// `micro[j]` is queued: the next micro-batch's ids copy while this one runs.
pub(crate) fn prefetch_next<B: Backend, S: Trainable<B>>(
    step: &S,
    be: &B,
    micro: &[TokenBatch],
    j: usize,
) -> Result<(), GpuError> {
    match micro.get(j + 1) {
        Some(next) => step.prefetch_ids(be, *next),
        None => Ok(()),
    }
}

impl<B: Backend, S: Trainable<B>> Replica<B, S> {
    /// Rank `rank_world.0` of `rank_world.1`: `step` loaded with `master` (the same on
    /// every rank: seeded alike, or broadcast), and the state of optimizer `kind` over it
    /// with `segments` under `strategy`.
    pub fn new(
        be: &B,
        step: S,
        (strategy, kind): (Strategy, Optimizer),
        master: &[f32],
        segments: &[(Range<usize>, bool)],
        rank_world: (usize, usize),
    ) -> Result<Self, GpuError> {
        step.load(be, master)?;
        let bufs = step.buffers();
        if bufs.grads_in_slots() != strategy.sums_shard_per_block() {
            return Err(GpuError::Shape {
                kernel: "replica",
                what: format!(
                    "ZeRO-2 runs a step with its blocks' gradients in slots, and only ZeRO-2 \
                     does (strategy {strategy:?}, gradients in slots: {})",
                    bufs.grads_in_slots()
                ),
            });
        }
        if bufs.sharded().is_some() != strategy.shards_params() {
            return Err(GpuError::Shape {
                kernel: "replica",
                what: format!(
                    "ZeRO-3 runs a step with its parameters sharded, and only ZeRO-3 does \
                     (strategy {strategy:?}, parameters sharded: {})",
                    bufs.sharded().is_some()
                ),
            });
        }
        if bufs.sharded().is_some_and(|s| s.shard_on_host()) && strategy != Strategy::Zero3Offload {
            return Err(GpuError::Shape {
                kernel: "replica",
                what: format!(
                    "ZeRO-3's shard in host memory is written by the optimizer offloaded \
                     there (Strategy::Zero3Offload), not {strategy:?}"
                ),
            });
        }
        let offloaded = bufs.offload().is_some();
        if offloaded && (strategy != Strategy::Offload || rank_world.1 != 1) {
            return Err(GpuError::Shape {
                kernel: "replica",
                what: format!(
                    "the blocks' parameters offloaded run with the optimizer offloaded \
                     (Strategy::Offload) on one rank, not {strategy:?} on {}",
                    rank_world.1
                ),
            });
        }
        let block_len = step
            .block_runs()
            .iter()
            .map(|b| b.iter().map(|r| r.len()).sum::<usize>())
            .max()
            .unwrap_or(0);
        let state = DataParallel::new(be, strategy, kind, master, segments, rank_world)?
            .accumulating(be, strategy, block_len)?;
        // Only beyond one rank do the buckets run (ZeRO-2's reductions at every world).
        let rest = match rank_world.1 > 1 || strategy.sums_shard_per_block() {
            true => buckets_rest(step.block_runs(), master.len())?,
            false => Vec::new(),
        };
        Ok(Replica {
            step,
            state,
            rest,
            overlap: true,
            tree: None,
        })
    }

    /// This replica with its per-block reductions (DDP's all-reduces, ZeRO-1's
    /// reduce-scatters) started as the last micro-batch's backward finishes each block
    /// (`true`, the default: torch DDP's buckets, DeepSpeed's `overlap_comm`), or one
    /// reduction after the backward (`false`). The same sums on the host, bit for bit;
    /// NCCL's may differ in rounding (its order of adding ranks depends on the size).
    pub fn with_overlap(mut self, overlap: bool) -> Self {
        self.overlap = overlap;
        self
    }

    /// This replica with its bf16 compute copy rounded stochastically under `seed` after
    /// each update (llm.c's AdamW; the same seed on every rank).
    pub fn with_stochastic_rounding(mut self, seed: u64) -> Result<Self, GpuError> {
        if S::T::DTYPE != Dtype::Bf16 {
            return Err(GpuError::Shape {
                kernel: "replica",
                what: format!(
                    "stochastic rounding writes a bf16 compute copy; this step's is {}",
                    S::T::DTYPE.suffix()
                ),
            });
        }
        self.state = self.state.with_stochastic_rounding(seed)?;
        Ok(self)
    }

    /// The step.
    pub fn step(&self) -> &S {
        &self.step
    }

    /// Puts `step` (the same model at another batch shape: a last, shorter batch, an
    /// evaluation's) in the running one's place, its compute copy copied from the running
    /// one on the backend; returns the step it replaced.
    pub fn replace_step(&mut self, be: &B, step: S) -> Result<S, GpuError> {
        if step.block_runs() != self.step.block_runs() {
            return Err(GpuError::Shape {
                kernel: "replica",
                what: "a step of another model's layout in the running step's place".into(),
            });
        }
        step.copy_params_from(be, &self.step)?;
        Ok(std::mem::replace(&mut self.step, step))
    }

    /// Sets the whole flat `master` (a checkpoint's, the same on every rank) as the step's
    /// compute copy and this rank's part of it as the optimizer's master, with the
    /// optimizer's buffers over that part (named and ordered as
    /// [`OptimizerState::moments`](crate::step::optimizer::OptimizerState::moments) gives
    /// them) and `updates` updates taken.
    pub fn load(
        &self,
        be: &B,
        master: &[f32],
        moments: &[(&str, &[f32])],
        updates: u64,
    ) -> Result<(), GpuError> {
        let range = self.state.range();
        check_len("replica", "master", master.len(), self.step.flat_len())?;
        self.step.load(be, master)?;
        self.state
            .state_at()
            .set(be, &master[range], moments, updates)
    }

    /// The optimizer state (this rank's master, or its shard).
    pub fn state(&self) -> &DataParallel<B> {
        &self.state
    }

    /// One window: this rank's `micro` batches (each the step's shape; as many on
    /// every rank), their gradients carrying `rule`'s loss scale, then the update with
    /// `scalars`, clipping the mean gradient's norm as `rule` says (skipped where an fp16
    /// overflow made it non-finite).
    pub fn window(
        &self,
        be: &B,
        coll: &impl Collectives<B>,
        micro: &[TokenBatch],
        scalars: &Scalars,
        rule: GradRule,
    ) -> Result<WindowReport, GpuError> {
        if self.tree.is_some() {
            return self.deterministic_window(be, coll, micro, (scalars, rule));
        }
        if let DataParallel::Zero1(z) = &self.state {
            if z.accumulates() {
                return self.zero2_window(be, coll, z, micro, (scalars, rule));
            }
        }
        let (capacity, grad_scale) = self.scales(coll.world(), micro.len(), rule);
        self.step.zero_grads(be)?;
        let mut tally = Tally::of_micro_batches(micro.len());
        // Queued back to back: the host checks and groups the next micro-batch's ids
        // while the backend runs this one; the window's loss is read once, after. Beyond
        // one rank the last micro-batch's backward starts each block's reduction (DDP's
        // all-reduce, ZeRO-1's reduce-scatter) as soon as the block is done, and the
        // rest follows it.
        let buckets = self.overlap && coll.world() > 1;
        let grads = match buckets {
            true => Some(self.step.update_views(be)?.grads),
            false => None,
        };
        let start = |runs: &[Range<usize>]| -> Result<(), GpuError> {
            let Some(grads) = grads else { return Ok(()) };
            runs.iter().try_for_each(|r| {
                // SAFETY: a block's runs are final when the backward calls back (and the
                // rest when it has returned): nothing queued before `finish` below writes
                // them again, nor ZeRO-1's shard of gradients, and both outlive it.
                unsafe { self.state.start_bucket(be, coll, grads, r.clone()) }
            })
        };
        let mut queued = || -> Result<(), GpuError> {
            for (j, batch) in micro.iter().enumerate() {
                let last = buckets && j + 1 == micro.len();
                let mut after = |_: usize, runs: &[Range<usize>]| start(runs);
                let hooks = BlockHooks {
                    before: None,
                    after: match last {
                        true => Some(&mut after),
                        false => None,
                    },
                };
                prefetch_next(&self.step, be, micro, j)?;
                self.step
                    .queue_micro_batch(be, (*batch, grad_scale), j > 0, hooks)?;
                tally.valid += batch.valid_targets() as f64;
            }
            if buckets {
                // A rank without micro-batches (refused below, with every rank) still
                // joins each block's all-reduce, in the backward's order.
                if micro.is_empty() {
                    for runs in self.step.block_runs().iter().rev() {
                        start(runs)?;
                    }
                }
                start(&self.rest)?;
            }
            Ok(())
        };
        let queued = queued();
        // Whatever failed, the buckets started are waited for before anything else
        // touches (or frees) the gradients.
        if buckets {
            coll.finish(be)?;
        }
        queued?;
        if !micro.is_empty() {
            tally.loss = self.step.loss_sum(be)?;
        }
        let (grad_norm, total) = match self.step.host_update_views(be)? {
            // The blocks' parameters offloaded: the update on the host, the resident
            // part of the compute copy back up.
            Some(host) => {
                let (norm, total) =
                    self.state
                        .update_on_host(be, coll, host, scalars, (tally, capacity), rule)?;
                if !rule.skips(norm) {
                    self.step.after_host_update(be)?;
                }
                (norm, total)
            }
            None => {
                let views = self.step.update_views(be)?;
                self.state
                    .update(be, coll, views, scalars, (tally, capacity), (rule, buckets))?
            }
        };
        self.end_fp8_step(be, coll)?;
        Ok(WindowReport::of(total, grad_norm, rule))
    }

    /// After a window's update, the FP8 scalers' step ended over the ranks: every rank
    /// takes the scales of the largest amax over them (nothing without FP8 layers).
    pub(super) fn end_fp8_step(&self, be: &B, coll: &impl Collectives<B>) -> Result<(), GpuError> {
        match self.step.fp8_scalers() {
            Some(f) => f.end_step_over(be, coll),
            None => Ok(()),
        }
    }

    /// One micro-batch's evaluation with the running step: the summed loss of its valid
    /// targets, how many are the top-1 logit, how many there are. Under ZeRO-3 a
    /// collective (each block gathered as the forward reaches it): every rank evaluates
    /// as many batches.
    pub fn evaluate(
        &self,
        be: &B,
        coll: &impl Collectives<B>,
        batch: TokenBatch,
    ) -> Result<(f64, usize, usize), GpuError> {
        let mut gather = |l: usize, backward: bool| self.gather_around(be, coll, l, backward);
        let hooks = BlockHooks {
            before: match self.sharded().is_some() {
                true => Some(&mut gather),
                false => None,
            },
            after: None,
        };
        // Every rank starts from empty slots: a rank that changed batch shape (another
        // step) since must not skip a gather another rank makes.
        self.forget_slots();
        let evaluated = self.step.evaluate(be, batch, hooks);
        self.settle(be, coll, evaluated.is_err(), None)?;
        evaluated
    }

    /// The running step's sharded compute copy, under ZeRO-3.
    fn sharded(&self) -> Option<&ShardedParams<B, S::T>> {
        self.step.buffers().sharded()
    }

    /// ZeRO-3: forgets which blocks the running step's slots hold.
    fn forget_slots(&self) {
        if let Some(s) = self.sharded() {
            s.forget_slots();
        }
    }

    /// ZeRO-3, before block `l` runs (in the backward when `backward`): the block in its
    /// slot, and the next one's gather started (FSDP's prefetch); nothing unsharded.
    fn gather_around(
        &self,
        be: &B,
        coll: &impl Collectives<B>,
        l: usize,
        backward: bool,
    ) -> Result<(), GpuError> {
        let Some(sharded) = self.sharded() else {
            return Ok(());
        };
        sharded.ensure(be, coll, l)?;
        let next = match backward {
            true => l.checked_sub(1),
            false => Some(l + 1).filter(|&n| n < self.step.block_runs().len()),
        };
        match next {
            Some(n) => sharded.prefetch(be, coll, n),
            None => Ok(()),
        }
    }

    /// After a pass that `failed` midway: every collective in flight ends before
    /// anything touches (or frees) what it reads or writes, and the slots and the block
    /// reductions in flight are forgotten.
    fn settle(
        &self,
        be: &B,
        coll: &impl Collectives<B>,
        failed: bool,
        blocks: Option<&super::landing::BlockReductions<'_, B>>,
    ) -> Result<(), GpuError> {
        if !failed {
            return Ok(());
        }
        // Forgotten first: even if `finish` fails, no later window adds a stale piece.
        self.forget_slots();
        if let Some(b) = blocks {
            b.abandon();
        }
        coll.finish(be)
    }

    /// A window's target capacity over every rank (ranks x `micro` micro-batches x
    /// rows, known to all without asking) and each micro-batch's gradient scale under
    /// `rule` (its loss scale over the capacity).
    pub(super) fn scales(&self, world: usize, micro: usize, rule: GradRule) -> (f64, f32) {
        let capacity = (world * micro * self.step.rows()) as f64;
        let grad_scale = (rule.loss_scale.unwrap_or(1.0) as f64 / capacity.max(1.0)) as f32;
        (capacity, grad_scale)
    }
}

impl<B: Backend, S: Trainable<B>> Replica<B, S> {
    /// ZeRO-2's and ZeRO-3's window (DeepSpeed's stages 2 and 3 under accumulation):
    /// after every micro-batch's backward of each block, its gradients (in the step's
    /// slot) are reduce-scattered and added into the shard's; the runs outside the blocks
    /// sum locally over the window and are reduced once after it. Then the update from
    /// the shard, as ZeRO-1's. Each reduction is ordered with the step's launches, so the
    /// slot is free again before the block after next zeroes it. Under ZeRO-3 each block
    /// is gathered into its slot before it runs, forward and backward, and the update
    /// writes the shard of the compute copy and gathers only the runs outside the blocks.
    fn zero2_window(
        &self,
        be: &B,
        coll: &impl Collectives<B>,
        z: &super::zero1::Zero1<B>,
        micro: &[TokenBatch],
        (scalars, rule): (&Scalars, GradRule),
    ) -> Result<WindowReport, GpuError> {
        let (capacity, grad_scale) = self.scales(coll.world(), micro.len(), rule);
        let mut tally = Tally::of_micro_batches(micro.len());
        // ZeRO-2 reduces after every micro-batch: a rank short of one would wait in a
        // collective the others never start. Every rank checks the counts first (one
        // scalar collective) and refuses together.
        Tally::from_values(&coll.sum(be, &tally.values())?).same_micro_batches(coll.world())?;
        self.step.zero_grads(be)?;
        z.zero_grads(be)?;
        // As in `evaluate`: every rank decides its gathers from the same empty slots.
        self.forget_slots();
        let blocks = z.blocks()?;
        let queued = self.queue_per_block(be, coll, &blocks, (micro, grad_scale), &mut tally);
        self.settle(be, coll, queued.is_err(), Some(&blocks))?;
        queued?;
        for r in &self.rest {
            blocks.reduce_add(
                be,
                coll,
                self.step.buffers().grads_at(be, r.clone())?,
                r.clone(),
            )?;
        }
        if !micro.is_empty() {
            tally.loss = self.step.loss_sum(be)?;
        }
        let window = (tally, capacity);
        let (grad_norm, total) = match self.sharded() {
            None => z.update_shard(
                be,
                coll,
                self.step.compute_views(be)?,
                scalars,
                window,
                rule,
            )?,
            Some(sharded) => {
                let views = (self.step.shard_compute_views(be)?, sharded.shard_on_host());
                let (norm, total, stepped) =
                    z.step_shard(be, coll, views, scalars, window, (rule, None))?;
                if stepped {
                    self.step.buffers().gather_resident(be, coll)?;
                }
                (norm, total)
            }
        };
        self.end_fp8_step(be, coll)?;
        Ok(WindowReport::of(total, grad_norm, rule))
    }
}

impl<B: Backend, S: Trainable<B>> Replica<B, S> {
    /// ZeRO-2's and ZeRO-3's micro-batches: each block's reduction started on the
    /// collectives' stream once its backward is queued (`blocks`), waited for and added
    /// before the block after next zeroes the slot; under ZeRO-3 each block in its slot
    /// before it runs and the next one's gather started. Every reduction added at the end.
    fn queue_per_block(
        &self,
        be: &B,
        coll: &impl Collectives<B>,
        blocks: &super::landing::BlockReductions<'_, B>,
        (micro, grad_scale): (&[TokenBatch], f32),
        tally: &mut Tally,
    ) -> Result<(), GpuError> {
        for (j, batch) in micro.iter().enumerate() {
            let mut before = |l: usize, backward: bool| -> Result<(), GpuError> {
                if backward {
                    // The slot's last reduction lands before the backward zeroes it.
                    blocks.flush(be, coll, l % 2)?;
                }
                self.gather_around(be, coll, l, backward)
            };
            let mut after = |l: usize, runs: &[Range<usize>]| -> Result<(), GpuError> {
                let inputs = runs
                    .iter()
                    .map(|r| Ok((self.step.buffers().grads_at(be, r.clone())?, r)));
                // SAFETY: the block's gradient slot is written next when the backward of
                // the block after next zeroes it, after `before` has flushed this parity
                // (or after the flush below, or a failed window's `finish`); the step
                // outlives the window.
                unsafe { blocks.start_block(be, coll, inputs, l % 2) }
            };
            let hooks = BlockHooks {
                before: Some(&mut before),
                after: Some(&mut after),
            };
            prefetch_next(&self.step, be, micro, j)?;
            self.step
                .queue_micro_batch(be, (*batch, grad_scale), j > 0, hooks)?;
            tally.valid += batch.valid_targets() as f64;
        }
        blocks.flush_all(be, coll)
    }
}

/// The runs of a flat buffer of `end` elements outside every block's runs, after checking
/// that the blocks' runs lie inside it and overlap nowhere (an element reduced twice
/// would be summed twice).
fn buckets_rest(blocks: &[Vec<Range<usize>>], end: usize) -> Result<Vec<Range<usize>>, GpuError> {
    let mut pieces: Vec<&Range<usize>> = blocks.iter().flatten().collect();
    pieces.sort_unstable_by_key(|r| (r.start, r.end));
    let mut at = 0;
    for r in pieces {
        if r.start < at || r.end > end {
            return Err(GpuError::Shape {
                kernel: "replica",
                what: format!(
                    "blocks' parameter run {r:?} overlaps another or passes the buffer's \
                     {end} elements"
                ),
            });
        }
        at = r.end;
    }
    Ok(outside_blocks(blocks, end))
}

#[cfg(test)]
// A block of one run is a Vec holding one Range, not a mistaken range of values.
#[allow(clippy::single_range_in_vec_init)]
mod tests {
    use super::buckets_rest;

    #[test]
    fn overlapping_or_outlying_block_runs_are_refused() {
        assert_eq!(
            buckets_rest(&[vec![2..4], vec![4..6]], 8).unwrap(),
            vec![0..2, 6..8]
        );
        assert!(buckets_rest(&[vec![0..4], vec![2..6]], 8).is_err());
        assert!(buckets_rest(&[vec![0..4, 0..4]], 8).is_err());
        assert!(buckets_rest(&[vec![0..100], vec![5..6]], 50).is_err());
        assert!(buckets_rest(&[vec![4..9]], 8).is_err());
    }
}
