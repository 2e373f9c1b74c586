//! `[loss_scale]`: the fp16 loss scaler's settings. torch's `GradScaler` by default, or
//! the scaler DeepSpeed would run for the run's strategy, each setting overridable under its
//! torch name; and whether an overflow with the scale already at its floor stops the run
//! (DeepSpeed's `raise_error_at_min_scale`) or is skipped like any other (torch's way).

use serde::{Deserialize, Serialize};
use stoker_precision::{PrecisionError, ScalerConfig};

use crate::error::{config_err, Result};

/// Which of DeepSpeed's optimizer wrappers would run a run's fp16 scaler: it decides the
/// scaler's rule and its class defaults. A training config's is
/// `TrainConfig::deepspeed_wrapper` (its strategy and optimizer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeepspeedWrapper {
    /// A ZeRO optimizer (stages 1-3): `DynamicLossScaler`.
    Zero,
    /// Stage 0 with an optimizer DeepSpeed fuses (Adam, AdamW): `FP16_Optimizer`.
    Fp16Optimizer,
    /// Stage 0 with another optimizer (SGD): `FP16_UnfusedOptimizer`, the same rule.
    Fp16UnfusedOptimizer,
}

impl DeepspeedWrapper {
    /// The wrapper for a run with (`zero`) or without ZeRO, whose optimizer DeepSpeed
    /// fuses or not (`unfused`).
    pub fn of(zero: bool, unfused: bool) -> Self {
        match (zero, unfused) {
            (true, _) => DeepspeedWrapper::Zero,
            (false, false) => DeepspeedWrapper::Fp16Optimizer,
            (false, true) => DeepspeedWrapper::Fp16UnfusedOptimizer,
        }
    }

    /// The scaler's name, for messages.
    pub fn scaler_name(self) -> &'static str {
        match self {
            DeepspeedWrapper::Zero => "DynamicLossScaler (ZeRO)",
            DeepspeedWrapper::Fp16Optimizer => "FP16_Optimizer (stage 0)",
            DeepspeedWrapper::Fp16UnfusedOptimizer => "FP16_UnfusedOptimizer (stage 0)",
        }
    }

    fn zero(self) -> bool {
        self == DeepspeedWrapper::Zero
    }
}

/// Whose defaults the scaler starts from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScalerPreset {
    /// torch.amp.GradScaler: 2^16, x2 after 2,000 finite steps, x0.5 on an overflow, no
    /// floor, and an overflow at any scale is skipped.
    #[default]
    Torch,
    /// The scaler DeepSpeed runs for the strategy, with its `fp16` defaults (2^16,
    /// `loss_scale_window` 1,000, `min_loss_scale` 1). Under ZeRO (`zero1`-`zero3`) its
    /// ZeRO optimizers' `DynamicLossScaler`: `hysteresis` 2, and an overflow at the floor
    /// stops the run. Under `ddp` or `none` (DeepSpeed's stage 0) its `FP16_Optimizer`: no
    /// hysteresis, the window counted from the step after an overflow, and the run goes
    /// on at the floor.
    Deepspeed,
}

impl ScalerPreset {
    /// The preset's name as a config writes it.
    pub fn name(self) -> &'static str {
        match self {
            ScalerPreset::Torch => "torch",
            ScalerPreset::Deepspeed => "deepspeed",
        }
    }
}

/// The `[loss_scale]` table (fp16 only). Unset keys take the preset's value.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LossScaleConfig {
    /// `torch` (the default) or `deepspeed`.
    #[serde(default)]
    pub preset: ScalerPreset,
    /// A fixed scale instead of a dynamic one (DeepSpeed's `loss_scale` > 0): an overflow
    /// is still skipped, and the scale never changes. Excludes the dynamic keys.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fixed: Option<f32>,
    /// The first scale (torch `init_scale`, DeepSpeed `2^initial_scale_power`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_scale: Option<f32>,
    /// The growth multiplier, > 1 (torch `growth_factor`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub growth_factor: Option<f64>,
    /// The backoff multiplier, in (0, 1) (torch `backoff_factor`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backoff_factor: Option<f64>,
    /// Finite steps before the scale grows (torch `growth_interval`, DeepSpeed
    /// `loss_scale_window`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub growth_interval: Option<u32>,
    /// Overflows tolerated before the scale backs off (DeepSpeed `hysteresis`; torch 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hysteresis: Option<u32>,
    /// Restore the hysteresis credits after every finite step (DeepSpeed
    /// `consecutive_hysteresis`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consecutive_hysteresis: Option<bool>,
    /// The floor the scale never backs off below (DeepSpeed `min_loss_scale`; torch 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_scale: Option<f32>,
    /// Stop the run, naming the step and the overflowing parameters, when an overflow
    /// finds the scale already at `min_scale` (DeepSpeed's `raise_error_at_min_scale`).
    /// Default: `deepspeed` under ZeRO stops; `deepspeed` under `ddp` or `none` and `torch`
    /// go on skipping (torch's scale halves down to 2^-126).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_at_min_scale: Option<bool>,
}

