//! The update after a window on every rank, by strategy: DDP (the gradients all-reduced,
//! every rank updating the whole master, as torch's DistributedDataParallel), ZeRO-1
//! ([`Zero1`]); either with the master and the optimizer's state in host memory
//! ([`StateAt`], ZeRO-Offload). At one rank each is the single-device update.

use std::ops::Range;

use super::grad_rule::GradRule;
use super::state_at::StateAt;
use super::tally::Tally;
use super::zero1::Zero1;
use crate::backend::{Backend, View};
use crate::collectives::Collectives;
use crate::elem::Act;
use crate::error::GpuError;
use crate::host::Host;
use crate::step::optimizer::{self, Optimizer, Scalars, UpdateViews};
use crate::step::options::StepOptions;

/// Which data parallelism a replica runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// Every rank holds the whole master and optimizer state.
    Ddp,
    /// Each rank holds its shard of them.
    Zero1,
    /// Every rank holds the whole master and optimizer state in host memory, stepped by
    /// the host (ZeRO-Offload; DeepSpeed's `offload_optimizer`).
    Offload,
    /// ZeRO-1 with each rank's shard of the master and optimizer state in host memory,
    /// stepped by the host (DeepSpeed's stage 1 with `offload_optimizer`).
    Zero1Offload,
    /// ZeRO-2: ZeRO-1's shard, and the gradients reduce-scattered block by block after
    /// every micro-batch's backward, so that no rank holds them whole (the step keeps
    /// its blocks' gradients in two slots).
    Zero2,
    /// ZeRO-2 with each rank's shard of the master and optimizer state in host memory
    /// (DeepSpeed's stage 2 with `offload_optimizer`, ZeRO-Offload's own setting).
    Zero2Offload,
    /// ZeRO-3: ZeRO-2's shards, and the compute copy sharded too, each block's
    /// parameters gathered into a slot just before it runs, forward and backward
    /// ([`crate::step::sharded_params`]).
    Zero3,
    /// ZeRO-3 with each rank's shard of the master and optimizer state in host memory
    /// (DeepSpeed's stage 3 with `offload_optimizer`).
    Zero3Offload,
}

impl Strategy {
    /// Whether the gradients are reduce-scattered block by block after every
    /// micro-batch (ZeRO-2, offloaded or not): its step keeps them in two slots.
    pub fn sums_shard_per_block(self) -> bool {
        matches!(
            self,
            Strategy::Zero2 | Strategy::Zero2Offload | Strategy::Zero3 | Strategy::Zero3Offload
        )
    }

    /// Whether the compute copy is sharded too (ZeRO-3, offloaded or not): its step
    /// keeps the blocks' parameters in two slots, gathered as they run.
    pub fn shards_params(self) -> bool {
        matches!(self, Strategy::Zero3 | Strategy::Zero3Offload)
    }

    /// `opts` with what this strategy's step needs on rank `rank_world.0` of
    /// `rank_world.1`: ZeRO-2's gradients in slots, ZeRO-3's parameters sharded (and
    /// neither for any other strategy).
    pub fn step_options(self, opts: StepOptions, rank_world: (usize, usize)) -> StepOptions {
        StepOptions {
            grads_in_slots: matches!(self, Strategy::Zero2 | Strategy::Zero2Offload),
            shard_params: self.shards_params().then_some(rank_world),
            ..opts
        }
    }

    /// Whether the master and the optimizer's state are in host memory.
    pub fn offloads_optimizer(self) -> bool {
        matches!(
            self,
            Strategy::Offload
                | Strategy::Zero1Offload
                | Strategy::Zero2Offload
                | Strategy::Zero3Offload
        )
    }
}

/// One rank's optimizer state under a [`Strategy`].
pub enum DataParallel<B: Backend> {
    /// DDP: the whole state (on the backend, or offloaded).
    Ddp(StateAt<B>),
    /// ZeRO-1: this rank's shard (likewise).
    Zero1(Zero1<B>),
}

impl<B: Backend> DataParallel<B> {
    /// Rank `rank` of `world`'s state of `kind` over `master` (the same on every rank)
    /// with its `segments`.
    pub fn new(
        be: &B,
        strategy: Strategy,
        kind: Optimizer,
        master: &[f32],
        segments: &[(Range<usize>, bool)],
        rank_world: (usize, usize),
    ) -> Result<Self, GpuError> {
        let offload = strategy.offloads_optimizer();
        Ok(match strategy {
            Strategy::Ddp | Strategy::Offload => {
                DataParallel::Ddp(StateAt::new(be, kind, master, segments, offload)?)
            }
            // ZeRO-2's and -3's landing buffers come with the step's block size
            // ([`Self::accumulating`]).
            _ => DataParallel::Zero1(Zero1::new(be, kind, master, segments, rank_world, offload)?),
        })
    }

