//! AdamW: Adam with decoupled weight decay and bias correction (Loshchilov & Hutter),
//! with torch.optim.AdamW's arithmetic order so results agree to f32 rounding (the
//! arithmetic itself is [`stoker_kernels::adamw_update`]).

use serde::{Deserialize, Serialize};

use half::bf16;
use stoker_kernels::{adamw_update, AdamWStep};

use std::ops::Range;

use super::{clip, out_segment, take_buffers, OptimState, Optimizer, Segment};

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

/// AdamW over a flat buffer; moments are FP32 in the same layout.
pub struct AdamW {
    config: AdamWConfig,
    segments: Vec<Segment>,
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<f32>,
    step: u64,
}

impl AdamW {
    /// AdamW for a buffer of `len` elements, updating `segments`.
    pub fn new(config: AdamWConfig, segments: Vec<Segment>, len: usize) -> Self {
        AdamW {
            config,
            segments,
            exp_avg: vec![0.0; len],
            exp_avg_sq: vec![0.0; len],
            step: 0,
        }
    }
}

impl Optimizer for AdamW {
    fn step_range(
        &mut self,
        params: &mut [f32],
        grads: &[f32],
        lr: f32,
        mut bf16_out: Option<&mut [bf16]>,
        range: Range<usize>,
    ) {
        self.step += 1;
        let c = self.config;
        let s = AdamWStep::new(lr, c.beta1, c.beta2, c.eps, c.weight_decay, self.step);
        for seg in &self.segments {
            let Some(r) = clip(seg, &range) else {
                continue;
            };
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
        }
    }

    fn state(&self) -> OptimState {
        OptimState {
            step: self.step,
            buffers: vec![
                ("exp_avg".into(), self.exp_avg.clone()),
                ("exp_avg_sq".into(), self.exp_avg_sq.clone()),
            ],
        }
    }

    fn restore(&mut self, state: OptimState) -> Result<(), String> {
        let step = state.step;
        let mut b = take_buffers(state, &["exp_avg", "exp_avg_sq"], self.exp_avg.len())?;
        self.exp_avg_sq = b.pop().unwrap();
        self.exp_avg = b.pop().unwrap();
        self.step = step;
        Ok(())
    }
}
