//! What the GPT's and the Llama's steps hold and do alike: the four buffers (the compute
//! copy of the parameters, the f32 gradients, the activations, the f32 statistics) and
//! their views, a micro-batch's ids checked and uploaded, and the loss at the end of the
//! forward (the fused classifier, then the sum).

use std::cell::RefCell;
use std::ops::Range;

use crate::backend::{Backend, View};
use crate::elem::Act;
use crate::error::{check_len, GpuError};
use crate::ids::{Groups, Ids};
use crate::kernels;

use super::batch_ids::{ids_bytes, BatchIds, IdSets};
use super::grad_slots::GradSlots;
use super::graphs::{GraphKey, MicroBatchGraphs};
use super::layout::{Span, PARTIAL_WARPS};
use super::optimizer::UpdateViews;
use super::options::StepOptions;
use super::param_offload::ParamOffload;
use super::sharded_params::ShardedParams;
use super::TokenBatch;

/// What a step's buffers hold, in elements: sized once, for [`StepBuffers::new`] and for a
/// plan made before any step exists (the planned side of a run's device memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepSizes {
    /// Parameters in the compute copy (and as many f32 gradients).
    pub params: usize,
    /// Activations, in the compute type.
    pub acts: usize,
    /// f32 statistics and scratch.
    pub floats: usize,
    /// Positions of a micro-batch (its ids).
    pub rows: usize,
    /// The vocabulary the ids index.
    pub vocab: usize,
    /// With the blocks' parameters offloaded ([`ParamOffload`]): what the backend holds
    /// of the parameters and gradients instead of all of them.
    pub offload: Option<OffloadSizes>,
    /// With the blocks' gradients in two slots alone ([`GradSlots`], ZeRO-2): what the
    /// backend holds of the gradients instead of all of them.
    pub grad_slots: Option<OffloadSizes>,
    /// With the parameters sharded over the ranks ([`ShardedParams`], ZeRO-3): what the
    /// backend holds of the parameters and gradients instead of all of them.
    pub sharded: Option<ShardedSizes>,
    /// Bytes of the FP8 linear layers' scalers and casts, where the step runs them
    /// ([`super::fp8_linear::Fp8Sizes`]); 0 otherwise.
    pub fp8: usize,
}

/// What a step with its parameters sharded (ZeRO-3) holds of them on the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardedSizes {
    /// The resident runs and one block's slot, in elements.
    pub placed: OffloadSizes,
    /// This rank and the ranks in all.
    pub rank_world: (usize, usize),
    /// Elements of this rank's shard of the compute copy.
    pub shard: usize,
    /// Whether the shard lives in host memory (the parameters offloaded too).
    pub on_host: bool,
}

/// What a step with its blocks' parameters offloaded holds of them on the backend, in
/// elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OffloadSizes {
    /// The runs outside every block, packed.
    pub resident: usize,
    /// One block's slot (two for parameters, two for gradients).
    pub slot: usize,
}

impl OffloadSizes {
    /// That `placement` (what the step made, `what`) lays out as planned.
    fn check(&self, placement: &super::placement::Placement, what: &str) -> Result<(), GpuError> {
        let got = (placement.resident_len(), placement.slot_len());
        if got != (self.resident, self.slot) {
            return Err(GpuError::Shape {
                kernel: "step",
                what: format!(
                    "{what} planned as {self:?} lay out as resident {} and slot {}",
                    got.0, got.1
                ),
            });
        }
        Ok(())
    }
}

impl StepSizes {
    /// The sizes of a step over `params` parameters, with an activation layout of
    /// `acts` elements and `floats` f32s, for micro-batches of `rows` positions over
    /// `vocab`.
    pub(crate) fn of(
        params: usize,
        (acts, floats): (usize, usize),
        (rows, vocab): (usize, usize),
    ) -> Self {
        StepSizes {
            params,
            acts,
            floats,
            rows,
            vocab,
            offload: None,
            grad_slots: None,
            sharded: None,
            fp8: 0,
        }
    }

