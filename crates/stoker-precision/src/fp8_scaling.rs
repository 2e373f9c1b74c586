//! FP8 delayed scaling, as Transformer Engine's `DelayedScaling` recipe.
//!
//! Each FP8 tensor (a layer's input, weight, output gradient) has a [`DelayedScaler`]: a
//! history of the tensor's amax (largest |x|) over the last `amax_history_len` steps and a
//! scale derived from it. Casting uses the scale computed from *previous* steps (hence
//! "delayed"): `q = fp8(x * scale)` (saturating), and `x ≈ fp8_to_f32(q) * scale_inv`.
//!
//! [`DelayedScaler::update`] follows TE's `amax_and_scale_update` kernel
//! (`transformer_engine/common/recipe/delayed_scaling.cu`):
//! - `amax` = the largest entry of the window (`"max"`) or the current step's (`"most_recent"`);
//!   NaN entries are ignored by "max" (it uses `fmaxf`).
//! - `scale = (fp8_max * 2^-margin) / amax` in f32 when `amax` is finite and > 0; otherwise the
//!   previous scale is kept; an infinite result (amax tiny) becomes `f32::MAX`.
//! - `scale_inv = 1 / scale`; then the window rolls and the new current slot starts at 0.
//!
//! Defaults as TE's today: margin 0, format HYBRID (E4M3 forward, E5M2 backward),
//! `amax_history_len` 1024, `amax_compute_algo` "max"; the initial scale is 1.

use crate::convert;
use crate::error::{PrecisionError, Result};
use crate::fp8::{Fp8Format, Saturation};

/// Which FP8 formats a recipe uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum RecipeFormat {
    /// E4M3 everywhere.
    E4M3,
    /// E5M2 everywhere.
    E5M2,
    /// E4M3 for forward tensors, E5M2 for gradients (TE's default).
    Hybrid,
}

/// Whether a tensor belongs to the forward or the backward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum TensorRole {
    /// Activations and weights.
    Forward,
    /// Gradients.
    Backward,
}

impl RecipeFormat {
    /// The storage format for a tensor of `role`.
    pub fn format_for(self, role: TensorRole) -> Fp8Format {
        match (self, role) {
            (RecipeFormat::E4M3, _) | (RecipeFormat::Hybrid, TensorRole::Forward) => {
                Fp8Format::E4M3
            }
            (RecipeFormat::E5M2, _) | (RecipeFormat::Hybrid, TensorRole::Backward) => {
                Fp8Format::E5M2
            }
        }
    }
}

/// How the amax used for the scale is taken from the history.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum AmaxComputeAlgo {
    /// The largest amax in the window.
    Max,
    /// The current step's amax.
    MostRecent,
}

/// The recipe's settings.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DelayedScalingConfig {
    /// Scale down by an extra `2^margin` (headroom); TE default 0.
    pub margin: f32,
    /// Formats; TE default HYBRID.
    pub format: RecipeFormat,
    /// Steps of amax history, >= 1; TE default 1024.
    pub amax_history_len: usize,
    /// TE default "max".
    pub amax_compute_algo: AmaxComputeAlgo,
}

impl Default for DelayedScalingConfig {
    fn default() -> Self {
        Self {
            margin: 0.0,
            format: RecipeFormat::Hybrid,
            amax_history_len: 1024,
            amax_compute_algo: AmaxComputeAlgo::Max,
        }
    }
}

/// FP8 data with the scale it was quantized with.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Fp8Tensor {
    /// Storage format of `data`.
    pub format: Fp8Format,
    /// FP8 bits of `x * scale`.
    pub data: Vec<u8>,
    /// The scale applied before the cast.
    pub scale: f32,
    /// `1 / scale`, applied when dequantizing.
    pub scale_inv: f32,
}

impl Fp8Tensor {
    /// Quantizes `x` with `scale` (saturating cast of `x * scale`); `scale` must be finite
    /// and > 0.
    pub fn quantize(x: &[f32], scale: f32, format: Fp8Format) -> Result<Self> {
        if !(scale.is_finite() && scale > 0.0) {
            return Err(PrecisionError::InvalidConfig {
                what: "fp8 quantize",
                field: "scale",
                value: scale.to_string(),
                reason: "must be finite and > 0",
            });
        }
        let mut data = vec![0u8; x.len()];
        convert::f32_to_fp8_scaled(x, &mut data, scale, format, Saturation::Saturate)?;
        Ok(Self {
            format,
            data,
            scale,
            scale_inv: 1.0 / scale,
        })
    }

    /// Writes `fp8_to_f32(q) * scale_inv` into `out`.
    pub fn dequantize_into(&self, out: &mut [f32]) -> Result<()> {
        convert::fp8_to_f32(&self.data, out, self.format)?;
        let s = self.scale_inv;
        out.iter_mut().for_each(|v| *v *= s);
        Ok(())
    }

    /// The dequantized values.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.data.len()];
        // Lengths match by construction.
        let _ = self.dequantize_into(&mut out);
        out
    }
}

/// Per-tensor delayed-scaling state: amax history, scale, scale_inv.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DelayedScaler {
    format: Fp8Format,
    margin: f32,
    algo: AmaxComputeAlgo,
    /// Ring buffer; `history[pos]` is the current step's amax.
    history: Vec<f32>,
    pos: usize,
    scale: f32,
    scale_inv: f32,
}

