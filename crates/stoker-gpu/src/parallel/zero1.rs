//! ZeRO stage 1 on a backend (DeepSpeed's `stage: 1`, FSDP's optimizer-state sharding):
//! each rank holds the FP32 master and the optimizer's moments of its own shard only,
//! the CPU trainer's split of the flat buffer ([`ShardPlan`], boundaries at multiples of
//! 16 elements). An update reduce-scatters the gradients into the shard, sums the
//! squared norm's pieces over the ranks (one scalar), updates the shard writing its
//! piece of the compute copy, and all-gathers the compute copy (bf16 where the step
//! computes in bf16: half of DDP's bytes on that leg). AdamW's 12 bytes a parameter of
//! master and moments become 12 / world.
//!
//! ZeRO-2 (DeepSpeed's `stage: 2`) is the same state over a step whose blocks' gradients
//! live in two slots ([`crate::step::grad_slots`]): each block's are reduce-scattered
//! after its backward, every micro-batch, and added into the shard's gradients
//! ([`Zero1::blocks`], `landing.rs`), so that the whole gradient exists nowhere; the
//! update then starts from the shard's sums.

use std::ops::Range;

use stoker_comm::shard::ShardPlan;

use super::grad_rule::GradRule;
use super::landing::{BlockReductions, Landing};
use super::state_at::StateAt;
use super::tally::Tally;
use crate::backend::{Backend, View};
use crate::collectives::{shard_plan, Collectives};
use crate::elem::Act;
use crate::error::{check_len, GpuError};
use crate::step::optimizer::{self, ComputeViews, Optimizer, Scalars, UpdateViews};

/// `segments` (sorted, disjoint, with their weight-decay flags) cut to `shard` and
/// moved to start at 0: the optimizer's segments over a shard of the master.
pub fn shard_segments(
    segments: &[(Range<usize>, bool)],
    shard: &Range<usize>,
) -> Vec<(Range<usize>, bool)> {
    segments
        .iter()
        .filter_map(|(r, decay)| {
            let (start, end) = (r.start.max(shard.start), r.end.min(shard.end));
            (start < end).then(|| (start - shard.start..end - shard.start, *decay))
        })
        .collect()
}

/// One rank's ZeRO-1 state: its shard of the master and moments (on the backend, or in
/// host memory), the shard's gradients.
pub struct Zero1<B: Backend> {
    plan: ShardPlan,
    rank: usize,
    state: StateAt<B>,
    grads: B::Buf<f32>,
    /// ZeRO-2: where the per-block reductions land before they are added into `grads`.
    landing: Option<Landing<B>>,
}

impl<B: Backend> Zero1<B> {
    /// Rank `rank` of `world`'s state of optimizer `kind` over the flat `master` (every
    /// rank passes the same one) with its `segments`; the shard's master and moments in
    /// host memory where `offload`.
    pub fn new(
        be: &B,
        kind: Optimizer,
        master: &[f32],
        segments: &[(Range<usize>, bool)],
        (rank, world): (usize, usize),
        offload: bool,
    ) -> Result<Self, GpuError> {
        if rank >= world {
            return Err(GpuError::Shape {
                kernel: "zero-1",
                what: format!("rank {rank} of a world of {world}"),
            });
        }
        let plan = shard_plan(master.len(), world);
        let shard = plan.range(rank);
        let (piece, segs) = (&master[shard.clone()], shard_segments(segments, &shard));
        let state = StateAt::new(be, kind, piece, &segs, offload)?;
        Ok(Zero1 {
            grads: be.zeros(shard.len())?,
            plan,
            rank,
            state,
            landing: None,
        })
    }

    /// This state for ZeRO-2: the shard's gradients summed from reductions after every
    /// block's backward ([`Zero1::blocks`]), of at most `block_len` elements each, with
    /// two landing buffers ([`super::landing::landing_len`] each).
    pub fn accumulating(mut self, be: &B, block_len: usize) -> Result<Self, GpuError> {
        self.landing = Some(Landing::new(be, B::len(&self.grads), block_len)?);
        Ok(self)
    }

