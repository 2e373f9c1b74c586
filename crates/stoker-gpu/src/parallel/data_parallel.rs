//! The update after a window on every rank, by strategy: DDP (the gradients all-reduced,
//! every rank updating the whole master, as torch's DistributedDataParallel), ZeRO-1
//! ([`Zero1`]), or DDP with the master and the optimizer in host memory ([`Offloaded`]).
//! At one rank each is the single-device update.

use std::ops::Range;

use super::collectives::Collectives;
use super::offload::Offloaded;
use super::tally::Tally;
use super::zero1::Zero1;
use crate::backend::{Backend, View};
use crate::elem::Act;
use crate::error::GpuError;
use crate::host::Host;
use crate::step::optimizer::{self, Optimizer, OptimizerState, Scalars, UpdateViews};

/// A rank's master and the optimizer's buffers by name, read back.
pub type MasterAndMoments = (Vec<f32>, Vec<(&'static str, Vec<f32>)>);

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
}

/// One rank's optimizer state under a [`Strategy`].
pub enum DataParallel<B: Backend> {
    /// DDP: the whole state.
    Ddp(OptimizerState<B>),
    /// ZeRO-1: this rank's shard.
    Zero1(Zero1<B>),
    /// The whole state, in host memory.
    Offload(Offloaded),
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
        Ok(match strategy {
            Strategy::Ddp => DataParallel::Ddp(OptimizerState::new(be, kind, master, segments)?),
            Strategy::Zero1 | Strategy::Zero1Offload => {
                let offload = strategy == Strategy::Zero1Offload;
                let z = Zero1::new(be, kind, master, segments, rank_world, offload)?;
                DataParallel::Zero1(z)
            }
            Strategy::Offload => DataParallel::Offload(Offloaded::new(kind, master, segments)?),
        })
    }

    /// Bytes rank `rank_world.0` of `rank_world.1`'s state of `kind` over a flat buffer of
    /// `len` elements holds under `strategy`, planned before it exists (the counted side
    /// is [`DataParallel::bytes`]): DDP the whole master and moments, ZeRO-1 its shard of
    /// them and of the gradients.
    pub fn planned_bytes(
        strategy: Strategy,
        kind: Optimizer,
        len: usize,
        (rank, world): (usize, usize),
    ) -> usize {
        match strategy {
            Strategy::Ddp => kind.state_bytes(len),
            Strategy::Offload => 0,
            Strategy::Zero1 | Strategy::Zero1Offload => {
                let shard = super::zero1::shard_plan(len, world)
                    .range(rank.min(world.max(1) - 1))
                    .len();
                let state = match strategy {
                    Strategy::Zero1 => kind.state_bytes(shard),
                    _ => 0,
                };
                state + 4 * shard
            }
        }
    }

    /// This state with the bf16 compute copy rounded stochastically under `seed` (AdamW;
    /// every rank and shard counting as the whole buffer does).
    pub fn with_stochastic_rounding(self, seed: u64) -> Result<Self, GpuError> {
        Ok(match self {
            DataParallel::Ddp(opt) => {
                let whole = (opt.len(), 0);
                DataParallel::Ddp(opt.with_stochastic_rounding(seed, whole)?)
            }
            DataParallel::Zero1(z) => DataParallel::Zero1(z.with_stochastic_rounding(seed)?),
            DataParallel::Offload(o) => {
                let whole = (o.optimizer().len(), 0);
                DataParallel::Offload(o.with_stochastic_rounding(seed, whole)?)
            }
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
                DataParallel::Ddp(_) | DataParallel::Offload(_) => {
                    coll.start_all_reduce(be, grads.slice(run)?)
                }
                DataParallel::Zero1(z) => z.start_bucket(be, coll, grads, run),
            }
        }
    }

    /// The range of the flat buffer this rank's master covers, and its values.
    pub fn master(&self, be: &B) -> Result<(Range<usize>, Vec<f32>), GpuError> {
        match self {
            DataParallel::Ddp(opt) => Ok((0..opt.len(), opt.master(be)?)),
            DataParallel::Zero1(z) => Ok((z.shard(), z.master(be)?)),
            DataParallel::Offload(o) => {
                let opt = o.optimizer();
                Ok((0..opt.len(), opt.master(&Host)?))
            }
        }
    }

    /// This rank's master and the optimizer's buffers (named as a checkpoint names them),
    /// read back from wherever they live.
    pub fn read_state(&self, be: &B) -> Result<MasterAndMoments, GpuError> {
        match self {
            DataParallel::Ddp(opt) => Ok((opt.master(be)?, opt.moments(be)?)),
            DataParallel::Zero1(z) => z.read_state(be),
            DataParallel::Offload(o) => {
                let opt = o.optimizer();
                Ok((opt.master(&Host)?, opt.moments(&Host)?))
            }
        }
    }

    /// Sets this rank's master and the optimizer's buffers (as [`Self::read_state`]
    /// names and orders them), `updates` updates into the run.
    pub fn set_state(
        &self,
        be: &B,
        master: &[f32],
        moments: &[(&str, &[f32])],
        updates: u64,
    ) -> Result<(), GpuError> {
        match self {
            DataParallel::Ddp(opt) => opt.set(be, master, moments, updates),
            DataParallel::Zero1(z) => z.set_state(be, master, moments, updates),
            DataParallel::Offload(o) => o.optimizer().set(&Host, master, moments, updates),
        }
    }

    /// The range of the flat buffer this rank's master and moments cover.
    pub fn range(&self) -> Range<usize> {
        match self {
            DataParallel::Ddp(opt) => 0..opt.len(),
            DataParallel::Zero1(z) => z.shard(),
            DataParallel::Offload(o) => 0..o.optimizer().len(),
        }
    }

    /// Bytes of this rank's master, optimizer state (and ZeRO-1's shard of gradients) on
    /// the backend: none where they are offloaded.
    pub fn bytes(&self) -> usize {
        match self {
            DataParallel::Ddp(opt) => opt.bytes(),
            DataParallel::Zero1(z) => z.bytes(),
            DataParallel::Offload(_) => 0,
        }
    }

    /// Bytes it holds in host memory: the offloaded master, moments, gradients copied
    /// down and compute copy (none otherwise).
    pub fn host_bytes(&self) -> usize {
        match self {
            DataParallel::Ddp(_) => 0,
            DataParallel::Zero1(z) => z.host_bytes(),
            DataParallel::Offload(o) => o.host_bytes(),
        }
    }

    /// The update of `views` (this rank's accumulated gradients, each micro-batch's
    /// scaled by 1 / `capacity`; already reduced when `reduced`, as the window's buckets
    /// leave them) with this rank's `tally`: the reduction over `coll`'s
    /// ranks, the tallies summed (one scalar collective), the gradients rescaled to the
    /// mean over the valid targets inside the optimizer's multiplier, the optimizer.
    /// Returns the unscaled norm of the mean gradient (before clipping) and the summed
    /// tally.
    pub fn update<T: Act>(
        &self,
        be: &B,
        coll: &impl Collectives<B>,
        views: UpdateViews<T>,
        scalars: &Scalars,
        (tally, capacity): (Tally, f64),
        (clip, reduced): (Option<f64>, bool),
    ) -> Result<(f64, Tally), GpuError> {
        match self {
            DataParallel::Ddp(opt) => {
                let (unscale, total) =
                    reduce_as_ddp(be, coll, views.grads, (tally, capacity), reduced)?;
                let norm = optimizer::update(be, opt, views, scalars, unscale, clip)?;
                Ok((norm, total))
            }
            DataParallel::Zero1(z) => {
                z.update(be, coll, views, scalars, (tally, capacity), (clip, reduced))
            }
            DataParallel::Offload(o) => {
                o.update(be, coll, views, scalars, (tally, capacity), (clip, reduced))
            }
        }
    }
}

/// DDP's side of an update, before the optimizer: the tallies summed over the ranks (one
/// scalar collective), the gradients' rescale to the mean over the valid targets, and
/// the gradients all-reduced unless the window's buckets did (`reduced`). Returns the
/// rescale and the summed tally.
pub(super) fn reduce_as_ddp<B: Backend>(
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
