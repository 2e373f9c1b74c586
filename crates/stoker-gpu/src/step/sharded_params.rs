//! ZeRO-3's compute copy on one rank (DeepSpeed's `stage: 3`, FSDP's `FULL_SHARD`): the
//! rank keeps its shard of the flat compute copy (ZeRO's split, [`shard_plan`]), the runs
//! outside every block whole (FSDP's root unit, which stays unsharded between forward
//! and backward), and two slots each for a block's parameters and gradients
//! ([`ParamSlots`]). Before block `l` runs, forward or backward, its runs are all-gathered
//! into slot `l % 2` from every rank's shard; after an update each rank has written its
//! shard, and the resident runs are gathered again. A block's gradients are the ZeRO-2
//! replica's to reduce-scatter after its backward.
//!
//! So a rank holds on the backend the resident runs, two blocks, `1 / world` of the
//! rest, and the activations: per micro-batch each block is gathered twice (its forward
//! and its backward) and its gradients reduce-scattered once, ZeRO-3's 1.5x the
//! communication of DDP.

use std::ops::Range;

use stoker_comm::shard::ShardPlan;

use super::param_slots::ParamSlots;
use super::placement::Placement;
use crate::backend::{Backend, View};
use crate::collectives::{shard_plan, Collectives};
use crate::elem::Act;
use crate::error::{check_len, GpuError};

/// One rank's ZeRO-3 compute copy: see the module docs.
pub struct ShardedParams<B: Backend, T: Act> {
    slots: ParamSlots<B, T>,
    plan: ShardPlan,
    rank: usize,
    /// This rank's shard of the compute copy.
    shard: B::Buf<T>,
}

impl<B: Backend, T: Act> ShardedParams<B, T> {
    /// Rank `rank` of `world`'s copy of a flat buffer of `end` elements whose blocks hold
    /// `blocks`.
    pub(crate) fn new(
        be: &B,
        blocks: &[Vec<Range<usize>>],
        end: usize,
        (rank, world): (usize, usize),
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
            shard: be.zeros(plan.range(rank).len())?,
            plan,
            rank,
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

    /// This rank's shard of the compute copy: what its optimizer writes.
    pub fn shard(&self, be: &B) -> View<'_, T> {
        be.all(&self.shard)
    }

    /// Elements of the flat buffer.
    pub(crate) fn flat_len(&self) -> usize {
        self.plan.len()
    }

    /// Block `l`'s parameters gathered into its slot from every rank's shard (a
    /// collective: every rank calls it, block for block).
    pub fn gather_block(
        &self,
        be: &B,
        coll: &impl Collectives<B>,
        l: usize,
    ) -> Result<(), GpuError> {
        for (r, o) in self.placement().block(l) {
            self.gather_run(be, coll, r, self.slots.param_run(be, l, (r, *o))?)?;
        }
        Ok(())
    }

    /// The runs outside every block gathered into `resident` from every rank's shard
    /// (a collective), after an update has written the shards.
    pub fn gather_resident(
        &self,
        be: &B,
        coll: &impl Collectives<B>,
        resident: &B::Buf<T>,
    ) -> Result<(), GpuError> {
        for (r, o) in self.placement().resident() {
            self.gather_run(be, coll, r, be.view(resident, *o..o + r.len())?)?;
        }
        Ok(())
    }

    /// The flat run `r` into `dst` (as long): this rank's piece of it from the shard into
    /// its place, then every rank's piece gathered.
    fn gather_run(
        &self,
        be: &B,
        coll: &impl Collectives<B>,
        r: &Range<usize>,
        dst: View<T>,
    ) -> Result<(), GpuError> {
        check_len("zero-3", "run", dst.len(), r.len())?;
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
        let local = self.plan.local_within(self.rank, r);
        if !local.is_empty() {
            let at = self.plan.range(self.rank).start + local.start - r.start;
            be.copy(
                dst.slice(at..at + local.len())?,
                be.view(&self.shard, local)?,
            )?;
        }
        coll.all_gather(be, dst, &self.plan.counts_within(r))
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
        let round = |xs: &[f32]| -> Vec<T> { xs.iter().map(|&x| T::from_f32(x)).collect() };
        be.write(&self.shard, 0, &round(&master[self.shard_range()]))?;
        for (r, o) in self.placement().resident() {
            be.write(resident, *o, &round(&master[r.clone()]))?;
        }
        Ok(())
    }

    /// The shard's compute copy, widened to f32.
    pub fn shard_values(&self, be: &B) -> Result<Vec<f32>, GpuError> {
        Ok(be
            .download(&self.shard)?
            .into_iter()
            .map(T::to_f32)
            .collect())
    }

    /// Copies `other`'s shard (the same model and rank at another batch shape).
    pub(crate) fn copy_shard_from(&self, be: &B, other: &Self) -> Result<(), GpuError> {
        check_len("zero-3", "shard", B::len(&self.shard), B::len(&other.shard))?;
        be.copy(be.all(&self.shard), be.all(&other.shard))
    }

    /// Bytes on the backend: the slots and the shard (the resident runs are the step's
    /// own buffers).
    pub(crate) fn backend_bytes(&self) -> usize {
        self.slots.bytes() + B::len(&self.shard) * std::mem::size_of::<T>()
    }
}