    /// These sizes for a step made with `opts` over `blocks` blocks of `block` elements
    /// each: with the blocks' parameters offloaded or sharded (their gradients in slots
    /// with them), or with their gradients alone in two slots; the rest of the flat
    /// buffer resident.
    pub fn placed(mut self, opts: StepOptions, (blocks, block): (usize, usize)) -> Self {
        let placed = OffloadSizes {
            resident: self.params.saturating_sub(blocks * block),
            slot: block,
        };
        if let Some(rank_world) = opts.shard_params {
            self.sharded = Some(ShardedSizes {
                placed,
                rank_world,
                shard: crate::collectives::shard_len(self.params, rank_world),
                on_host: opts.offload_params,
            });
        } else if opts.offload_params {
            self.offload = Some(placed);
        } else if opts.grads_in_slots {
            self.grad_slots = Some(placed);
        }
        self
    }

    /// Parameters the backend holds: all of them, or the resident runs and two slots
    /// (and ZeRO-3's shard).
    pub fn backend_params(&self) -> usize {
        match (self.offload, self.sharded) {
            (Some(o), _) => o.resident + 2 * o.slot,
            (None, Some(s)) => {
                let shard = if s.on_host { 0 } else { s.shard };
                s.placed.resident + 2 * s.placed.slot + shard
            }
            (None, None) => self.params,
        }
    }

    /// Gradients the backend holds: all of them, or the resident runs and two slots.
    pub fn backend_grads(&self) -> usize {
        let placed = self.offload.or(self.sharded.map(|s| s.placed));
        match placed.or(self.grad_slots) {
            Some(o) => o.resident + 2 * o.slot,
            None => self.params,
        }
    }

    /// Bytes the buffers hold in host memory with a compute copy of `act_bytes` bytes an
    /// element: with the blocks' parameters offloaded the whole compute copy (pinned),
    /// the window's gradient sum, the blocks' gradients landing (two pinned slots) and
    /// the norm's scratch; ZeRO-3's shard where it lives there (pinned); else none.
    /// [`StepBuffers::host_bytes`] counts the same.
    pub fn host_bytes(&self, act_bytes: usize) -> usize {
        match (self.offload, self.sharded) {
            (Some(o), _) => super::param_offload::planned_host_bytes(
                self.params,
                o.slot,
                PARTIAL_WARPS,
                act_bytes,
            ),
            (None, Some(s)) if s.on_host => crate::pinned::planned_bytes(s.shard, act_bytes),
            _ => 0,
        }
    }

    /// Bytes the buffers take on the backend with the compute copy and activations of
    /// `act_bytes` bytes an element (4 for f32, 2 for bf16 and f16), the FP8 layers'
    /// bytes with them. An offload's host
    /// memory (the whole compute copy and gradient) is not counted: that is
    /// [`StepSizes::host_bytes`].
    pub fn bytes(&self, act_bytes: usize) -> usize {
        let (p, g) = (self.backend_params(), self.backend_grads());
        (p + self.acts) * act_bytes + (g + self.floats) * 4 + ids_bytes(self.rows) + self.fp8
    }
}

/// A step's buffers on backend `B`, activations in `T`, and its micro-batch's ids
/// (rewritten batch after batch: a step allocates nothing after it is made).
pub struct StepBuffers<B: Backend, T: Act> {
    /// The micro-batches' graphs, where they replay as graphs (before the buffers they
    /// launch on, so they go first).
    graphs: Option<MicroBatchGraphs<B::Graph>>,
    /// The compute copy: all of it, or with the blocks' parameters offloaded the
    /// resident runs.
    pub(crate) params: B::Buf<T>,
    /// The gradients, likewise.
    pub(crate) grads: B::Buf<f32>,
    pub(crate) acts: B::Buf<T>,
    pub(crate) floats: B::Buf<f32>,
    pub(crate) ids: RefCell<IdSets<B>>,
    /// Where the blocks' parameters and gradients live beyond these buffers.
    placed: Placed<B, T>,
}

/// Where a step keeps its blocks' parameters and gradients: one of these, as its sizes
/// ask ([`StepSizes`]).
enum Placed<B: Backend, T: Act> {
    /// All of them in the step's own buffers.
    Whole,
    /// The blocks' gradients in two slots alone (ZeRO-2).
    GradSlots(GradSlots<B>),
    /// The blocks' parameters offloaded to host memory, their gradients in slots.
    Offload(ParamOffload<B, T>),
    /// The compute copy sharded over the ranks, the blocks in slots (ZeRO-3).
    Sharded(ShardedParams<B, T>),
}

