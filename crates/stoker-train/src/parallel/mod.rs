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
//!    summed partial squares ([`Strategy::sum_of_squares`]); in fp8 each delayed scaler's
//!    amax of the step is the largest over ranks ([`Strategy::max_over_ranks`],
//!    Transformer Engine's amax all-reduce), so every rank takes one rank's scales.
//! 5. The optimizer updates [`Strategy::update_range`] of the flat buffer, and
//!    [`Strategy::after_update`] brings every rank's parameters up to date.
//!
//! [`single::Single`] is the one-rank strategy; [`ddp::Ddp`] is data parallelism with
//! bucketed all-reduce overlapped with the backward, or, in deterministic mode, a fixed
//! reduction tree; [`zero::Zero`] is ZeRO stage 1 or 2 over [`ShardPlan`]'s
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
pub use single::Single;
pub use stoker_comm::shard::{GroupSplit, ShardPlan};
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

/// The bytes a strategy holds beside the trainer's buffers, for the memory accounting
/// (every strategy has it; the defaults are a strategy that holds nothing of its own).
pub trait StrategyBytes {
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
    /// [`StrategyBytes::buffer_bytes`] in steady state, known before the first step
    /// allocates them (the forecast's count); where it cannot be known, what is held now.
    fn steady_buffer_bytes(&self) -> usize {
        self.buffer_bytes()
    }
}

/// How one rank's step meets the others: the phase methods, in the order of the module
/// doc; a strategy that serves the direct step group by group, or shards the
/// parameters, says so through [`Strategy::by_group`] and [`Strategy::sharded`].
pub trait Strategy: StrategyBytes {
    /// `none` or `ddp`, for logs.
    fn name(&self) -> &'static str;
    /// The communicator it runs over (None: one rank alone), for a path that runs its
    /// own collectives on its own buffers (the resident path, [`crate::trainer::StepPath`]).
    fn communicator(&self) -> Option<Rc<dyn Communicator>> {
        None
    }
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
    /// Replaces `x` (amaxes: >= 0 or NaN) by its largest value over ranks, element by
    /// element, NaN where any rank has one: fp8's amax of the step, so that every rank
    /// scales as one rank holding the whole batch would.
    fn max_over_ranks(&mut self, x: &mut [f32]) -> Result<()>;
    /// The part of a flat buffer of `len` elements this rank's optimizer updates.
    fn update_range(&self, len: usize) -> Pieces;
    /// After the optimizer: every rank's `master` is up to date.
    fn after_update(&mut self, master: &mut [f32]) -> Result<()>;
    /// The part of a flat buffer of `len` elements whose parameters and gradients this
    /// rank's trainer keeps between steps: all of it, except under ZeRO-3 (its piece of
    /// every group).
    fn holds(&self, len: usize) -> Pieces {
        Pieces::one(0..len)
    }
    /// Settles, before the first step, how the trainer's gradients meet this strategy,
    /// predicted whether its steps are direct; returns the part of a flat gradient buffer of
    /// `len` elements the trainer keeps: [`Strategy::holds`], except where a direct step's
    /// gradients are reduced group by group into this rank's shard (ZeRO-2 reducing every
    /// micro-batch; ZeRO-3), when [`Strategy::by_group`] then answers. Calling it again
    /// gives the same answer.
    fn settle_grads(&mut self, len: usize, _direct: bool) -> Result<Pieces> {
        Ok(self.holds(len))
    }
    /// Where a direct step's micro-batch finds each parameter group and sends its
    /// gradients, as settled by [`Strategy::settle_grads`]; None where the step reads and
    /// writes the whole buffers.
    fn by_group(&mut self) -> Option<&mut dyn GroupSource> {
        None
    }
    /// ZeRO-3's parameter hooks (the graph path's gathers and reduce-scatters, the whole
    /// buffer gathered); None where every rank holds every parameter.
    fn sharded(&mut self) -> Option<&mut dyn ShardedParams> {
        None
    }
    /// What the last window cost.
    fn stats(&self) -> SyncStats;
}

/// A strategy that serves the direct step group by group: each parameter group from it
/// (ZeRO-3: gathered from the ranks' shards; ZeRO-2: the master itself), each group's
/// gradients to it as the backward finishes them (reduce-scattered and added into this
/// rank's shard).
pub trait GroupSource {
    /// The source for one micro-batch over this rank's parameters `master` and gradient
    /// shard `grads`.
    fn step_source<'a>(
        &'a mut self,
        master: &'a [f32],
        grads: &'a mut [f32],
    ) -> Box<dyn stoker_kernels::StepParams + 'a>;
    /// The same schedule over a communicator that moves no data, for one scratch
    /// micro-batch, with the workspace it holds at most (known before the first step,
    /// as [`StrategyBytes::steady_buffer_bytes`]): what the run's memory count measures
    /// the kernels' own scratch with.
    #[allow(clippy::type_complexity)]
    fn scratch_source<'a>(
        &self,
        master: &'a [f32],
        grads: &'a mut [f32],
    ) -> Result<(Box<dyn stoker_kernels::StepParams + 'a>, usize)>;
}

/// ZeRO-3's parameter hooks: the graph path gathers each unit's groups and
/// reduce-scatters their gradients through them ([`units`]), and the whole buffer is
/// gathered where it is needed at once (FSDP's `summon_full_params`).
pub trait ShardedParams {
    /// Starts gathering the parameters of flat span `span` from every rank's shard
    /// `held` (a collective), for [`ShardedParams::finish_gather_span`] to complete: the
    /// next unit's gather proceeds while this one computes.
    fn start_gather_span(
        &mut self,
        held: &[f32],
        span: Range<usize>,
    ) -> Result<stoker_comm::Pending>;
    /// Completes a gather [`ShardedParams::start_gather_span`] started: the span's
    /// parameters. The wait counts as exposed communication.
    fn finish_gather_span(&mut self, started: stoker_comm::Pending) -> Result<Vec<f32>>;
    /// Reduce-scatters `grads`, a micro-batch's gradients of flat span `span`, and adds
    /// this rank's part into its shard `shard` (a collective).
    fn scatter_span(
        &mut self,
        grads: Vec<f32>,
        span: Range<usize>,
        shard: &mut [f32],
    ) -> Result<()>;
    /// The whole parameter buffer, gathered from every rank's shard `held` (a
    /// collective).
    fn gather_params(&mut self, held: &[f32]) -> Result<Vec<f32>>;
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
        // On the resident loop the backend shards the compute copy; the host keeps
        // ZeRO-2's flat shards of the master and moments, as the loop's optimizer does.
        StrategyKind::Zero3 if config.resident_loop() => Box::new(
            Zero::new(comm, len, align, plan(), zero(ZeroStage::Two)).on_resident_loop_as("zero3"),
        ),
        StrategyKind::Zero3 => Box::new(Zero3::new(
            comm,
            GroupShards::new(layout.group_spans()?, world, align),
            p.reshard_after_forward,
        )?),
    })
}
