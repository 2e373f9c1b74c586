//! Data parallelism: where one rank's training step meets the other ranks.
//!
//! Like torchtitan's `parallelize`, stoker applies parallelism in one documented order,
//! each strategy a small module behind one seam, [`Strategy`]:
//!
//! 1. Up front, [`dims::ParallelDims`] checks the degrees against the launcher and the
//!    batch arithmetic (`global_batch = micro_batch x accumulation_steps x world_size`);
//!    every error names its config key, before any work.
//! 2. At start the strategy makes the ranks agree: [`Strategy::start`] broadcasts the
//!    parameters from rank 0 (ranks have already compared their configs); a ZeRO-3 rank
//!    given a model declared without values draws its own pieces instead, the same on
//!    every rank ([`crate::params::ParamSet::init_pieces`]).
//! 3. Each window, the trainer runs the micro-batches. For those the strategy
//!    reduces ([`Strategy::begin_micro_batch`]; DDP: only the last, PyTorch's `no_sync` for the
//!    others) it hears of every parameter group as the backward finishes it
//!    ([`Strategy::group_ready`], which starts that bucket's reduction) and completes
//!    the reductions after the backward ([`Strategy::finish_micro_batch`]);
//!    [`Strategy::finish_window`] does what is left after the last one (the
//!    deterministic tree).
//! 4. The window's scalars are summed over ranks ([`Strategy::sum_scalars`]: loss, valid
//!    targets), so normalization is by the whole global batch's count; the loss scaler's
//!    overflow is agreed by all ([`Strategy::any_rank`]); the gradient norm comes from
//!    summed partial squares ([`Strategy::sum_of_squares`]).
//! 5. The optimizer updates [`Strategy::update_range`] of the flat buffer, and
//!    [`Strategy::after_update`] brings every rank's parameters up to date.
//!
//! [`single::Single`] is the one-rank strategy; [`ddp::Ddp`] is data parallelism with
//! bucketed all-reduce overlapped with the backward, or, in deterministic mode, a fixed
//! reduction tree; [`zero::Zero`] is ZeRO stage 1 or 2 over [`shard::ShardPlan`]'s
//! split of the flat buffer (stage 2 on the direct step reduces each parameter group's
//! gradients as the backward finishes it, [`reduce`]); [`zero3::Zero3`] shards the
//! parameters too, gathering each group for the direct step as it computes ([`gather`]). [`for_config`] picks one from
//! the config.

pub mod agree;
pub mod buckets;
pub mod ddp;
pub mod dims;
pub mod gather;
pub mod group_shards;
pub mod reduce;
pub mod scalars;
pub mod shard;
pub mod single;
pub mod units;
pub mod zero;
pub mod zero3;

use std::ops::Range;
use std::rc::Rc;
use std::time::Duration;

use stoker_comm::Communicator;

use crate::config::{StrategyKind, TrainConfig};
use crate::error::Result;
use crate::grad_sum::SumOrder;
use crate::layout::FlatLayout;

pub use crate::pieces::Pieces;
pub use ddp::Ddp;
pub use dims::ParallelDims;
pub use group_shards::GroupShards;
pub use shard::{GroupSplit, ShardPlan};
pub use single::Single;
pub use zero::{Zero, ZeroOptions, ZeroStage};
pub use zero3::Zero3;

/// What a strategy measured in the last window.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SyncStats {
    /// Collective calls made before the window's last micro-batch started (0 unless
    /// `sync_every_micro_batch`).
    pub calls_before_last: u64,
    /// Time the step waited for reductions after the backward had finished (the
    /// communication the backward did not hide).
    pub exposed_wait: Duration,
    /// Bytes this rank sent (ring model, see stoker-comm's stats).
    pub bytes_sent: u64,
    /// Gradient buckets reduced.
    pub buckets: usize,
}