impl<B: Backend, T: Act> StepBuffers<B, T> {
    /// The buffers of `sizes`, zeroed, for a model whose blocks hold `blocks` (each
    /// block's runs of the flat buffer: what an offload streams).
    pub(crate) fn new(
        be: &B,
        sizes: StepSizes,
        blocks: &[Vec<Range<usize>>],
        graph_micro_batches: bool,
    ) -> Result<Self, GpuError> {
        if graph_micro_batches
            && (sizes.offload.is_some() || sizes.sharded.is_some() || sizes.grad_slots.is_some())
        {
            return Err(GpuError::Capture {
                what: "micro-batches replayed as graphs with the blocks' parameters or \
                       gradients in slots or offloaded: those move blocks between the \
                       launches of every micro-batch, which a graph cannot hold"
                    .into(),
            });
        }
        let placed = match (sizes.offload, sizes.sharded, sizes.grad_slots) {
            (Some(want), _, _) => {
                let o = ParamOffload::new(be, blocks, sizes.params, PARTIAL_WARPS)?;
                want.check(o.placement(), "an offload")?;
                Placed::Offload(o)
            }
            (None, Some(want), _) => {
                let s =
                    ShardedParams::new(be, blocks, sizes.params, want.rank_world, want.on_host)?;
                want.placed.check(s.placement(), "a sharded copy")?;
                check_len("step", "shard", s.shard_range().len(), want.shard)?;
                Placed::Sharded(s)
            }
            (None, None, Some(want)) => {
                let s = GradSlots::new(be, blocks, sizes.params)?;
                want.check(s.placement(), "gradient slots")?;
                Placed::GradSlots(s)
            }
            (None, None, None) => Placed::Whole,
        };
        // The resident runs where the blocks' parameters (or gradients) are in slots,
        // else all.
        let in_slots = sizes.offload.or(sizes.sharded.map(|s| s.placed));
        let p = in_slots.map_or(sizes.params, |o| o.resident);
        let g = in_slots
            .or(sizes.grad_slots)
            .map_or(sizes.params, |o| o.resident);
        Ok(StepBuffers {
            graphs: graph_micro_batches.then(MicroBatchGraphs::default),
            params: be.zeros(p)?,
            grads: be.zeros(g)?,
            acts: be.zeros(sizes.acts)?,
            floats: be.zeros(sizes.floats)?,
            ids: RefCell::new(IdSets::with_room(be, sizes.rows, sizes.vocab)?),
            placed,
        })
    }

    /// Micro-batch keys captured as graphs so far (0 without graphs).
    pub fn graphs_captured(&self) -> usize {
        self.graphs.as_ref().map_or(0, |g| g.captured())
    }

    /// Bytes of the buffers on the backend and the ids, counted from them
    /// ([`StepSizes::bytes`] is the same sum planned). With AdamW add
    /// [`super::optimizer::OptimizerState::bytes`]: the device check's memory line.
    pub fn bytes(&self) -> usize {
        let t = std::mem::size_of::<T>();
        (B::len(&self.params) + B::len(&self.acts)) * t
            + (B::len(&self.grads) + B::len(&self.floats)) * 4
            + self.ids.borrow().bytes()
            + match &self.placed {
                Placed::Whole => 0,
                Placed::GradSlots(s) => s.bytes(),
                Placed::Offload(o) => o.backend_bytes(),
                Placed::Sharded(s) => s.backend_bytes(),
            }
    }

    /// Bytes the buffers hold in host memory, counted from them ([`StepSizes::host_bytes`]
    /// is the same sum planned).
    pub fn host_bytes(&self) -> usize {
        match &self.placed {
            Placed::Offload(o) => o.host_bytes(),
            Placed::Sharded(s) => s.host_bytes(),
            Placed::Whole | Placed::GradSlots(_) => 0,
        }
    }

