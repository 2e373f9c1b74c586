//! Parameter offload for a step (FSDP's `CPUOffload(offload_params=True)`, DeepSpeed's
//! `offload_param`): the whole compute copy lives in host memory, and so do the blocks'
//! gradients, summed over a window there. The backend holds the runs outside every block
//! (embeddings, final norm, head: [`Placement`]'s resident buffer, with their gradients)
//! and two slots for the blocks' parameters and two for their gradients. Before block
//! `l` runs, forward or backward, its parameters go up into slot `l % 2` (staged: the
//! copy queues behind the launches before it, the host does not wait); before its
//! backward its gradient slot is zeroed, and after it the slot comes down and is added
//! into the host's sum. The activations stay on the backend, as FSDP's do.
//!
//! What stays on the backend is the resident runs, two blocks' parameters (compute type)
//! and gradients (f32), and the activations: a model of `n` blocks holds `2 / n` of its
//! blocks' weights there. The update then runs on the host over the host's copy (the
//! optimizer offloaded too, [`crate::parallel::Offloaded`]), and the resident runs go
//! back up.

use std::ops::Range;

use super::optimizer::UpdateViews;
use super::param_slots::ParamSlots;
use super::placement::Placement;
use crate::backend::Backend;
use crate::elem::Act;
use crate::error::{check_len, GpuError};
use crate::host::{Host, HostBuf};
use crate::kernels;

/// A step's offloaded parameters: see the module docs.
pub struct ParamOffload<B: Backend, T: Act> {
    /// The blocks' parameter and gradient slots, and where every run lives.
    slots: ParamSlots<B, T>,
    /// The whole compute copy (the flat layout), in host memory.
    host_params: HostBuf<T>,
    /// The whole gradient (the flat layout), summed over a window in host memory: the
    /// blocks' after each backward, the resident runs' when an update gathers them.
    host_grads: HostBuf<f32>,
    /// A block's gradients read down.
    host_scratch: HostBuf<f32>,
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
            slots,
            host_params: Host.zeros(end)?,
            host_grads: Host.zeros(end)?,
            host_scratch: Host.zeros(slot)?,
            host_floats: Host.zeros(1 + partials)?,
        })
    }

    /// Where the flat buffer's runs live on the backend.
    pub fn placement(&self) -> &Placement {
        self.slots.placement()
    }

    /// Elements of the flat buffer.
    pub(crate) fn flat_len(&self) -> usize {
        Host::len(&self.host_params)
    }

    /// The blocks' parameter and gradient slots.
    pub(crate) fn slots(&self) -> &ParamSlots<B, T> {
        &self.slots
    }

    /// Block `l`'s parameters up into its slot, before it runs; before its backward
    /// (`backward`) its gradient slot zeroed too.
    pub(crate) fn enter_block(&self, be: &B, l: usize, backward: bool) -> Result<(), GpuError> {
        for (r, o) in self.placement().block(l) {
            let src = Host.view(&self.host_params, r.clone())?;
            Host.stage_to(src, be, self.slots.param_run(be, l, (r, *o))?)?;
        }
        if backward {
            self.slots.grad_slots().zero(be, l)?;
        }
        Ok(())
    }

    /// Block `l`'s gradients, after its backward: down from its slot and added into the
    /// host's sum (waiting for the backend: the slot is the next block's but one).
    pub(crate) fn leave_block(&self, be: &B, l: usize) -> Result<(), GpuError> {
        for (r, o) in self.placement().block(l) {
            let scratch = Host.view(&self.host_scratch, 0..r.len())?;
            Host.copy_from(
                scratch,
                be,
                self.slots.grad_slots().slot_run(be, l, (r, *o))?,
            )?;
            kernels::add_into(&Host, Host.view(&self.host_grads, r.clone())?, scratch)?;
        }
        Ok(())
    }

    /// Sets the whole compute copy from the FP32 master `master` (rounded to `T`), and
    /// the resident runs on the backend (`resident`).
    pub(crate) fn load(
        &self,
        be: &B,
        resident: &B::Buf<T>,
        master: &[f32],
    ) -> Result<(), GpuError> {
        check_len("step", "params", master.len(), Host::len(&self.host_params))?;
        let copy: Vec<T> = master.iter().map(|&x| T::from_f32(x)).collect();
        Host.write(&self.host_params, 0, &copy)?;
        self.resident_up(be, resident)
    }

    /// The resident runs of the host's compute copy up into `resident` (after an update
    /// on the host).
    pub(crate) fn resident_up(&self, be: &B, resident: &B::Buf<T>) -> Result<(), GpuError> {
        for (r, o) in self.placement().resident() {
            let src = Host.view(&self.host_params, r.clone())?;
            Host.copy_to(src, be, be.view(resident, *o..o + r.len())?)?;
        }
        Ok(())
    }

    /// The whole compute copy, widened to f32.
    pub(crate) fn host_params(&self) -> Result<Vec<f32>, GpuError> {
        Ok(Host
            .download(&self.host_params)?
            .into_iter()
            .map(T::to_f32)
            .collect())
    }

    /// The resident runs' gradients (`resident`) down into the host's sum: the whole
    /// gradient is then on the host.
    pub(crate) fn gather_grads(&self, be: &B, resident: &B::Buf<f32>) -> Result<(), GpuError> {
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
        Host.zero(Host.all(&self.host_grads))?;
        be.zero(be.all(resident))
    }

    /// The views a host update works on: the whole compute copy and gradient, the norm's
    /// scratch (all in host memory).
    pub(crate) fn host_views(&self) -> Result<UpdateViews<'_, T>, GpuError> {
        Ok(UpdateViews {
            params: Host.all(&self.host_params),
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
        Host.copy(Host.all(&self.host_params), Host.all(&other.host_params))?;
        self.resident_up(be, resident)
    }

    /// Bytes on the backend: the slots (the resident buffers are the step's own).
    pub(crate) fn backend_bytes(&self) -> usize {
        self.slots.bytes()
    }
}
