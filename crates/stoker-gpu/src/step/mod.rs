//! The GPU-resident training steps over flat buffers, written once for any
//! [`crate::Backend`]: `gpt` (stoker-kernels' `GptStep`'s twin) and `llama`
//! (`LlamaStep`'s), on `buffers` (the four buffers both hold, a micro-batch's ids, the
//! loss), `layout` / `llama_layout` (every activation's span, sized in one place),
//! `attention` (the causal attention products both share) and `optimizer` (AdamW over
//! the FP32 master, the gradient norm the one value read back).
//!
//! The host backend runs them in the tests against the CPU steps (the same flat buffers,
//! the same losses and gradients within float tolerance); the device backend runs the
//! same calls on a GPU.

/// The methods the GPT's and the Llama's steps share, written once: their buffers, a
/// micro-batch (read back at once, or queued), evaluation, and the update. `$cpu` names
/// the stoker-kernels step each is the twin of. Expanded inside each step's `impl`, where
/// `OP`, `bufs` and `layout` (with `grad_norm` and `partials`) are the step's own.
macro_rules! token_step_api {
    ($cpu:literal) => {
        /// The step's buffers: loading parameters, reading gradients, their bytes.
        pub fn buffers(&self) -> &StepBuffers<B, T> {
            &self.bufs
        }

        /// The update after an accumulation window: the gradients' norm (the one value
        /// read back), then the optimizer on every segment of `opt` over the gradients
        /// times `unscale` (1 / the loss scale) and the clipping coefficient for `clip`
        /// (torch's `clip_grad_norm_`), the compute copy written from the master ([`optimizer::update`]).
        /// Returns the unscaled gradient norm.
        pub fn update(
            &self,
            be: &B,
            opt: &OptimizerState<B>,
            scalars: &Scalars,
            unscale: f32,
            clip: Option<f64>,
        ) -> Result<f64, GpuError> {
            let norm = optimizer::update(be, opt, self.update_views(be)?, scalars, unscale, clip)?;
            self.end_fp8_step(be)?;
            Ok(norm)
        }

        /// Ends the FP8 scalers' step (each one's next scale from its amax history), after
        /// the optimizer's, as the CPU trainer's; nothing where the linear layers are not
        /// in FP8. [`Self::update`] calls it; an update made from the views calls it after.
        pub fn end_fp8_step(&self, be: &B) -> Result<(), GpuError> {
            match &self.fp8 {
                Some(f) => f.scalers().end_step(be),
                None => Ok(()),
            }
        }

        /// Bytes the FP8 linear layers hold beyond the step's buffers (their scalers and
        /// the casts' scratch); 0 where the layers are not in FP8.
        pub fn fp8_bytes(&self) -> usize {
            self.fp8.as_ref().map_or(0, |f| f.bytes())
        }

        /// The FP8 delayed scalers of the linear layers (three per layer: input, weight,
        /// output gradient), where the step runs them in FP8.
        pub fn fp8_scalers(&self) -> Option<&$crate::fp8::Fp8Scalers<B>> {
            self.fp8.as_ref().map(|f| f.scalers())
        }

        /// The views an update works on: the compute copy, the gradients, the norm's
        /// scratch.
        pub fn update_views(&self, be: &B) -> Result<UpdateViews<'_, T>, GpuError> {
            let (params, grads) = self.bufs.whole(be)?;
            let (squares, partials) = self.norm_scratch(be)?;
            Ok(UpdateViews {
                params,
                grads,
                squares,
                partials,
            })
        }

        /// The norm's scratch: one f32 for the squared norm, then the per-warp partial sums.
        fn norm_scratch(
            &self,
            be: &B,
        ) -> Result<($crate::backend::View<'_, f32>, $crate::backend::View<'_, f32>), GpuError>
        {
            Ok((
                self.bufs.f(be, self.layout.grad_norm)?,
                self.bufs.f(be, self.layout.partials)?,
            ))
        }

        /// The compute copy (the whole flat buffer on the backend) and the norm's scratch
        /// (one f32, the per-warp partial sums): what an update from a shard's gradients
        /// (ZeRO-2's) works on, where the whole gradient exists nowhere.
        pub fn compute_views(
            &self,
            be: &B,
        ) -> Result<$crate::step::optimizer::ComputeViews<'_, T>, GpuError> {
            Ok((
                self.bufs.whole_params(be)?,
                self.norm_scratch(be)?,
            ))
        }

        /// ZeRO-3: this rank's shard of the compute copy and the norm's scratch (what an
        /// update from the shard's gradients writes); an error where the parameters are
        /// not sharded.
        pub fn shard_compute_views(
            &self,
            be: &B,
        ) -> Result<$crate::step::optimizer::ComputeViews<'_, T>, GpuError> {
            let sharded = self.bufs.sharded().ok_or_else(|| GpuError::Shape {
                kernel: OP,
                what: "a shard of the compute copy from a step whose parameters are not \
                       sharded"
                    .into(),
            })?;
            Ok((
                sharded.shard(be)?,
                self.norm_scratch(be)?,
            ))
        }

        #[doc = concat!(
            "The training forward of one micro-batch and its loss without a gradient: the\n",
            "summed loss of the valid targets, how many are the top-1 logit, how many there\n",
            "are (as stoker-kernels' `", $cpu, "::evaluate`)."
        )]
        pub fn evaluate(
            &self,
            be: &B,
            batch: TokenBatch,
        ) -> Result<(f64, usize, usize), GpuError> {
            buffers::evaluate(self, be, OP, batch, buffers::BlockHooks::default())
        }

        /// [`Self::evaluate`] calling `hooks.before` before each block (ZeRO-3's gather).
        pub fn evaluate_with(
            &self,
            be: &B,
            batch: TokenBatch,
            hooks: buffers::BlockHooks<'_>,
        ) -> Result<(f64, usize, usize), GpuError> {
            buffers::evaluate(self, be, OP, batch, hooks)
        }

        #[doc = concat!(
            "Forward and backward of one micro-batch: adds the gradient of `grad_scale x\n",
            "(summed token loss)` to the gradients and returns the summed loss of the valid\n",
            "targets (unscaled), as stoker-kernels' `", $cpu, "::forward_backward`."
        )]
        pub fn forward_backward(
            &self,
            be: &B,
            batch: TokenBatch,
            grad_scale: f32,
        ) -> Result<f64, GpuError> {
            buffers::forward_backward(self, be, OP, batch, grad_scale)
        }

        /// [`Self::forward_backward`] queued without reading the loss back: the
        /// micro-batch's summed loss is written to the step's loss sum on the backend, or
        /// added to it with `add_loss` (a window's micro-batches, read once by
        /// [`Self::loss_sum`]); `hooks` are called around each block (ZeRO-3's gathers
        /// before it runs, DDP's buckets once its backward has queued its last gradient).
        pub fn queue_micro_batch(
            &self,
            be: &B,
            (batch, grad_scale): (TokenBatch, f32),
            add_loss: bool,
            hooks: buffers::BlockHooks<'_>,
        ) -> Result<(), GpuError> {
            buffers::queue_micro_batch(self, be, OP, (batch, grad_scale), add_loss, hooks)
        }

        /// Starts `batch`'s ids up beside the launches, for the micro-batch after the
        /// next one queued: a window calls it before it queues the micro-batch before
        /// `batch`, whose launches then run while the copy does.
        pub fn prefetch_ids(&self, be: &B, batch: TokenBatch) -> Result<(), GpuError> {
            buffers::prefetch_ids(self, be, OP, batch)
        }

        /// Each block's parameters as runs of the flat buffer, block order.
        pub fn block_runs(&self) -> &[Vec<std::ops::Range<usize>>] {
            &self.blocks
        }

        /// The loss sum the micro-batches queued since the last one without `add_loss`
        /// wrote (waits for every launch so far).
        pub fn loss_sum(&self, be: &B) -> Result<f64, GpuError> {
            buffers::read_loss(self, be)
        }

        /// The loss sum on the backend (one f32), to copy without waiting for it.
        pub fn loss_view<'s>(&'s self, be: &B) -> Result<crate::View<'s, f32>, GpuError> {
            buffers::loss_view(self, be)
        }
    };
}

