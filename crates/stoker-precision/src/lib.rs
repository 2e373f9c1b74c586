//! stoker-precision: number formats, loss scaling, FP8 delayed scaling and the autocast policy.
//!
//! What the trainer uses to train in reduced precision:
//!
//! - [`fp8`] and [`convert`]: f32 <-> f16 / bf16 / FP8 (E4M3FN, E5M2), round to nearest even,
//!   saturating or not for FP8, slice to slice, vectorized (AVX2 picked at run time) and
//!   optionally parallel (`par_*`). FP8 is bit-exact with ml_dtypes on all 256 patterns and
//!   1.19 million f32 inputs, f32 -> bf16 / f16 on 11,787 structured inputs (f16 NaN payloads
//!   aside); every f16 and bf16 pattern round-trips through f32 (`tests/`).
//! - [`stochastic`]: stochastic rounding f32 -> bf16 with a seeded, counter-based generator
//!   (llm.c's bf16 parameter update).
//! - [`scaler`]: [`LossScaler`], torch.amp.GradScaler's dynamic loss scaling (reproduces a
//!   recorded torch trace step for step), DeepSpeed's hysteresis and `min_loss_scale`, or a
//!   static scale; state saved and restored with serde.
//! - [`overflow`]: on a skipped step, which parameters overflowed and how many steps were
//!   skipped; a warning with hints when the scale is stuck at its minimum.
//! - [`fp8_scaling`]: Transformer Engine's `DelayedScaling` recipe (amax history, margin,
//!   E4M3 / E5M2 / HYBRID) and [`Fp8Tensor`], FP8 data that carries its scale.
//! - [`autocast`]: which ops run in the low-precision dtype and which stay in f32.
//!
//! ```
//! use stoker_precision::{convert, fp8::{Fp8Format, Saturation}};
//! let x = [1.0f32, 0.1, 500.0, -1e-3];
//! let mut q = [0u8; 4];
//! convert::f32_to_fp8(&x, &mut q, Fp8Format::E4M3, Saturation::Saturate).unwrap();
//! let mut back = [0f32; 4];
//! convert::fp8_to_f32(&q, &mut back, Fp8Format::E4M3).unwrap();
//! assert_eq!(back, [1.0, 0.1015625, 448.0, -0.001953125]); // 500 saturates to 448
//! ```
//!
//! # Loss scaling
//!
//! Per step: `scale_loss` -> backward -> `unscale_and_check` (multiplies the flat gradient
//! buffer by `1/scale`, returns `found_inf`, notes which parameters were non-finite) ->
//! clip -> `update(found_inf)`, which returns [`StepDecision::Step`] or
//! [`StepDecision::Skip`] with an [`OverflowReport`]. On inf/NaN the step is skipped and the
//! scale backs off (`x backoff_factor`, after `hysteresis` overflows, never below
//! `min_scale`); after `growth_interval` finite steps in a row it grows (`x growth_factor`,
//! only if the result is finite). Presets: [`ScalerConfig::torch`] (2^16, x2 / 2000 steps,
//! x0.5, no hysteresis, no floor), [`ScalerConfig::deepspeed`] (DeepSpeed's
//! `DynamicLossScaler`, its ZeRO stages' scaler: 2^16, window 1000, hysteresis 2, min 1) and
//! [`ScalerConfig::deepspeed_fp16_optimizer`] (DeepSpeed's `FP16_Optimizer`, fp16 without
//! ZeRO: no hysteresis, its window counted from the step after an overflow). Details and the
//! exact arithmetic in [`scaler`]; reproduced step for step against a recorded torch trace
//! and transcriptions of both DeepSpeed update rules.
//!
//! # Autocast policy
//!
//! Following torch's autocast op lists ([`autocast::AUTOCAST_TABLE`] is the data; this table
//! is rendered from it):
//!
//! | policy | runs in | ops (torch names) |
//! |---|---|---|
//! | `LowerPrecision` | compute dtype (f16/bf16) | `matmul`, `mm`, `bmm`, `addmm`, `addbmm`, `baddbmm`, `linear`, `conv1d`, `conv2d`, `conv3d`, `conv_transpose1d`, `conv_transpose2d`, `conv_transpose3d`, `prelu`, `scaled_dot_product_attention`, `rnn_tanh_cell / rnn_relu_cell`, `lstm_cell`, `gru_cell` |
//! | `Float32` | f32 | `pow`, `exp`, `expm1`, `log`, `log2`, `log10`, `log1p`, `reciprocal`, `rsqrt`, `sinh`, `cosh`, `tan`, `acos`, `asin`, `erfinv`, `softplus`, `softmax`, `log_softmax`, `logsumexp`, `layer_norm`, `rms_norm`, `group_norm`, `norm / frobenius_norm / nuclear_norm`, `renorm`, `sum`, `prod`, `cumsum`, `cumprod`, `dist`, `cdist`, `pdist`, `cosine_similarity`, `cross_entropy (log_softmax + nll_loss)`, `nll_loss`, `mse_loss`, `l1_loss`, `smooth_l1_loss`, `huber_loss`, `kl_div`, `binary_cross_entropy_with_logits`, `cosine_embedding_loss`, `margin_ranking_loss`, `poisson_nll_loss` |
//! | `Promote` | widest input dtype | `cat`, `stack`, `addcmul`, `addcdiv`, `atan2`, `dot`, `index_put`, `scatter_add` |
//! | `Passthrough` | input dtype (unchanged) | `add`, `mul`, `relu`, `gelu`, `silu`, `tanh`, `dropout`, `embedding`, `view / reshape / transpose`, `mean` |
#![deny(missing_docs)]

pub mod autocast;
pub mod convert;
pub mod error;
pub mod format;
pub mod fp8;
pub mod fp8_scaling;
pub mod overflow;
pub mod scaler;
pub mod stochastic;

pub use autocast::{AutocastPolicy, CastPolicy, Op};
pub use error::{PrecisionError, Result};
pub use format::Dtype;
pub use fp8::{Fp8Format, Saturation};
pub use fp8_scaling::{
    AmaxComputeAlgo, DelayedScaler, DelayedScalingConfig, Fp8Tensor, RecipeFormat, TensorRole,
};
pub use overflow::{CollapseWarning, DiagnosticsConfig, OverflowReport, ParamSpan, ParamTable};
pub use scaler::{DynamicConfig, LossScaler, ScalerConfig, ScalerState, ShownScale, StepDecision};
pub use stochastic::StochasticRounder;
