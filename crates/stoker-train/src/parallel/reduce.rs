//! Gradients reduced group by group as the direct step's backward finishes each one, so
//! a rank never holds a full-size gradient: each parameter group (the embeddings, a
//! block, the final norm) gets a zeroed buffer of its own when the backward first writes
//! it; when the backward is done with the group its reduce-scatter starts, at most
//! [`REDUCING`] stay in flight, and each is waited for and added into the rank's
//! gradient shard in the order they started. Buffers come from a pool, so steady-state
//! steps allocate nothing.
//!
//! ZeRO-2 (every micro-batch reduced) reads the parameters from the whole FP32 buffer it
//! keeps ([`ReduceSource`]); ZeRO-3 gathers them too ([`super::gather`]) and shares this
//! pool for its parameter buffers.

use std::borrow::BorrowMut;
use std::collections::VecDeque;
use std::ops::Range;
use std::rc::Rc;
use std::time::{Duration, Instant};

use stoker_comm::{Buffer, Communicator, NullComm, Pending};
use stoker_kernels::{GroupCall, GroupView, KernelError, Phase, StepParams};

use crate::error::{Result, TrainError};
use stoker_comm::shard::GroupSplit;

/// Reduce-scatters a rank lets run at once before it waits for the oldest.
pub const REDUCING: usize = 1;

/// A pool of zeroed f32 buffers, with the bytes handed out counted by length (a backend
/// may keep a buffer it was handed, so the count cannot follow capacities; buffers are
/// asked for in a few fixed sizes, which best-fit reuses exactly). A counting pool
/// ([`Pool::counting`]) hands out empty buffers and only counts: a schedule replayed to
/// learn its peak touches no memory, whatever the model's size.
#[derive(Default)]
pub struct Pool {
    free: Vec<Vec<f32>>,
    in_use: usize,
    peak: usize,
    counting: bool,
}

impl Pool {
    /// A pool that counts what it would hand out and hands out empty buffers.
    pub fn counting() -> Self {
        Pool {
            counting: true,
            ..Pool::default()
        }
    }

    /// Whether this pool only counts ([`Pool::counting`]).
    pub fn is_counting(&self) -> bool {
        self.counting
    }

    /// A buffer of `len` zeros from the pool (the smallest that fits) or new; an empty
    /// one (a rank that owns nothing of a group) takes nothing from the pool.
    pub fn take(&mut self, len: usize) -> Vec<f32> {
        if len == 0 {
            return Vec::new();
        }
        self.in_use += 4 * len;
        self.peak = self.peak.max(self.in_use);
        if self.counting {
            return Vec::new();
        }
        let best = (0..self.free.len())
            .filter(|&i| self.free[i].capacity() >= len)
            .min_by_key(|&i| self.free[i].capacity());
        let mut v = match best {
            Some(i) => self.free.swap_remove(i),
            None => Vec::with_capacity(len),
        };
        v.clear();
        v.resize(len, 0.0);
        v
    }

    /// Gives back `v`, the buffer of `len` elements [`Pool::take`] handed out (or the one a
    /// backend returned in its place: its own length is what comes back, except in a
    /// counting pool, whose buffers are empty).
    pub fn give(&mut self, v: Vec<f32>, len: usize) {
        self.in_use -= 4 * if self.counting { len } else { v.len() };
        if v.capacity() > 0 {
            self.free.push(v);
        }
    }

    /// A buffer of `len` elements handed to a collective: back to the pool if the backend
    /// returned it, else only the accounting.
    pub fn gone(&mut self, input: Option<Vec<f32>>, len: usize) {
        match input {
            Some(v) => self.give(v, len),
            None => self.in_use -= 4 * len,
        }
    }

    /// The most bytes handed out at once so far.
    pub fn peak_bytes(&self) -> usize {
        self.peak
    }
}