    /// Whether the blocks' gradients are in two slots for whoever runs the step to take
    /// each block's out after its backward ([`Self::grads_at`]): ZeRO-2's, ZeRO-3's.
    pub fn grads_in_slots(&self) -> bool {
        matches!(self.placed, Placed::GradSlots(_) | Placed::Sharded(_))
    }

    /// The parameters sharded over the ranks, if they are (ZeRO-3).
    pub fn sharded(&self) -> Option<&ShardedParams<B, T>> {
        match &self.placed {
            Placed::Sharded(s) => Some(s),
            _ => None,
        }
    }

    /// The blocks' gradients in two slots alone (ZeRO-2), if they are.
    fn grad_slots(&self) -> Option<&GradSlots<B>> {
        match &self.placed {
            Placed::GradSlots(s) => Some(s),
            _ => None,
        }
    }

    /// The gradients of the flat run `r` (inside one run of the placement: a block's
    /// run, or one outside the blocks) wherever they are on the backend.
    pub fn grads_at(&self, be: &B, r: Range<usize>) -> Result<View<'_, f32>, GpuError> {
        self.g(be, r.start, r.len())
    }

    /// ZeRO-3: the runs outside every block gathered from every rank's shard (a
    /// collective, after an update); an error where the parameters are not sharded.
    pub fn gather_resident(
        &self,
        be: &B,
        coll: &impl crate::collectives::Collectives<B>,
    ) -> Result<(), GpuError> {
        self.sharded_or_err()?
            .gather_resident(be, coll, &self.params)
    }

    fn sharded_or_err(&self) -> Result<&ShardedParams<B, T>, GpuError> {
        self.sharded().ok_or_else(|| GpuError::Shape {
            kernel: "step",
            what: "a gather into a step whose parameters are not sharded".into(),
        })
    }

    /// The blocks' offloaded parameters, if they are.
    pub fn offload(&self) -> Option<&ParamOffload<B, T>> {
        match &self.placed {
            Placed::Offload(o) => Some(o),
            _ => None,
        }
    }

    /// Elements of the flat buffer (the whole compute copy, wherever it lives).
    pub fn flat_len(&self) -> usize {
        match (self.offload(), self.sharded()) {
            (Some(o), _) => o.flat_len(),
            (None, Some(s)) => s.flat_len(),
            (None, None) => B::len(&self.params),
        }
    }

    /// With an offload, the views an update on the host works on (the whole compute
    /// copy and gradient in host memory, the resident runs' gradients gathered into it
    /// first); None without one.
    pub fn host_update_views(&self, be: &B) -> Result<Option<UpdateViews<'_, T>>, GpuError> {
        match self.offload() {
            Some(o) => {
                o.gather_grads(be, &self.grads)?;
                o.host_views(be).map(Some)
            }
            None => Ok(None),
        }
    }

    /// With an offload, the resident runs of the host's compute copy up after an update
    /// on the host; nothing without one.
    pub fn after_host_update(&self, be: &B) -> Result<(), GpuError> {
        match self.offload() {
            Some(o) => o.resident_up(be, &self.params),
            None => Ok(()),
        }
    }

    /// The whole compute copy and gradient on the backend (the views an update or a
    /// collective takes); an error where the blocks' parameters are offloaded.
    pub(crate) fn whole(&self, be: &B) -> Result<(View<'_, T>, View<'_, f32>), GpuError> {
        if self.grad_slots().is_some() {
            return Err(GpuError::Shape {
                kernel: "step",
                what: "the blocks' gradients are in slots (ZeRO-2): each block's is reduced \
                       after its backward, and the whole gradient exists nowhere"
                    .into(),
            });
        }
        if self.offload().is_some() {
            return Err(GpuError::Shape {
                kernel: "step",
                what: "the blocks' parameters are offloaded: the whole compute copy and \
                       gradient are in host memory (an update runs there)"
                    .into(),
            });
        }
        Ok((self.whole_params(be)?, be.all(&self.grads)))
    }

    /// The whole compute copy on the backend; an error where the blocks' parameters are
    /// offloaded.
    pub(crate) fn whole_params(&self, be: &B) -> Result<View<'_, T>, GpuError> {
        if self.sharded().is_some() {
            return Err(GpuError::Shape {
                kernel: "step",
                what: "the parameters are sharded over the ranks (ZeRO-3): the whole compute \
                       copy exists nowhere, each block is gathered as it runs"
                    .into(),
            });
        }
        match self.offload() {
            Some(_) => Err(GpuError::Shape {
                kernel: "step",
                what: "the blocks' parameters are offloaded: the whole compute copy is in \
                       host memory"
                    .into(),
            }),
            None => Ok(be.all(&self.params)),
        }
    }

    /// Before block `l` runs (its backward when `backward`): with an offload, its
    /// parameters up into their slot and, for the backward, its gradient slot zeroed.
    pub(crate) fn enter_block(&self, be: &B, l: usize, backward: bool) -> Result<(), GpuError> {
        match &self.placed {
            Placed::Whole => Ok(()),
            Placed::GradSlots(s) if backward => s.zero(be, l),
            Placed::Sharded(s) if backward => s.slots().grad_slots().zero(be, l),
            Placed::GradSlots(_) | Placed::Sharded(_) => Ok(()),
            Placed::Offload(o) => o.enter_block(be, l, backward),
        }
    }

    /// After block `l`'s backward: with an offload, its gradients down and added into
    /// the host's sum.
    pub(crate) fn leave_block(&self, be: &B, l: usize) -> Result<(), GpuError> {
        match self.offload() {
            Some(o) => o.leave_block(be, l),
            None => Ok(()),
        }
    }

    /// Copies `other`'s compute copy (the same model at another batch shape) into this
    /// one.
    pub fn copy_params_from(&self, be: &B, other: &Self) -> Result<(), GpuError> {
        match (self.offload(), other.offload()) {
            (Some(mine), Some(theirs)) => mine.copy_params_from(be, &self.params, theirs),
            (None, None) => {
                if let (Some(mine), Some(theirs)) = (self.sharded(), other.sharded()) {
                    mine.copy_shard_from(be, theirs)?;
                } else if self.sharded().is_some() || other.sharded().is_some() {
                    return Err(GpuError::Shape {
                        kernel: "step",
                        what: "copying parameters between a sharded step and one not".into(),
                    });
                }
                check_len(
                    "step",
                    "params",
                    B::len(&self.params),
                    B::len(&other.params),
                )?;
                be.copy(be.all(&self.params), be.all(&other.params))
            }
            _ => Err(GpuError::Shape {
                kernel: "step",
                what: "copying parameters between a step with an offload and one without".into(),
            }),
        }
    }

    /// Copies the FP32 master `params` (the flat layout) into the compute copy: as it
    /// is for f32, rounded for bf16 and f16 (with an offload: into host memory, the
    /// resident runs up).
    pub fn load_params(&self, be: &B, params: &[f32]) -> Result<(), GpuError> {
        if let Some(o) = self.offload() {
            return o.load(be, &self.params, params);
        }
        if let Some(s) = self.sharded() {
            return s.load(be, &self.params, params);
        }
        check_len("step", "params", params.len(), B::len(&self.params))?;
        if let Ok(f32s) = be.all(&self.params).cast::<f32>() {
            return be.write_at(f32s, params);
        }
        let copy: Vec<T> = params.iter().map(|&x| T::from_f32(x)).collect();
        be.write(&self.params, 0, &copy)
    }

    /// The compute copy of the parameters, widened to f32 (the flat layout).
    pub fn params(&self, be: &B) -> Result<Vec<f32>, GpuError> {
        if let Some(o) = self.offload() {
            return o.host_params();
        }
        self.whole_params(be)?;
        Ok(be
            .download(&self.params)?
            .into_iter()
            .map(T::to_f32)
            .collect())
    }

    /// The gradients (f32, the flat layout; with an offload, gathered on the host; an
    /// error with the gradients in slots, where they exist nowhere whole).
    pub fn grads(&self, be: &B) -> Result<Vec<f32>, GpuError> {
        if let Some(o) = self.offload() {
            o.gather_grads(be, &self.grads)?;
            return o.host_grads();
        }
        // The whole gradient on the backend, or why there is none (ZeRO-2's slots).
        self.whole(be)?;
        be.download(&self.grads)
    }

    /// The gradients into `out` (as many), reusing the caller's memory.
    pub fn grads_into(&self, be: &B, out: &mut [f32]) -> Result<(), GpuError> {
        if self.offload().is_some() {
            let g = self.grads(be)?;
            check_len("step", "out", out.len(), g.len())?;
            out.copy_from_slice(&g);
            return Ok(());
        }
        be.read_into(be.all(&self.grads), out)
    }

    /// Sets every gradient to 0.
    pub fn zero_grads(&self, be: &B) -> Result<(), GpuError> {
        if let Some(o) = self.offload() {
            return o.zero_grads(be, &self.grads);
        }
        be.zero(be.all(&self.grads))
    }

    /// All the gradients on the backend (the view [`crate::parallel::Collectives`] sum);
    /// an error where the blocks' parameters are offloaded.
    pub fn grads_view(&self, be: &B) -> Result<View<'_, f32>, GpuError> {
        Ok(self.whole(be)?.1)
    }

    /// Parameters `at..at + len` (with an offload, a block's must be in its slot).
    pub(crate) fn p(&self, be: &B, at: usize, len: usize) -> Result<View<'_, T>, GpuError> {
        match &self.placed {
            Placed::Offload(o) => o.slots().params(be, &self.params, (at, len)),
            Placed::Sharded(s) => s.slots().params(be, &self.params, (at, len)),
            Placed::Whole | Placed::GradSlots(_) => be.view(&self.params, at..at + len),
        }
    }

    /// Gradients `at..at + len` (likewise, and with the gradients in slots).
    pub(crate) fn g(&self, be: &B, at: usize, len: usize) -> Result<View<'_, f32>, GpuError> {
        match &self.placed {
            Placed::Offload(o) => o.slots().grads(be, &self.grads, (at, len)),
            Placed::Sharded(s) => s.slots().grads(be, &self.grads, (at, len)),
            Placed::GradSlots(s) => s.grads(be, &self.grads, (at, len)),
            Placed::Whole => be.view(&self.grads, at..at + len),
        }
    }

    /// An activation span.
    pub(crate) fn a(&self, be: &B, s: Span) -> Result<View<'_, T>, GpuError> {
        be.view(&self.acts, s.range())
    }

    /// An f32 span.
    pub(crate) fn f(&self, be: &B, s: Span) -> Result<View<'_, f32>, GpuError> {
        be.view(&self.floats, s.range())
    }
}

