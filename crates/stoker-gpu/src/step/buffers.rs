//! What the GPT's and the Llama's steps hold and do alike: the four buffers (the compute
//! copy of the parameters, the f32 gradients, the activations, the f32 statistics) and
//! their views, a micro-batch's ids checked and uploaded, and the loss at the end of the
//! forward (the fused classifier, then the sum).

use crate::backend::{Backend, View};
use crate::elem::Act;
use crate::error::{check_len, GpuError};
use crate::ids::{Groups, Ids};
use crate::kernels;
use crate::token_groups::TokenGroups;

use super::layout::{Span, PARTIAL_WARPS};
use super::TokenBatch;

/// A step's buffers on backend `B`, activations in `T`.
pub struct StepBuffers<B: Backend, T: Act> {
    pub(crate) params: B::Buf<T>,
    pub(crate) grads: B::Buf<f32>,
    pub(crate) acts: B::Buf<T>,
    pub(crate) floats: B::Buf<f32>,
}

impl<B: Backend, T: Act> StepBuffers<B, T> {
    /// `params` parameters (and as many gradients), `acts` activations, `floats` f32s.
    pub(crate) fn new(be: &B, params: usize, acts: usize, floats: usize) -> Result<Self, GpuError> {
        Ok(StepBuffers {
            params: be.zeros(params)?,
            grads: be.zeros(params)?,
            acts: be.zeros(acts)?,
            floats: be.zeros(floats)?,
        })
    }

    /// Bytes of the four buffers. With AdamW add [`super::optimizer::OptimizerState::bytes`]:
    /// the planned side of the device check's memory line.
    pub fn bytes(&self) -> usize {
        let t = std::mem::size_of::<T>();
        (B::len(&self.params) + B::len(&self.acts)) * t
            + (B::len(&self.grads) + B::len(&self.floats)) * 4
    }

    /// Copies the FP32 master `params` (the flat layout) into the compute copy.
    pub fn load_params(&self, be: &B, params: &[f32]) -> Result<(), GpuError> {
        check_len("step", "params", params.len(), B::len(&self.params))?;
        let copy: Vec<T> = params.iter().map(|&x| T::from_f32(x)).collect();
        be.write(&self.params, 0, &copy)
    }

    /// The compute copy of the parameters, widened to f32 (the flat layout).
    pub fn params(&self, be: &B) -> Result<Vec<f32>, GpuError> {
        Ok(be
            .download(&self.params)?
            .into_iter()
            .map(T::to_f32)
            .collect())
    }

    /// The gradients (f32, the flat layout).
    pub fn grads(&self, be: &B) -> Result<Vec<f32>, GpuError> {
        be.download(&self.grads)
    }

    /// Sets every gradient to 0.
    pub fn zero_grads(&self, be: &B) -> Result<(), GpuError> {
        be.zero(be.all(&self.grads))
    }

    /// All the gradients (the view [`crate::parallel::Collectives`] sum).
    pub fn grads_view(&self, be: &B) -> View<'_, f32> {
        be.all(&self.grads)
    }

    /// Parameters `at..at + len`.
    pub(crate) fn p(&self, be: &B, at: usize, len: usize) -> Result<View<'_, T>, GpuError> {
        be.view(&self.params, at..at + len)
    }

    /// Gradients `at..at + len`.
    pub(crate) fn g(&self, be: &B, at: usize, len: usize) -> Result<View<'_, f32>, GpuError> {
        be.view(&self.grads, at..at + len)
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

/// A micro-batch's ids on the backend: tokens and targets checked against the vocabulary
/// (targets may be the ignore index), and the tokens as the host has them (for the
/// embedding backward's groups, which only training needs).
pub(crate) struct BatchIds<B: Backend> {
    pub(crate) tokens: Ids<B>,
    pub(crate) targets: Ids<B>,
    pub(crate) host_tokens: Vec<i32>,
    pub(crate) ignore: i32,
}