pub mod attention;
mod batch_ids;
pub mod block_runs;
pub mod buffers;
pub mod fp8_linear;
pub mod gpt;
pub mod grad_slots;
mod graphs;
pub mod layout;
mod linear;
pub mod llama;
pub mod llama_layout;
pub mod optimizer;
pub mod options;
pub mod param_offload;
pub mod param_slots;
pub mod placement;
pub mod sharded_params;
pub mod token_step;

pub use gpt::GptGpuStep;
pub use llama::LlamaGpuStep;

/// The vocabulary padded to a multiple of 64 (GPT-2's 50,257 to 50,304): the logits'
/// row width, so their rows stay aligned.
pub fn padded_vocab(v: usize) -> usize {
    v.div_ceil(64) * 64
}

/// One micro-batch: token ids and next-token targets `[batch, t]`, row-major.
#[derive(Debug, Clone, Copy)]
pub struct TokenBatch<'a> {
    /// Token ids.
    pub tokens: &'a [i64],
    /// Targets; `ignore` marks positions without a loss.
    pub targets: &'a [i64],
    /// The ignore index.
    pub ignore: i64,
}

impl TokenBatch<'_> {
    /// Targets that are not the ignore index: the positions with a loss.
    pub fn valid_targets(&self) -> usize {
        self.targets.iter().filter(|&&t| t != self.ignore).count()
    }
}
