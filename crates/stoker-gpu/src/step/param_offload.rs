//! Parameter offload for a step (FSDP's `CPUOffload(offload_params=True)`, DeepSpeed's
//! `offload_param`): the whole compute copy lives in host memory (pinned for the
//! backend, [`PinnedHostBuf`]: the copies up read it directly), and so do the blocks'
//! gradients, summed over a window there. The backend holds the runs outside every block
//! (embeddings, final norm, head: [`Placement`]'s resident buffer, with their gradients)
//! and two slots for the blocks' parameters and two for their gradients. Block `l` runs
//! in slot `l % 2`, forward and backward:
//! - while block `l` runs, the next block's parameters go up into the other slot
//!   ([`Backend::start_write_from_pin`]: on a device, on the copy stream beside `l`'s
//!   kernels),
//!   and the next block's launches wait for that copy alone. A slot that already holds
//!   its block (the last two blocks at the turn from forward to backward, the first two
//!   at the next micro-batch) is not copied again; an update on the host forgets them;
//! - before block `l`'s backward its gradient slot is zeroed; after it the slot starts
//!   down ([`Backend::start_read`]), and the block before's gradients, down by then, are
//!   added into the host's sum while the device runs on.
//!
//! The activations stay on the backend, as FSDP's do.
//!
//! What stays on the backend is the resident runs, two blocks' parameters (compute type)
//! and gradients (f32), and the activations: a model of `n` blocks holds `2 / n` of its
//! blocks' weights there. The update then runs on the host over the host's copy (the
//! optimizer offloaded too, [`crate::parallel::Offloaded`]), and the resident runs go
//! back up.

use std::cell::{Cell, RefCell};
use std::ops::Range;

use super::optimizer::UpdateViews;
use super::param_slots::ParamSlots;
use super::placement::Placement;
use crate::backend::Backend;
use crate::elem::Act;
use crate::error::{check_len, GpuError};
use crate::host::{Host, HostBuf};
use crate::kernels;
use crate::pinned::PinnedHostBuf;

/// Host bytes of an offload of a flat buffer of `end` elements whose blocks' slot holds
/// `slot`, with `partials` f32s of norm scratch and a compute copy of `elem` bytes an
/// element ([`ParamOffload::host_bytes`] counts the same).
pub(crate) fn planned_host_bytes(end: usize, slot: usize, partials: usize, elem: usize) -> usize {
    crate::pinned::planned_bytes(end, elem)
        + 4 * end
        + 2 * crate::pinned::planned_bytes(slot, 4)
        + 4 * (1 + partials)
}

/// A step's offloaded parameters: see the module docs.
pub struct ParamOffload<B: Backend, T: Act> {
    // The copies in flight come first: they drop (a device's wait for them) before the
    // slots they copy into or out of.
    /// The block whose parameters are going up into its slot, and its runs' writes.
    landing: RefCell<Option<(usize, Vec<B::PendingWrite>)>>,
    /// The block whose gradients are going down (the last backward's: each leave
    /// finishes the one before), and its runs' reads.
    leaving: RefCell<Option<(usize, Vec<B::PendingRead>)>>,
    /// The block whose parameters each slot holds (landed, or landing); None where
    /// the host's copy changed since.
    in_slot: [Cell<Option<usize>>; 2],
    /// The blocks' parameter and gradient slots, and where every run lives.
    slots: ParamSlots<B, T>,
    /// The whole compute copy (the flat layout), in host memory pinned for the backend:
    /// a block's copy up reads it directly.
    host_params: PinnedHostBuf<B, T>,
    /// The whole gradient (the flat layout), summed over a window in host memory: the
    /// blocks' after each backward, the resident runs' when an update gathers them.
    host_grads: HostBuf<f32>,
    /// A block's gradients read down, straight into pinned memory, one for each slot: a
    /// block's read lands while the block before's is added.
    host_scratch: [PinnedHostBuf<B, f32>; 2],
    /// The host norm's scratch: one f32, then the per-warp partial sums.
    host_floats: HostBuf<f32>,
}

impl<B: Backend, T: Act> ParamOffload<B, T> {
    /// The offload of a flat buffer of `end` elements whose blocks hold `blocks`, with
    /// `partials` f32s of scratch for the host's norm.
    pub(crate) fn new(
        be: &B,
        blocks: &[Vec<Range<usize>>],
        end: usize,
        partials: usize,
    ) -> Result<Self, GpuError> {
        let slots = ParamSlots::new(be, blocks, end)?;
        let slot = slots.placement().slot_len();
        Ok(ParamOffload {
            landing: RefCell::new(None),
            leaving: RefCell::new(None),
            in_slot: [Cell::new(None), Cell::new(None)],
            slots,
            host_params: PinnedHostBuf::zeros(be, end)?,
            host_grads: Host.zeros(end)?,
            host_scratch: [
                PinnedHostBuf::zeros(be, slot)?,
                PinnedHostBuf::zeros(be, slot)?,
            ],
            host_floats: Host.zeros(1 + partials)?,
        })
    }

