//! The blocks' gradients in two slots instead of one buffer each (what ZeRO-2 and the
//! parameter offload need): block `l`'s gradients accumulate in slot `l % 2` during its
//! backward, and something takes them out before block `l - 2`'s backward zeroes the slot
//! again (ZeRO-2's reduce-scatter into the rank's shard, or the offload's copy down to
//! host memory). The runs outside every block keep their gradients in the step's own
//! buffer, packed ([`Placement`]).

use std::ops::Range;

use super::placement::{slot_of, Placement};
use crate::backend::{Backend, View};
use crate::error::GpuError;

/// Two gradient slots and where each run of the flat buffer lives.
pub struct GradSlots<B: Backend> {
    placement: Placement,
    slots: [B::Buf<f32>; 2],
}

impl<B: Backend> GradSlots<B> {
    /// The slots for a flat buffer of `end` elements whose blocks hold `blocks`.
    pub(crate) fn new(be: &B, blocks: &[Vec<Range<usize>>], end: usize) -> Result<Self, GpuError> {
        let placement = Placement::new(blocks, end)?;
        let slot = placement.slot_len();
        Ok(GradSlots {
            slots: [be.zeros(slot)?, be.zeros(slot)?],
            placement,
        })
    }

    /// Where the flat buffer's runs live.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// Gradients `at..at + len`: in `resident` (the runs outside the blocks, packed) or
    /// in their block's slot.
    pub(crate) fn grads<'a>(
        &'a self,
        be: &B,
        resident: &'a B::Buf<f32>,
        (at, len): (usize, usize),
    ) -> Result<View<'a, f32>, GpuError> {
        self.placement.view(be, (resident, &self.slots), (at, len))
    }

    /// Block `l`'s slot zeroed, before its backward.
    pub(crate) fn zero(&self, be: &B, l: usize) -> Result<(), GpuError> {
        be.zero(be.all(slot_of(&self.slots, l)))
    }

    /// Block `l`'s run `r` (flat) in its slot.
    pub(crate) fn slot_run<'a>(
        &'a self,
        be: &B,
        l: usize,
        (r, o): (&Range<usize>, usize),
    ) -> Result<View<'a, f32>, GpuError> {
        be.view(slot_of(&self.slots, l), o..o + r.len())
    }

    /// Bytes of the two slots.
    pub(crate) fn bytes(&self) -> usize {
        2 * 4 * B::len(&self.slots[0])
    }
}
