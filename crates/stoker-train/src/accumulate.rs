//! Gradient accumulation over a window of micro-batches, and the one micro-batch
//! forward/backward ([`micro_batch`]) that the trainer's step and these helpers share.
//!
//! For token losses the window's loss is `sum of token losses / valid target tokens in the
//! whole window`, so accumulating `k` micro-batches gives the gradient of one batch of `k`
//! micro-batches whatever their token counts. Normalizing each micro-batch by its own
//! token count and then by `k` (DeepSpeed, candle, burn; HF transformers before its 2024
//! fix) weights tokens of short micro-batches more. Classification uses the same rule
//! with samples as the unit: the mean over the window's samples.
//!
//! Under data parallelism the denominator is the valid targets of the whole global batch
//! (every rank's window), which only a collective can count. So that nothing is
//! communicated before the window's last micro-batch, the trainer multiplies each
//! micro-batch's loss by `loss_scale / C` with `C` the global batch's target capacity
//! (known to every rank without asking), and after the reduction rescales the summed
//! gradient by `C / (valid targets counted over all ranks)`; without masked targets that
//! factor is exactly 1 and the pass is skipped. [`accumulate`] and [`accumulate_direct`]
//! are the one-rank forms with the normalization applied up front, the reference the
//! tests hold the trainer to.

use candle_core::Tensor;

use crate::error::Result;
use crate::layout::FlatLayout;
use crate::loss::{cross_entropy_sum, scalar, valid_count};
use crate::models::{DirectStep, Model};
use crate::precision::Fx;
use stoker_kernels::GroupReady;

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
#[derive(Clone)]
pub struct MicroBatch {
    /// Input tensor (token ids or images).
    pub input: Tensor,
    /// Targets, one per logit row.
    pub targets: Vec<i64>,
}

impl MicroBatch {
    /// The same input with every target masked: a forward that counts nothing, for a rank
    /// that must take part in a collective forward (ZeRO-3's evaluation) with no batch of
    /// its own left.
    pub fn masked(&self) -> MicroBatch {
        MicroBatch {
            input: self.input.clone(),
            targets: vec![crate::loss::IGNORE_INDEX; self.targets.len()],
        }
    }

    /// This batch of `n` samples grown to `rows` samples (`n <= rows`) by repeating its
    /// first sample with every added target masked: a short last batch that then runs on
    /// the step's buffers at the full micro-batch's shape and counts only its own
    /// targets. A batch of `rows` or more is returned as it is.
    pub fn padded_to(self, rows: usize) -> Result<MicroBatch> {
        let n = self.input.dim(0)?;
        if n >= rows || n == 0 {
            return Ok(self);
        }
        let per_sample = self.targets.len() / n;
        let picks: Vec<u32> = (0..rows as u32)
            .map(|i| if (i as usize) < n { i } else { 0 })
            .collect();
        let picks = Tensor::new(picks.as_slice(), self.input.device())?;
        let mut targets = self.targets;
        targets.resize(rows * per_sample, crate::loss::IGNORE_INDEX);
        Ok(MicroBatch {
            input: self.input.index_select(&picks, 0)?,
            targets,
        })
    }
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

/// What runs a micro-batch's forward and backward: the model's candle graph, or its
/// direct step over the flat buffers.
pub enum Backward<'a> {
    /// Candle's autograd graph; gradients gathered into the flat buffer afterwards.
    Graph {
        /// The model.
        model: &'a dyn Model,
        /// The forward context.
        fx: &'a Fx<'a>,
        /// The flat layout of the gradient buffer.
        layout: &'a FlatLayout,
        /// Fail naming any parameter that received no gradient.
        check_grads: bool,
        /// Host buffers the gradients come down through, for a model on a GPU
        /// ([`crate::offload`]); None: read them directly.
        staging: Option<&'a mut crate::offload::HostStaging>,
    },
    /// The model's hand-written step, reading the FP32 master buffer.
    Direct {
        /// The step.
        step: &'a mut dyn DirectStep,
        /// The FP32 master weights.
        master: &'a [f32],
    },
    /// The model's hand-written step with its parameter groups from a strategy's source
    /// (ZeRO-3: gathered from the ranks' shards; ZeRO-2: the whole buffer) and its
    /// gradients reduced group by group into this rank's shard; the `grads` and `ready` of
    /// [`micro_batch`] are unused.
    Sharded {
        /// The step.
        step: &'a mut dyn DirectStep,
        /// Where each group's parameters and gradients are.
        source: &'a mut dyn stoker_kernels::StepParams,
    },
}