/// The f32 vector in `b`, or an error naming `what`.
pub fn f32s(b: Buffer, what: &str) -> Result<Vec<f32>> {
    match b {
        Buffer::F32(v) => Ok(v),
        other => Err(TrainError::Strategy(format!(
            "the {what} came back as {}, expected f32",
            other.dtype().name()
        ))),
    }
}

/// One rank's per-group gradient buffers and their reduce-scatters.
pub struct GroupReduce {
    pub(super) comm: Rc<dyn Communicator>,
    /// Each group's span, counts and this rank's piece, by group number.
    pub(super) splits: Vec<GroupSplit>,
    /// Elements of this rank's shard.
    own_len: usize,
    grads: Vec<Option<Vec<f32>>>,
    /// Reduce-scatters in flight: group, handle, input length.
    reducing: VecDeque<(usize, Pending, usize)>,
    pub(super) pool: Pool,
    pub(super) waited: Duration,
}

impl GroupReduce {
    /// The groups `splits` (by group number, as this rank sees them) over `comm`'s ranks,
    /// this rank's shard holding `own_len` elements.
    pub fn new(comm: Rc<dyn Communicator>, splits: Vec<GroupSplit>, own_len: usize) -> Self {
        let n = splits.len();
        GroupReduce {
            own_len,
            comm,
            splits,
            grads: vec![None; n],
            reducing: VecDeque::new(),
            pool: Pool::default(),
            waited: Duration::ZERO,
        }
    }

    /// The most bytes of group buffers held at once so far.
    pub fn peak_bytes(&self) -> usize {
        self.pool.peak_bytes()
    }

    /// The parameter groups.
    pub fn groups(&self) -> usize {
        self.splits.len()
    }

    /// Time spent waiting for collectives since the last call.
    pub fn take_waited(&mut self) -> Duration {
        std::mem::take(&mut self.waited)
    }

    /// The same groups and shards over a communicator that moves no data, for running
    /// the schedule before the first step.
    pub fn over_null_comm(&self) -> Result<GroupReduce> {
        let comm = NullComm::new(self.comm.rank(), self.comm.world_size())?;
        Ok(GroupReduce::new(
            Rc::new(comm),
            self.splits.clone(),
            self.own_len,
        ))
    }

    /// The shard's length.
    pub(super) fn own_len(&self) -> usize {
        self.own_len
    }

    /// What [`GroupReduce::peak_bytes`] reaches in one micro-batch of the GPT's direct
    /// step, predicted before the first: the step's calls (`stoker_kernels::group_calls`) run
    /// through [`ReduceSource`]'s two rules (a group's buffer at its first backward view,
    /// its reduce-scatter when the backward is done with it) over a communicator that moves no data. The
    /// rules are restated here because a `ReduceSource` needs the whole parameter buffer
    /// to serve views; `tests/data_parallel.rs` holds the predicted bytes to the held ones.
    pub fn planned_peak(&self) -> Result<usize> {
        let mut scratch = self.over_null_comm()?;
        scratch.pool = Pool::counting();
        // Never written: the counting pool's reductions are empty.
        let mut shard = vec![0f32; self.own_len];
        for call in stoker_kernels::group_calls(self.splits.len()) {
            match call {
                GroupCall::Open(g, Phase::Backward) => {
                    scratch.grads(g);
                }
                GroupCall::Done(g, Phase::Backward) => scratch.start(g, &mut shard)?,
                GroupCall::Open(_, Phase::Forward) | GroupCall::Done(_, Phase::Forward) => {}
            }
        }
        scratch.finish(&mut shard)?;
        Ok(scratch.peak_bytes())
    }

    /// The part of `group` this rank owns, as a range of its shard (empty if none).
    pub fn local(&self, group: usize) -> Range<usize> {
        self.splits[group].local.clone()
    }

    /// `group`'s span of the flat buffer.
    pub fn span(&self, group: usize) -> Range<usize> {
        self.splits[group].span.clone()
    }

