//! ZeRO-3's compute copy on one rank (DeepSpeed's `stage: 3`, FSDP's `FULL_SHARD`): the
//! rank keeps its shard of the flat compute copy (ZeRO's split, [`shard_plan`]), the runs
//! outside every block whole (FSDP's root unit, which stays unsharded between forward
//! and backward), and two slots each for a block's parameters and gradients
//! ([`ParamSlots`]). Before block `l` runs, forward or backward, its runs are all-gathered
//! into slot `l % 2` from every rank's shard; after an update each rank has written its
//! shard, and the resident runs are gathered again. A block's gradients are the ZeRO-2
//! replica's to reduce-scatter after its backward.
//!
//! With the parameters offloaded too (`StepOptions::offload_params`: FSDP's `FULL_SHARD`
//! with `CPUOffload(offload_params=True)`, DeepSpeed's stage 3 with `offload_param`) the
//! shard lives in host memory: a gather stages this rank's piece up from there, and the
//! offloaded optimizer writes it in place ([`crate::parallel::StateAt::apply_into_host`]).
//!
//! So a rank holds on the backend the resident runs, two blocks, `1 / world` of the
//! rest (none of it with the shard on the host), and the activations: per micro-batch each block is gathered twice (its forward
//! and its backward) and its gradients reduce-scattered once, ZeRO-3's 1.5x the
//! communication of DDP.
//!
//! The slots remember which block they hold, and a block still in its slot is not
//! gathered again: the forward's last two blocks are the backward's first two, and the
//! backward's last two the next micro-batch's first two, so a micro-batch of `L >= 2`
//! blocks gathers `2L - 4` times, the first of a window `2L - 2` (a window and an
//! evaluation start from empty slots, so that every rank, whatever steps it made for
//! other batch shapes since, makes the same gathers). The next block's gather starts on
//! the collectives' own stream while this block runs ([`ShardedParams::prefetch`], FSDP's
//! forward and backward prefetch); a block waits for its own before it runs
//! ([`ShardedParams::ensure`]).

use std::cell::Cell;
use std::ops::Range;

use stoker_comm::shard::ShardPlan;

use super::param_slots::ParamSlots;
use super::placement::Placement;
use crate::backend::{Backend, View};
use crate::collectives::{shard_plan, Collectives, Mark};
use crate::elem::Act;
use crate::error::{check_len, GpuError};
use crate::host::Host;
use crate::pinned::PinnedHostBuf;

/// One rank's ZeRO-3 compute copy: see the module docs.
pub struct ShardedParams<B: Backend, T: Act> {
    slots: ParamSlots<B, T>,
    plan: ShardPlan,
    rank: usize,
    /// This rank's shard of the compute copy.
    shard: ShardAt<B, T>,
    /// What each slot holds.
    held: Cell<[Option<Held>; 2]>,
}

/// A slot's block, and the mark of its gather while it may still be running.
type Held = (usize, Option<Mark>);

/// Where a rank's shard of the compute copy lives.
enum ShardAt<B: Backend, T: Act> {
    /// On the backend.
    Backend(B::Buf<T>),
    /// In host memory pinned for the backend (the parameters offloaded): a gather's
    /// copy up reads it directly.
    Host(PinnedHostBuf<B, T>),
}

impl<B: Backend, T: Act> ShardedParams<B, T> {
    /// Rank `rank` of `world`'s copy of a flat buffer of `end` elements whose blocks hold
    /// `blocks`, its shard in host memory where `on_host`.
    pub(crate) fn new(
        be: &B,
        blocks: &[Vec<Range<usize>>],
        end: usize,
        (rank, world): (usize, usize),
        on_host: bool,
    ) -> Result<Self, GpuError> {
        if rank >= world {
            return Err(GpuError::Shape {
                kernel: "zero-3",
                what: format!("rank {rank} of a world of {world}"),
            });
        }
        let plan = shard_plan(end, world);
        Ok(ShardedParams {
            slots: ParamSlots::new(be, blocks, end)?,
            shard: match on_host {
                true => ShardAt::Host(PinnedHostBuf::zeros(be, plan.range(rank).len())?),
                false => ShardAt::Backend(be.zeros(plan.range(rank).len())?),
            },
            plan,
            rank,
            held: Cell::new([None, None]),
        })
    }

    /// The parameter and gradient slots.
    pub(crate) fn slots(&self) -> &ParamSlots<B, T> {
        &self.slots
    }

