//! Gradient accumulation over a window of micro-batches.
//!
//! For token losses the window's loss is `sum of token losses / valid target tokens in the
//! whole window`, so accumulating `k` micro-batches gives the gradient of one batch of `k`
//! micro-batches whatever their token counts. Normalizing each micro-batch by its own
//! token count and then by `k` (DeepSpeed, candle, burn; HF transformers before its 2024
//! fix) weights tokens of short micro-batches more. Classification uses the same rule
//! with samples as the unit: the mean over the window's samples.

use candle_core::Tensor;

use crate::error::Result;
use crate::layout::FlatLayout;
use crate::loss::{cross_entropy_sum, scalar, valid_count};
use crate::models::{DirectStep, Model};
use crate::precision::Fx;

/// How a window's micro-batch losses are normalized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Normalization {
    /// Divide the summed loss by the valid targets of the whole window (correct).
    WindowCount,
    /// Divide each micro-batch's mean loss by the number of micro-batches (the bug; kept
    /// only to show in tests that it is wrong).
    StepCount,
}

/// One micro-batch: the model input and its targets (flattened, [`IGNORE_INDEX`](crate::loss::IGNORE_INDEX) = masked).
pub struct MicroBatch {
    /// Input tensor (token ids or images).
    pub input: Tensor,
    /// Targets, one per logit row.
    pub targets: Vec<i64>,
}

/// What one accumulation window produced.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WindowResult {
    /// The window's mean loss (sum over valid targets / their count), unscaled.
    pub loss: f64,
    /// Valid targets (tokens or samples) in the window.
    pub count: usize,
}

/// How [`accumulate`] treats a window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AccumulateOptions {
    /// Loss normalization.
    pub norm: Normalization,
    /// Multiplies the loss before backward (the fp16 loss scale; 1 otherwise).
    pub loss_scale: f64,
    /// Fail naming any parameter that received no gradient.
    pub check_grads: bool,
}

impl Default for AccumulateOptions {
    fn default() -> Self {
        AccumulateOptions {
            norm: Normalization::WindowCount,
            loss_scale: 1.0,
            check_grads: true,
        }
    }
}

/// Runs forward and backward over `window`, adding the gradients of
/// `loss_scale x normalized loss` into `grads` (flat `layout`, zeroed by the caller).
pub fn accumulate(
    model: &dyn Model,
    fx: &Fx,
    window: &[MicroBatch],
    opts: AccumulateOptions,
    layout: &FlatLayout,
    grads: &mut [f32],
) -> Result<WindowResult> {
    let total: usize = window.iter().map(|m| valid_count(&m.targets)).sum();
    let mut loss_sum = 0f64;
    for mb in window {
        let logits = model.forward(fx, &mb.input)?;
        let (sum, count) = cross_entropy_sum(fx, &logits, &mb.targets)?;
        loss_sum += scalar(&sum)?;
        let denom = match opts.norm {
            Normalization::WindowCount => total,
            Normalization::StepCount => count * window.len(),
        };
        if denom == 0 {
            continue; // nothing to learn from (all targets masked)
        }
        let scaled = (sum * (opts.loss_scale / denom as f64))?;
        let g = scaled.backward()?;
        if opts.check_grads {
            crate::check::every_param_has_grad(&g, model.params())?;
        }
        layout.gather_grads(&g, model.params(), grads)?;
    }
    Ok(WindowResult {
        loss: if total == 0 {
            0.0
        } else {
            loss_sum / total as f64
        },
        count: total,
    })
}

/// [`accumulate`] through a model's [`DirectStep`]: the same normalization and loss
/// scale, gradients added into `grads` by the step itself, no autograd graph.
/// `opts.check_grads` has nothing to check here: the step writes every parameter's
/// gradient by construction.
pub fn accumulate_direct(
    step: &mut dyn DirectStep,
    window: &[MicroBatch],
    opts: AccumulateOptions,
    master: &[f32],
    grads: &mut [f32],
) -> Result<WindowResult> {
    let total: usize = window.iter().map(|m| valid_count(&m.targets)).sum();
    let mut loss_sum = 0f64;
    for mb in window {
        let count = valid_count(&mb.targets);
        let denom = match opts.norm {
            Normalization::WindowCount => total,
            Normalization::StepCount => count * window.len(),
        };
        // A micro-batch without valid targets still runs (its gradient is zero), so bad
        // input is reported here as on the graph path.
        let scale = match denom {
            0 => 0.0,
            d => (opts.loss_scale / d as f64) as f32,
        };
        loss_sum += step.forward_backward(master, &mb.input, &mb.targets, scale, grads)?;
    }
    Ok(WindowResult {
        loss: if total == 0 {
            0.0
        } else {
            loss_sum / total as f64
        },
        count: total,
    })
}