/// How one rank's step meets the others; see the module doc for the order of calls.
pub trait Strategy {
    /// `none` or `ddp`, for logs.
    fn name(&self) -> &'static str;
    /// This rank.
    fn rank(&self) -> usize;
    /// Ranks in the data-parallel group.
    fn world_size(&self) -> usize;
    /// How the trainer must sum this rank's micro-batch gradients.
    fn sum_order(&self) -> SumOrder;
    /// Makes every rank start from rank 0's parameters, `master` the whole buffer (not
    /// called where each rank drew its own pieces of them, ZeRO-3's model without values).
    fn start(&mut self, master: &mut [f32]) -> Result<()>;
    /// Marks the start of a window of `len` micro-batches.
    fn begin_window(&mut self, len: usize) -> Result<()>;
    /// Micro-batch `micro` of a window of `len` starts; returns whether it is reduced as
    /// its backward runs.
    fn begin_micro_batch(&mut self, micro: usize, len: usize) -> Result<bool>;
    /// Group `group`'s gradients in `grads` are final for the micro-batch being reduced.
    fn group_ready(&mut self, group: usize, grads: &[f32]) -> Result<()>;
    /// After a reduced micro-batch's backward: waits for its reductions and leaves the
    /// sums over ranks in `grads`.
    fn finish_micro_batch(&mut self, grads: &mut [f32]) -> Result<()>;
    /// After the window's last micro-batch has been added to the local sum in `grads`.
    fn finish_window(&mut self, grads: &mut [f32]) -> Result<()>;
    /// Sums `x` over ranks in place (in deterministic mode in the fixed tree order).
    fn sum_scalars(&mut self, x: &mut [f64]) -> Result<()>;
    /// Whether `flag` holds on any rank.
    fn any_rank(&mut self, flag: bool) -> Result<bool>;
    /// The sum of squares of the whole (logical) gradient, over ranks where it is sharded.
    fn sum_of_squares(&mut self, grads: &[f32]) -> Result<f64>;
    /// The part of a flat buffer of `len` elements this rank's optimizer updates.
    fn update_range(&self, len: usize) -> Pieces;
    /// After the optimizer: every rank's `master` is up to date.
    fn after_update(&mut self, master: &mut [f32]) -> Result<()>;
    /// Bytes of gradient sums the strategy keeps besides the trainer's gradient buffer
    /// (ZeRO-2's shard-sized running sum).
    fn grad_bytes(&self) -> usize {
        0
    }
    /// Bytes of communication buffers it holds (bucket copies, shard buffers; ZeRO-3:
    /// the most its gathered groups and their gradients held at once).
    fn buffer_bytes(&self) -> usize {
        0
    }
    /// [`Strategy::buffer_bytes`] in steady state, known before the first step allocates
    /// them (the forecast's count); where it cannot be told, what is held now.
    fn steady_buffer_bytes(&self) -> usize {
        self.buffer_bytes()
    }
    /// The part of a flat buffer of `len` elements whose parameters and gradients this
    /// rank's trainer keeps between steps: all of it, except under ZeRO-3 (its piece of
    /// every group).
    fn holds(&self, len: usize) -> Pieces {
        Pieces::one(0..len)
    }
    /// Settles, before the first step, how the trainer's gradients meet this strategy,
    /// told whether its steps are direct (group by group through
    /// [`Strategy::step_source`]); returns the part of a flat gradient buffer of `len`
    /// elements the trainer keeps: [`Strategy::holds`], except where a direct step's
    /// gradients are reduced group by group into this rank's shard (ZeRO-2 reducing
    /// every micro-batch; ZeRO-3). Calling it again gives the same answer.
    fn settle_grads(&mut self, len: usize, _direct: bool) -> Result<Pieces> {
        Ok(self.holds(len))
    }
    /// Whether a direct step's micro-batch runs through [`Strategy::step_source`] (its
    /// gradients reduced group by group into this rank's shard), as settled by
    /// [`Strategy::settle_grads`].
    fn reduces_by_group(&self) -> bool {
        false
    }
    /// A source for one scratch micro-batch of the direct step: this strategy's per-group
    /// schedule over a communicator that moves no data (ZeRO-2 reducing by group,
    /// ZeRO-3), with the workspace it holds at most (told, as in
    /// [`Strategy::steady_buffer_bytes`]). None where the step reads and writes the whole
    /// buffers. What the run's memory count measures the kernels' own scratch with.
    #[allow(clippy::type_complexity)]
    fn dry_source<'a>(
        &self,
        _master: &'a [f32],
        _grads: &'a mut [f32],
    ) -> Result<Option<(Box<dyn stoker_kernels::StepParams + 'a>, usize)>> {
        Ok(None)
    }
    /// Where a micro-batch's direct step finds each parameter group (ZeRO-3: gathered
    /// from the ranks' shards of `master`; ZeRO-2: `master` itself) and where its
    /// gradients go (reduce-scattered and added into this rank's shard `grads`). None:
    /// the step reads and writes the whole buffers.
    fn step_source<'a>(
        &'a mut self,
        _master: &'a [f32],
        _grads: &'a mut [f32],
    ) -> Option<Box<dyn stoker_kernels::StepParams + 'a>> {
        None
    }
    /// ZeRO-3 on the graph path: starts gathering the parameters of flat span `span` from
    /// every rank's shard `held` (a collective; [`units`]), for
    /// [`Strategy::finish_gather_span`] to complete: the next unit's gather proceeds while
    /// this one computes.
    fn start_gather_span(
        &mut self,
        _held: &[f32],
        _span: Range<usize>,
    ) -> Result<stoker_comm::Pending> {
        Err(not_sharded(self.name()))
    }
    /// Completes a gather [`Strategy::start_gather_span`] started: the span's parameters.
    /// The wait counts as exposed communication.
    fn finish_gather_span(&mut self, _started: stoker_comm::Pending) -> Result<Vec<f32>> {
        Err(not_sharded(self.name()))
    }
    /// ZeRO-3 on the graph path: reduce-scatters `grads`, a micro-batch's gradients of flat
    /// span `span`, and adds this rank's part into its shard `shard` (a collective).
    fn scatter_span(
        &mut self,
        _grads: Vec<f32>,
        _span: Range<usize>,
        _shard: &mut [f32],
    ) -> Result<()> {
        Err(not_sharded(self.name()))
    }
    /// ZeRO-3: the whole parameter buffer, gathered from every rank's shard `held` (a
    /// collective: FSDP's `summon_full_params`). None where every rank holds it already.
    fn gather_params(&mut self, _held: &[f32]) -> Result<Option<Vec<f32>>> {
        Ok(None)
    }
    /// What the last window cost.
    fn stats(&self) -> SyncStats;
}