impl LossScaleConfig {
    /// The scaler these settings describe for a run DeepSpeed would wrap in `wrapper`;
    /// errors name the
    /// `loss_scale.` key.
    pub fn scaler(&self, wrapper: DeepspeedWrapper) -> Result<ScalerConfig> {
        let config = match self.fixed {
            Some(scale) => {
                if let Some(key) = self.dynamic_key_given() {
                    return Err(config_err(
                        format!("loss_scale.{key}"),
                        "a dynamic scaler's setting, and loss_scale.fixed asks for a fixed \
                         scale: give one or the other",
                    ));
                }
                ScalerConfig::Static(scale)
            }
            None => {
                let mut base = match self.preset {
                    ScalerPreset::Torch => ScalerConfig::torch(),
                    ScalerPreset::Deepspeed if wrapper.zero() => ScalerConfig::deepspeed(),
                    ScalerPreset::Deepspeed => ScalerConfig::deepspeed_fp16_optimizer(),
                };
                if let ScalerConfig::Dynamic(c) = &mut base {
                    c.init_scale = self.init_scale.unwrap_or(c.init_scale);
                    c.growth_factor = self.growth_factor.unwrap_or(c.growth_factor);
                    c.backoff_factor = self.backoff_factor.unwrap_or(c.backoff_factor);
                    c.growth_interval = self.growth_interval.unwrap_or(c.growth_interval);
                    c.hysteresis = self.hysteresis.unwrap_or(c.hysteresis);
                    c.consecutive_hysteresis = self
                        .consecutive_hysteresis
                        .unwrap_or(c.consecutive_hysteresis);
                    c.min_scale = self.min_scale.unwrap_or(c.min_scale);
                }
                base
            }
        };
        match stoker_precision::LossScaler::new(config.clone()) {
            Ok(_) => Ok(config),
            Err(PrecisionError::InvalidConfig {
                field,
                value,
                reason,
                ..
            }) => {
                let key = if field == "scale" { "fixed" } else { field };
                Err(config_err(
                    format!("loss_scale.{key}"),
                    format!("{value}: {reason}"),
                ))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// A DeepSpeed config's `fp16` scaler for a run DeepSpeed would wrap in `wrapper`: the
    /// `deepspeed` preset with the keys it sets (`loss_scale` > 0 a fixed scale), so that a
    /// plan of it emits the scaler DeepSpeed would run. What DeepSpeed has no key for
    /// (`stop_at_min_scale`, `growth_factor`, `backoff_factor`) is kept from `base`, the
    /// training config's own table; the rest is the DeepSpeed file's, its defaults
    /// included, as the later source. Without ZeRO, DeepSpeed's `FP16_Optimizer` ignores
    /// `hysteresis` and `consecutive_hysteresis`, and so does the emitted table. Where the
    /// block names no dynamic key, DeepSpeed's scalers take their class defaults: under
    /// ZeRO `DynamicLossScaler()`'s 2^32 and no hysteresis; without ZeRO, for an optimizer
    /// it does not fuse (SGD, `FP16_UnfusedOptimizer`), a floor of 0.25.
    pub fn from_deepspeed(
        ds: &stoker_plan::deepspeed_fp16::DsLossScale,
        base: Option<&LossScaleConfig>,
        wrapper: DeepspeedWrapper,
    ) -> LossScaleConfig {
        let kept = base.cloned().unwrap_or_default();
        let preset = ScalerPreset::Deepspeed;
        let stop_at_min_scale = kept.stop_at_min_scale;
        if let Some(fixed) = ds.loss_scale.filter(|s| *s > 0.0) {
            return LossScaleConfig {
                preset,
                fixed: Some(fixed as f32),
                stop_at_min_scale,
                ..Default::default()
            };
        }
        let zero = wrapper.zero();
        let class_defaults = !ds.dynamic_keys_given;
        let unfused = wrapper == DeepspeedWrapper::Fp16UnfusedOptimizer;
        LossScaleConfig {
            preset,
            init_scale: match (zero && class_defaults, ds.initial_scale_power) {
                (true, _) => Some(2f32.powi(32)),
                (false, p) => p.map(|p| 2f32.powi(p)),
            },
            growth_factor: kept.growth_factor,
            backoff_factor: kept.backoff_factor,
            growth_interval: ds.loss_scale_window,
            hysteresis: match zero {
                true if class_defaults => Some(1),
                true => ds.hysteresis,
                false => None,
            },
            consecutive_hysteresis: ds.consecutive_hysteresis.filter(|_| zero),
            min_scale: match (!zero && class_defaults && unfused, ds.min_loss_scale) {
                (true, _) => Some(0.25),
                (false, m) => m.map(|m| m as f32),
            },
            stop_at_min_scale,
            fixed: None,
        }
    }

    /// Whether an overflow at the floor stops a run DeepSpeed would wrap in `wrapper` (see
    /// [`LossScaleConfig::stop_at_min_scale`]).
    pub fn stops_at_min_scale(&self, wrapper: DeepspeedWrapper) -> bool {
        self.stop_at_min_scale
            .unwrap_or(self.preset == ScalerPreset::Deepspeed && wrapper.zero())
    }

    /// The first dynamic setting given, by its key.
    fn dynamic_key_given(&self) -> Option<&'static str> {
        [
            ("init_scale", self.init_scale.is_some()),
            ("growth_factor", self.growth_factor.is_some()),
            ("backoff_factor", self.backoff_factor.is_some()),
            ("growth_interval", self.growth_interval.is_some()),
            ("hysteresis", self.hysteresis.is_some()),
            (
                "consecutive_hysteresis",
                self.consecutive_hysteresis.is_some(),
            ),
            ("min_scale", self.min_scale.is_some()),
        ]
        .into_iter()
        .find_map(|(key, given)| given.then_some(key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TrainError;

    fn parse(text: &str) -> LossScaleConfig {
        toml::from_str(text).unwrap()
    }

    fn key_of(e: TrainError) -> String {
        match e {
            TrainError::Config { key, .. } => key,
            other => panic!("expected a config error, got {other}"),
        }
    }

    #[test]
    fn presets_and_overrides() {
        use DeepspeedWrapper::{Fp16Optimizer, Fp16UnfusedOptimizer, Zero};
        assert_eq!(
            parse("").scaler(Fp16Optimizer).unwrap(),
            ScalerConfig::torch()
        );
        assert!(!parse("").stops_at_min_scale(Zero));
        // DeepSpeed's scaler is its ZeRO optimizers' under ZeRO, FP16_Optimizer's at stage 0.
        let ds = parse("preset = \"deepspeed\"");
        assert_eq!(ds.scaler(Zero).unwrap(), ScalerConfig::deepspeed());
        assert!(ds.stops_at_min_scale(Zero));
        for stage0 in [Fp16Optimizer, Fp16UnfusedOptimizer] {
            assert_eq!(
                ds.scaler(stage0).unwrap(),
                ScalerConfig::deepspeed_fp16_optimizer()
            );
            assert!(!ds.stops_at_min_scale(stage0));
        }
        assert!(
            !parse("preset = \"deepspeed\"\nstop_at_min_scale = false").stops_at_min_scale(Zero)
        );
        assert!(parse("preset = \"deepspeed\"\nstop_at_min_scale = true")
            .stops_at_min_scale(Fp16Optimizer));
        let ScalerConfig::Dynamic(c) =
            parse("preset = \"deepspeed\"\nhysteresis = 4\nmin_scale = 0.5")
                .scaler(Fp16Optimizer)
                .unwrap()
        else {
            panic!("expected a dynamic scaler")
        };
        assert_eq!(
            (c.hysteresis, c.min_scale, c.growth_interval),
            (4, 0.5, 1000)
        );
        assert_eq!(
            parse("fixed = 128.0").scaler(Zero).unwrap(),
            ScalerConfig::Static(128.0)
        );
        // A first scale below the floor, as a negative `initial_scale_power` gives:
        // DeepSpeed runs it, and its first back-off raises it to the floor.
        let ScalerConfig::Dynamic(c) = parse("preset = \"deepspeed\"\ninit_scale = 0.5")
            .scaler(Zero)
            .unwrap()
        else {
            panic!("expected a dynamic scaler")
        };
        assert_eq!((c.init_scale, c.floor()), (0.5, 1.0));
    }

    /// A DeepSpeed file's keys, emitted for a run under ZeRO and under DDP: stage 0's
    /// `FP16_Optimizer` ignores the hysteresis keys, so its table leaves them out.
    #[test]
    fn a_deepspeed_scaler_follows_the_strategy() {
        use DeepspeedWrapper::{Fp16Optimizer, Fp16UnfusedOptimizer, Zero};
        let ds = stoker_plan::deepspeed_fp16::DsLossScale {
            initial_scale_power: Some(-2),
            hysteresis: Some(4),
            consecutive_hysteresis: Some(true),
            min_loss_scale: Some(0.5),
            dynamic_keys_given: true,
            ..Default::default()
        };
        let zero = LossScaleConfig::from_deepspeed(&ds, None, Zero);
        assert_eq!(
            (
                zero.init_scale,
                zero.hysteresis,
                zero.consecutive_hysteresis
            ),
            (Some(0.25), Some(4), Some(true))
        );
        let ddp = LossScaleConfig::from_deepspeed(&ds, None, Fp16Optimizer);
        assert_eq!(
            (ddp.init_scale, ddp.hysteresis, ddp.consecutive_hysteresis),
            (Some(0.25), None, None)
        );
        // Both run: a first scale of 2^-2 under a floor of 0.5 is DeepSpeed's too.
        let ScalerConfig::Dynamic(c) = zero.scaler(Zero).unwrap() else {
            panic!("expected a dynamic scaler")
        };
        assert_eq!((c.hysteresis, c.deepspeed_window), (4, false));
        let ScalerConfig::Dynamic(c) = ddp.scaler(Fp16Optimizer).unwrap() else {
            panic!("expected a dynamic scaler")
        };
        assert_eq!((c.hysteresis, c.deepspeed_window), (1, true));
        // A bare `{"enabled": true}`: DeepSpeed's class defaults, which are not its
        // documented `fp16` defaults. ZeRO's DynamicLossScaler(): 2^32, no hysteresis;
        // stage 0 with SGD (FP16_UnfusedOptimizer): a floor of 0.25.
        let bare = stoker_plan::deepspeed_fp16::DsLossScale::default();
        let zero = LossScaleConfig::from_deepspeed(&bare, None, Zero);
        assert_eq!(
            (zero.init_scale, zero.hysteresis, zero.min_scale),
            (Some(2f32.powi(32)), Some(1), None)
        );
        let fused = LossScaleConfig::from_deepspeed(&bare, None, Fp16Optimizer);
        assert_eq!(fused, parse("preset = \"deepspeed\""));
        let unfused = LossScaleConfig::from_deepspeed(&bare, None, Fp16UnfusedOptimizer);
        assert_eq!(
            (unfused.init_scale, unfused.hysteresis, unfused.min_scale),
            (None, None, Some(0.25))
        );
        assert_eq!(
            DeepspeedWrapper::of(false, true),
            Fp16UnfusedOptimizer,
            "SGD without ZeRO"
        );
    }

    #[test]
    fn bad_settings_name_their_key() {
        for (text, key) in [
            ("fixed = 128.0\nhysteresis = 2", "loss_scale.hysteresis"),
            ("fixed = 0.0", "loss_scale.fixed"),
            ("hysteresis = 0", "loss_scale.hysteresis"),
            ("backoff_factor = 1.5", "loss_scale.backoff_factor"),
            ("init_scale = 1e-40", "loss_scale.init_scale"),
            ("min_scale = -1.0", "loss_scale.min_scale"),
        ] {
            let e = parse(text)
                .scaler(DeepspeedWrapper::Fp16Optimizer)
                .unwrap_err();
            assert_eq!(key_of(e), key, "{text}");
        }
        assert!(toml::from_str::<LossScaleConfig>("window = 3").is_err());
    }
}
