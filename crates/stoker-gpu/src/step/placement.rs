//! Where a flat buffer's elements live on the backend when the blocks' parameters are
//! offloaded (FSDP's `CPUOffload(offload_params=True)`): the runs outside every block
//! (embeddings, final norm, head) packed end to end in one resident buffer, and each
//! block's runs packed in one of two slots, block `l` in slot `l % 2`, filled from host
//! memory just before the block runs. Computed once when a step is made.

use std::ops::Range;

use super::block_runs::outside_blocks;
use crate::backend::{Backend, View};
use crate::elem::Elem;
use crate::error::GpuError;

/// Where a run of the flat buffer lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Where {
    /// In the resident buffer, from this offset.
    Resident(usize),
    /// In block `.0`'s slot, from offset `.1`.
    Block(usize, usize),
}

/// Block `l`'s slot of the two: they alternate, so a block's never holds its neighbour's.
pub(crate) fn slot_of<S>(slots: &[S; 2], l: usize) -> &S {
    &slots[l % 2]
}

/// Every run of a flat buffer and where it lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// Sorted by start, covering `0..end` exactly once.
    runs: Vec<(Range<usize>, Where)>,
    /// Each block's runs and their offsets in its slot.
    blocks: Vec<Vec<(Range<usize>, usize)>>,
    /// The resident runs and their offsets in the resident buffer.
    resident: Vec<(Range<usize>, usize)>,
    resident_len: usize,
    slot_len: usize,
}

impl Placement {
    /// The placement of a flat buffer of `end` elements whose blocks hold `blocks` (each
    /// block's sorted runs, overlapping nowhere and inside `0..end`: checked).
    pub fn new(blocks: &[Vec<Range<usize>>], end: usize) -> Result<Self, GpuError> {
        let mut runs = Vec::new();
        let mut placed_blocks = Vec::new();
        let mut slot_len = 0;
        for (l, block) in blocks.iter().enumerate() {
            let mut at = 0;
            let mut mine = Vec::new();
            for r in block.iter().filter(|r| !r.is_empty()) {
                mine.push((r.clone(), at));
                runs.push((r.clone(), Where::Block(l, at)));
                at += r.len();
            }
            slot_len = slot_len.max(at);
            placed_blocks.push(mine);
        }
        let mut resident = Vec::new();
        let mut at = 0;
        for r in outside_blocks(blocks, end) {
            resident.push((r.clone(), at));
            runs.push((r.clone(), Where::Resident(at)));
            at += r.len();
        }
        runs.sort_unstable_by_key(|(r, _)| r.start);
        let mut next = 0;
        for (r, _) in &runs {
            if r.start != next || r.end > end {
                return Err(GpuError::Shape {
                    kernel: "placement",
                    what: format!(
                        "blocks' runs that overlap or pass the buffer's {end} elements \
                         (run {r:?} after element {next})"
                    ),
                });
            }
            next = r.end;
        }
        Ok(Placement {
            runs,
            blocks: placed_blocks,
            resident,
            resident_len: at,
            slot_len,
        })
    }

    /// Where elements `at..at + len` live: they must lie inside one run (a tensor does).
    pub fn locate(&self, at: usize, len: usize) -> Result<Where, GpuError> {
        let i = self.runs.partition_point(|(r, _)| r.end <= at);
        match self.runs.get(i) {
            Some((r, place)) if r.start <= at && at + len <= r.end => Ok(match *place {
                Where::Resident(o) => Where::Resident(o + at - r.start),
                Where::Block(l, o) => Where::Block(l, o + at - r.start),
            }),
            _ => Err(GpuError::Shape {
                kernel: "placement",
                what: format!("elements {at}..{} span runs of the flat buffer", at + len),
            }),
        }
    }

    /// Elements `at..at + len` (inside one run) as a view: of `resident`, or of their
    /// block's slot in `slots` ([`slot_of`]).
    pub(crate) fn view<'a, B: Backend, E: Elem>(
        &self,
        be: &B,
        (resident, slots): (&'a B::Buf<E>, &'a [B::Buf<E>; 2]),
        (at, len): (usize, usize),
    ) -> Result<View<'a, E>, GpuError> {
        match self.locate(at, len)? {
            Where::Resident(o) => be.view(resident, o..o + len),
            Where::Block(l, o) => be.view(slot_of(slots, l), o..o + len),
        }
    }

    /// Block `l`'s runs and their offsets in its slot.
    pub fn block(&self, l: usize) -> &[(Range<usize>, usize)] {
        &self.blocks[l]
    }

    /// The resident runs and their offsets in the resident buffer.
    pub fn resident(&self) -> &[(Range<usize>, usize)] {
        &self.resident
    }

    /// Elements of the resident buffer.
    pub fn resident_len(&self) -> usize {
        self.resident_len
    }

    /// Elements of one slot (the largest block's).
    pub fn slot_len(&self) -> usize {
        self.slot_len
    }

    /// Blocks.
    pub fn blocks(&self) -> usize {
        self.blocks.len()
    }
}

#[cfg(test)]
// A block of one run is a Vec holding one Range, not a mistaken range of values.
#[allow(clippy::single_range_in_vec_init)]
mod tests {
    use super::*;

    #[test]
    fn runs_are_packed_and_located() {
        // Blocks at 2..5 and (5..7, 9..10) of 12: the rest 0..2, 7..9, 10..12.
        let p = Placement::new(&[vec![2..5], vec![5..7, 9..10]], 12).unwrap();
        assert_eq!((p.resident_len(), p.slot_len()), (6, 3));
        assert_eq!(p.locate(0, 2).unwrap(), Where::Resident(0));
        assert_eq!(p.locate(8, 1).unwrap(), Where::Resident(3));
        assert_eq!(p.locate(11, 1).unwrap(), Where::Resident(5));
        assert_eq!(p.locate(3, 2).unwrap(), Where::Block(0, 1));
        assert_eq!(p.locate(9, 1).unwrap(), Where::Block(1, 2));
        assert!(p.locate(4, 2).is_err(), "4..6 spans two runs");
        assert!(p.locate(11, 2).is_err(), "past the end");
        assert_eq!(p.block(1), &[(5..7, 0), (9..10, 2)]);
        assert!(Placement::new(&[vec![0..4], vec![3..6]], 8).is_err());
        assert!(Placement::new(&[vec![0..9]], 8).is_err());
    }
}
