//! Deterministic mode on the resident loop (`parallel.deterministic`, one rank, DDP or
//! ZeRO-1, the optimizer on the backend or offloaded):
//! the window's weights bit-identical at every power-of-two world size. Each
//! micro-batch's gradient is computed alone into zeroed buffers and summed by
//! [`GradTree`] in the global batch's tree, then across ranks by the tree over ranks; the
//! loss goes through the same trees; every rank then holds the same gradient bits, so the
//! norm, the clipping and the update are the same at every world size.
//!
//! What it costs against the default window: a pass to zero and one to add per
//! micro-batch, one gradient-sized buffer per level of the tree, and across ranks an
//! all-gather of every rank's subtree (world / 2 times a ring all-reduce's traffic) that
//! waits for the whole backward. The micro-batches' losses are copied on the backend and
//! read once, after the last.

use super::grad_tree::{rank_tree_sum, tree_sum, GradTree};
use super::replica::{Replica, Trainable, WindowReport};
use super::tally::Tally;
use super::{DataParallel, GradRule};
use crate::backend::Backend;
use crate::collectives::Collectives;
use crate::error::GpuError;
use crate::step::buffers::BlockHooks;
use crate::step::optimizer::Scalars;
use crate::step::TokenBatch;

impl<B: Backend, S: Trainable<B>> Replica<B, S> {
    /// This replica in deterministic mode, for windows of at most `max_micro`
    /// micro-batches; `chunk` elements of the gradient a round from each rank
    /// ([`super::grad_tree::chunk_for`] unless a test wants several rounds). One rank,
    /// DDP or ZeRO-1 (the optimizer on the backend or offloaded), a power-of-two world,
    /// the parameters not offloaded.
    pub fn with_deterministic(
        mut self,
        be: &B,
        max_micro: usize,
        world: usize,
        chunk: usize,
    ) -> Result<Self, GpuError> {
        let refuse = |what: String| GpuError::Shape {
            kernel: "deterministic",
            what,
        };
        let whole_gradients = match &self.state {
            DataParallel::Ddp(_) => true,
            DataParallel::Zero1(z) => !z.accumulates(),
        };
        if !whole_gradients || self.step.buffers().sharded().is_some() {
            return Err(refuse(
                "deterministic mode on the resident loop runs one rank, DDP or ZeRO-1: \
                 ZeRO-2 and -3 reduce each block's gradient as the backward goes, and the \
                 tree needs each micro-batch's whole (parallel.deterministic, \
                 parallel.strategy)"
                    .into(),
            ));
        }
        if self.step.buffers().offload().is_some() {
            return Err(refuse(
                "deterministic mode sums whole gradients on the backend; with the blocks' \
                 parameters offloaded they are gathered on the host \
                 (parallel.deterministic, parallel.offload_params)"
                    .into(),
            ));
        }
        self.tree = Some(std::cell::RefCell::new(GradTree::new(
            be,
            self.step.flat_len(),
            max_micro,
            world,
            chunk,
        )?));
        Ok(self)
    }

    /// Bytes of deterministic mode's buffers (none outside it).
    pub fn tree_bytes(&self) -> usize {
        self.tree.as_ref().map_or(0, |t| t.borrow().bytes())
    }

    /// A window in deterministic mode: as [`Replica::window`], with the sums of
    /// [`GradTree`].
    pub(super) fn deterministic_window(
        &self,
        be: &B,
        coll: &impl Collectives<B>,
        micro: &[TokenBatch],
        (scalars, rule): (&Scalars, GradRule),
    ) -> Result<WindowReport, GpuError> {
        let Some(tree) = &self.tree else {
            return Err(GpuError::Shape {
                kernel: "deterministic",
                what: "a deterministic window on a replica made without its tree".into(),
            });
        };
        let mut tree = tree.borrow_mut();
        let (capacity, grad_scale) = self.scales(coll.world(), micro.len(), rule);
        let mut valid = 0f64;
        // This rank's micro-batches, with nothing collective inside: whatever fails on
        // one rank is told to every rank by the sum below, before the first gradient
        // collective, so that no rank waits in one the others never join.
        let mut local = || -> Result<(), GpuError> {
            tree.begin(micro.len())?;
            for (j, batch) in micro.iter().enumerate() {
                self.step.zero_grads(be)?;
                super::replica::prefetch_next(&self.step, be, micro, j)?;
                self.step.queue_micro_batch(
                    be,
                    (*batch, grad_scale),
                    false,
                    BlockHooks::default(),
                )?;
                tree.keep_loss(be, j, self.step.loss_view(be)?)?;
                valid += batch.valid_targets() as f64;
                let grads = self.step.update_views(be)?.grads;
                match j + 1 == micro.len() {
                    true => tree.finish(be, grads)?,
                    false => tree.push(be, grads)?,
                }
            }
            Ok(())
        };
        let local = local();
        let n = micro.len() as f64;
        let failed = local.is_err() as u8 as f64;
        let summed = coll.sum(be, &[n, n * n, failed])?;
        local?;
        if summed[2] > 0.0 {
            return Err(GpuError::Shape {
                kernel: "deterministic",
                what: format!(
                    "{} of {} ranks failed their micro-batches in this window (see theirs)",
                    summed[2],
                    coll.world()
                ),
            });
        }
        // Every rank ran as many micro-batches (the tree over ranks needs whole subtrees).
        let counts = Tally {
            micro: summed[0],
            micro_sq: summed[1],
            ..Tally::default()
        };
        counts.same_micro_batches(coll.world())?;
        let views = self.step.update_views(be)?;
        tree.all_reduce(be, coll, views.grads)?;
        // The window's loss through the same trees; the update's scalar sum then adds
        // zeros to rank 0's (exactly), and integers for the counts.
        let loss = rank_tree_sum(be, coll, tree_sum(&tree.losses(be, micro.len())?))?;
        let tally = Tally {
            valid,
            loss: if coll.rank() == 0 { loss } else { 0.0 },
            ..Tally::of_micro_batches(micro.len())
        };
        // Every rank holds the whole summed gradient: DDP updates the whole master, ZeRO-1
        // its shard, with the norm from the whole gradient either way.
        let (grad_norm, total) = match &self.state {
            DataParallel::Ddp(_) => {
                self.state
                    .update(be, coll, views, scalars, (tally, capacity), (rule, true))?
            }
            DataParallel::Zero1(z) => {
                z.update_from_whole(be, coll, views, scalars, (tally, capacity), rule)?
            }
        };
        self.end_fp8_step(be, coll)?;
        Ok(WindowReport::of(total, grad_norm, rule))
    }
}
