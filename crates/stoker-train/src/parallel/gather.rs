//! ZeRO-3's parameter groups on one rank during a micro-batch: each group (the
//! embeddings, a block, the final norm) is all-gathered from the ranks' shards into a
//! buffer of its own just before the direct step needs it, and its gradients are
//! reduce-scattered out of a buffer of their own as soon as they are final
//! ([`super::reduce`]); the buffers go back to one pool, so between micro-batches a rank
//! holds only its shard.
//!
//! The schedule ([`Source`] is the step's [`StepParams`]):
//! - The root groups (embeddings, used first and by the tied head last, and the final
//!   norm) are gathered when the micro-batch starts and kept until their gradients are
//!   reduced: FSDP's root unit.
//! - A block is gathered before its forward, while the previous block computes (one
//!   block ahead), and freed after it (`reshard_after_forward`; without it, it stays until
//!   its backward: ZeRO-2's parameter memory). The last block's backward gather starts as
//!   its forward ends; each backward gather starts while the block after it computes.
//! - A group's gradients are [`GroupReduce`]'s: reduced as soon as the backward is done
//!   with the group.
//!
//! Every rank starts the same collectives in the same order (the schedule depends on the
//! model alone), as non-blocking MPI collectives require.

use std::borrow::BorrowMut;
use std::rc::Rc;
use std::time::{Duration, Instant};

use stoker_comm::{Buffer, Communicator, Pending};
use stoker_kernels::{GroupView, KernelError, Phase, StepParams};

use super::reduce::{f32s, source_err, GroupReduce};
use crate::error::Result;
use stoker_comm::shard::GroupSplit;

/// Where one group's gathered parameters are.
enum Slot {
    /// Not gathered.
    Free,
    /// Being gathered; the input's length, for the accounting if the backend keeps it.
    Gathering(Pending, usize),
    /// Gathered.
    Ready(Vec<f32>),
}

/// The gathers, reductions and buffers of one rank's groups.
pub struct GroupGather {
    reduce: GroupReduce,
    reshard_after_forward: bool,
    params: Vec<Slot>,
}

impl GroupGather {
    /// The groups `splits` (by group number, as this rank sees them) over `comm`'s ranks,
    /// this rank's shard holding `own_len` elements.
    pub fn new(
        comm: Rc<dyn Communicator>,
        splits: Vec<GroupSplit>,
        own_len: usize,
        reshard_after_forward: bool,
    ) -> Self {
        let n = splits.len();
        GroupGather {
            reduce: GroupReduce::new(comm, splits, own_len),
            reshard_after_forward,
            params: (0..n).map(|_| Slot::Free).collect(),
        }
    }

    /// The most bytes of group buffers held at once so far.
    pub fn peak_bytes(&self) -> usize {
        self.reduce.peak_bytes()
    }

    /// The parameter groups.
    pub fn groups(&self) -> usize {
        self.reduce.groups()
    }

    /// Time spent waiting for gathers and reductions since the last call.
    pub fn take_waited(&mut self) -> Duration {
        self.reduce.take_waited()
    }

    /// What [`GroupGather::peak_bytes`] reaches in one micro-batch of the GPT's direct
    /// step, predicted before the first: the step's calls (`stoker_kernels::group_calls`)
    /// replayed through a [`Source`] over a communicator that moves no data.
    pub fn planned_peak(&self) -> Result<usize> {
        let mut scratch = self.over_null_comm()?;
        scratch.reduce.pool = super::reduce::Pool::counting();
        // Never read or written: the counting pool's buffers are empty.
        let n = self.reduce.own_len();
        let (master, mut grads) = (vec![0f32; n], vec![0f32; n]);
        let mut source = Source {
            gather: &mut scratch,
            master: &master,
            grads: &mut grads,
        };
        stoker_kernels::replay(&mut source, &stoker_kernels::group_calls(self.params.len()))
            .map_err(|e| crate::error::TrainError::Units(e.to_string()))?;
        scratch.finish(&mut grads)?;
        Ok(scratch.peak_bytes())
    }

    /// The same groups and shards over a communicator that moves no data: the schedule
    /// runs alone (gathered groups stay zero, reductions add zeros).
    pub fn over_null_comm(&self) -> Result<GroupGather> {
        Ok(GroupGather {
            reduce: self.reduce.over_null_comm()?,
            reshard_after_forward: self.reshard_after_forward,
            params: (0..self.params.len()).map(|_| Slot::Free).collect(),
        })
    }

    fn is_block(&self, group: usize) -> bool {
        group > 0 && group + 1 < self.params.len()
    }