    /// Where the flat buffer's runs live on the backend.
    pub fn placement(&self) -> &Placement {
        self.slots.placement()
    }

    /// The range of the flat buffer this rank's shard covers.
    pub fn shard_range(&self) -> Range<usize> {
        self.plan.range(self.rank)
    }

    /// This rank's shard of the compute copy: what its optimizer writes (a view of host
    /// memory where [`Self::shard_on_host`], once no copy up reads it).
    pub fn shard(&self, be: &B) -> Result<View<'_, T>, GpuError> {
        Ok(match &self.shard {
            ShardAt::Backend(b) => be.all(b),
            ShardAt::Host(h) => h.settled(be)?,
        })
    }

    /// Whether the shard lives in host memory (the parameters offloaded).
    pub fn shard_on_host(&self) -> bool {
        matches!(self.shard, ShardAt::Host(_))
    }

    /// Elements of the flat buffer.
    pub(crate) fn flat_len(&self) -> usize {
        self.plan.len()
    }

    /// Block `l`'s parameters gathered into its slot from every rank's shard (a
    /// collective: every rank calls it, block for block), at once; [`Self::ensure`]
    /// records it.
    fn gather_block(&self, be: &B, coll: &impl Collectives<B>, l: usize) -> Result<(), GpuError> {
        self.check_world(coll)?;
        for (r, o) in self.placement().block(l) {
            self.gather_run(be, coll, r, self.slots.param_run(be, l, (r, *o))?)?;
        }
        Ok(())
    }

    /// Block `l` in its slot, before it runs: waited for if its gather was started, else
    /// gathered now (a collective: every rank calls it, block for block, and every rank
    /// decides alike whether it gathers).
    pub fn ensure(&self, be: &B, coll: &impl Collectives<B>, l: usize) -> Result<(), GpuError> {
        let mut held = self.held.get();
        match held[l % 2] {
            Some((b, pending)) if b == l => {
                if let Some(mark) = pending {
                    coll.wait(be, mark)?;
                }
            }
            Some((_, Some(mark))) => {
                coll.wait(be, mark)?;
                self.gather_block(be, coll, l)?;
            }
            _ => self.gather_block(be, coll, l)?,
        }
        held[l % 2] = Some((l, None));
        self.held.set(held);
        Ok(())
    }

    /// Starts gathering block `l` into its slot, unless it is there, without holding back
    /// the launches after. On a device the gather runs on the collectives' own stream;
    /// the replica's collectives on the compute stream (the update's) come only after
    /// every mark has been waited for, so the two streams never hold NCCL calls that wait
    /// on each other. The caller has queued every use of the block the slot held
    /// (the one before the block about to run, whichever way the pass goes).
    pub fn prefetch(&self, be: &B, coll: &impl Collectives<B>, l: usize) -> Result<(), GpuError> {
        let mut held = self.held.get();
        match held[l % 2] {
            Some((b, _)) if b == l => return Ok(()),
            // Another block's gather still in flight into this slot: it lands first.
            Some((_, Some(mark))) => coll.wait(be, mark)?,
            _ => {}
        }
        self.check_world(coll)?;
        for (r, o) in self.placement().block(l) {
            let dst = self.slots.param_run(be, l, (r, *o))?;
            self.own_piece_into(be, r, dst)?;
            // SAFETY: nothing touches the slot until `ensure(l)` waits for the mark below
            // (a slot changes block only through `ensure` and `prefetch`, which wait for
            // a gather in flight first, and the step reads a block's parameters only after
            // `ensure`); the slot lives as long as the step.
            unsafe { coll.start_all_gather(be, dst, &self.plan.counts_within(r))? };
        }
        held[l % 2] = Some((l, Some(coll.mark(be)?)));
        self.held.set(held);
        Ok(())
    }

    /// Forgets what the slots hold: the shards changed (an update, a load), or a pass
    /// failed midway (after the collectives' `finish`).
    pub fn forget_slots(&self) {
        self.held.set([None, None]);
    }

    /// The runs outside every block gathered into `resident` from every rank's shard
    /// (a collective), after an update has written the shards (which leaves the slots
    /// stale: they are forgotten).
    pub fn gather_resident(
        &self,
        be: &B,
        coll: &impl Collectives<B>,
        resident: &B::Buf<T>,
    ) -> Result<(), GpuError> {
        self.forget_slots();
        self.check_world(coll)?;
        for (r, o) in self.placement().resident() {
            self.gather_run(be, coll, r, be.view(resident, *o..o + r.len())?)?;
        }
        Ok(())
    }

    /// The flat run `r` into `dst` (as long): this rank's piece of it from the shard into
    /// its place, then every rank's piece gathered (`coll` checked by the caller).
    fn gather_run(
        &self,
        be: &B,
        coll: &impl Collectives<B>,
        r: &Range<usize>,
        dst: View<T>,
    ) -> Result<(), GpuError> {
        self.own_piece_into(be, r, dst)?;
        coll.all_gather(be, dst, &self.plan.counts_within(r))
    }

    /// This rank's piece of the flat run `r` copied from the shard into its place in
    /// `dst` (as long as `r`).
    fn own_piece_into(&self, be: &B, r: &Range<usize>, dst: View<T>) -> Result<(), GpuError> {
        check_len("zero-3", "run", dst.len(), r.len())?;
        let local = self.plan.local_within(self.rank, r);
        if !local.is_empty() {
            let at = self.plan.range(self.rank).start + local.start - r.start;
            let dst = dst.slice(at..at + local.len())?;
            match &self.shard {
                ShardAt::Backend(b) => be.copy(dst, be.view(b, local)?)?,
                // From pinned memory, queued behind the launches before it.
                ShardAt::Host(h) => h.copy_to(be, local, dst)?,
            }
        }
        Ok(())
    }

    /// `coll` is the world this shard was cut for, at its rank.
    fn check_world(&self, coll: &impl Collectives<B>) -> Result<(), GpuError> {
        if coll.rank() != self.rank || coll.world() != self.plan.world() {
            return Err(GpuError::Shape {
                kernel: "zero-3",
                what: format!(
                    "a shard of rank {} of {} gathered by rank {} of {}",
                    self.rank,
                    self.plan.world(),
                    coll.rank(),
                    coll.world()
                ),
            });
        }
        Ok(())
    }

    /// Sets the shard and the resident runs (`resident`) from the whole FP32 `master`,
    /// rounded to `T`.
    pub(crate) fn load(
        &self,
        be: &B,
        resident: &B::Buf<T>,
        master: &[f32],
    ) -> Result<(), GpuError> {
        check_len("zero-3", "params", master.len(), self.plan.len())?;
        self.forget_slots();
        let round = |xs: &[f32]| -> Vec<T> { xs.iter().map(|&x| T::from_f32(x)).collect() };
        let shard = round(&master[self.shard_range()]);
        match &self.shard {
            ShardAt::Backend(b) => be.write(b, 0, &shard)?,
            ShardAt::Host(h) => Host.write_at(h.settled(be)?, &shard)?,
        }
        for (r, o) in self.placement().resident() {
            be.write(resident, *o, &round(&master[r.clone()]))?;
        }
        Ok(())
    }

    /// The shard's compute copy, widened to f32.
    pub fn shard_values(&self, be: &B) -> Result<Vec<f32>, GpuError> {
        let values = match &self.shard {
            ShardAt::Backend(b) => be.download(b)?,
            ShardAt::Host(h) => Host.read(h.all()?)?,
        };
        Ok(values.into_iter().map(T::to_f32).collect())
    }

    /// Copies `other`'s shard (the same model and rank at another batch shape).
    pub(crate) fn copy_shard_from(&self, be: &B, other: &Self) -> Result<(), GpuError> {
        self.forget_slots();
        match (&self.shard, &other.shard) {
            (ShardAt::Backend(a), ShardAt::Backend(b)) => be.copy(be.all(a), be.all(b)),
            (ShardAt::Host(a), ShardAt::Host(b)) => Host.copy(a.settled(be)?, b.all()?),
            _ => Err(GpuError::Shape {
                kernel: "zero-3",
                what: "copying a shard between a step with its parameters offloaded and one \
                       without"
                    .into(),
            }),
        }
    }

    /// Bytes in host memory: the shard where it lives there.
    pub(crate) fn host_bytes(&self) -> usize {
        match &self.shard {
            ShardAt::Backend(_) => 0,
            ShardAt::Host(h) => h.bytes(),
        }
    }

    /// Bytes on the backend: the slots and the shard unless it is in host memory (the
    /// resident runs are the step's own buffers).
    pub(crate) fn backend_bytes(&self) -> usize {
        let shard = match &self.shard {
            ShardAt::Backend(b) => B::len(b) * std::mem::size_of::<T>(),
            ShardAt::Host(_) => 0,
        };
        self.slots.bytes() + shard
    }
}
