//! ZeRO stages 1 and 2 (DeepSpeed's names; FSDP calls stage 2 SHARD_GRAD_OP): each rank
//! owns one contiguous shard of the flat buffer ([`ShardPlan`]), keeps the optimizer's
//! moments for that shard alone, and updates only it; the updated shards are then
//! all-gathered so every rank holds the whole FP32 parameter buffer again (the direct
//! step reads FP32 weights and casts its GEMM operands itself, so the FP32 copy is what
//! is gathered: 4 bytes per parameter, where DeepSpeed gathers its 2-byte fp16 copy).
//!
//! - Stage 1: micro-batches accumulate locally with no communication; after the window's
//!   last backward one reduce-scatter of the whole gradient buffer leaves each rank the
//!   global sums of its shard.
//! - Stage 2: the reduction is bucketed and overlapped with the backward like DDP's, but
//!   each bucket is reduce-scattered: a rank keeps only the sums of the part it owns. With
//!   accumulation, two choices (`[parallel] sync_every_micro_batch`):
//!   - reduce-scatter every micro-batch (the default, DeepSpeed's stage 2): the rank's
//!     running sum is shard-sized and each micro-batch's full gradient is workspace
//!     (zeroed after its reduce-scatter); traffic `k` reduce-scatters per step;
//!   - `false` (FSDP's `no_sync`): full local gradients accumulate until the last
//!     micro-batch, whose backward reduce-scatters; one reduce-scatter per step, full
//!     gradient memory during the window.
//!
//! On the GPT's direct step, stage 2 reducing every micro-batch never holds a full
//! gradient: the step writes each parameter group into a buffer of its own, reduce-
//! scattered as soon as the backward is done with the group and added into the rank's
//! shard ([`super::reduce`], the seam ZeRO-3 uses, with the parameters read from the
//! whole FP32 buffer), so its gradient memory is the shard plus a few group buffers, as
//! DeepSpeed's. On the candle-graph path the backward produces the whole gradient at
//! once (candle's gradient store), so there it is a full buffer plus the shard-sized sum.
//!
//! Deterministic mode: the ranks sum in the fixed tree ([`tree_all_reduce`] over the
//! whole buffer after the window), so each rank's shard holds the bits one rank computes,
//! the norm is taken over the whole reduced buffer, and the shard updates are the
//! one-rank update's elements: weights bit-identical to one rank at every power-of-two
//! world size, at DDP's traffic instead of a reduce-scatter's.

use std::ops::Range;
use std::rc::Rc;
use std::time::Instant;

use stoker_comm::{tree_all_reduce, CommExt, CommStats, Communicator};

use super::buckets::{Bucket, BucketOp, Buckets};
use super::reduce::{GroupReduce, ReduceSource};
use super::{scalars, GroupSource, Pieces, Strategy, StrategyBytes, SyncStats};
use crate::error::Result;
use crate::grad_sum::SumOrder;
use stoker_comm::shard::ShardPlan;

/// Which ZeRO stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZeroStage {
    /// Optimizer states sharded.
    One,
    /// Optimizer states and gradients sharded.
    Two,
}

/// ZeRO's knobs (the `[parallel]` config keys).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ZeroOptions {
    /// Stage 1 or 2.
    pub stage: ZeroStage,
    /// Fixed reduction order: bit-identical results at every world size.
    pub deterministic: bool,
    /// Stage 2: reduce-scatter every micro-batch (true) or only the window's last.
    pub reduce_every_micro_batch: bool,
}

impl ZeroOptions {
    /// Whether gradients are reduced during the backward (stage 2 outside deterministic
    /// mode, whose tree sums after the window instead).
    fn during_backward(&self) -> bool {
        self.stage == ZeroStage::Two && !self.deterministic
    }

    /// Whether every micro-batch is reduced (else only the window's last).
    fn every(&self) -> bool {
        self.during_backward() && self.reduce_every_micro_batch
    }
}

/// The ZeRO-1/2 strategy of one rank.
pub struct Zero {
    comm: Rc<dyn Communicator>,
    opts: ZeroOptions,
    shards: ShardPlan,
    own: Range<usize>,
    /// Stage 2's bucketed reduce-scatters.
    buckets: Buckets,
    /// Stage 2, every micro-batch, graph path: the running sum of this rank's shard.
    shard_sum: Vec<f32>,
    /// The parameter groups' spans, by group number (stage 2 on the direct step).
    spans: Option<Vec<Range<usize>>>,
    /// Stage 2, every micro-batch, direct step: per-group gradient buffers reduced into
    /// the trainer's shard-sized gradient sum.
    reduce: Option<ByGroup>,
    /// A shard-sized buffer: the stage-1 reduce-scatter's output, the all-gather's input.
    shard_buf: Vec<f32>,
    window_start: CommStats,
    stats: SyncStats,
    /// The strategy's name where it is not its stage's ([`Zero::on_resident_loop_as`]).
    name: Option<&'static str>,
}