    /// Where the flat buffer's runs live on the backend.
    pub fn placement(&self) -> &Placement {
        self.slots.placement()
    }

    /// Elements of the flat buffer.
    pub(crate) fn flat_len(&self) -> usize {
        self.host_params.len()
    }

    /// The blocks' parameter and gradient slots.
    pub(crate) fn slots(&self) -> &ParamSlots<B, T> {
        &self.slots
    }

    /// Before block `l` runs (its backward when `backward`): its parameters in its slot
    /// for the launches that follow (their copy waited for, or made now), for the
    /// backward its gradient slot zeroed, then the next block's parameters started up
    /// into the other slot.
    pub(crate) fn enter_block(&self, be: &B, l: usize, backward: bool) -> Result<(), GpuError> {
        self.bring(be, l)?;
        if backward {
            // The slot's last gradients (two blocks back) are read before it is zeroed.
            self.finish_leaving(be, |m| m % 2 == l % 2)?;
            self.slots.grad_slots().zero(be, l)?;
        }
        match self.next_block(l, backward) {
            Some(next) => self.start_up(be, next),
            None => Ok(()),
        }
    }

    /// After block `l`'s backward: its gradients start down from its slot, and every
    /// block's before it (down by now, or soon) are added into the host's sum.
    pub(crate) fn leave_block(&self, be: &B, l: usize) -> Result<(), GpuError> {
        let mut reads = Vec::new();
        let scratch = &self.host_scratch[l % 2];
        for (r, o) in self.placement().block(l) {
            let v = self.slots.grad_slots().slot_run(be, l, (r, *o))?;
            // SAFETY: the slot is written next by block l - 2's backward, whose zeroing
            // first finishes this read (`enter_block`), and so is the scratch's range
            // (this block's runs' places in its slot, disjoint), which nothing else
            // touches until then; the slots and the scratch live as long as `self`,
            // whose `leaving` drops first.
            reads.push(unsafe { scratch.start_read_into(be, v, *o..o + r.len())? });
        }
        self.finish_leaving(be, |_| true)?;
        *self.leaving.borrow_mut() = Some((l, reads));
        Ok(())
    }

    /// The block that runs after block `l` (its backward when `backward`) in a
    /// micro-batch: the next forward block, the backward's second block at the turn
    /// (the backward's first is `l` itself), the backward's next; none after block 0's
    /// backward (the next micro-batch starts where this one ends).
    fn next_block(&self, l: usize, backward: bool) -> Option<usize> {
        let blocks = self.placement().blocks();
        match backward {
            false if l + 1 < blocks => Some(l + 1),
            false => blocks.checked_sub(2),
            true => l.checked_sub(1),
        }
    }

    /// Starts block `m`'s parameters up into its slot, where it does not hold them.
    fn start_up(&self, be: &B, m: usize) -> Result<(), GpuError> {
        let slot = &self.in_slot[m % 2];
        if slot.get() == Some(m) {
            return Ok(());
        }
        self.land(be)?;
        // Until every run is on its way the slot holds no one block (an error midway
        // leaves it mixed).
        slot.set(None);
        let mut writes = Vec::new();
        for (r, o) in self.placement().block(m) {
            let dst = self.slots.param_run(be, m, (r, *o))?;
            // SAFETY: nothing touches slot m % 2 until block m runs, after `bring` waits
            // for this write: the launches queued before it have read the slot (the copy
            // starts after them), and those queued until `bring` are another block's, in
            // the other slot. The slots live as long as `self`, whose `landing` drops
            // first. The host's copy is written only after `settle`, which lands this.
            writes.push(unsafe { self.host_params.start_copy_to(be, r.clone(), dst)? });
        }
        slot.set(Some(m));
        *self.landing.borrow_mut() = Some((m, writes));
        Ok(())
    }

    /// Block `l`'s parameters in its slot, ordered before the launches that follow.
    fn bring(&self, be: &B, l: usize) -> Result<(), GpuError> {
        if self.in_slot[l % 2].get() != Some(l) {
            self.start_up(be, l)?;
        }
        self.land(be)
    }

    /// Orders the launches that follow after the parameters landing, if any.
    fn land(&self, be: &B) -> Result<(), GpuError> {
        let Some((m, writes)) = self.landing.borrow_mut().take() else {
            return Ok(());
        };
        let waited = crate::backend::wait_writes(be, writes);
        if waited.is_err() {
            // Not landed: the slot holds no one block.
            self.in_slot[m % 2].set(None);
        }
        waited
    }

    /// Adds into the host's sum the gradients of the leaving block, where `which` picks
    /// it, once they are down.
    fn finish_leaving(&self, be: &B, which: impl Fn(usize) -> bool) -> Result<(), GpuError> {
        let picked = {
            let mut leaving = self.leaving.borrow_mut();
            match &*leaving {
                Some((m, _)) if which(*m) => leaving.take(),
                _ => None,
            }
        };
        let Some((m, reads)) = picked else {
            return Ok(());
        };
        let scratch = &self.host_scratch[m % 2];
        for ((r, o), read) in self.placement().block(m).iter().zip(reads) {
            let src = self.slots.grad_slots().slot_run(be, m, (r, *o))?;
            let place = *o..o + r.len();
            scratch.finish_read_into(be, read, src, place.clone())?;
            let down = scratch.view(place)?;
            kernels::add_into(&Host, Host.view(&self.host_grads, r.clone())?, down)?;
        }
        Ok(())
    }