/// Where the loss's buffers are: the logits (then their gradient), each row's loss, the
/// partial sums and the summed loss.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LossSpans {
    pub(crate) logits: Span,
    pub(crate) losses: Span,
    pub(crate) hits: Span,
    pub(crate) partials: Span,
    pub(crate) loss_sum: Span,
}

/// The fused classifier over the logits (their gradient, times `grad_scale`, in place)
/// and the summed loss into `loss_sum` (added to it with `add_loss`).
pub(crate) fn loss_and_grad<B: Backend, T: Act>(
    be: &B,
    bufs: &StepBuffers<B, T>,
    s: LossSpans,
    ids: &BatchIds<B>,
    vocab: usize,
    grad_scale: f32,
    add_loss: bool,
) -> Result<(), GpuError> {
    kernels::classifier(
        be,
        bufs.a(be, s.logits)?,
        bufs.f(be, s.losses)?,
        None,
        ids.targets(),
        vocab,
        Some(grad_scale),
        ids.ignore,
    )?;
    kernels::sum(
        be,
        bufs.f(be, s.loss_sum)?,
        bufs.f(be, s.losses)?,
        bufs.f(be, s.partials)?,
        false,
        PARTIAL_WARPS,
        add_loss,
    )
}

/// Called with a block's index just before it runs, and whether it is its backward.
pub type BeforeBlock<'a> = &'a mut dyn FnMut(usize, bool) -> Result<(), GpuError>;

