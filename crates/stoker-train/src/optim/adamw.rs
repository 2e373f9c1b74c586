//! AdamW: Adam with decoupled weight decay and bias correction (Loshchilov & Hutter),
//! with torch.optim.AdamW's arithmetic order so results agree to f32 rounding (the
//! arithmetic itself is [`stoker_kernels::adamw_update`]).

use serde::{Deserialize, Serialize};

use half::bf16;
use stoker_kernels::{adamw_update, AdamWStep};

use crate::pieces::Pieces;

use super::{
    out_segment, segments_in, span, take_buffers, tell, OptimState, OptimStateRef, Optimizer,
    Segment, SegmentDone,
};

/// AdamW hyper-parameters (torch's defaults).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdamWConfig {
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Decoupled weight decay (multiplies `lr`).
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

/// AdamW over some pieces of a flat buffer; its FP32 moments cover those alone.
pub struct AdamW {
    config: AdamWConfig,
    pieces: Pieces,
    /// The segments inside `pieces`, rebased to them laid end to end.
    segments: Vec<Segment>,
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<f32>,
    step: u64,
}

impl AdamW {
    /// AdamW over the elements `pieces` of a flat buffer (a range converts), updating
    /// the parts of `segments` (global offsets) inside them.
    pub fn new(config: AdamWConfig, segments: &[Segment], pieces: impl Into<Pieces>) -> Self {
        let pieces = pieces.into();
        AdamW {
            config,
            segments: segments_in(segments, &pieces),
            exp_avg: vec![0.0; pieces.len()],
            exp_avg_sq: vec![0.0; pieces.len()],
            pieces,
            step: 0,
        }
    }
}

impl AdamW {
    /// The scalars of the next update at `lr`, the step count advanced.
    fn advance(&mut self, lr: f32) -> AdamWStep {
        let s = self.scalars(lr);
        self.step += 1;
        s
    }

    /// The next update's scalars at `lr` (step `t` one past the count).
    fn scalars(&self, lr: f32) -> AdamWStep {
        let c = self.config;
        AdamWStep::new(lr, c.beta1, c.beta2, c.eps, c.weight_decay, self.step + 1)
    }
}

impl Optimizer for AdamW {
    fn next_scalars(&self, lr: f32) -> stoker_gpu::step::optimizer::Scalars {
        stoker_gpu::step::optimizer::Scalars::AdamW(self.scalars(lr))
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
            adamw_update(
                &s,
                seg.decay,
                &mut params[r.clone()],
                &grads[r.clone()],
                &mut self.exp_avg[r.clone()],
                &mut self.exp_avg_sq[r.clone()],
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
        4 * (self.exp_avg.len() + self.exp_avg_sq.len())
    }

    fn state_ref(&self) -> OptimStateRef<'_> {
        OptimStateRef {
            step: self.step,
            pieces: self.pieces.clone(),
            buffers: vec![("exp_avg", &self.exp_avg), ("exp_avg_sq", &self.exp_avg_sq)],
        }
    }

    fn restore(&mut self, state: OptimState) -> Result<(), String> {
        let step = state.step;
        let mut b = take_buffers(state, &["exp_avg", "exp_avg_sq"], &self.pieces)?;
        self.exp_avg_sq = b.pop().unwrap();
        self.exp_avg = b.pop().unwrap();
        self.step = step;
        Ok(())
    }
}
