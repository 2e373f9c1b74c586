//! AdamW over the step's flat FP32 master on the backend: the master and both moments
//! live beside the step's buffers, one `adamw` launch per segment (a tensor, or a run of
//! tensors with one weight-decay flag), the compute copy rewritten from the master in the
//! same pass (bf16) or copied after it (f32). The only value read back is the gradient
//! norm, for clipping and for the run's metrics.

use std::ops::Range;

use crate::backend::{Backend, View};
use crate::elem::{Act, Dtype};
use crate::error::GpuError;
use crate::kernels;

/// AdamW's state on a backend: the FP32 master, the moments, the segments.
pub struct AdamWState<B: Backend> {
    pub(crate) master: B::Buf<f32>,
    pub(crate) m: B::Buf<f32>,
    pub(crate) v: B::Buf<f32>,
    pub(crate) segments: Vec<(Range<usize>, bool)>,
}

impl<B: Backend> AdamWState<B> {
    /// The master `master` (the flat layout), moments at zero, and `segments`: ranges
    /// of the flat buffer with their weight-decay flag, each inside the master.
    pub fn new(
        be: &B,
        master: &[f32],
        segments: Vec<(Range<usize>, bool)>,
    ) -> Result<Self, GpuError> {
        if let Some((r, _)) = segments
            .iter()
            .find(|(r, _)| r.start > r.end || r.end > master.len())
        {
            return Err(GpuError::Shape {
                kernel: "adamw",
                what: format!("segment {r:?} outside a master of {}", master.len()),
            });
        }
        Ok(AdamWState {
            master: be.upload(master)?,
            m: be.zeros(master.len())?,
            v: be.zeros(master.len())?,
            segments,
        })
    }

    /// Bytes of the master and both moments.
    pub fn bytes(&self) -> usize {
        3 * 4 * B::len(&self.master)
    }

    /// The master's values.
    pub fn master(&self, be: &B) -> Result<Vec<f32>, GpuError> {
        be.download(&self.master)
    }
}

/// The gradients' multiplier for an update: `unscale` (1 / the loss scale), times
/// torch's `clip_grad_norm_` coefficient `max_norm / (norm + 1e-6)` where that is below
/// 1 (`norm` of the unscaled gradients), as stoker-train's `clip_to`.
pub fn grad_multiplier(norm: f64, unscale: f32, clip: Option<f64>) -> f32 {
    let coef = clip.map(|c| c / (norm + 1e-6)).filter(|&c| c < 1.0);
    match coef {
        Some(c) => unscale * c as f32,
        None => unscale,
    }
}

/// The update of a step's `(params, grads)` (the compute copy in `T`, the f32 gradients,
/// both the flat layout of `opt`'s master): the gradients' squared norm into
/// `scratch.0` through `scratch.1`'s partial sums (the one value read back), then AdamW
/// on every segment over the gradients times [`grad_multiplier`], writing the bf16 copy
/// in the same pass or, for f32, copying the master into it. Returns the unscaled norm.
pub fn update<B: Backend, T: Act>(
    be: &B,
    opt: &AdamWState<B>,
    (params, grads): (&B::Buf<T>, &B::Buf<f32>),
    (squares, partials): (View<f32>, View<f32>),
    step: &stoker_kernels::AdamWStep,
    unscale: f32,
    clip: Option<f64>,
) -> Result<f64, GpuError> {
    crate::error::check_len("adamw", "master", B::len(&opt.master), B::len(params))?;
    crate::error::check_len("adamw", "grads", B::len(grads), B::len(params))?;
    let warps = super::layout::PARTIAL_WARPS.min(partials.len());
    kernels::sum(be, squares, be.all(grads), partials, true, warps, false)?;
    let norm = (be.read(squares)?[0] as f64).sqrt() * unscale as f64;
    let mult = grad_multiplier(norm, unscale, clip);
    for (r, decay) in &opt.segments {
        let copy = match T::DTYPE {
            Dtype::Bf16 => Some(be.view(params, r.clone())?.cast::<half::bf16>()?),
            Dtype::F32 => None,
        };
        let at = |b| be.view(b, r.clone());
        kernels::adamw(
            be,
            at(&opt.master)?,
            at(grads)?,
            at(&opt.m)?,
            at(&opt.v)?,
            copy,
            step,
            *decay,
            mult,
        )?;
    }
    if T::DTYPE == Dtype::F32 {
        be.copy(be.all(params).cast::<f32>()?, be.all(&opt.master))?;
    }
    Ok(norm)
}
