//! ZeRO stage 3 (FSDP's `FULL_SHARD`): parameters, gradients and optimizer states all
//! sharded. Each rank keeps only its [`GroupShards`] piece of every parameter group (about
//! 1/N of each, so every collective loads every link both ways) of the FP32 parameters,
//! of the window's gradient sum and of the optimizer's moments; the direct step sees each
//! parameter group only while it computes with it ([`super::gather`]: gathered one block
//! ahead, freed after use, gradients reduce-scattered as soon as they are final). After
//! the optimizer nothing is gathered: the updated shard is what the rank keeps.
//!
//! Every micro-batch gathers and reduces (FSDP without `no_sync`, which under
//! `FULL_SHARD` would keep full unsharded gradients and defeat the sharding): per micro-
//! batch, the root groups are gathered once, every block twice (forward and backward;
//! once with `reshard_after_forward = false`), and every group reduce-scattered once:
//! with the ring model `(n-1)/n x 4 x (root + 2 blocks + everything)` bytes, about 1.5x
//! DDP's all-reduce per micro-batch, as the ZeRO paper counts.
//!
//! On the candle-graph path (every model; the GPT without `kernels = "direct"`) the trainer
//! runs the model unit by unit ([`super::units`]: a layer or block at a time, its groups
//! gathered through [`ShardedParams::start_gather_span`] and reduce-scattered through
//! [`ShardedParams::scatter_span`], with activation checkpointing at the units'
//! boundaries); the traffic is the direct step's. Between micro-batches a rank holds only
//! its shards either way.
//!
//! Not built: deterministic mode (the per-micro-batch reduce-scatters sum in MPI's order)
//! and `no_sync`; the config refuses each, naming the key.

use std::ops::Range;
use std::rc::Rc;

use stoker_comm::{Buffer, CommExt, CommStats, Communicator, Pending};

use super::gather::{GroupGather, Source};
use super::{
    scalars, GroupShards, GroupSource, GroupSplit, Pieces, ShardedParams, Strategy, StrategyBytes,
    SyncStats,
};
use crate::error::Result;
use crate::error::TrainError;
use crate::grad_sum::SumOrder;

/// The ZeRO-3 strategy of one rank.
pub struct Zero3 {
    comm: Rc<dyn Communicator>,
    shards: GroupShards,
    /// This rank's piece of every group.
    own: Pieces,
    /// Every group as this rank's collectives see it.
    splits: Vec<GroupSplit>,
    gather: GroupGather,
    /// The gathered groups' workspace one micro-batch of the direct step holds, predicted
    /// before the first (0 on the graph path, whose units the trainer tells).
    planned_peak: usize,
    window_start: CommStats,
    stats: SyncStats,
}

impl Zero3 {
    /// ZeRO-3 over `comm` for a flat buffer whose parameter groups
    /// ([`FlatLayout::group_spans`]; the GPT's direct step gathers them one at a time:
    /// embeddings, blocks, final norm) `shards` splits.
    ///
    /// [`FlatLayout::group_spans`]: crate::layout::FlatLayout::group_spans
    pub fn new(
        comm: Rc<dyn Communicator>,
        shards: GroupShards,
        reshard_after_forward: bool,
    ) -> Result<Self> {
        let own = shards.held(comm.rank());
        let splits = shards.group_splits(comm.rank());
        let gather = GroupGather::new(
            comm.clone(),
            splits.clone(),
            own.len(),
            reshard_after_forward,
        );
        Ok(Zero3 {
            splits,
            window_start: comm.stats(),
            planned_peak: 0,
            gather,
            comm,
            own,
            shards,
            stats: SyncStats::default(),
        })
    }
}

impl Zero3 {
    /// The group whose span `span` is: ZeRO-3's collectives move whole groups.
    fn split(&self, span: &Range<usize>) -> Result<&GroupSplit> {
        match self.shards.group_of(span) {
            Some(g) => Ok(&self.splits[g]),
            None => Err(TrainError::Strategy(format!(
                "zero3: elements {span:?} are not one parameter group's span"
            ))),
        }
    }
}