/// Called with a block's index and parameter runs once its backward has queued their last
/// gradient.
pub type AfterBlock<'a> = &'a mut dyn FnMut(usize, &[Range<usize>]) -> Result<(), GpuError>;

/// What a micro-batch's forward and backward call around each block, either absent:
/// `before` just before the block runs, forward or backward, and before the step zeroes
/// its gradient slot (ZeRO-2's wait for the slot's last reduction, ZeRO-3's gather of its
/// parameters), `after` once its backward has queued its last gradient (DDP's buckets,
/// ZeRO-2's reduce-scatter).
#[derive(Default)]
pub struct BlockHooks<'a> {
    /// Before each block runs.
    pub before: Option<BeforeBlock<'a>>,
    /// After each block's backward.
    pub after: Option<AfterBlock<'a>>,
}

impl BlockHooks<'_> {
    /// `before` for block `l` (its backward when `backward`), if there is one.
    pub(crate) fn run_before(&mut self, l: usize, backward: bool) -> Result<(), GpuError> {
        match &mut self.before {
            Some(f) => f(l, backward),
            None => Ok(()),
        }
    }

    /// `after` for block `l`, its parameter runs `runs`, if there is one.
    pub(crate) fn run_after(&mut self, l: usize, runs: &[Range<usize>]) -> Result<(), GpuError> {
        match &mut self.after {
            Some(f) => f(l, runs),
            None => Ok(()),
        }
    }
}

