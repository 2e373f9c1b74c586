//! ZeRO-3's parameter groups on one rank during a micro-batch: each group (the
//! embeddings, a block, the final norm) is all-gathered from the ranks' shards into a
//! buffer of its own just before the direct step needs it, and its gradients are
//! reduce-scattered out of a buffer of their own as soon as they are final; the buffers
//! go back to a pool, so between micro-batches a rank holds only its shard.
//!
//! The schedule ([`Source`] is the step's [`StepParams`]):
//! - The root groups (embeddings, used first and by the tied head last, and the final
//!   norm) are gathered when the micro-batch starts and kept until their gradients are
//!   reduced: FSDP's root unit.
//! - A block is gathered before its forward, while the previous block computes (one
//!   block ahead), and freed after it (`reshard_after_forward`; without it, it stays until
//!   its backward: ZeRO-2's parameter memory). The last block's backward gather starts as
//!   its forward ends; each backward gather starts while the block after it computes.
//! - A group's gradients go into a zeroed buffer; when the backward is done with the
//!   group its reduce-scatter starts and at most [`REDUCING`] stay in flight, each
//!   waited for and added into the rank's gradient shard in the order they started.
//!
//! Every rank starts the same collectives in the same order (the schedule depends on the
//! model alone), as non-blocking MPI collectives require.

use std::collections::VecDeque;
use std::ops::Range;
use std::rc::Rc;
use std::time::{Duration, Instant};

use stoker_comm::{Buffer, Communicator, Pending};
use stoker_kernels::{GroupView, KernelError, Phase, StepParams};

use super::shard::ShardPlan;
use crate::error::{Result, TrainError};

/// Reduce-scatters a rank lets run at once before it waits for the oldest.
pub const REDUCING: usize = 1;

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
    comm: Rc<dyn Communicator>,
    shards: ShardPlan,
    own: Range<usize>,
    /// Each group's span of the flat buffer, by group number.
    spans: Vec<Range<usize>>,
    reshard_after_forward: bool,
    params: Vec<Slot>,
    grads: Vec<Option<Vec<f32>>>,
    /// Reduce-scatters in flight: group, handle, input length.
    reducing: VecDeque<(usize, Pending, usize)>,
    pool: Vec<Vec<f32>>,
    in_use: usize,
    peak: usize,
    waited: Duration,
}

fn f32s(b: Buffer, what: &str) -> Result<Vec<f32>> {
    match b {
        Buffer::F32(v) => Ok(v),
        other => Err(TrainError::Layout(format!(
            "zero3: the {what} came back as {}, expected f32",
            other.dtype().name()
        ))),
    }
}

impl GroupGather {
    /// The groups `spans` (by group number) of a flat buffer split by `shards` over
    /// `comm`'s ranks.
    pub fn new(
        comm: Rc<dyn Communicator>,
        shards: ShardPlan,
        spans: Vec<Range<usize>>,
        reshard_after_forward: bool,
    ) -> Self {
        let n = spans.len();
        GroupGather {
            own: shards.range(comm.rank()),
            comm,
            shards,
            spans,
            reshard_after_forward,
            params: (0..n).map(|_| Slot::Free).collect(),
            grads: vec![None; n],
            reducing: VecDeque::new(),
            pool: Vec::new(),
            in_use: 0,
            peak: 0,
            waited: Duration::ZERO,
        }
    }

    /// The most bytes of group buffers held at once so far.
    pub fn peak_bytes(&self) -> usize {
        self.peak
    }

    /// Time spent waiting for gathers and reductions since the last call.
    pub fn take_waited(&mut self) -> Duration {
        std::mem::take(&mut self.waited)
    }

    /// A buffer of `len` zeros from the pool (the smallest that fits) or new.
    fn take(&mut self, len: usize) -> Vec<f32> {
        let best = (0..self.pool.len())
            .filter(|&i| self.pool[i].capacity() >= len)
            .min_by_key(|&i| self.pool[i].capacity());
        let mut v = match best {
            Some(i) => self.pool.swap_remove(i),
            None => Vec::with_capacity(len),
        };
        v.clear();
        v.resize(len, 0.0);
        self.in_use += 4 * len;
        self.peak = self.peak.max(self.in_use);
        v
    }

    fn give(&mut self, v: Vec<f32>) {
        self.in_use -= 4 * v.len();
        self.pool.push(v);
    }

    /// A backend that consumed an input buffer: only the accounting is left to do.
    fn gone(&mut self, input: Option<Vec<f32>>, len: usize) {
        match input {
            Some(v) => self.give(v),
            None => self.in_use -= 4 * len,
        }
    }

    /// The part of `group` this rank owns, as a range of its shard (empty if none).
    fn local(&self, group: usize) -> Range<usize> {
        let owned = self
            .shards
            .owned_within(self.comm.rank(), &self.spans[group]);
        match owned.is_empty() {
            true => 0..0,
            false => owned.start - self.own.start..owned.end - self.own.start,
        }
    }