    /// The copies in flight ended: the gradients down added, the parameters landed, and
    /// the slots forgotten where `forget` (the host's copy is about to change).
    fn settle(&self, be: &B, forget: bool) -> Result<(), GpuError> {
        if forget {
            // First, so that an error below leaves no slot claiming a stale block.
            self.in_slot.iter().for_each(|s| s.set(None));
        }
        self.finish_leaving(be, |_| true)?;
        self.land(be)
    }

    /// Sets the whole compute copy from the FP32 master `master` (rounded to `T`), and
    /// the resident runs on the backend (`resident`).
    pub(crate) fn load(
        &self,
        be: &B,
        resident: &B::Buf<T>,
        master: &[f32],
    ) -> Result<(), GpuError> {
        check_len("step", "params", master.len(), self.host_params.len())?;
        // The copies in flight read the host's copy: they end before it changes.
        self.settle(be, true)?;
        let copy: Vec<T> = master.iter().map(|&x| T::from_f32(x)).collect();
        Host.write_at(self.host_params.settled(be)?, &copy)?;
        self.resident_up(be, resident)
    }

    /// The resident runs of the host's compute copy up into `resident` (after an update
    /// on the host).
    pub(crate) fn resident_up(&self, be: &B, resident: &B::Buf<T>) -> Result<(), GpuError> {
        // The host's copy has changed (or is about to): the slots' blocks are stale.
        self.settle(be, true)?;
        for (r, o) in self.placement().resident() {
            let dst = be.view(resident, *o..o + r.len())?;
            self.host_params.copy_to(be, r.clone(), dst)?;
        }
        Ok(())
    }

    /// The whole compute copy, widened to f32.
    pub(crate) fn host_params(&self) -> Result<Vec<f32>, GpuError> {
        Ok(Host
            .read(self.host_params.all()?)?
            .into_iter()
            .map(T::to_f32)
            .collect())
    }

    /// The resident runs' gradients (`resident`) down into the host's sum: the whole
    /// gradient is then on the host.
    pub(crate) fn gather_grads(&self, be: &B, resident: &B::Buf<f32>) -> Result<(), GpuError> {
        self.settle(be, false)?;
        for (r, o) in self.placement().resident() {
            let dst = Host.view(&self.host_grads, r.clone())?;
            Host.copy_from(dst, be, be.view(resident, *o..o + r.len())?)?;
        }
        Ok(())
    }

    /// The whole gradient after [`Self::gather_grads`] (f32, the flat layout).
    pub(crate) fn host_grads(&self) -> Result<Vec<f32>, GpuError> {
        Host.download(&self.host_grads)
    }

    /// Every gradient to 0, here and on the backend (`resident`).
    pub(crate) fn zero_grads(&self, be: &B, resident: &B::Buf<f32>) -> Result<(), GpuError> {
        self.settle(be, false)?;
        Host.zero(Host.all(&self.host_grads))?;
        be.zero(be.all(resident))
    }

    /// The views a host update works on: the whole compute copy and gradient, the norm's
    /// scratch (all in host memory).
    pub(crate) fn host_views(&self, be: &B) -> Result<UpdateViews<'_, T>, GpuError> {
        // The update writes the host's copy through these: the slots' blocks go stale
        // (here already, in case the update stops midway), and the copies still reading
        // it end first.
        self.settle(be, true)?;
        Ok(UpdateViews {
            params: self.host_params.settled(be)?,
            grads: Host.all(&self.host_grads),
            squares: Host.view(&self.host_floats, 0..1)?,
            partials: Host.view(&self.host_floats, 1..Host::len(&self.host_floats))?,
        })
    }

    /// Copies `other`'s compute copy (the same model's) into this one, and the resident
    /// runs up (`resident`).
    pub(crate) fn copy_params_from(
        &self,
        be: &B,
        resident: &B::Buf<T>,
        other: &Self,
    ) -> Result<(), GpuError> {
        self.settle(be, true)?;
        Host.copy(self.host_params.settled(be)?, other.host_params.all()?)?;
        self.resident_up(be, resident)
    }

    /// Bytes in host memory: the compute copy, the gradient sum, the landing slots and
    /// the norm's scratch.
    pub(crate) fn host_bytes(&self) -> usize {
        self.host_params.bytes()
            + 4 * Host::len(&self.host_grads)
            + self.host_scratch.iter().map(|s| s.bytes()).sum::<usize>()
            + 4 * Host::len(&self.host_floats)
    }

    /// Bytes on the backend: the slots (the resident buffers are the step's own).
    pub(crate) fn backend_bytes(&self) -> usize {
        self.slots.bytes()
    }
}
