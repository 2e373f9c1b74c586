//! AdamW over the step's flat FP32 master on the backend: the master and both moments
//! live beside the step's buffers, one `adamw` launch per segment (a tensor, or a run of
//! tensors with one weight-decay flag), the compute copy rewritten from the master in the
//! same pass (bf16) or copied after it (f32). The only value read back is the gradient
//! norm, for clipping and for the run's metrics.

use std::ops::Range;

use crate::backend::Backend;
use crate::error::GpuError;

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