    /// ZeRO-2 and -3 ([`Strategy::sums_shard_per_block`]): this ZeRO-1 state summing per-block
    /// reductions, with a landing buffer for pieces of at most `block_len` elements (the
    /// step's largest block). Anything else is as it was.
    pub fn accumulating(
        self,
        be: &B,
        strategy: Strategy,
        block_len: usize,
    ) -> Result<Self, GpuError> {
        Ok(match (self, strategy.sums_shard_per_block()) {
            (DataParallel::Zero1(z), true) => DataParallel::Zero1(z.accumulating(be, block_len)?),
            (other, _) => other,
        })
    }

    /// Bytes rank `rank_world.0` of `rank_world.1`'s state of `kind` over a flat buffer of
    /// `len` elements holds under `strategy`, planned before it exists (the counted side
    /// is [`DataParallel::bytes`]): DDP the whole master and moments, ZeRO-1 its shard of
    /// them and of the gradients, ZeRO-2 and -3 also their two landing buffers (from
    /// `block_len`, the step's largest block; ZeRO-3's shard of the compute copy is the
    /// step's).
    pub fn planned_bytes(
        strategy: Strategy,
        kind: Optimizer,
        len: usize,
        (rank, world): (usize, usize),
        block_len: usize,
    ) -> usize {
        match strategy {
            Strategy::Ddp => kind.state_bytes(len),
            Strategy::Offload => 0,
            _ => {
                let shard = crate::collectives::shard_len(len, (rank, world));
                let state = match strategy.offloads_optimizer() {
                    true => 0,
                    false => kind.state_bytes(shard),
                };
                // ZeRO-2 lands each reduction beside the shard's sums.
                let grads = match strategy.sums_shard_per_block() {
                    true => shard + 2 * super::landing::landing_len(shard, block_len),
                    false => shard,
                };
                state + 4 * grads
            }
        }
    }

    /// Bytes this rank holds in host memory for `strategy` and optimizer `kind` over a
    /// flat buffer of `len` elements, its compute copy of `elem` bytes an element, with
    /// the blocks' parameters offloaded where `params_offloaded`: the offloaded master and
    /// moments (this rank's shard, beyond DDP), and the buffers its updates copy through
    /// ([`Offloaded::planned_host_bytes`]). [`DataParallel::host_bytes`] counts the same.
    pub fn planned_host_bytes(
        strategy: Strategy,
        kind: Optimizer,
        len: usize,
        rank_world: (usize, usize),
        (elem, params_offloaded): (usize, bool),
    ) -> usize {
        if !strategy.offloads_optimizer() {
            return 0;
        }
        let piece = match strategy {
            Strategy::Offload => len,
            _ => crate::collectives::shard_len(len, rank_world),
        };
        // With the parameters offloaded, one rank's update steps the host's whole copy
        // and sum in place; ZeRO-3's copies its shard's gradients down and writes the
        // shard where it lives.
        let copies = match (params_offloaded, strategy.shards_params()) {
            (false, _) => (true, Some(elem)),
            (true, true) => (true, None),
            (true, false) => (false, None),
        };
        super::offload::Offloaded::<B>::planned_host_bytes(kind, piece, copies)
    }

    /// This state with the bf16 compute copy rounded stochastically under `seed` (AdamW;
    /// every rank and shard counting as the whole buffer does).
    pub fn with_stochastic_rounding(self, seed: u64) -> Result<Self, GpuError> {
        Ok(match self {
            DataParallel::Ddp(state) => {
                let whole = (state.len(), 0);
                DataParallel::Ddp(state.with_stochastic_rounding(seed, whole)?)
            }
            DataParallel::Zero1(z) => DataParallel::Zero1(z.with_stochastic_rounding(seed)?),
        })
    }

    /// Starts the reduction of the gradients in `run` (a block's, or the rest): DDP's
    /// all-reduce, or ZeRO-1's reduce-scatter into this rank's shard.
    ///
    /// # Safety
    /// As [`Collectives::start_all_reduce`]: the run's gradients (and ZeRO-1's shard of
    /// gradients) stay unwritten and alive until `finish`.
    pub unsafe fn start_bucket(
        &self,
        be: &B,
        coll: &impl Collectives<B>,
        grads: View<f32>,
        run: Range<usize>,
    ) -> Result<(), GpuError> {
        // SAFETY: the caller's contract, passed on.
        unsafe {
            match self {
                DataParallel::Ddp(_) => coll.start_all_reduce(be, grads.slice(run)?),
                DataParallel::Zero1(z) => z.start_bucket(be, coll, grads, run),
            }
        }
    }

    /// The range of the flat buffer this rank's master covers, and its values.
    pub fn master(&self, be: &B) -> Result<(Range<usize>, Vec<f32>), GpuError> {
        Ok((self.range(), self.state_at().master(be)?))
    }

    /// This rank's master and moments (DDP's whole, ZeRO-1's shard), wherever they live:
    /// to read back or set from a checkpoint.
    pub fn state_at(&self) -> &StateAt<B> {
        match self {
            DataParallel::Ddp(state) => state,
            DataParallel::Zero1(z) => z.state(),
        }
    }