impl<B: Backend> BatchIds<B> {
    /// The ids of `batch`, `n` of each, in `0..vocab`.
    pub(crate) fn new(
        be: &B,
        op: &'static str,
        batch: TokenBatch,
        n: usize,
        vocab: usize,
    ) -> Result<Self, GpuError> {
        check_len(op, "tokens", batch.tokens.len(), n)?;
        check_len(op, "targets", batch.targets.len(), n)?;
        let ignore = i32::try_from(batch.ignore).map_err(|_| GpuError::Shape {
            kernel: op,
            what: format!("ignore index {} outside i32", batch.ignore),
        })?;
        let to_i32 = |x: &[i64]| -> Vec<i32> {
            x.iter()
                .map(|&v| v.clamp(i32::MIN as i64, i32::MAX as i64) as i32)
                .collect()
        };
        let tok = to_i32(batch.tokens);
        Ok(BatchIds {
            tokens: Ids::new(be, "tokens", &tok, vocab, None)?,
            targets: Ids::new(be, "targets", &to_i32(batch.targets), vocab, Some(ignore))?,
            host_tokens: tok,
            ignore,
        })
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
/// and the summed loss into `loss_sum`.
pub(crate) fn loss_and_grad<B: Backend, T: Act>(
    be: &B,
    bufs: &StepBuffers<B, T>,
    s: LossSpans,
    ids: &BatchIds<B>,
    vocab: usize,
    grad_scale: f32,
) -> Result<(), GpuError> {
    kernels::classifier(
        be,
        bufs.a(be, s.logits)?,
        bufs.f(be, s.losses)?,
        None,
        &ids.targets,
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
        false,
    )
}

/// What a step tells [`forward_backward`]: its buffers, shape, loss spans, and its own
/// forward and backward.
pub(crate) trait TokenModel<B: Backend, T: Act> {
    /// The step's buffers.
    fn bufs(&self) -> &StepBuffers<B, T>;
    /// Rows of a micro-batch (sequences x positions) and the vocabulary.
    fn rows_and_vocab(&self) -> (usize, usize);
    /// Where the loss's buffers are.
    fn loss_spans(&self) -> LossSpans;
    /// The forward to the logits.
    fn forward(&self, be: &B, tokens: &Ids<B>) -> Result<(), GpuError>;
    /// The backward from the logits' gradient.
    fn backward(&self, be: &B, groups: &Groups<B>) -> Result<(), GpuError>;
}

/// One micro-batch through a step: its ids uploaded, the forward, the loss and the
/// logits' gradient, the backward; the summed loss read back (the one value, after the
/// step).
pub(crate) fn forward_backward<B: Backend, T: Act>(
    m: &impl TokenModel<B, T>,
    be: &B,
    op: &'static str,
    batch: TokenBatch,
    grad_scale: f32,
) -> Result<f64, GpuError> {
    let (n, vocab) = m.rows_and_vocab();
    let ids = BatchIds::new(be, op, batch, n, vocab)?;
    m.forward(be, &ids.tokens)?;
    let spans = m.loss_spans();
    loss_and_grad(be, m.bufs(), spans, &ids, vocab, grad_scale)?;
    let groups = Groups::new(be, &TokenGroups::new(&ids.host_tokens, vocab)?, vocab)?;
    m.backward(be, &groups)?;
    Ok(be.read(m.bufs().f(be, spans.loss_sum)?)?[0] as f64)
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
) -> Result<(f64, usize, usize), GpuError> {
    let (n, vocab) = m.rows_and_vocab();
    let ids = BatchIds::new(be, op, batch, n, vocab)?;
    m.forward(be, &ids.tokens)?;
    let (s, bufs) = (m.loss_spans(), m.bufs());
    kernels::classifier(
        be,
        bufs.a(be, s.logits)?,
        bufs.f(be, s.losses)?,
        Some(bufs.f(be, s.hits)?),
        &ids.targets,
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
    let count = batch.targets.iter().filter(|&&t| t != batch.ignore).count();
    Ok((loss as f64, hits as usize, count))
}