    fn is_block(&self, group: usize) -> bool {
        group > 0 && group + 1 < self.spans.len()
    }

    fn start_gather(&mut self, group: usize, master: &[f32]) -> Result<()> {
        if !matches!(self.params[group], Slot::Free) {
            return Ok(());
        }
        let span = self.spans[group].clone();
        let local = self.local(group);
        let mut input = self.take(local.len());
        input.copy_from_slice(&master[local]);
        let output = self.take(span.len());
        let counts = self.shards.counts_within(&span);
        let len = input.len();
        let p = self
            .comm
            .start_all_gather(Buffer::F32(input), &counts, Buffer::F32(output))?;
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
            self.waited += t0.elapsed();
            let input = input.map(|b| f32s(b, "gather input")).transpose()?;
            self.gone(input, len);
            self.params[group] = Slot::Ready(f32s(out, "gathered group")?);
        }
        Ok(())
    }

    fn free(&mut self, group: usize) -> Result<()> {
        self.wait(group)?;
        if let Slot::Ready(v) = std::mem::replace(&mut self.params[group], Slot::Free) {
            self.give(v);
        }
        Ok(())
    }

    /// Starts the reduce-scatter of `group`'s gradients, keeping at most [`REDUCING`]
    /// in flight.
    fn start_reduce(&mut self, group: usize, grads: &mut [f32]) -> Result<()> {
        let Some(input) = self.grads[group].take() else {
            return Ok(());
        };
        let span = self.spans[group].clone();
        let output = self.take(self.local(group).len());
        let counts = self.shards.counts_within(&span);
        let len = input.len();
        let p = self
            .comm
            .start_reduce_scatter(Buffer::F32(input), &counts, Buffer::F32(output))?;
        self.reducing.push_back((group, p, len));
        while self.reducing.len() > REDUCING {
            self.finish_one(grads)?;
        }
        Ok(())
    }

    /// Waits for the oldest reduce-scatter and adds its sums into the shard `grads`.
    fn finish_one(&mut self, grads: &mut [f32]) -> Result<()> {
        let Some((group, p, len)) = self.reducing.pop_front() else {
            return Ok(());
        };
        let t0 = Instant::now();
        let (out, input) = p.wait_with_input()?;
        self.waited += t0.elapsed();
        let out = f32s(out, "reduced gradients")?;
        for (g, s) in grads[self.local(group)].iter_mut().zip(&out) {
            *g += s;
        }
        self.give(out);
        let input = input.map(|b| f32s(b, "gradient buffer")).transpose()?;
        self.gone(input, len);
        Ok(())
    }

    /// After a micro-batch: every reduction added into the shard `grads`, every group
    /// buffer back in the pool.
    pub fn finish(&mut self, grads: &mut [f32]) -> Result<()> {
        while !self.reducing.is_empty() {
            self.finish_one(grads)?;
        }
        for group in 0..self.params.len() {
            self.free(group)?;
            if let Some(v) = self.grads[group].take() {
                self.give(v);
            }
        }
        Ok(())
    }

    fn group_view<'a>(
        &'a mut self,
        group: usize,
        master: &[f32],
        phase: Phase,
    ) -> Result<GroupView<'a>> {
        let last = self.spans.len() - 1;
        self.comm.progress();
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
                if self.grads[group].is_none() {
                    let len = self.spans[group].len();
                    self.grads[group] = Some(self.take(len));
                }
            }
        }
        let base = self.spans[group].start;
        let Slot::Ready(params) = &self.params[group] else {
            unreachable!("ensured above")
        };
        let grads = match (phase, &mut self.grads[group]) {
            (Phase::Backward, Some(g)) => g.as_mut_slice(),
            _ => &mut [],
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
                self.start_reduce(group, grads)?;
                self.free(group)?;
            }
        }
        Ok(())
    }
}

/// The direct step's parameter source for one micro-batch: groups gathered from the
/// shard `master`, gradients reduced into the shard `grads`.
pub struct Source<'a> {
    /// The gathers and buffers.
    pub gather: &'a mut GroupGather,
    /// This rank's shard of the FP32 parameters.
    pub master: &'a [f32],
    /// This rank's shard of the window's gradient sum.
    pub grads: &'a mut [f32],
}

fn source_err(group: usize, e: TrainError) -> KernelError {
    KernelError::Source {
        op: "zero3",
        group,
        msg: e.to_string(),
    }
}

impl StepParams for Source<'_> {
    fn group(
        &mut self,
        group: usize,
        phase: Phase,
    ) -> std::result::Result<GroupView<'_>, KernelError> {
        self.gather
            .group_view(group, self.master, phase)
            .map_err(|e| source_err(group, e))
    }

    fn done(&mut self, group: usize, phase: Phase) -> std::result::Result<(), KernelError> {
        self.gather
            .group_done(group, phase, self.master, self.grads)
            .map_err(|e| source_err(group, e))
    }
}