    /// ZeRO-2: the per-block reductions into the shard's gradients; an error for a state
    /// made without [`Zero1::accumulating`].
    pub fn blocks(&self) -> Result<BlockReductions<'_, B>, GpuError> {
        let landing = self.landing.as_ref().ok_or_else(|| GpuError::Shape {
            kernel: "zero-2",
            what: "a per-block reduction into a ZeRO-1 state (made without `accumulating`)".into(),
        })?;
        Ok(BlockReductions {
            landing,
            plan: &self.plan,
            rank: self.rank,
            grads: &self.grads,
        })
    }

    /// Whether the shard's gradients are summed from per-block reductions (ZeRO-2).
    pub fn accumulates(&self) -> bool {
        self.landing.is_some()
    }

    /// ZeRO-2: the shard's gradients to 0, before a window.
    pub fn zero_grads(&self, be: &B) -> Result<(), GpuError> {
        be.zero(be.all(&self.grads))
    }

    /// This state with the bf16 compute copy rounded stochastically under `seed`, each
    /// shard counting from its place in the whole buffer (so the shards round as one
    /// rank's whole copy would).
    pub fn with_stochastic_rounding(mut self, seed: u64) -> Result<Self, GpuError> {
        let at = (self.plan.len(), self.shard().start);
        self.state = self.state.with_stochastic_rounding(seed, at)?;
        Ok(self)
    }

    /// Starts the reduce-scatter of the gradients in `run` (a block's, or the rest) into
    /// this rank's shard of gradients: each rank's piece of the run to its owner.
    ///
    /// # Safety
    /// As [`Collectives::start_reduce_scatter`]: the run's gradients stay unwritten and
    /// alive until `finish`, and nothing else writes the shard's gradients before then.
    pub unsafe fn start_bucket(
        &self,
        be: &B,
        coll: &impl Collectives<B>,
        grads: View<f32>,
        run: Range<usize>,
    ) -> Result<(), GpuError> {
        check_len("zero-1", "grads", grads.len(), self.plan.len())?;
        let counts = self.plan.counts_within(&run);
        let out = be.view(&self.grads, self.plan.local_within(self.rank, &run))?;
        // SAFETY: the caller's contract, passed on.
        unsafe { coll.start_reduce_scatter(be, grads.slice(run)?, &counts, out) }
    }

    /// This rank's shard of the flat buffer.
    pub fn shard(&self) -> Range<usize> {
        self.plan.range(self.rank)
    }

    /// The shard's master values.
    pub fn master(&self, be: &B) -> Result<Vec<f32>, GpuError> {
        self.state.master(be)
    }

    /// The shard's master and moments, wherever they live.
    pub fn state(&self) -> &StateAt<B> {
        &self.state
    }

    /// Bytes in host memory: the shard's master and moments where they are offloaded.
    pub fn host_bytes(&self) -> usize {
        self.state.host_bytes()
    }

    /// Bytes on the backend: the shard's gradients (and ZeRO-2's landing buffer), and its
    /// master and moments unless they are offloaded.
    pub fn bytes(&self) -> usize {
        let landing = self.landing.as_ref().map_or(0, |l| l.bytes());
        self.state.bytes() + 4 * B::len(&self.grads) + landing
    }

    /// The update of `views` (this rank's accumulated gradients, scaled by `rule`'s loss
    /// scale / `capacity`; already reduce-scattered into the shard when `reduced`, as the
    /// window's buckets leave them) with this rank's `tally`: the reduce-scatter, one
    /// scalar collective for the norm's pieces and the tallies, the shard's optimizer
    /// step on the mean gradient, the compute copy gathered (neither where `rule` skips
    /// the update: every rank sees the same norm). Returns the unscaled norm of the mean
    /// gradient and the summed tally.
    pub fn update<T: Act>(
        &self,
        be: &B,
        coll: &impl Collectives<B>,
        views: UpdateViews<T>,
        scalars: &Scalars,
        (tally, capacity): (Tally, f64),
        (rule, reduced): (GradRule, bool),
    ) -> Result<(f64, Tally), GpuError> {
        check_len("zero-1", "grads", views.grads.len(), self.plan.len())?;
        if !reduced {
            coll.reduce_scatter(be, views.grads, &self.plan.counts(), be.all(&self.grads))?;
        }
        let compute = (views.params, (views.squares, views.partials));
        self.update_shard(be, coll, compute, scalars, (tally, capacity), rule)
    }

    /// The update from the shard's summed gradients (ZeRO-2's, or ZeRO-1's after its
    /// reduce-scatter): one scalar collective for the norm's pieces and the tallies, the
    /// shard's optimizer step writing its piece of the compute copy `params` (the whole
    /// flat buffer), the compute copy gathered (neither where `rule` skips the update).
    /// `scratch` is the norm's (one f32, the per-warp partial sums). Returns the
    /// unscaled norm of the mean gradient and the summed tally.
    pub fn update_shard<T: Act>(
        &self,
        be: &B,
        coll: &impl Collectives<B>,
        (params, scratch): ComputeViews<T>,
        scalars: &Scalars,
        (tally, capacity): (Tally, f64),
        rule: GradRule,
    ) -> Result<(f64, Tally), GpuError> {
        let window = (tally, capacity);
        self.step_and_gather(be, coll, (params, scratch), scalars, window, (rule, None))
    }

    /// The update from the whole summed gradient, the same on every rank (deterministic
    /// mode's trees): the norm from the whole gradient here, in the bracketing of one
    /// rank's (not from the shards' pieces, whose sum would follow the world size), this
    /// rank's piece copied into the shard's gradient, the shard stepped and the compute
    /// copy gathered.
    pub(crate) fn update_from_whole<T: Act>(
        &self,
        be: &B,
        coll: &impl Collectives<B>,
        views: UpdateViews<T>,
        scalars: &Scalars,
        window: (Tally, f64),
        rule: GradRule,
    ) -> Result<(f64, Tally), GpuError> {
        check_len("zero-1", "grads", views.grads.len(), self.plan.len())?;
        let scratch = (views.squares, views.partials);
        let whole = optimizer::squared_norm(be, views.grads, scratch)?;
        be.copy(be.all(&self.grads), views.grads.slice(self.shard())?)?;
        let compute = (views.params, scratch);
        self.step_and_gather(be, coll, compute, scalars, window, (rule, Some(whole)))
    }

    /// [`Zero1::step_shard`] on this rank's piece of the compute copy `params` (the whole
    /// flat buffer), then the compute copy gathered where the optimizer stepped.
    fn step_and_gather<T: Act>(
        &self,
        be: &B,
        coll: &impl Collectives<B>,
        (params, scratch): ComputeViews<T>,
        scalars: &Scalars,
        window: (Tally, f64),
        norm: (GradRule, Option<f64>),
    ) -> Result<(f64, Tally), GpuError> {
        check_len("zero-1", "params", params.len(), self.plan.len())?;
        let piece = ((params.slice(self.shard())?, scratch), false);
        let (norm, total, stepped) = self.step_shard(be, coll, piece, scalars, window, norm)?;
        if stepped {
            coll.all_gather(be, params, &self.plan.counts())?;
        }
        Ok((norm, total))
    }

    /// [`Zero1::update_shard`] up to the gather: the norm's pieces and the tallies summed
    /// (one scalar collective), the shard's optimizer step writing `piece`, this shard's
    /// compute copy (in host memory where `on_host`), unless `rule` skips the update.
    /// ZeRO-3's update, whose compute copy stays sharded. `whole` is the whole
    /// gradient's squared norm where every rank has it (then the shards add no pieces).
    /// Returns the unscaled norm, the summed tally, and whether the optimizer stepped.
    pub(crate) fn step_shard<T: Act>(
        &self,
        be: &B,
        coll: &impl Collectives<B>,
        ((piece, scratch), on_host): (ComputeViews<T>, bool),
        scalars: &Scalars,
        (tally, capacity): (Tally, f64),
        (rule, whole): (GradRule, Option<f64>),
    ) -> Result<(f64, Tally, bool), GpuError> {
        check_len("zero-1", "shard", piece.len(), self.shard().len())?;
        let grads = be.all(&self.grads);
        let mine = match whole {
            Some(_) => 0.0,
            None => optimizer::squared_norm(be, grads, scratch)?,
        };
        let [valid, loss, micro, micro_sq] = tally.values();
        let sums = coll.sum(be, &[mine, valid, loss, micro, micro_sq])?;
        let total = Tally::from_values(&sums[1..]);
        let rescale = total.rescale(coll.world(), capacity)?;
        let (norm, mult) = rule.multiplier(whole.unwrap_or(sums[0]), rescale);
        match (mult, on_host) {
            (Some(mult), false) => self.state.apply(be, piece, grads, scalars, mult)?,
            (Some(mult), true) => self
                .state
                .apply_into_host(be, piece, grads, scalars, mult)?,
            (None, _) => {}
        }
        Ok((norm, total, mult.is_some()))
    }
}
