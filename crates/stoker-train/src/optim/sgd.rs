//! SGD with momentum (torch.optim.SGD semantics: coupled L2 weight decay, dampening 0,
//! optional Nesterov; the first step seeds the momentum buffer with the gradient). The
//! arithmetic is [`stoker_kernels::sgd_update`].

use serde::{Deserialize, Serialize};

use half::bf16;
use stoker_kernels::{sgd_update, SgdStep};

use crate::pieces::Pieces;

use super::{
    out_segment, segments_in, span, take_buffers, tell, OptimState, OptimStateRef, Optimizer,
    Segment, SegmentDone,
};

/// SGD hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SgdConfig {
    /// Momentum factor (0 disables the buffer).
    pub momentum: f64,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig {
            momentum: 0.9,
            weight_decay: 0.0,
            nesterov: false,
        }
    }
}

/// SGD over some pieces of a flat buffer; its momentum covers those alone.
pub struct Sgd {
    config: SgdConfig,
    pieces: Pieces,
    /// The segments inside `pieces`, rebased to them laid end to end.
    segments: Vec<Segment>,
    momentum: Vec<f32>,
    step: u64,
}

impl Sgd {
    /// SGD over the elements `pieces` of a flat buffer (a range converts), updating the
    /// parts of `segments` (global offsets) inside them.
    pub fn new(config: SgdConfig, segments: &[Segment], pieces: impl Into<Pieces>) -> Self {
        let pieces = pieces.into();
        Sgd {
            config,
            segments: segments_in(segments, &pieces),
            momentum: vec![0.0; pieces.len()],
            pieces,
            step: 0,
        }
    }
}

impl Sgd {
    /// The scalars of the next update at `lr`, the step count advanced.
    fn advance(&mut self, lr: f32) -> SgdStep {
        let s = self.scalars(lr);
        self.step += 1;
        s
    }

    /// The next update's scalars at `lr` (the first one seeds the momentum buffer).
    fn scalars(&self, lr: f32) -> SgdStep {
        SgdStep {
            lr,
            momentum: self.config.momentum as f32,
            weight_decay: self.config.weight_decay as f32,
            nesterov: self.config.nesterov,
            first: self.step == 0,
        }
    }
}

impl Optimizer for Sgd {
    fn next_scalars(&self, lr: f32) -> stoker_gpu::step::optimizer::Scalars {
        stoker_gpu::step::optimizer::Scalars::Sgd(self.scalars(lr))
    }

    fn count_update(&mut self) {
        self.step += 1;
    }

    fn step_each(
        &mut self,
        params: &mut [f32],
        grads: &[f32],
        lr: f32,
        mut bf16_out: Option<&mut [bf16]>,
        done: SegmentDone<'_>,
    ) {
        let s = self.advance(lr);
        for seg in &self.segments {
            let r = span(seg);
            sgd_update(
                &s,
                seg.decay,
                &mut params[r.clone()],
                &grads[r.clone()],
                &mut self.momentum[r.clone()],
                out_segment(&mut bf16_out, &r),
            )
            .expect("segments slice every buffer alike");
            tell(done, &r, params, &bf16_out);
        }
    }

    fn pieces(&self) -> &Pieces {
        &self.pieces
    }

    fn state_bytes(&self) -> usize {
        4 * self.momentum.len()
    }

    fn state_ref(&self) -> OptimStateRef<'_> {
        OptimStateRef {
            step: self.step,
            pieces: self.pieces.clone(),
            buffers: vec![("momentum", &self.momentum)],
        }
    }

    fn restore(&mut self, state: OptimState) -> Result<(), String> {
        let step = state.step;
        self.momentum = take_buffers(state, &["momentum"], &self.pieces)?
            .pop()
            .unwrap();
        self.step = step;
        Ok(())
    }
}