impl Zero {
    /// ZeRO over `comm` for a flat buffer of `len` elements aligned to `align`, with
    /// gradient buckets `plan` (stage 2).
    pub fn new(
        comm: Rc<dyn Communicator>,
        len: usize,
        align: usize,
        plan: Vec<Bucket>,
        opts: ZeroOptions,
    ) -> Self {
        let shards = ShardPlan::new(len, comm.world_size(), align);
        let own = shards.range(comm.rank());
        let op = BucketOp::ReduceScatter {
            shards: shards.clone(),
            rank: comm.rank(),
        };
        Zero {
            window_start: comm.stats(),
            comm,
            buckets: Buckets::new(plan, op),
            shard_sum: if opts.every() {
                vec![0.0; own.len()]
            } else {
                vec![]
            },
            shard_buf: vec![0.0; own.len()],
            spans: None,
            reduce: None,
            own,
            shards,
            opts,
            stats: SyncStats::default(),
            name: None,
        }
    }

    /// This strategy as the host's side of a resident loop's `name` (`"zero3"`): the loop
    /// reduces and updates on its backend, and the trainer keeps only the bookkeeping
    /// (this rank's flat shard of the master and moments, its whole host mirror
    /// all-gathered when something reads it), which for ZeRO-3 on the loop is ZeRO-2's.
    /// The compute copy that ZeRO-3 shards lives on the loop's backend alone.
    pub fn on_resident_loop_as(mut self, name: &'static str) -> Self {
        self.name = Some(name);
        self
    }

    /// Tells the strategy the parameter groups' spans by group number
    /// ([`FlatLayout::group_spans`]), which stage 2 reduces one by one on a direct step;
    /// None (a model whose groups are not numbered so, without a direct step) keeps the
    /// buckets.
    ///
    /// [`FlatLayout::group_spans`]: crate::layout::FlatLayout::group_spans
    pub fn with_groups(mut self, spans: Option<Vec<Range<usize>>>) -> Self {
        self.spans = spans;
        self
    }

    /// The ranks' shards.
    pub fn shards(&self) -> &ShardPlan {
        &self.shards
    }

    fn every(&self) -> bool {
        self.opts.every()
    }
}

