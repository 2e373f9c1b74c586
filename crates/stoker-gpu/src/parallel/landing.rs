//! ZeRO-2's and ZeRO-3's per-block reductions: each block's gradients, in the step's
//! slot, reduce-scattered into a landing buffer, then this rank's piece added into the
//! shard's gradients. Two landing buffers, one per slot parity: block `l`'s reduction
//! starts on the collectives' own stream when its backward is queued and runs while
//! block `l - 1`'s backward does; it is waited for and added just before block `l - 2`'s
//! backward zeroes the slot again ([`BlockReductions::flush`]). On the host backend the
//! collectives run at once, so the sums are the same bits either way.

use std::cell::RefCell;
use std::ops::Range;

use stoker_comm::shard::ShardPlan;

use crate::backend::{Backend, View};
use crate::collectives::{Collectives, Mark};
use crate::error::{check_len, GpuError};

/// ZeRO-2's landing buffer for a shard of `shard` elements and reductions of at most
/// `block_len` elements (at least one): a block's pieces for this rank are no longer
/// than either.
pub fn landing_len(shard: usize, block_len: usize) -> usize {
    shard.min(block_len.max(1))
}

/// A landing buffer's block reduction: its mark while it is started and not yet added,
/// and each piece's place in the shard and in the landing buffer (kept from block to
/// block, so a step allocates nothing after its first pass).
#[derive(Default)]
struct Pending {
    mark: Option<Mark>,
    pieces: Vec<(Range<usize>, usize)>,
}

/// The two landing buffers and the reductions in flight.
pub(crate) struct Landing<B: Backend> {
    bufs: [B::Buf<f32>; 2],
    /// The longest run one reduction takes (the step's largest block).
    most: usize,
    pending: RefCell<[Pending; 2]>,
}

impl<B: Backend> Landing<B> {
    /// Landing buffers for a shard of `shard` elements and blocks of at most `block_len`.
    pub(crate) fn new(be: &B, shard: usize, block_len: usize) -> Result<Self, GpuError> {
        let len = landing_len(shard, block_len);
        Ok(Landing {
            bufs: [be.zeros(len)?, be.zeros(len)?],
            most: block_len.max(1),
            pending: RefCell::new(Default::default()),
        })
    }

    /// Bytes of the two buffers.
    pub(crate) fn bytes(&self) -> usize {
        2 * 4 * B::len(&self.bufs[0])
    }
}

/// A ZeRO-1 state's per-block reductions: its landing buffers, its split and rank, and
/// the shard's gradients they add into.
pub struct BlockReductions<'a, B: Backend> {
    pub(crate) landing: &'a Landing<B>,
    pub(crate) plan: &'a ShardPlan,
    pub(crate) rank: usize,
    pub(crate) grads: &'a B::Buf<f32>,
}

impl<B: Backend> BlockReductions<'_, B> {
    /// The flat run `run`'s gradients `input` (this rank's, in whatever buffer holds them)
    /// summed over the ranks, and this rank's piece added into the shard's gradients, at
    /// once (in pieces of at most a block, in order: every rank cuts alike), after every
    /// reduction in flight has been added. Ordered with the launches around it, so
    /// `input` may be rewritten by anything queued after.
    pub fn reduce_add(
        &self,
        be: &B,
        coll: &impl Collectives<B>,
        input: View<f32>,
        run: Range<usize>,
    ) -> Result<(), GpuError> {
        check_len("zero-2", "input", input.len(), run.len())?;
        self.flush_all(be, coll)?;
        let landing = &self.landing.bufs[0];
        let mut at = run.start;
        while at < run.end {
            let piece = at..run.end.min(at.saturating_add(self.landing.most));
            let (counts, local) = (
                self.plan.counts_within(&piece),
                self.plan.local_within(self.rank, &piece),
            );
            let landed = be.view(landing, 0..local.len())?;
            let from = input.slice(piece.start - run.start..piece.end - run.start)?;
            coll.reduce_scatter(be, from, &counts, landed)?;
            crate::kernels::add_into(be, be.view(self.grads, local)?, landed)?;
            at = piece.end;
        }
        Ok(())
    }

    /// Starts the reductions of one block's `runs` (each run's gradients and its place in
    /// the flat buffer, or the error of finding them) into landing buffer `parity` (the
    /// block's slot's), without holding back later launches; what that buffer held in
    /// flight is added first.
    ///
    /// # Safety
    /// Until [`Self::flush`] of `parity` (or [`Self::flush_all`], or the collectives'
    /// `finish`), nothing may write the runs' gradients, and their buffers must stay
    /// alive: on a device the reductions may still be reading them.
    pub unsafe fn start_block<'r>(
        &self,
        be: &B,
        coll: &impl Collectives<B>,
        runs: impl IntoIterator<Item = Result<(View<'r, f32>, &'r Range<usize>), GpuError>>,
        parity: usize,
    ) -> Result<(), GpuError> {
        self.flush(be, coll, parity)?;
        let landing = &self.landing.bufs[parity % 2];
        let mut pending = self.landing.pending.borrow_mut();
        let pieces = &mut pending[parity % 2].pieces;
        pieces.clear();
        let mut at = 0;
        for run in runs {
            let (input, run) = run?;
            check_len("zero-2", "input", input.len(), run.len())?;
            if run.len() > self.landing.most {
                return Err(GpuError::Shape {
                    kernel: "zero-2",
                    what: format!(
                        "a block's run of {} elements, longer than the {} a reduction takes",
                        run.len(),
                        self.landing.most
                    ),
                });
            }
            let (counts, local) = (
                self.plan.counts_within(run),
                self.plan.local_within(self.rank, run),
            );
            let landed = be.view(landing, at..at + local.len())?;
            // SAFETY: the caller keeps the input unwritten and alive until this parity's
            // flush; the landing piece is touched by nothing else until that flush waits
            // for it (each run's piece has its own place in the buffer).
            unsafe { coll.start_reduce_scatter(be, input, &counts, landed)? };
            let len = local.len();
            pieces.push((local, at));
            at += len;
        }
        pending[parity % 2].mark = Some(coll.mark(be)?);
        Ok(())
    }

    /// Waits for the block reduction in flight in landing buffer `parity`, if any, and
    /// adds its pieces into the shard's gradients.
    pub fn flush(&self, be: &B, coll: &impl Collectives<B>, parity: usize) -> Result<(), GpuError> {
        let mut pending = self.landing.pending.borrow_mut();
        let p = &mut pending[parity % 2];
        let Some(mark) = p.mark.take() else {
            return Ok(());
        };
        coll.wait(be, mark)?;
        let landing = &self.landing.bufs[parity % 2];
        for (local, at) in &p.pieces {
            let landed = be.view(landing, *at..at + local.len())?;
            crate::kernels::add_into(be, be.view(self.grads, local.clone())?, landed)?;
        }
        Ok(())
    }

    /// [`Self::flush`] of both landing buffers.
    pub fn flush_all(&self, be: &B, coll: &impl Collectives<B>) -> Result<(), GpuError> {
        self.flush(be, coll, 0)?;
        self.flush(be, coll, 1)
    }

    /// Forgets the reductions in flight without adding them: after a failed window,
    /// once the collectives' `finish` has ordered everything after them.
    pub fn abandon(&self) {
        for p in self.landing.pending.borrow_mut().iter_mut() {
            p.mark = None;
        }
    }
}
