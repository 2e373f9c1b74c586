//! The blocks' parameters in two slots, and their gradients in two more ([`GradSlots`]):
//! what a step holds on the backend when the whole compute copy lives elsewhere (host
//! memory under parameter offload, the ranks' shards under ZeRO-3). Block `l`'s
//! parameters are put into slot `l % 2` just before it runs, forward or backward, by
//! whoever keeps the whole copy; the runs outside every block stay in the step's own
//! buffers ([`Placement`]'s resident runs).

use std::ops::Range;

use super::grad_slots::GradSlots;
use super::placement::{slot_of, Placement};
use crate::backend::{Backend, View};
use crate::elem::Act;
use crate::error::GpuError;

/// Two parameter slots (compute type) and two gradient slots (f32).
pub struct ParamSlots<B: Backend, T: Act> {
    grads: GradSlots<B>,
    params: [B::Buf<T>; 2],
}

impl<B: Backend, T: Act> ParamSlots<B, T> {
    /// The slots for a flat buffer of `end` elements whose blocks hold `blocks`.
    pub(crate) fn new(be: &B, blocks: &[Vec<Range<usize>>], end: usize) -> Result<Self, GpuError> {
        let grads = GradSlots::new(be, blocks, end)?;
        let slot = grads.placement().slot_len();
        Ok(ParamSlots {
            params: [be.zeros(slot)?, be.zeros(slot)?],
            grads,
        })
    }

    /// Where the flat buffer's runs live.
    pub fn placement(&self) -> &Placement {
        self.grads.placement()
    }

    /// The gradient slots.
    pub(crate) fn grad_slots(&self) -> &GradSlots<B> {
        &self.grads
    }

    /// Parameters `at..at + len`: in `resident` (the runs outside the blocks, packed) or
    /// in their block's slot (the block must have been put there).
    pub(crate) fn params<'a>(
        &'a self,
        be: &B,
        resident: &'a B::Buf<T>,
        (at, len): (usize, usize),
    ) -> Result<View<'a, T>, GpuError> {
        self.placement()
            .view(be, (resident, &self.params), (at, len))
    }

    /// Gradients `at..at + len`, as [`Self::params`].
    pub(crate) fn grads<'a>(
        &'a self,
        be: &B,
        resident: &'a B::Buf<f32>,
        (at, len): (usize, usize),
    ) -> Result<View<'a, f32>, GpuError> {
        self.grads.grads(be, resident, (at, len))
    }

    /// Block `l`'s run `r` (flat) at offset `o` of its parameter slot: where it is put.
    pub(crate) fn param_run<'a>(
        &'a self,
        be: &B,
        l: usize,
        (r, o): (&Range<usize>, usize),
    ) -> Result<View<'a, T>, GpuError> {
        be.view(slot_of(&self.params, l), o..o + r.len())
    }

    /// Bytes of the four slots.
    pub(crate) fn bytes(&self) -> usize {
        2 * B::len(&self.params[0]) * std::mem::size_of::<T>() + self.grads.bytes()
    }
}