    /// The range of the flat buffer this rank's master and moments cover.
    pub fn range(&self) -> Range<usize> {
        match self {
            DataParallel::Ddp(state) => 0..state.len(),
            DataParallel::Zero1(z) => z.shard(),
        }
    }

    /// Bytes of this rank's master, optimizer state (and ZeRO-1's shard of gradients) on
    /// the backend: none where they are offloaded.
    pub fn bytes(&self) -> usize {
        match self {
            DataParallel::Ddp(state) => state.bytes(),
            DataParallel::Zero1(z) => z.bytes(),
        }
    }

    /// Bytes of this rank's offloaded state in host memory, and the buffers its updates
    /// made there ([`DataParallel::planned_host_bytes`]).
    pub fn host_bytes(&self) -> usize {
        match self {
            DataParallel::Ddp(state) => state.host_bytes(),
            DataParallel::Zero1(z) => z.host_bytes(),
        }
    }

    /// The update of `views` (this rank's accumulated gradients, each micro-batch's
    /// scaled by `rule`'s loss scale / `capacity`; already reduced when `reduced`, as the
    /// window's buckets leave them) with this rank's `tally`: the reduction over `coll`'s
    /// ranks, the tallies summed (one scalar collective), the gradients rescaled to the
    /// mean over the valid targets, unscaled and clipped inside the optimizer's
    /// multiplier, the optimizer (skipped, on every rank alike, where `rule` skips).
    /// Returns the unscaled norm of the mean gradient (before clipping) and the summed
    /// tally.
    pub fn update<T: Act>(
        &self,
        be: &B,
        coll: &impl Collectives<B>,
        views: UpdateViews<T>,
        scalars: &Scalars,
        (tally, capacity): (Tally, f64),
        (rule, reduced): (GradRule, bool),
    ) -> Result<(f64, Tally), GpuError> {
        match self {
            DataParallel::Ddp(state) => {
                let (rescale, total) =
                    reduce_as_ddp(be, coll, views.grads, (tally, capacity), reduced)?;
                let squares =
                    optimizer::squared_norm(be, views.grads, (views.squares, views.partials))?;
                let (norm, mult) = rule.multiplier(squares, rescale);
                if let Some(mult) = mult {
                    state.apply(be, views.params, views.grads, scalars, mult)?;
                }
                Ok((norm, total))
            }
            DataParallel::Zero1(z) => {
                z.update(be, coll, views, scalars, (tally, capacity), (rule, reduced))
            }
        }
    }
}

impl<B: Backend> DataParallel<B> {
    /// The update of a step whose blocks' parameters are offloaded: `host` (views of
    /// host memory) holds the whole compute copy and the window's summed gradient, each
    /// micro-batch's scaled as [`DataParallel::update`] says. One rank, the optimizer
    /// offloaded (the replica checks both when it is made): the tally's collective, the
    /// norm and the optimizer all on the host, the same kernels' host build, so the
    /// result is an update without the offload bit for bit. Returns the unscaled norm of
    /// the mean gradient and the summed tally.
    pub fn update_on_host<T: Act>(
        &self,
        be: &B,
        coll: &impl Collectives<B>,
        host: UpdateViews<T>,
        scalars: &Scalars,
        (tally, capacity): (Tally, f64),
        rule: GradRule,
    ) -> Result<(f64, Tally), GpuError> {
        let DataParallel::Ddp(StateAt::Host(offloaded)) = self else {
            return Err(GpuError::Shape {
                kernel: "replica",
                what: "an update on the host needs the optimizer offloaded".into(),
            });
        };
        let total = Tally::from_values(&coll.sum(be, &tally.values())?);
        let rescale = total.rescale(coll.world(), capacity)?;
        let squares = optimizer::squared_norm(&Host, host.grads, (host.squares, host.partials))?;
        let (norm, mult) = rule.multiplier(squares, rescale);
        if let Some(mult) = mult {
            offloaded.step_in_host_memory(host.grads, host.params, scalars, mult)?;
        }
        Ok((norm, total))
    }
}

/// DDP's side of an update, before the optimizer: the tallies summed over the ranks (one
/// scalar collective), the gradients' rescale to the mean over the valid targets, and
/// the gradients all-reduced unless the window's buckets did (`reduced`). Returns the
/// rescale and the summed tally.
fn reduce_as_ddp<B: Backend>(
    be: &B,
    coll: &impl Collectives<B>,
    grads: View<f32>,
    (tally, capacity): (Tally, f64),
    reduced: bool,
) -> Result<(f32, Tally), GpuError> {
    let total = Tally::from_values(&coll.sum(be, &tally.values())?);
    let unscale = total.rescale(coll.world(), capacity)?;
    if coll.world() > 1 && !reduced {
        coll.all_reduce(be, grads)?;
    }
    Ok((unscale, total))
}