impl DelayedScaler {
    /// A scaler for a tensor of `role` under `config`, with scale 1.
    pub fn new(config: &DelayedScalingConfig, role: TensorRole) -> Result<Self> {
        if config.amax_history_len == 0 {
            return Err(PrecisionError::InvalidConfig {
                what: "delayed scaling",
                field: "amax_history_len",
                value: "0".into(),
                reason: "must be >= 1",
            });
        }
        if !config.margin.is_finite() {
            return Err(PrecisionError::InvalidConfig {
                what: "delayed scaling",
                field: "margin",
                value: config.margin.to_string(),
                reason: "must be finite",
            });
        }
        Ok(Self {
            format: config.format.format_for(role),
            margin: config.margin,
            algo: config.amax_compute_algo,
            history: vec![0.0; config.amax_history_len],
            pos: 0,
            scale: 1.0,
            scale_inv: 1.0,
        })
    }

    /// A scaler for a tensor of `role` under `config` holding `scale` and `history`
    /// (oldest first, ending with the current step's slot, as [`Self::history`] gives
    /// it): one whose state was kept elsewhere (the GPU step's scalers), for checkpoints.
    pub fn with_state(
        config: &DelayedScalingConfig,
        role: TensorRole,
        scale: f32,
        history: &[f32],
    ) -> Result<Self> {
        let mut s = Self::new(config, role)?;
        if history.len() != s.history.len() {
            return Err(PrecisionError::InvalidConfig {
                what: "delayed scaling state",
                field: "history",
                value: history.len().to_string(),
                reason: "must hold amax_history_len entries",
            });
        }
        if !(scale.is_finite() && scale > 0.0) {
            return Err(PrecisionError::InvalidConfig {
                what: "delayed scaling state",
                field: "scale",
                value: scale.to_string(),
                reason: "must be finite and > 0",
            });
        }
        s.history.copy_from_slice(history);
        s.pos = history.len() - 1;
        s.scale = scale;
        s.scale_inv = 1.0 / scale;
        Ok(s)
    }

    /// Checks a state that came from elsewhere (a checkpoint's, read without
    /// [`Self::new`]): a history of at least one entry with its position inside it, a
    /// finite positive scale and its inverse, and amaxes that are >= 0 or NaN (what
    /// [`Self::record_amax`] keeps, and what ranks reduce).
    pub fn check(&self) -> Result<()> {
        let bad = |field: &'static str, value: String, reason: &'static str| {
            Err(PrecisionError::InvalidConfig {
                what: "delayed scaling state",
                field,
                value,
                reason,
            })
        };
        if self.pos >= self.history.len() {
            return bad(
                "pos",
                format!("{} of {}", self.pos, self.history.len()),
                "must lie inside a history of at least one entry",
            );
        }
        if !(self.scale.is_finite() && self.scale > 0.0) {
            return bad("scale", self.scale.to_string(), "must be finite and > 0");
        }
        if self.scale_inv.to_bits() != (1.0 / self.scale).to_bits() {
            return bad("scale_inv", self.scale_inv.to_string(), "must be 1 / scale");
        }
        if let Some(a) = self
            .history
            .iter()
            .find(|a| a.is_sign_negative() && !a.is_nan())
        {
            return bad("history", a.to_string(), "amaxes are >= 0 or NaN");
        }
        Ok(())
    }

    /// The tensor's FP8 format.
    pub fn format(&self) -> Fp8Format {
        self.format
    }

    /// Scale to multiply by before casting.
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// `1 / scale`.
    pub fn scale_inv(&self) -> f32 {
        self.scale_inv
    }

    /// Folds an amax into the current step's slot (max with what is there; several casts of
    /// one tensor in a step, e.g. micro-batches, keep the largest). A NaN amax marks the slot
    /// NaN: "most_recent" then keeps the previous scale, "max" skips the slot.
    pub fn record_amax(&mut self, amax: f32) {
        let slot = &mut self.history[self.pos];
        *slot = if amax.is_nan() || slot.is_nan() {
            f32::NAN
        } else {
            slot.max(amax.abs())
        };
    }

    /// The current step's amax so far (the slot [`Self::record_amax`] folds into): what
    /// data-parallel ranks reduce (max) before [`Self::update`], so that every rank takes
    /// the same scale, as one rank holding the whole batch would.
    pub fn step_amax(&self) -> f32 {
        self.history[self.pos]
    }

    /// Quantizes `x` with the current (delayed) scale and records its amax.
    pub fn quantize(&mut self, x: &[f32]) -> Result<Fp8Tensor> {
        let mut data = vec![0u8; x.len()];
        let amax = convert::f32_to_fp8_scaled(
            x,
            &mut data,
            self.scale,
            self.format,
            Saturation::Saturate,
        )?;
        self.record_amax(amax);
        Ok(Fp8Tensor {
            format: self.format,
            data,
            scale: self.scale,
            scale_inv: self.scale_inv,
        })
    }

    /// Ends the step: computes the new scale from the history, rolls the window, returns the
    /// new scale (see the module docs for the rule).
    pub fn update(&mut self) -> f32 {
        let amax = match self.algo {
            AmaxComputeAlgo::MostRecent => self.history[self.pos],
            AmaxComputeAlgo::Max => self.history.iter().fold(0f32, |m, &a| m.max(a)),
        };
        let scaled_max = self.format.max() * (-self.margin).exp2();
        let mut scale = if amax.is_finite() && amax > 0.0 {
            scaled_max / amax
        } else {
            self.scale
        };
        if scale.is_infinite() {
            scale = f32::MAX;
        }
        self.scale = scale;
        self.scale_inv = 1.0 / scale;
        self.pos = (self.pos + 1) % self.history.len();
        self.history[self.pos] = 0.0;
        scale
    }

    /// The history, oldest first, ending with the current step's slot.
    pub fn history(&self) -> Vec<f32> {
        let n = self.history.len();
        (1..=n).map(|k| self.history[(self.pos + k) % n]).collect()
    }
}