impl Strategy for Zero {
    fn name(&self) -> &'static str {
        match (self.name, self.opts.stage) {
            (Some(name), _) => name,
            (None, ZeroStage::One) => "zero1",
            (None, ZeroStage::Two) => "zero2",
        }
    }

    fn communicator(&self) -> Option<Rc<dyn Communicator>> {
        Some(self.comm.clone())
    }

    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn sum_order(&self) -> SumOrder {
        match self.opts.deterministic {
            true => SumOrder::Tree,
            false => SumOrder::InPlace,
        }
    }

    fn start(&mut self, master: &mut [f32]) -> Result<()> {
        self.comm.broadcast(master, 0)?;
        Ok(())
    }

    fn begin_window(&mut self, _len: usize) -> Result<()> {
        self.window_start = self.comm.stats();
        self.stats = SyncStats::default();
        self.shard_sum.fill(0.0);
        Ok(())
    }

    fn begin_micro_batch(&mut self, micro: usize, len: usize) -> Result<bool> {
        if micro + 1 == len {
            self.stats.calls_before_last = self.comm.stats().since(&self.window_start).calls();
        }
        Ok(self.opts.during_backward() && (self.every() || micro + 1 == len))
    }

    fn group_ready(&mut self, group: usize, grads: &[f32]) -> Result<()> {
        self.buckets.ready(&*self.comm, group, grads)
    }

    fn finish_micro_batch(&mut self, grads: &mut [f32]) -> Result<()> {
        if let Some(ByGroup { reduce, .. }) = &mut self.reduce {
            // `grads` is this rank's shard of the window's sum: the reductions add into it.
            reduce.finish(grads)?;
            self.stats.exposed_wait += reduce.take_waited();
            // One reduce-scatter per parameter group.
            self.stats.buckets += reduce.groups();
            return Ok(());
        }
        self.stats.exposed_wait += self.buckets.finish(grads)?;
        self.stats.buckets += self.buckets.plan().len();
        if self.every() {
            // Keep this micro-batch's shard sums; the next backward starts from zero.
            for (s, g) in self.shard_sum.iter_mut().zip(&grads[self.own.clone()]) {
                *s += g;
            }
            stoker_kernels::flat::zero(grads);
        }
        Ok(())
    }

    fn finish_window(&mut self, grads: &mut [f32]) -> Result<()> {
        let t0 = Instant::now();
        if self.opts.deterministic {
            tree_all_reduce(&*self.comm, grads)?;
        } else if self.reduce.is_some() {
            // The sums are in the trainer's shard already.
        } else if self.every() {
            grads[self.own.clone()].copy_from_slice(&self.shard_sum);
        } else if self.opts.stage == ZeroStage::One {
            let counts = self.shards.counts();
            self.comm
                .reduce_scatter(grads, &counts, &mut self.shard_buf)?;
            grads[self.own.clone()].copy_from_slice(&self.shard_buf);
        }
        self.stats.exposed_wait += t0.elapsed();
        Ok(())
    }

    fn sum_scalars(&mut self, x: &mut [f64]) -> Result<()> {
        scalars::sum_scalars(&*self.comm, self.opts.deterministic, x)
    }

    fn any_rank(&mut self, flag: bool) -> Result<bool> {
        scalars::any_rank(&*self.comm, flag)
    }

    fn sum_of_squares(&mut self, grads: &[f32]) -> Result<f64> {
        if self.opts.deterministic {
            // Every rank holds the whole tree-reduced gradient: the one-rank norm's bits.
            return Ok(stoker_kernels::flat::sum_of_squares(grads));
        }
        let mine = match self.reduce.is_some() {
            true => grads,
            false => &grads[self.own.clone()],
        };
        scalars::sharded_sum_of_squares(&*self.comm, mine)
    }

    fn max_over_ranks(&mut self, x: &mut [f32]) -> Result<()> {
        scalars::max_over_ranks(&*self.comm, x)
    }

    fn update_range(&self, len: usize) -> Pieces {
        debug_assert_eq!(len, self.shards.len());
        Pieces::one(self.own.clone())
    }

    fn after_update(&mut self, master: &mut [f32]) -> Result<()> {
        let t0 = Instant::now();
        self.shard_buf.copy_from_slice(&master[self.own.clone()]);
        let counts = self.shards.counts();
        self.comm.all_gather(&self.shard_buf, &counts, master)?;
        self.stats.exposed_wait += t0.elapsed();
        Ok(())
    }

    fn settle_grads(&mut self, len: usize, direct: bool) -> Result<Pieces> {
        debug_assert_eq!(len, self.shards.len());
        if self.reduce.is_some() {
            return Ok(Pieces::one(self.own.clone()));
        }
        match (direct && self.every(), &self.spans) {
            (true, Some(spans)) => {
                let splits = self.shards.group_splits(self.comm.rank(), spans);
                let reduce = GroupReduce::new(self.comm.clone(), splits, self.own.len());
                let planned_peak = reduce.planned_peak()?;
                self.reduce = Some(ByGroup {
                    reduce,
                    planned_peak,
                });
                self.shard_sum = Vec::new();
                Ok(Pieces::one(self.own.clone()))
            }
            _ => Ok(Pieces::one(0..len)),
        }
    }

    fn by_group(&mut self) -> Option<&mut dyn GroupSource> {
        self.reduce.as_mut().map(|r| r as &mut dyn GroupSource)
    }

    fn stats(&self) -> SyncStats {
        SyncStats {
            bytes_sent: self.comm.stats().since(&self.window_start).bus_bytes(),
            ..self.stats
        }
    }
}

impl StrategyBytes for Zero {
    fn grad_bytes(&self) -> usize {
        4 * self.shard_sum.len()
    }

    fn buffer_bytes(&self) -> usize {
        4 * self.shard_buf.len()
            + self.buckets.buffer_bytes()
            + self.reduce.as_ref().map_or(0, |r| r.reduce.peak_bytes())
    }

    fn steady_buffer_bytes(&self) -> usize {
        // Reductions during the backward go through the buckets, or, on the direct step,
        // by group.
        4 * self.shard_buf.len()
            + match (&self.reduce, self.opts.during_backward()) {
                (Some(r), _) => r.planned_peak,
                (None, true) => self.buckets.steady_bytes(),
                (None, false) => 0,
            }
    }
}

/// ZeRO-2's reductions on the direct step, group by group as its backward finishes each,
/// and the workspace they hold at most (predicted before the first step).
struct ByGroup {
    reduce: GroupReduce,
    planned_peak: usize,
}

impl GroupSource for ByGroup {
    fn step_source<'a>(
        &'a mut self,
        master: &'a [f32],
        grads: &'a mut [f32],
    ) -> Box<dyn stoker_kernels::StepParams + 'a> {
        Box::new(ReduceSource {
            reduce: &mut self.reduce,
            master,
            grads,
        })
    }

    fn scratch_source<'a>(
        &self,
        master: &'a [f32],
        grads: &'a mut [f32],
    ) -> Result<(Box<dyn stoker_kernels::StepParams + 'a>, usize)> {
        let source = ReduceSource {
            reduce: self.reduce.over_null_comm()?,
            master,
            grads,
        };
        Ok((Box::new(source), self.planned_peak))
    }
}