/// What a step tells [`queue_micro_batch`]: its buffers, shape, loss spans, and its own
/// forward and backward.
pub(crate) trait TokenModel<B: Backend, T: Act> {
    /// The step's buffers.
    fn bufs(&self) -> &StepBuffers<B, T>;
    /// Rows of a micro-batch (sequences x positions) and the vocabulary.
    fn rows_and_vocab(&self) -> (usize, usize);
    /// Where the loss's buffers are.
    fn loss_spans(&self) -> LossSpans;
    /// The forward to the logits, calling `hooks.before` before each block.
    fn forward(&self, be: &B, tokens: &Ids<B>, hooks: &mut BlockHooks<'_>) -> Result<(), GpuError>;
    /// The step's FP8 linear layers, where it runs them: a training micro-batch's casts
    /// record amax, an evaluation's do not (set here, for both models).
    fn fp8_layers(&self) -> Option<&super::fp8_linear::Fp8Linears<B>>;
    /// The backward from the logits' gradient, calling `hooks.before` before each block
    /// and `hooks.after` with its parameter runs as soon as its gradients are final (last
    /// block first).
    fn backward(
        &self,
        be: &B,
        groups: &Groups<B>,
        hooks: &mut BlockHooks<'_>,
    ) -> Result<(), GpuError>;
}

/// One micro-batch through a step: its ids written, the forward, the loss and the
/// logits' gradient, the backward, all queued; the micro-batch's summed loss written to,
/// or with `add_loss` added to, the step's loss sum on the backend (a window's micro-batches
/// add up there, read once after the last: [`read_loss`]). Nothing waits for the
/// backend.
pub(crate) fn queue_micro_batch<B: Backend, T: Act>(
    m: &impl TokenModel<B, T>,
    be: &B,
    op: &'static str,
    (batch, grad_scale): (TokenBatch, f32),
    add_loss: bool,
    mut hooks: BlockHooks<'_>,
) -> Result<(), GpuError> {
    check_hooks(m.bufs(), op, &hooks)?;
    let mut sets = m.bufs().ids.borrow_mut();
    let (set, ids) = sets.take(be, op, batch, true)?;
    let vocab = m.rows_and_vocab().1;
    let plain = hooks.before.is_none() && hooks.after.is_none();
    if let Some(f) = m.fp8_layers() {
        f.set_recording(true);
    }
    let key = GraphKey {
        grad_scale: grad_scale.to_bits(),
        add_loss,
        ignore: ids.ignore,
        ids_set: set,
    };
    let mut body = || {
        m.forward(be, ids.tokens(), &mut hooks)?;
        let spans = m.loss_spans();
        loss_and_grad(be, m.bufs(), spans, ids, vocab, grad_scale, add_loss)?;
        m.backward(be, ids.groups(), &mut hooks)
    };
    match (&m.bufs().graphs, plain) {
        // SAFETY: with no hooks a micro-batch launches on the step's own buffers alone
        // (its ids were written above, outside the graph), which StepBuffers::new
        // allocated once (none in slots or offloaded: refused there with graphs) and
        // which live as long as the graphs they hold.
        (Some(graphs), true) => unsafe { graphs.run(be, key, body) },
        _ => body(),
    }
}

/// Starts `batch`'s ids up beside the launches, for the micro-batch after the next one
/// queued ([`super::batch_ids::IdSets::prefetch`]): a window calls it before it queues the
/// micro-batch before `batch`.
pub(crate) fn prefetch_ids<B: Backend, T: Act>(
    m: &impl TokenModel<B, T>,
    be: &B,
    op: &'static str,
    batch: TokenBatch,
) -> Result<(), GpuError> {
    m.bufs().ids.borrow_mut().prefetch(be, op, batch)
}

/// The step's loss sum, read back (waits for every launch so far).
pub(crate) fn read_loss<B: Backend, T: Act>(
    m: &impl TokenModel<B, T>,
    be: &B,
) -> Result<f64, GpuError> {
    Ok(be.read(loss_view(m, be)?)?[0] as f64)
}

/// The step's loss sum on the backend (one f32).
pub(crate) fn loss_view<'m, B: Backend + 'm, T: Act>(
    m: &'m impl TokenModel<B, T>,
    be: &B,
) -> Result<View<'m, f32>, GpuError> {
    m.bufs().f(be, m.loss_spans().loss_sum)
}