    /// `group`'s gradient buffer for this micro-batch, zeroed when first asked for.
    pub fn grads(&mut self, group: usize) -> &mut [f32] {
        if self.grads[group].is_none() {
            let len = self.splits[group].span.len();
            self.grads[group] = Some(self.pool.take(len));
        }
        self.grads[group].as_mut().expect("set above")
    }

    /// Starts the reduce-scatter of `group`'s gradients (none if the backward wrote
    /// none), keeping at most [`REDUCING`] in flight; finished ones are added into the
    /// shard `shard`.
    pub fn start(&mut self, group: usize, shard: &mut [f32]) -> Result<()> {
        let Some(input) = self.grads[group].take() else {
            return Ok(());
        };
        let output = self.pool.take(self.local(group).len());
        // The buffer's logical length (a counting pool's buffers are empty).
        let len = self.splits[group].span.len();
        let p = self.comm.start_reduce_scatter(
            Buffer::F32(input),
            &self.splits[group].counts,
            Buffer::F32(output),
        )?;
        self.reducing.push_back((group, p, len));
        while self.reducing.len() > REDUCING {
            self.finish_one(shard)?;
        }
        Ok(())
    }

    /// Waits for the oldest reduce-scatter and adds its sums into the shard `shard`.
    fn finish_one(&mut self, shard: &mut [f32]) -> Result<()> {
        let Some((group, p, len)) = self.reducing.pop_front() else {
            return Ok(());
        };
        let t0 = Instant::now();
        let (out, input) = p.wait_with_input()?;
        self.waited += t0.elapsed();
        let out = f32s(out, "reduced gradients")?;
        let local = self.local(group);
        for (g, s) in shard[local.clone()].iter_mut().zip(&out) {
            *g += s;
        }
        self.pool.give(out, local.len());
        let input = input.map(|b| f32s(b, "gradient buffer")).transpose()?;
        self.pool.gone(input, len);
        Ok(())
    }

    /// After a micro-batch: every reduction added into the shard `shard`, every gradient
    /// buffer back in the pool.
    pub fn finish(&mut self, shard: &mut [f32]) -> Result<()> {
        while !self.reducing.is_empty() {
            self.finish_one(shard)?;
        }
        for group in 0..self.grads.len() {
            if let Some(v) = self.grads[group].take() {
                let len = self.splits[group].span.len();
                self.pool.give(v, len);
            }
        }
        Ok(())
    }
}

/// The direct step's parameter source for one ZeRO-2 micro-batch: every group's
/// parameters read from the whole FP32 buffer `master`, its gradients written into a
/// buffer of their own and reduce-scattered into this rank's shard `grads`.
pub struct ReduceSource<'a, R = &'a mut GroupReduce> {
    /// The gradient buffers and their reductions (borrowed, or owned by a scratch step).
    pub reduce: R,
    /// The whole FP32 parameter buffer.
    pub master: &'a [f32],
    /// This rank's shard of the window's gradient sum.
    pub grads: &'a mut [f32],
}

/// A source's error as the kernels report it.
pub fn source_err(op: &'static str, group: usize, e: TrainError) -> KernelError {
    KernelError::Source {
        op,
        group,
        msg: e.to_string(),
    }
}

impl<R: BorrowMut<GroupReduce>> StepParams for ReduceSource<'_, R> {
    fn group(
        &mut self,
        group: usize,
        phase: Phase,
    ) -> std::result::Result<GroupView<'_>, KernelError> {
        let reduce = self.reduce.borrow_mut();
        reduce.comm.progress();
        let span = reduce.span(group);
        let grads = match phase {
            Phase::Backward => reduce.grads(group),
            Phase::Forward => &mut [],
        };
        Ok(GroupView {
            base: span.start,
            params: &self.master[span],
            grads,
        })
    }

    fn done(&mut self, group: usize, phase: Phase) -> std::result::Result<(), KernelError> {
        match phase {
            Phase::Forward => Ok(()),
            Phase::Backward => self
                .reduce
                .borrow_mut()
                .start(group, self.grads)
                .map_err(|e| source_err("zero2", group, e)),
        }
    }
}