impl Strategy for Zero3 {
    fn name(&self) -> &'static str {
        "zero3"
    }

    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn sum_order(&self) -> SumOrder {
        SumOrder::InPlace
    }

    fn start(&mut self, master: &mut [f32]) -> Result<()> {
        self.comm.broadcast(master, 0)?;
        Ok(())
    }

    fn begin_window(&mut self, _len: usize) -> Result<()> {
        self.window_start = self.comm.stats();
        self.stats = SyncStats::default();
        self.gather.take_waited();
        Ok(())
    }

    fn begin_micro_batch(&mut self, micro: usize, len: usize) -> Result<bool> {
        if micro + 1 == len {
            self.stats.calls_before_last = self.comm.stats().since(&self.window_start).calls();
        }
        Ok(true)
    }

    fn group_ready(&mut self, _group: usize, _grads: &[f32]) -> Result<()> {
        Ok(())
    }

    fn finish_micro_batch(&mut self, grads: &mut [f32]) -> Result<()> {
        self.gather.finish(grads)?;
        self.stats.exposed_wait += self.gather.take_waited();
        // One reduce-scatter per parameter group.
        self.stats.buckets += self.gather.groups();
        Ok(())
    }

    fn finish_window(&mut self, _grads: &mut [f32]) -> Result<()> {
        Ok(())
    }

    fn sum_scalars(&mut self, x: &mut [f64]) -> Result<()> {
        scalars::sum_scalars(&*self.comm, false, x)
    }

    fn any_rank(&mut self, flag: bool) -> Result<bool> {
        scalars::any_rank(&*self.comm, flag)
    }

    fn sum_of_squares(&mut self, grads: &[f32]) -> Result<f64> {
        // `grads` is this rank's shard.
        scalars::sharded_sum_of_squares(&*self.comm, grads)
    }

    fn max_over_ranks(&mut self, x: &mut [f32]) -> Result<()> {
        scalars::max_over_ranks(&*self.comm, x)
    }

    fn update_range(&self, len: usize) -> Pieces {
        debug_assert_eq!(len, self.shards.len());
        self.own.clone()
    }

    fn after_update(&mut self, _master: &mut [f32]) -> Result<()> {
        Ok(())
    }

    fn holds(&self, len: usize) -> Pieces {
        debug_assert_eq!(len, self.shards.len());
        self.own.clone()
    }

    fn settle_grads(&mut self, len: usize, direct: bool) -> Result<Pieces> {
        if direct {
            self.planned_peak = self.gather.planned_peak()?;
        }
        Ok(self.holds(len))
    }

    fn by_group(&mut self) -> Option<&mut dyn GroupSource> {
        Some(self)
    }

    fn sharded(&mut self) -> Option<&mut dyn ShardedParams> {
        Some(self)
    }

    fn stats(&self) -> SyncStats {
        SyncStats {
            bytes_sent: self.comm.stats().since(&self.window_start).bus_bytes(),
            ..self.stats
        }
    }
}

impl StrategyBytes for Zero3 {
    fn buffer_bytes(&self) -> usize {
        self.gather.peak_bytes()
    }

    fn steady_buffer_bytes(&self) -> usize {
        self.planned_peak
    }
}

impl GroupSource for Zero3 {
    fn step_source<'a>(
        &'a mut self,
        master: &'a [f32],
        grads: &'a mut [f32],
    ) -> Box<dyn stoker_kernels::StepParams + 'a> {
        Box::new(Source {
            gather: &mut self.gather,
            master,
            grads,
        })
    }

    fn scratch_source<'a>(
        &self,
        master: &'a [f32],
        grads: &'a mut [f32],
    ) -> Result<(Box<dyn stoker_kernels::StepParams + 'a>, usize)> {
        let source = Source {
            gather: self.gather.over_null_comm()?,
            master,
            grads,
        };
        Ok((Box::new(source), self.planned_peak))
    }
}

impl ShardedParams for Zero3 {
    // Non-blocking collectives and a wait: the MPI backend's wait yields the core, where
    // MPICH's blocking calls spin (4 ranks on 2 cores took 4.7 s per step spinning).
    fn start_gather_span(&mut self, held: &[f32], span: Range<usize>) -> Result<Pending> {
        let split = self.split(&span)?;
        let input = held[split.local.clone()].to_vec();
        let output = vec![0f32; span.len()];
        Ok(self
            .comm
            .start_all_gather(Buffer::F32(input), &split.counts, Buffer::F32(output))?)
    }

    fn finish_gather_span(&mut self, started: Pending) -> Result<Vec<f32>> {
        let t0 = std::time::Instant::now();
        let out = started.wait_vec::<f32>()?;
        self.stats.exposed_wait += t0.elapsed();
        Ok(out)
    }

    fn scatter_span(
        &mut self,
        grads: Vec<f32>,
        span: Range<usize>,
        shard: &mut [f32],
    ) -> Result<()> {
        let t0 = std::time::Instant::now();
        let split = self.split(&span)?;
        let local = split.local.clone();
        let output = vec![0f32; local.len()];
        let mine = self
            .comm
            .start_reduce_scatter(Buffer::F32(grads), &split.counts, Buffer::F32(output))?
            .wait_vec::<f32>()?;
        for (s, m) in shard[local].iter_mut().zip(&mine) {
            *s += m;
        }
        self.stats.exposed_wait += t0.elapsed();
        Ok(())
    }

    fn gather_params(&mut self, held: &[f32]) -> Result<Vec<f32>> {
        // Group by group, straight into place (rank order is buffer order within a group).
        let mut full = vec![0f32; self.shards.len()];
        for s in &self.splits {
            self.comm
                .all_gather(&held[s.local.clone()], &s.counts, &mut full[s.span.clone()])?;
        }
        Ok(full)
    }
}