fn not_sharded(name: &str) -> crate::error::TrainError {
    crate::error::TrainError::Layout(format!("{name}: the parameters are not sharded here"))
}

/// The strategy `config` asks for over `comm`, with buckets over `layout`. One rank
/// needs no reduction: any strategy at world size 1 is the one-rank strategy (the same
/// bits; no bucket copies, no shards).
pub fn for_config(
    config: &TrainConfig,
    layout: &FlatLayout,
    comm: Rc<dyn Communicator>,
) -> Result<Box<dyn Strategy>> {
    let p = &config.parallel;
    let world = comm.world_size();
    let kind = match world {
        1 => StrategyKind::None,
        _ => p.strategy,
    };
    let mib = |x: f64| (x * (1 << 20) as f64) as usize;
    let plan = || {
        buckets::plan(
            &layout.group_ranges(),
            mib(p.bucket_cap_mb),
            mib(p.first_bucket_mb),
        )
    };
    let zero = |stage| ZeroOptions {
        stage,
        deterministic: p.deterministic,
        reduce_every_micro_batch: p.sync_every_micro_batch.unwrap_or(true),
    };
    let (len, align) = (layout.total_len(), layout.align());
    Ok(match kind {
        StrategyKind::None => Box::new(Single::new(match p.deterministic {
            true => SumOrder::Tree,
            false => SumOrder::InPlace,
        })),
        StrategyKind::Ddp => Box::new(Ddp::new(
            comm,
            plan(),
            ddp::DdpOptions {
                deterministic: p.deterministic,
                sync_every_micro_batch: p.sync_every_micro_batch.unwrap_or(false),
            },
        )),
        StrategyKind::Zero1 => Box::new(Zero::new(comm, len, align, plan(), zero(ZeroStage::One))),
        StrategyKind::Zero2 => Box::new(
            Zero::new(comm, len, align, plan(), zero(ZeroStage::Two))
                .with_groups(layout.group_spans().ok()),
        ),
        StrategyKind::Zero3 => Box::new(Zero3::new(
            comm,
            GroupShards::new(layout.group_spans()?, world, align),
            p.reshard_after_forward,
        )?),
    })
}