/// A sharded step (ZeRO-3) runs only with a `before` hook that puts each block in its
/// slot: without one it would compute on whatever the slots hold.
fn check_hooks<B: Backend, T: Act>(
    bufs: &StepBuffers<B, T>,
    op: &'static str,
    hooks: &BlockHooks<'_>,
) -> Result<(), GpuError> {
    if bufs.sharded().is_some() && hooks.before.is_none() {
        return Err(GpuError::Shape {
            kernel: op,
            what: "a step whose parameters are sharded (ZeRO-3) runs through its replica, \
                   which gathers each block before it runs"
                .into(),
        });
    }
    Ok(())
}

/// One micro-batch through a step ([`queue_micro_batch`]), its summed loss read back.
pub(crate) fn forward_backward<B: Backend, T: Act>(
    m: &impl TokenModel<B, T>,
    be: &B,
    op: &'static str,
    batch: TokenBatch,
    grad_scale: f32,
) -> Result<f64, GpuError> {
    queue_micro_batch(m, be, op, (batch, grad_scale), false, BlockHooks::default())?;
    read_loss(m, be)
}

/// One micro-batch's evaluation through a step: the training forward, each row's loss
/// and top-1 hit (no gradient), their sums read back. Returns the summed loss of the
/// valid targets, how many are the first largest logit, and how many there are (as
/// stoker-kernels' `TokenStep::evaluate`).
pub(crate) fn evaluate<B: Backend, T: Act>(
    m: &impl TokenModel<B, T>,
    be: &B,
    op: &'static str,
    batch: TokenBatch,
    mut hooks: BlockHooks<'_>,
) -> Result<(f64, usize, usize), GpuError> {
    check_hooks(m.bufs(), op, &hooks)?;
    let vocab = m.rows_and_vocab().1;
    let mut sets = m.bufs().ids.borrow_mut();
    let (_, ids) = sets.take(be, op, batch, false)?;
    if let Some(f) = m.fp8_layers() {
        f.set_recording(false);
    }
    m.forward(be, ids.tokens(), &mut hooks)?;
    let (s, bufs) = (m.loss_spans(), m.bufs());
    kernels::classifier(
        be,
        bufs.a(be, s.logits)?,
        bufs.f(be, s.losses)?,
        Some(bufs.f(be, s.hits)?),
        ids.targets(),
        vocab,
        None,
        ids.ignore,
    )?;
    let total = |rows: Span| -> Result<f32, GpuError> {
        kernels::sum(
            be,
            bufs.f(be, s.loss_sum)?,
            bufs.f(be, rows)?,
            bufs.f(be, s.partials)?,
            false,
            PARTIAL_WARPS,
            false,
        )?;
        Ok(be.read(bufs.f(be, s.loss_sum)?)?[0])
    };
    let loss = total(s.losses)?;
    // A count of ones below 2^24 sums exactly in f32.
    let hits = total(s.hits)?;
    let count = batch.valid_targets();
    Ok((loss as f64, hits as usize, count))
}
