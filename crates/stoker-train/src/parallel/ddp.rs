//! DDP: every rank holds the whole model and optimizer; gradients are summed over ranks.
//!
//! Default mode (PyTorch DDP): on the window's last micro-batch each gradient bucket's
//! all-reduce starts as soon as the backward has finished its groups, so it overlaps the
//! rest of the backward; earlier micro-batches accumulate locally with no communication
//! (`no_sync`). `sync_every_micro_batch` reduces every micro-batch instead, only to
//! measure the chapter's advice. The reductions are MPI's own, whose bracketing of the
//! sums depends on the world size: results match one rank to rounding.
//!
//! Deterministic mode: each rank sums its micro-batches as a fixed tree
//! ([`SumOrder::Tree`]) and the ranks combine their subtrees with
//! [`tree_all_reduce`] after the backward, and the window's scalars go through the same
//! tree: weights are bit-identical at every power-of-two world size. It costs the overlap
//! (the reduction waits for the whole backward) and `log2(k) + 2` gradient-sized buffers.

use std::rc::Rc;
use std::time::Instant;

use stoker_comm::{tree_all_reduce, CommExt, CommStats, Communicator};

use super::buckets::{Bucket, BucketOp, Buckets};
use super::{scalars, Pieces, Strategy, StrategyBytes, SyncStats};
use crate::error::Result;
use crate::grad_sum::SumOrder;

/// DDP's knobs (the `[parallel]` config keys of the same names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DdpOptions {
    /// Fixed reduction order: bit-identical results at every world size.
    pub deterministic: bool,
    /// Reduce after every micro-batch, not only the window's last.
    pub sync_every_micro_batch: bool,
}

/// The DDP strategy of one rank.
pub struct Ddp {
    comm: Rc<dyn Communicator>,
    opts: DdpOptions,
    buckets: Buckets,
    window_start: CommStats,
    stats: SyncStats,
}

impl Ddp {
    /// DDP over `comm` with gradient buckets `plan`.
    pub fn new(comm: Rc<dyn Communicator>, plan: Vec<Bucket>, opts: DdpOptions) -> Self {
        Ddp {
            window_start: comm.stats(),
            comm,
            opts,
            buckets: Buckets::new(plan, BucketOp::AllReduce),
            stats: SyncStats::default(),
        }
    }

    /// The bucket plan.
    pub fn buckets(&self) -> &[Bucket] {
        self.buckets.plan()
    }
}

impl Strategy for Ddp {
    fn name(&self) -> &'static str {
        "ddp"
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
        match (self.opts.deterministic, self.opts.sync_every_micro_batch) {
            (true, _) => SumOrder::Tree,
            (false, true) => SumOrder::Sequential,
            (false, false) => SumOrder::InPlace,
        }
    }

    fn start(&mut self, master: &mut [f32]) -> Result<()> {
        self.comm.broadcast(master, 0)?;
        Ok(())
    }

    fn begin_window(&mut self, _len: usize) -> Result<()> {
        self.window_start = self.comm.stats();
        self.stats = SyncStats::default();
        Ok(())
    }

    fn begin_micro_batch(&mut self, micro: usize, len: usize) -> Result<bool> {
        if micro + 1 == len {
            self.stats.calls_before_last = self.comm.stats().since(&self.window_start).calls();
        }
        Ok(!self.opts.deterministic && (self.opts.sync_every_micro_batch || micro + 1 == len))
    }

    fn group_ready(&mut self, group: usize, grads: &[f32]) -> Result<()> {
        self.buckets.ready(&*self.comm, group, grads)
    }

    fn finish_micro_batch(&mut self, grads: &mut [f32]) -> Result<()> {
        self.stats.exposed_wait += self.buckets.finish(grads)?;
        self.stats.buckets += self.buckets.plan().len();
        Ok(())
    }

    fn finish_window(&mut self, grads: &mut [f32]) -> Result<()> {
        if self.opts.deterministic {
            let t0 = Instant::now();
            tree_all_reduce(&*self.comm, grads)?;
            self.stats.exposed_wait += t0.elapsed();
        }
        Ok(())
    }

    fn sum_scalars(&mut self, x: &mut [f64]) -> Result<()> {
        scalars::sum_scalars(&*self.comm, self.opts.deterministic, x)
    }

    fn any_rank(&mut self, flag: bool) -> Result<bool> {
        scalars::any_rank(&*self.comm, flag)
    }

    fn sum_of_squares(&mut self, grads: &[f32]) -> Result<f64> {
        // Every rank holds the whole reduced gradient (the same bits): no communication.
        Ok(stoker_kernels::flat::sum_of_squares(grads))
    }

    fn max_over_ranks(&mut self, x: &mut [f32]) -> Result<()> {
        scalars::max_over_ranks(&*self.comm, x)
    }

    fn update_range(&self, len: usize) -> Pieces {
        Pieces::one(0..len)
    }

    fn after_update(&mut self, _master: &mut [f32]) -> Result<()> {
        Ok(())
    }

    fn stats(&self) -> SyncStats {
        SyncStats {
            bytes_sent: self.comm.stats().since(&self.window_start).bus_bytes(),
            ..self.stats
        }
    }
}

impl StrategyBytes for Ddp {
    fn buffer_bytes(&self) -> usize {
        self.buckets.buffer_bytes()
    }

    fn steady_buffer_bytes(&self) -> usize {
        self.buckets.steady_bytes()
    }
}