/// Forward and backward of one micro-batch: adds the gradient of `factor x (summed loss
/// of its valid targets)` into `grads`, tells `ready` about every parameter group as soon
/// as its gradients are final (during the backward on the direct step, after it on the
/// graph path: last group first either way), and returns the summed loss. `factor` None
/// means the window has no valid target at all: nothing to learn, no backward.
pub fn micro_batch(
    backward: &mut Backward<'_>,
    mb: &MicroBatch,
    factor: Option<f64>,
    grads: &mut [f32],
    ready: GroupReady<'_>,
) -> Result<f64> {
    match backward {
        Backward::Graph {
            model,
            fx,
            layout,
            check_grads,
            staging,
        } => {
            let logits = model.forward(fx, &mb.input)?;
            let (sum, _) = cross_entropy_sum(fx, &logits, &mb.targets)?;
            let loss = scalar(&sum)?;
            if let Some(factor) = factor {
                let g = (sum * factor)?.backward()?;
                if *check_grads {
                    crate::check::every_param_has_grad(&g, model.params())?;
                }
                match staging {
                    Some(s) => s.download_grads(&g, model.params(), layout, grads)?,
                    None => layout.gather_grads(&g, model.params(), grads)?,
                }
            }
            for (group, _) in layout.group_ranges().into_iter().rev() {
                ready(group, grads);
            }
            Ok(loss)
        }
        Backward::Direct { step, master } => {
            // A micro-batch without valid targets still runs (its gradient is zero), so
            // bad input is reported here as on the graph path.
            let scale = factor.unwrap_or(0.0) as f32;
            step.forward_backward(master, &mb.input, &mb.targets, scale, grads, ready)
        }
        Backward::Sharded { step, source } => {
            let scale = factor.unwrap_or(0.0) as f32;
            step.forward_backward_groups(&mut **source, &mb.input, &mb.targets, scale)
        }
    }
}

/// The window loop of the one-rank helpers: each micro-batch gets the factor its summed
/// loss is multiplied by before backward (`loss_scale / denominator`, None when the
/// denominator is 0: nothing to learn from), and the window's mean loss and
/// valid-target count come back.
fn over_window(
    window: &[MicroBatch],
    opts: AccumulateOptions,
    mut backward: Backward<'_>,
    grads: &mut [f32],
) -> Result<WindowResult> {
    let total: usize = window.iter().map(|m| valid_count(&m.targets)).sum();
    let mut loss_sum = 0f64;
    for mb in window {
        let denom = match opts.norm {
            Normalization::WindowCount => total,
            Normalization::StepCount => valid_count(&mb.targets) * window.len(),
        };
        let factor = (denom > 0).then(|| opts.loss_scale / denom as f64);
        loss_sum += micro_batch(&mut backward, mb, factor, grads, &mut |_, _| {})?;
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

/// Runs forward and backward over `window` on the candle graph, adding the gradients of
/// `loss_scale x normalized loss` into `grads` (flat `layout`, zeroed by the caller).
pub fn accumulate(
    model: &dyn Model,
    fx: &Fx,
    window: &[MicroBatch],
    opts: AccumulateOptions,
    layout: &FlatLayout,
    grads: &mut [f32],
) -> Result<WindowResult> {
    let backward = Backward::Graph {
        model,
        fx,
        layout,
        check_grads: opts.check_grads,
        staging: None,
    };
    over_window(window, opts, backward, grads)
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
    over_window(window, opts, Backward::Direct { step, master }, grads)
}
