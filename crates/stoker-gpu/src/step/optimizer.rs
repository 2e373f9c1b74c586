//! The optimizer over a step's flat FP32 master on the backend (AdamW or SGD): the master
//! and the optimizer's state live beside the step's buffers, one launch updates every
//! segment (a tensor, or a run of tensors with one weight-decay flag: `optim`), writing
//! the compute copy in the same pass (bf16) or copying the master into it after (f32).
//! The only value read back is the gradient norm, for clipping and the run's metrics.

use std::ops::Range;

use stoker_kernels::{AdamWStep, SgdStep};

use crate::backend::{Backend, View};
use crate::elem::{Act, Dtype};
use crate::error::GpuError;
use crate::kernels;
use crate::optim::{self, Segments};

/// The optimizer's own buffers.
enum Moments<B: Backend> {
    /// AdamW's first and second moments.
    AdamW { m: B::Buf<f32>, v: B::Buf<f32> },
    /// SGD's momentum buffer (none without momentum).
    Sgd { buf: Option<B::Buf<f32>> },
}

/// An optimizer's state on a backend: the FP32 master, its moments, the segments.
pub struct OptimizerState<B: Backend> {
    pub(crate) master: B::Buf<f32>,
    moments: Moments<B>,
    segments: Segments<B>,
}

/// One step's scalars: which optimizer, at which step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scalars {
    /// AdamW at step `t` (stoker-kernels' `AdamWStep`).
    AdamW(AdamWStep),
    /// SGD (stoker-kernels' `SgdStep`).
    Sgd(SgdStep),
}

impl<B: Backend> OptimizerState<B> {
    /// AdamW over `master` (the flat layout), moments at zero, with `segments`: sorted,
    /// disjoint ranges inside it with their weight-decay flags.
    pub fn adamw(
        be: &B,
        master: &[f32],
        segments: &[(Range<usize>, bool)],
    ) -> Result<Self, GpuError> {
        let n = master.len();
        Ok(OptimizerState {
            master: be.upload(master)?,
            moments: Moments::AdamW {
                m: be.zeros(n)?,
                v: be.zeros(n)?,
            },
            segments: Segments::new(be, segments, n)?,
        })
    }

    /// SGD over `master`, with a momentum buffer when `momentum`.
    pub fn sgd(
        be: &B,
        master: &[f32],
        segments: &[(Range<usize>, bool)],
        momentum: bool,
    ) -> Result<Self, GpuError> {
        let n = master.len();
        let buf = match momentum {
            true => Some(be.zeros(n)?),
            false => None,
        };
        Ok(OptimizerState {
            master: be.upload(master)?,
            moments: Moments::Sgd { buf },
            segments: Segments::new(be, segments, n)?,
        })
    }

    /// Bytes of the master and the optimizer's buffers.
    pub fn bytes(&self) -> usize {
        let moments = match &self.moments {
            Moments::AdamW { .. } => 2,
            Moments::Sgd { buf } => buf.is_some() as usize,
        };
        (1 + moments) * 4 * B::len(&self.master)
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
    match clip.and_then(|c| stoker_kernels::flat::clip_coefficient(norm, c)) {
        Some(c) => unscale * c as f32,
        None => unscale,
    }
}

/// The update of a step's `(params, grads)` (the compute copy in `T`, the f32 gradients,
/// both the flat layout of `opt`'s master): the gradients' squared norm into
/// `scratch.0` through `scratch.1`'s partial sums (the one value read back), then one
/// launch of the optimizer over every segment on the gradients times [`grad_multiplier`],
/// writing the bf16 copy in the same pass or, for f32, copying the master into it.
/// Returns the unscaled norm. (With a loss scale the CPU multiplies twice, unscale then
/// clip; here once by their product.)
pub fn update<B: Backend, T: Act>(
    be: &B,
    opt: &OptimizerState<B>,
    (params, grads): (&B::Buf<T>, &B::Buf<f32>),
    (squares, partials): (View<f32>, View<f32>),
    scalars: &Scalars,
    unscale: f32,
    clip: Option<f64>,
) -> Result<f64, GpuError> {
    crate::error::check_len("optimizer", "master", B::len(&opt.master), B::len(params))?;
    crate::error::check_len("optimizer", "grads", B::len(grads), B::len(params))?;
    let warps = super::layout::PARTIAL_WARPS.min(partials.len());
    kernels::sum(be, squares, be.all(grads), partials, true, warps, false)?;
    let norm = (be.read(squares)?[0] as f64).sqrt() * unscale as f64;
    let mult = grad_multiplier(norm, unscale, clip);
    let copy = match T::DTYPE {
        Dtype::Bf16 => Some(be.all(params).cast::<half::bf16>()?),
        Dtype::F32 => None,
    };
    let (p, g) = (be.all(&opt.master), be.all(grads));
    match (&opt.moments, scalars) {
        (Moments::AdamW { m, v }, Scalars::AdamW(s)) => {
            optim::adamw(be, p, g, be.all(m), be.all(v), copy, s, &opt.segments, mult)?
        }
        (Moments::Sgd { buf }, Scalars::Sgd(s)) => optim::sgd(
            be,
            p,
            g,
            buf.as_ref().map(|b| be.all(b)),
            copy,
            s,
            &opt.segments,
            mult,
        )?,
        (_, s) => {
            return Err(GpuError::Shape {
                kernel: "optimizer",
                what: format!("{s:?} for a state made for the other optimizer"),
            })
        }
    }
    if T::DTYPE == Dtype::F32 {
        be.copy(be.all(params).cast::<f32>()?, be.all(&opt.master))?;
    }
    Ok(norm)
}
