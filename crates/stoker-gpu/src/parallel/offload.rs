//! The optimizer offloaded to the host on the resident loop (DeepSpeed's
//! `offload_optimizer`, ZeRO-Offload; FSDP's optimizer CPU offload): the FP32 master and
//! the optimizer's moments (DDP's whole state, or ZeRO-1's shard) live in host memory and
//! the host build of the same optimizer kernels steps them, so the device holds only the
//! step (compute copy, gradients, activations). The strategy reduces the gradients on the
//! device and takes their norm there (the one value an update reads back anyway); then
//! [`Offloaded::step_on_host`] copies them down, steps, and copies the compute copy up.
//! Per step that moves 4 bytes a parameter down and the compute copy's (2 in bf16 or
//! f16) up, both between device memory and host memory pinned for the backend
//! ([`PinnedHostBuf`], DeepSpeed's `offload_optimizer.pin_memory`): on a device the
//! driver copies registered memory by DMA at the bus's speed, where pageable memory goes
//! through its own staging.
//! [`super::StateAt`] is the choice between this and a state on the backend.

use std::cell::RefCell;
use std::ops::Range;

use half::{bf16, f16};

use crate::backend::{Backend, View};
use crate::elem::{Act, Dtype};
use crate::error::GpuError;
use crate::host::Host;
use crate::pinned::PinnedHostBuf;
use crate::step::optimizer::{self, Optimizer, OptimizerState, Scalars};

/// One rank's optimizer state in host memory.
pub struct Offloaded<B: Backend> {
    opt: OptimizerState<Host>,
    /// The gradients, copied down for the host's optimizer: made by the first update
    /// that copies them (an update over gradients in host memory already needs none).
    grads: RefCell<Option<PinnedHostBuf<B, f32>>>,
    /// The compute copy the host's optimizer writes, in the step's type: made by the
    /// first update (the state does not know the type before).
    copy: RefCell<Option<HostCopy<B>>>,
}

/// The compute copy on the host, in the step's type.
enum HostCopy<B: Backend> {
    F32(PinnedHostBuf<B, f32>),
    Bf16(PinnedHostBuf<B, bf16>),
    F16(PinnedHostBuf<B, f16>),
}

impl<B: Backend> Offloaded<B> {
    /// The state of optimizer `kind` over `master` (the whole flat buffer, or a ZeRO-1
    /// shard of it) with its `segments`, in host memory (its copies to and from the
    /// backend through pinned buffers, made by the updates that need them).
    pub fn new(
        kind: Optimizer,
        master: &[f32],
        segments: &[(Range<usize>, bool)],
    ) -> Result<Self, GpuError> {
        Ok(Offloaded {
            opt: OptimizerState::new(&Host, kind, master, segments)?,
            grads: RefCell::new(None),
            copy: RefCell::new(None),
        })
    }

    /// Host bytes of `kind`'s state over `len` elements of the master, and of the
    /// buffers its updates make: with `copies` the gradients copied down (ZeRO-3's shard
    /// in host memory), and with `copies_up` the compute copy of `elem` bytes an element
    /// too (the compute copy on the backend); neither where the update steps host memory
    /// in place (parameter offload). [`Offloaded::host_bytes`] counts the same.
    pub fn planned_host_bytes(
        kind: Optimizer,
        len: usize,
        (copies, copies_up): (bool, Option<usize>),
    ) -> usize {
        let grads = match copies || copies_up.is_some() {
            true => crate::pinned::planned_bytes(len, 4),
            false => 0,
        };
        let copy = copies_up.map_or(0, |elem| crate::pinned::planned_bytes(len, elem));
        kind.state_bytes(len) + grads + copy
    }

