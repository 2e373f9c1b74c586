//! SGD with momentum (torch.optim.SGD semantics: coupled L2 weight decay, dampening 0,
//! optional Nesterov; the first step seeds the momentum buffer with the gradient). The
//! arithmetic is [`stoker_kernels::sgd_update`].

use serde::{Deserialize, Serialize};

use half::bf16;
use stoker_kernels::{sgd_update, SgdStep};

use std::ops::Range;

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

/// SGD over one range of a flat buffer; its momentum covers that range alone.
pub struct Sgd {
    config: SgdConfig,
    range: Range<usize>,
    /// The segments inside `range`, rebased to it.
    segments: Vec<Segment>,
    momentum: Vec<f32>,
    step: u64,
}

impl Sgd {
    /// SGD over the elements `range` of a flat buffer, updating the parts of `segments`
    /// (global offsets) inside it.
    pub fn new(config: SgdConfig, segments: &[Segment], range: Range<usize>) -> Self {
        Sgd {
            config,
            segments: segments_in(segments, &range),
            momentum: vec![0.0; range.len()],
            range,
            step: 0,
        }
    }
}

impl Optimizer for Sgd {
    fn step_each(
        &mut self,
        params: &mut [f32],
        grads: &[f32],
        lr: f32,
        mut bf16_out: Option<&mut [bf16]>,
        done: SegmentDone<'_>,
    ) {
        let s = SgdStep {
            lr,
            momentum: self.config.momentum as f32,
            weight_decay: self.config.weight_decay as f32,
            nesterov: self.config.nesterov,
            first: self.step == 0,
        };
        self.step += 1;
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

    fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    fn state_bytes(&self) -> usize {
        4 * self.momentum.len()
    }

    fn state_ref(&self) -> OptimStateRef<'_> {
        OptimStateRef {
            step: self.step,
            range: self.range.clone(),
            buffers: vec![("momentum", &self.momentum)],
        }
    }

    fn restore(&mut self, state: OptimState) -> Result<(), String> {
        let step = state.step;
        self.momentum = take_buffers(state, &["momentum"], &self.range)?
            .pop()
            .unwrap();
        self.step = step;
        Ok(())
    }
}