    fn start_gather(&mut self, group: usize, master: &[f32]) -> Result<()> {
        if !matches!(self.params[group], Slot::Free) {
            return Ok(());
        }
        let r = &mut self.reduce;
        let local = r.local(group);
        let mut input = r.pool.take(local.len());
        if !r.pool.is_counting() {
            input.copy_from_slice(&master[local.clone()]);
        }
        let output = r.pool.take(r.span(group).len());
        // The buffer's logical length (a counting pool's buffers are empty).
        let len = local.len();
        let p = r.comm.start_all_gather(
            Buffer::F32(input),
            &r.splits[group].counts,
            Buffer::F32(output),
        )?;
        self.params[group] = Slot::Gathering(p, len);
        Ok(())
    }

    /// Waits for `group`'s gather (starting it if need be).
    fn ensure(&mut self, group: usize, master: &[f32]) -> Result<()> {
        self.start_gather(group, master)?;
        self.wait(group)
    }

    /// Waits for `group`'s gather if one is running.
    fn wait(&mut self, group: usize) -> Result<()> {
        if let Slot::Gathering(..) = self.params[group] {
            let Slot::Gathering(p, len) = std::mem::replace(&mut self.params[group], Slot::Free)
            else {
                unreachable!("matched above")
            };
            let t0 = Instant::now();
            let (out, input) = p.wait_with_input()?;
            self.reduce.waited += t0.elapsed();
            let input = input.map(|b| f32s(b, "gather input")).transpose()?;
            self.reduce.pool.gone(input, len);
            self.params[group] = Slot::Ready(f32s(out, "gathered group")?);
        }
        Ok(())
    }

    fn free(&mut self, group: usize) -> Result<()> {
        self.wait(group)?;
        if let Slot::Ready(v) = std::mem::replace(&mut self.params[group], Slot::Free) {
            let len = self.reduce.span(group).len();
            self.reduce.pool.give(v, len);
        }
        Ok(())
    }

    /// After a micro-batch: every reduction added into the shard `grads`, every group
    /// buffer back in the pool.
    pub fn finish(&mut self, grads: &mut [f32]) -> Result<()> {
        self.reduce.finish(grads)?;
        for group in 0..self.params.len() {
            self.free(group)?;
        }
        Ok(())
    }

    fn group_view<'a>(
        &'a mut self,
        group: usize,
        master: &[f32],
        phase: Phase,
    ) -> Result<GroupView<'a>> {
        let last = self.params.len() - 1;
        self.reduce.comm.progress();
        match phase {
            Phase::Forward => {
                if group == 0 && matches!(self.params[0], Slot::Free) {
                    // The micro-batch starts: the root groups, and the first block ahead.
                    self.start_gather(0, master)?;
                    self.start_gather(last, master)?;
                    if self.is_block(1) {
                        self.start_gather(1, master)?;
                    }
                }
                self.ensure(group, master)?;
                if self.is_block(group) && self.is_block(group + 1) {
                    self.start_gather(group + 1, master)?;
                }
            }
            Phase::Backward => {
                self.ensure(group, master)?;
                if self.is_block(group) && self.is_block(group - 1) {
                    self.start_gather(group - 1, master)?;
                }
            }
        }
        let base = self.reduce.span(group).start;
        let Slot::Ready(params) = &self.params[group] else {
            unreachable!("ensured above")
        };
        let grads = match phase {
            Phase::Backward => self.reduce.grads(group),
            Phase::Forward => &mut [],
        };
        Ok(GroupView {
            base,
            params,
            grads,
        })
    }

    fn group_done(
        &mut self,
        group: usize,
        phase: Phase,
        master: &[f32],
        grads: &mut [f32],
    ) -> Result<()> {
        match phase {
            Phase::Forward => {
                if self.is_block(group) && self.reshard_after_forward {
                    self.free(group)?;
                    if !self.is_block(group + 1) {
                        // The last block: its backward comes right after the head.
                        self.start_gather(group, master)?;
                    }
                }
            }
            Phase::Backward => {
                self.reduce.start(group, grads)?;
                self.free(group)?;
            }
        }
        Ok(())
    }
}

/// The direct step's parameter source for one micro-batch: groups gathered from the
/// shard `master`, gradients reduced into the shard `grads`.
pub struct Source<'a, G = &'a mut GroupGather> {
    /// The gathers and buffers (borrowed, or owned by a scratch step).
    pub gather: G,
    /// This rank's shard of the FP32 parameters.
    pub master: &'a [f32],
    /// This rank's shard of the window's gradient sum.
    pub grads: &'a mut [f32],
}

impl<G: BorrowMut<GroupGather>> StepParams for Source<'_, G> {
    fn group(
        &mut self,
        group: usize,
        phase: Phase,
    ) -> std::result::Result<GroupView<'_>, KernelError> {
        self.gather
            .borrow_mut()
            .group_view(group, self.master, phase)
            .map_err(|e| source_err("zero3", group, e))
    }

    fn done(&mut self, group: usize, phase: Phase) -> std::result::Result<(), KernelError> {
        self.gather
            .borrow_mut()
            .group_done(group, phase, self.master, self.grads)
            .map_err(|e| source_err("zero3", group, e))
    }
}
