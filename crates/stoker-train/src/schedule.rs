//! Learning-rate schedule: linear warmup, then cosine decay to a floor.

use serde::{Deserialize, Serialize};

/// Warmup + cosine decay, by optimizer step.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Schedule {
    /// Peak learning rate.
    pub lr: f64,
    /// Final learning rate after the decay.
    pub min_lr: f64,
    /// Steps of linear warmup from `lr / warmup_steps` to `lr`.
    pub warmup_steps: u64,
    /// Step at which the cosine reaches `min_lr` (usually the run's total steps); 0 keeps
    /// `lr` constant after warmup.
    pub decay_steps: u64,
}

impl Default for Schedule {
    fn default() -> Self {
        Schedule {
            lr: 1e-3,
            min_lr: 1e-4,
            warmup_steps: 0,
            decay_steps: 0,
        }
    }
}

impl Schedule {
    /// The learning rate of optimizer step `step` (0-based).
    pub fn lr_at(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            return self.lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        if self.decay_steps <= self.warmup_steps {
            return self.lr;
        }
        if step >= self.decay_steps {
            return self.min_lr;
        }
        let t = (step - self.warmup_steps) as f64 / (self.decay_steps - self.warmup_steps) as f64;
        let c = 0.5 * (1.0 + (std::f64::consts::PI * t).cos());
        self.min_lr + c * (self.lr - self.min_lr)
    }
}
