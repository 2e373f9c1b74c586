//! AdamW: Adam with decoupled weight decay and bias correction (Loshchilov & Hutter),
//! with torch.optim.AdamW's arithmetic order so results agree to f32 rounding.

use serde::{Deserialize, Serialize};

use super::{take_buffers, OptimState, Optimizer, Segment};

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
    fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f32) {
        self.step += 1;
        let c = self.config;
        let t = self.step as i32;
        // Scalars in f64 as torch computes them in Python, applied in f32.
        let lr64 = lr as f64;
        let decay = (1.0 - lr64 * c.weight_decay) as f32;
        let w1 = (1.0 - c.beta1) as f32;
        let beta2 = c.beta2 as f32;
        let w2 = (1.0 - c.beta2) as f32;
        let step_size = (lr64 / (1.0 - c.beta1.powi(t))) as f32;
        let bc2_sqrt = (1.0 - c.beta2.powi(t)).sqrt() as f32;
        let eps = c.eps as f32;
        for seg in &self.segments {
            let r = seg.offset..seg.offset + seg.len;
            let (p, g) = (&mut params[r.clone()], &grads[r.clone()]);
            let (m, v) = (&mut self.exp_avg[r.clone()], &mut self.exp_avg_sq[r]);
            for i in 0..p.len() {
                if seg.decay {
                    p[i] *= decay;
                }
                // torch's lerp with weight < 0.5: m + w (g - m).
                m[i] += w1 * (g[i] - m[i]);
                v[i] = v[i] * beta2 + w2 * g[i] * g[i];
                let denom = v[i].sqrt() / bc2_sqrt + eps;
                // torch's vectorized addcdiv fuses the multiply-add: so do we.
                p[i] = (-step_size).mul_add(m[i] / denom, p[i]);
            }
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