    /// Host bytes it holds: the master and moments, and the buffers its updates made.
    pub fn host_bytes(&self) -> usize {
        let grads = self.grads.borrow().as_ref().map_or(0, |g| g.bytes());
        let copy = match &*self.copy.borrow() {
            Some(HostCopy::F32(b)) => b.bytes(),
            Some(HostCopy::Bf16(b)) => b.bytes(),
            Some(HostCopy::F16(b)) => b.bytes(),
            None => 0,
        };
        self.opt.bytes() + grads + copy
    }

    /// This state with the bf16 compute copy rounded stochastically under `seed`, its
    /// master being elements `base..` of a flat buffer of `total` (as
    /// [`OptimizerState::with_stochastic_rounding`]).
    pub fn with_stochastic_rounding(
        mut self,
        seed: u64,
        (total, base): (usize, usize),
    ) -> Result<Self, GpuError> {
        self.opt = self.opt.with_stochastic_rounding(seed, (total, base))?;
        Ok(self)
    }

    /// The optimizer state, in host memory.
    pub fn optimizer(&self) -> &OptimizerState<Host> {
        &self.opt
    }

    /// The optimizer's step on the host over `grads` (on `be`, as long as the master)
    /// times `mult`: the gradients copied down, the host build of the optimizer's kernels,
    /// the compute copy `params` (on `be`, as long) copied up.
    pub fn step_on_host<T: Act>(
        &self,
        be: &B,
        grads: View<f32>,
        params: View<T>,
        scalars: &Scalars,
        mult: f32,
    ) -> Result<(), GpuError> {
        let mut copy = self.copy.borrow_mut();
        if copy.is_none() {
            *copy = Some(match T::DTYPE {
                Dtype::F32 => HostCopy::F32(PinnedHostBuf::zeros(be, self.opt.len())?),
                Dtype::Bf16 => HostCopy::Bf16(PinnedHostBuf::zeros(be, self.opt.len())?),
                Dtype::F16 => HostCopy::F16(PinnedHostBuf::zeros(be, self.opt.len())?),
            });
        }
        let host_copy: View<T> = match copy.as_ref() {
            // The copies from it (`write_at`, below) end before they return: settled at
            // once.
            Some(HostCopy::F32(b)) => b.settled(be)?.cast::<T>()?,
            Some(HostCopy::Bf16(b)) => b.settled(be)?.cast::<T>()?,
            Some(HostCopy::F16(b)) => b.settled(be)?.cast::<T>()?,
            None => {
                return Err(GpuError::Shape {
                    kernel: "offload",
                    what: "no host compute copy".into(),
                })
            }
        };
        self.step_into_host(be, grads, host_copy, scalars, mult)?;
        Host.copy_to(host_copy, be, params)
    }

    /// The optimizer's step over gradients and a compute copy that are host memory
    /// already (`grads`, `params`: parameter offload's whole copy and sum), times `mult`:
    /// nothing to copy either way.
    pub fn step_in_host_memory<T: Act>(
        &self,
        grads: View<f32>,
        params: View<T>,
        scalars: &Scalars,
        mult: f32,
    ) -> Result<(), GpuError> {
        optimizer::apply(&Host, &self.opt, params, grads, scalars, mult)
    }

    /// [`Self::step_on_host`] writing the compute copy `host_params` where it lives, in
    /// host memory (ZeRO-3's shard with the parameters offloaded): nothing goes back up.
    pub(crate) fn step_into_host<T: Act>(
        &self,
        be: &B,
        grads: View<f32>,
        host_params: View<T>,
        scalars: &Scalars,
        mult: f32,
    ) -> Result<(), GpuError> {
        let mut made = self.grads.borrow_mut();
        if made.is_none() {
            *made = Some(PinnedHostBuf::zeros(be, self.opt.len())?);
        }
        let Some(pinned) = made.as_ref() else {
            return Err(GpuError::Shape {
                kernel: "offload",
                what: "no host gradients".into(),
            });
        };
        let host_grads = pinned.settled(be)?;
        Host.copy_from(host_grads, be, grads)?;
        optimizer::apply(&Host, &self.opt, host_params, host_grads, scalars, mult)
    }
}
