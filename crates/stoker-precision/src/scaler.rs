//! Loss scaling for fp16 training: torch.amp.GradScaler's dynamic scaler, DeepSpeed's
//! hysteresis and floor, and a static scale.
//!
//! One step, as a trainer drives it:
//! ```
//! use stoker_precision::{LossScaler, ParamTable, ScalerConfig, StepDecision};
//! let mut scaler = LossScaler::new(ScalerConfig::torch()).unwrap();
//! let table = ParamTable::contiguous([("w", 3), ("b", 1)]);
//! let loss = 2.5f32;
//! let scaled = scaler.scale_loss(loss); // backward from `scaled` gives scaled gradients
//! let mut grads = vec![scaled, 0.0, 1.0, f32::INFINITY];
//! let found_inf = scaler.unscale_and_check(&mut grads, Some(&table)).unwrap();
//! assert!(found_inf);
//! match scaler.update(found_inf) {
//!     StepDecision::Step => { /* clip, optimizer step */ }
//!     StepDecision::Skip(report) => assert_eq!(report.nonfinite_params, vec!["b"]),
//! }
//! assert_eq!(scaler.scale(), 32768.0);
//! ```
//!
//! ## Update rule (exactly what [`LossScaler::update`] does)
//! On a step with inf/NaN gradients: the optimizer step is skipped, the growth counter is
//! reset, and if more than one hysteresis credit is left one is spent and the scale kept,
//! otherwise `scale = max(scale * backoff_factor, min_scale, f32::MIN_POSITIVE)`. On a finite step: (with
//! `consecutive_hysteresis`, the credits are restored) the counter goes up by one (with
//! `deepspeed_window`, not on the first finite step after an overflow or the start); when it
//! reaches `growth_interval`, `scale * growth_factor` replaces the scale if it is finite, the
//! counter is reset and the hysteresis credits are restored.
//!
//! With `hysteresis = 1` and `min_scale = 0` (the [`ScalerConfig::torch`] preset) this is
//! `torch._amp_update_scale_` down to a scale of 2^-126, f32's least normal, where torch's
//! would go on halving to 0 (after 166 overflows in a row from 2^16; a scaled loss of 0 has
//! nothing for candle's backward to differentiate, and either way every step overflows)
//! (checked step by step against a recorded torch trace in
//! `tests/scaler_torch.rs`), including its arithmetic: the factors are f64 like torch's Python
//! floats, the product is rounded once to the f32 scale, and unscaling multiplies by the f32
//! reciprocal `(1.0f64 / scale) as f32`.
//!
//! DeepSpeed has two fp16 scalers, each checked against a transcription of its Python in
//! `tests/scaler_deepspeed.rs` (DeepSpeed's scale is a Python float, so it has no
//! finiteness check on growth):
//! - `DynamicLossScaler`, which its ZeRO optimizers (stages 1-3) run, is this rule
//!   (`loss_scale_window` = `growth_interval`, `delayed_shift` = `hysteresis`,
//!   `min_scale`, `consecutive_hysteresis`): [`ScalerConfig::deepspeed`];
//! - `FP16_Optimizer`'s own `_update_scale`, which runs fp16 without ZeRO (stage 0), has
//!   no hysteresis and counts its window from the step after an overflow (or the start):
//!   this rule with `deepspeed_window` set, [`ScalerConfig::deepspeed_fp16_optimizer`].
//!
//! A first scale below `min_scale` is allowed, as DeepSpeed allows it (a negative
//! `initial_scale_power`): the first back-off raises it to the floor.
//! Where `DynamicLossScaler` can raise "Current loss scale already at minimum"
//! (`raise_error_at_min_scale`), this scaler keeps going: the skip report says so
//! ([`OverflowReport::at_min_scale`], on DeepSpeed's condition: the scale equals the floor
//! and no hysteresis credit is left) and attaches a [`crate::CollapseWarning`] after a few
//! such steps, for the caller to say (the run's skipped-step line does); stopping is the
//! trainer's call.
//!
//! A static scale never changes; a step with inf/NaN gradients is still skipped (applying
//! them would destroy the weights), and reported like a dynamic one.

use crate::error::{PrecisionError, Result};
use crate::overflow::{DiagnosticsConfig, OverflowCounters, OverflowReport, ParamTable};

/// A loss scale as a person reads it: plain from 1e-4 to 1e16 (`65536`, `0.25`), in
/// exponent form beyond (`1.1754944e-38` for 2^-126, not its 45-digit decimal).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShownScale(pub f32);

impl std::fmt::Display for ShownScale {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let a = self.0.abs();
        if a == 0.0 || !a.is_finite() || (1e-4..1e16).contains(&a) {
            write!(f, "{}", self.0)
        } else {
            write!(f, "{:e}", self.0)
        }
    }
}

/// Dynamic loss-scale settings (torch names; DeepSpeed's in the field docs).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DynamicConfig {
    /// First scale (torch `init_scale` 2^16; DeepSpeed `2^initial_scale_power`, 2^16).
    pub init_scale: f32,
    /// Growth multiplier, > 1 (torch 2.0; DeepSpeed's `scale_factor` 2).
    pub growth_factor: f64,
    /// Backoff multiplier, in (0, 1) (torch 0.5; DeepSpeed divides by `scale_factor`).
    pub backoff_factor: f64,
    /// Finite steps in a row before growing, >= 1 (torch 2000; DeepSpeed
    /// `loss_scale_window` 1000).
    pub growth_interval: u32,
    /// Overflows tolerated before backing off, >= 1 (torch: 1, none; DeepSpeed `hysteresis` 2).
    pub hysteresis: u32,
    /// Restore the hysteresis credits after every finite step instead of only on growth
    /// (DeepSpeed `consecutive_hysteresis`, default false).
    pub consecutive_hysteresis: bool,
    /// The scale never backs off below this (torch: 0, no floor; DeepSpeed `min_loss_scale` 1).
    pub min_scale: f32,
    /// DeepSpeed `FP16_Optimizer`'s window count: the first finite step after an overflow
    /// (or after the start) does not count toward growth, so the first growth comes on the
    /// `growth_interval + 1`-th clean step and later ones every `growth_interval` steps
    /// (`stable_interval = cur_iter - last_overflow_iter - 1`, grow when it is a positive
    /// multiple of `scale_window`). torch and DeepSpeed's `DynamicLossScaler`: false.
    #[serde(default)]
    pub deepspeed_window: bool,
}

impl DynamicConfig {
    /// The lowest the scale backs off to: `min_scale`, and never below f32's least normal
    /// (2^-126), where a scaled loss still has a gradient (a product by 0 leaves candle's
    /// backward nothing to differentiate).
    pub fn floor(&self) -> f32 {
        self.min_scale.max(f32::MIN_POSITIVE)
    }
}

/// How the loss is scaled.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum ScalerConfig {
    /// A scale that adapts to overflows.
    Dynamic(DynamicConfig),
    /// A fixed scale (1.0 for bf16/f32, where no scaling is needed).
    Static(f32),
}

impl ScalerConfig {
    /// torch.amp.GradScaler's defaults: 2^16, x2 every 2000 finite steps, x0.5 on overflow.
    pub fn torch() -> Self {
        ScalerConfig::Dynamic(DynamicConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            hysteresis: 1,
            consecutive_hysteresis: false,
            min_scale: 0.0,
            deepspeed_window: false,
        })
    }

    /// DeepSpeed's `DynamicLossScaler` with its fp16 defaults, as its ZeRO optimizers run
    /// it: 2^16, x2 after 1,000 finite steps, x0.5 on an overflow, hysteresis 2,
    /// min_loss_scale 1.
    pub fn deepspeed() -> Self {
        ScalerConfig::Dynamic(DynamicConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 1000,
            hysteresis: 2,
            consecutive_hysteresis: false,
            min_scale: 1.0,
            deepspeed_window: false,
        })
    }

    /// DeepSpeed's `FP16_Optimizer` with its fp16 defaults, as fp16 without ZeRO runs it:
    /// 2^16, x2 after 1,000 finite steps counted from the step after an overflow, x0.5 on
    /// an overflow, no hysteresis (it ignores the key), min_loss_scale 1.
    pub fn deepspeed_fp16_optimizer() -> Self {
        ScalerConfig::Dynamic(DynamicConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 1000,
            hysteresis: 1,
            consecutive_hysteresis: false,
            min_scale: 1.0,
            deepspeed_window: true,
        })
    }

    fn validate(&self) -> Result<()> {
        let bad = |field, value: String, reason| {
            Err(PrecisionError::InvalidConfig {
                what: "loss scaler",
                field,
                value,
                reason,
            })
        };
        match self {
            ScalerConfig::Static(s) if !(s.is_finite() && *s > 0.0) => {
                bad("scale", s.to_string(), "must be finite and > 0")
            }
            ScalerConfig::Static(_) => Ok(()),
            ScalerConfig::Dynamic(c) => {
                if !(c.init_scale.is_finite() && c.init_scale >= f32::MIN_POSITIVE) {
                    bad(
                        "init_scale",
                        c.init_scale.to_string(),
                        "must be finite and at least 2^-126 (f32's least normal, the lowest \
                         a dynamic scale goes)",
                    )
                } else if !(c.growth_factor.is_finite() && c.growth_factor > 1.0) {
                    bad(
                        "growth_factor",
                        c.growth_factor.to_string(),
                        "must be finite and > 1",
                    )
                } else if !(c.backoff_factor > 0.0 && c.backoff_factor < 1.0) {
                    bad(
                        "backoff_factor",
                        c.backoff_factor.to_string(),
                        "must be in (0, 1)",
                    )
                } else if c.growth_interval == 0 {
                    bad("growth_interval", "0".into(), "must be >= 1")
                } else if c.hysteresis == 0 {
                    bad(
                        "hysteresis",
                        "0".into(),
                        "must be >= 1 (1 = back off on every overflow)",
                    )
                } else if !(c.min_scale.is_finite() && c.min_scale >= 0.0) {
                    bad(
                        "min_scale",
                        c.min_scale.to_string(),
                        "must be finite and >= 0",
                    )
                } else {
                    Ok(())
                }
            }
        }
    }
}

/// Whether the optimizer should apply this step.
#[derive(Debug, Clone, PartialEq)]
pub enum StepDecision {
    /// Gradients are finite: clip (after unscaling) and step.
    Step,
    /// Gradients held inf/NaN: skip the optimizer step; the report says which and how often.
    Skip(Box<OverflowReport>),
}

impl StepDecision {
    /// True for [`StepDecision::Step`].
    pub fn should_step(&self) -> bool {
        matches!(self, StepDecision::Step)
    }
}

/// Everything a checkpoint needs to resume the scaler bit-identically.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ScalerState {
    /// The configuration it ran with.
    pub config: ScalerConfig,
    /// Current scale.
    pub scale: f32,
    /// Finite steps since the last overflow or growth (torch `_growth_tracker`).
    pub growth_tracker: u32,
    /// Hysteresis credits left (DeepSpeed `cur_hysteresis`).
    pub hysteresis_left: u32,
    /// With `deepspeed_window`: the next finite step is the first after an overflow (or the
    /// start) and is not counted.
    #[serde(default)]
    pub uncounted_step_pending: bool,
    /// Steps seen by `update`.
    pub steps: u64,
    /// Overflow counters.
    pub overflow: OverflowCounters,
}

impl ScalerState {
    /// This state carried on under `config`: the scale and the counters go on, the
    /// settings are `config`'s. A scale below the new floor is raised to it (a static
    /// config's scale is its own), and hysteresis credits beyond the new `hysteresis` are
    /// dropped. For a resume whose configuration changed the scaler's settings; the same
    /// state when `config` is its own.
    pub fn under(self, config: ScalerConfig) -> Result<ScalerState> {
        config.validate()?;
        if config == self.config {
            return Ok(self);
        }
        let (scale, hysteresis_left, uncounted_step_pending) = match &config {
            ScalerConfig::Dynamic(c) => (
                self.scale.max(c.floor()),
                self.hysteresis_left.clamp(1, c.hysteresis),
                self.uncounted_step_pending && c.deepspeed_window,
            ),
            ScalerConfig::Static(s) => (*s, 1, false),
        };
        Ok(ScalerState {
            config,
            scale,
            hysteresis_left,
            uncounted_step_pending,
            ..self
        })
    }
}

/// The loss scaler. See the module docs for the update rule.
#[derive(Debug, Clone)]
pub struct LossScaler {
    state: ScalerState,
    diagnostics: DiagnosticsConfig,
    pending_names: Vec<String>,
}

impl LossScaler {
    /// A scaler with default diagnostics; errors on an invalid configuration.
    pub fn new(config: ScalerConfig) -> Result<Self> {
        Self::with_diagnostics(config, DiagnosticsConfig::default())
    }

    /// A scaler with the given diagnostics settings.
    pub fn with_diagnostics(config: ScalerConfig, diagnostics: DiagnosticsConfig) -> Result<Self> {
        config.validate()?;
        let (scale, hysteresis, pending) = match &config {
            ScalerConfig::Dynamic(c) => (c.init_scale, c.hysteresis, c.deepspeed_window),
            ScalerConfig::Static(s) => (*s, 1, false),
        };
        Ok(Self {
            state: ScalerState {
                config,
                scale,
                growth_tracker: 0,
                hysteresis_left: hysteresis,
                uncounted_step_pending: pending,
                steps: 0,
                overflow: OverflowCounters::default(),
            },
            diagnostics,
            pending_names: Vec::new(),
        })
    }

    /// Current scale.
    pub fn scale(&self) -> f32 {
        self.state.scale
    }

    /// `loss * scale` (f32, as torch multiplies the loss by its f32 scale tensor).
    pub fn scale_loss(&self, loss: f32) -> f32 {
        loss * self.state.scale
    }

    /// The multiplier that unscales gradients: `(1.0f64 / scale) as f32`, torch's
    /// `scale.double().reciprocal().float()`.
    pub fn inv_scale(&self) -> f32 {
        (1.0f64 / self.state.scale as f64) as f32
    }

    /// Multiplies `grads` (a flat buffer) by [`Self::inv_scale`] in place and returns whether
    /// any gradient was inf/NaN before unscaling (torch's `found_inf`). With a `table`, the
    /// names of the non-finite parameters are kept for the report of the coming
    /// [`Self::update`]. Errors if a span of `table` lies outside `grads`.
    pub fn unscale_and_check(
        &mut self,
        grads: &mut [f32],
        table: Option<&ParamTable>,
    ) -> Result<bool> {
        if let Some(t) = table {
            t.check_fits(grads.len())?;
        }
        let inv = self.inv_scale();
        let mut found = false;
        for chunk in grads.chunks_mut(4096) {
            let mut bad = false;
            for g in chunk.iter_mut() {
                bad |= g.to_bits() & 0x7F80_0000 == 0x7F80_0000;
                *g *= inv;
            }
            found |= bad;
        }
        if found {
            if let Some(t) = table {
                // Non-finite inputs stay non-finite after multiplying by a finite inv > 0.
                self.pending_names.extend(t.nonfinite_names(grads)?);
            }
        }
        Ok(found)
    }

    /// Records a non-finite gradient found outside [`Self::unscale_and_check`] (another rank,
    /// another buffer), so the next report names it.
    pub fn note_nonfinite(&mut self, name: impl Into<String>) {
        self.pending_names.push(name.into());
    }

    /// Ends the step: decides step or skip and updates the scale (see the module docs).
    /// `found_inf` must be the same on every data-parallel rank (all-reduce it with max).
    pub fn update(&mut self, found_inf: bool) -> StepDecision {
        let before = self.state.scale;
        let mut at_min_scale = false;
        let st = &mut self.state;
        if let ScalerConfig::Dynamic(c) = &st.config {
            if found_inf {
                st.growth_tracker = 0;
                st.uncounted_step_pending = c.deepspeed_window;
                if st.hysteresis_left > 1 {
                    st.hysteresis_left -= 1;
                } else {
                    let floor = c.floor();
                    // DeepSpeed's condition for "Current loss scale already at minimum":
                    // the scale is the floor (a first scale below it is raised to it).
                    at_min_scale = st.scale == floor;
                    let next = (st.scale as f64 * c.backoff_factor) as f32;
                    st.scale = next.max(floor);
                }
            } else {
                if c.consecutive_hysteresis {
                    st.hysteresis_left = c.hysteresis;
                }
                if st.uncounted_step_pending {
                    st.uncounted_step_pending = false;
                } else {
                    st.growth_tracker += 1;
                }
                if st.growth_tracker >= c.growth_interval {
                    let next = (st.scale as f64 * c.growth_factor) as f32;
                    if next.is_finite() {
                        st.scale = next;
                    }
                    st.growth_tracker = 0;
                    st.hysteresis_left = c.hysteresis;
                }
            }
        }
        let floor = self.collapse_floor();
        let step = self.state.steps;
        self.state.steps += 1;
        let names = std::mem::take(&mut self.pending_names);
        let after = self.state.scale;
        match self.state.overflow.record(
            &self.diagnostics,
            floor,
            step,
            found_inf,
            before,
            after,
            names,
        ) {
            None => StepDecision::Step,
            // The report carries any collapse warning, for its caller to say once (the
            // run's step line does; the scaler said it too, a second time, before the
            // step's line).
            Some(report) => StepDecision::Skip(Box::new(OverflowReport {
                at_min_scale,
                ..report
            })),
        }
    }

    fn collapse_floor(&self) -> f32 {
        if let Some(f) = self.diagnostics.collapse_floor {
            return f;
        }
        match &self.state.config {
            ScalerConfig::Dynamic(c) if c.min_scale > 0.0 => c.min_scale,
            _ => 1.0,
        }
    }

    /// The state to save in a checkpoint.
    pub fn state(&self) -> &ScalerState {
        &self.state
    }

    /// Restores a saved state (its configuration included); errors if the state is invalid.
    pub fn restore(&mut self, state: ScalerState) -> Result<()> {
        state.config.validate()?;
        if !(state.scale.is_finite() && state.scale >= 0.0) {
            return Err(PrecisionError::BadState(format!(
                "scale {} is not a finite scale",
                state.scale
            )));
        }
        // A dynamic scale saved below f32's least normal (before 2026-12-07 torch's could
        // reach 0) goes on from it, where a scaled loss still has a gradient. One below
        // `min_scale` stays: a first scale may be (DeepSpeed's negative
        // `initial_scale_power`), until its first back-off raises it.
        let floor = match &state.config {
            ScalerConfig::Dynamic(_) => f32::MIN_POSITIVE,
            ScalerConfig::Static(_) => 0.0,
        };
        self.state = ScalerState {
            scale: state.scale.max(floor),
            ..state
        };
        self.pending_names.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dynamic(f: impl FnOnce(&mut DynamicConfig)) -> ScalerConfig {
        let ScalerConfig::Dynamic(mut c) = ScalerConfig::torch() else {
            unreachable!()
        };
        f(&mut c);
        ScalerConfig::Dynamic(c)
    }

    #[test]
    fn rejects_bad_config() {
        for cfg in [
            dynamic(|c| c.growth_factor = 1.0),
            dynamic(|c| c.backoff_factor = 1.0),
            dynamic(|c| c.backoff_factor = 0.0),
            dynamic(|c| c.growth_interval = 0),
            dynamic(|c| c.hysteresis = 0),
            dynamic(|c| c.init_scale = f32::INFINITY),
            dynamic(|c| c.min_scale = f32::NAN),
            dynamic(|c| c.min_scale = -1.0),
            ScalerConfig::Static(0.0),
        ] {
            assert!(matches!(
                LossScaler::new(cfg),
                Err(PrecisionError::InvalidConfig { .. })
            ));
        }
    }

    #[test]
    fn deepspeed_hysteresis_and_floor() {
        let mut s = LossScaler::new(dynamic(|c| {
            c.init_scale = 4.0;
            c.hysteresis = 2;
            c.min_scale = 1.0;
            c.growth_interval = 3;
        }))
        .unwrap();
        // First overflow spends a hysteresis credit: scale kept, step still skipped.
        assert!(!s.update(true).should_step());
        assert_eq!(s.scale(), 4.0);
        assert!(!s.update(true).should_step());
        assert_eq!(s.scale(), 2.0);
        // Credits are not restored by a finite step (consecutive_hysteresis = false)...
        assert!(s.update(false).should_step());
        s.update(true);
        assert_eq!(s.scale(), 1.0);
        // ...and the floor holds.
        s.update(true);
        assert_eq!(s.scale(), 1.0);
        // Three finite steps grow and restore the credits.
        for _ in 0..3 {
            s.update(false);
        }
        assert_eq!(s.scale(), 2.0);
        s.update(true);
        assert_eq!(s.scale(), 2.0);
    }

    #[test]
    fn consecutive_hysteresis_restores_on_finite_step() {
        let mut s = LossScaler::new(dynamic(|c| {
            c.hysteresis = 2;
            c.consecutive_hysteresis = true;
        }))
        .unwrap();
        s.update(true);
        s.update(false);
        s.update(true);
        assert_eq!(s.scale(), 65536.0);
        s.update(true);
        assert_eq!(s.scale(), 32768.0);
    }

    #[test]
    fn scales_are_shown_plain_or_in_exponent_form() {
        for (scale, shown) in [
            (65536.0, "65536"),
            (1.0, "1"),
            (0.25, "0.25"),
            (2f32.powi(-13), "0.00012207031"),
            (2f32.powi(-14), "6.1035156e-5"),
            (f32::MIN_POSITIVE, "1.1754944e-38"),
            (2f32.powi(60), "1.1529215e18"),
            (0.0, "0"),
            (f32::INFINITY, "inf"),
        ] {
            assert_eq!(ShownScale(scale).to_string(), shown);
        }
    }

    #[test]
    fn static_scale_skips_but_never_changes() {
        let mut s = LossScaler::new(ScalerConfig::Static(128.0)).unwrap();
        assert_eq!(s.scale_loss(0.5), 64.0);
        assert!(!s.update(true).should_step());
        assert!(s.update(false).should_step());
        assert_eq!(s.scale(), 128.0);
    }

    #[test]
    fn collapse_warning_after_patience_at_floor() {
        let mut s = LossScaler::new(ScalerConfig::deepspeed()).unwrap();
        let table = ParamTable::contiguous([("a", 2), ("b", 2)]);
        let mut last = None;
        for _ in 0..40 {
            let mut g = [1.0, 1.0, f32::NAN, 1.0];
            let inf = s.unscale_and_check(&mut g, Some(&table)).unwrap();
            last = Some(s.update(inf));
        }
        let StepDecision::Skip(r) = last.unwrap() else {
            panic!("expected a skip")
        };
        assert_eq!(r.total_skips, 40);
        assert_eq!(r.consecutive_skips, 40);
        assert_eq!(r.nonfinite_params, vec!["b"]);
        let c = r.collapse.expect("collapse warning");
        assert_eq!(c.floor, 1.0);
        assert!(c.consecutive_at_floor >= 3);
        let msg = c.to_string();
        assert!(
            msg.contains("is already at its minimum (1 <= floor 1)")
                && msg.contains("bf16")
                && msg.contains("clip"),
            "{msg}"
        );
        // A finite step ends the spiral.
        assert!(s.update(false).should_step());
        assert_eq!(s.state().overflow.consecutive_at_floor, 0);
        // torch's scaler has no floor: its scale keeps halving past the diagnostics' 1,
        // and the warning says so rather than "at its minimum".
        let mut t = LossScaler::new(ScalerConfig::torch()).unwrap();
        let mut last = None;
        for _ in 0..40 {
            last = Some(t.update(true));
        }
        let StepDecision::Skip(r) = last.unwrap() else {
            panic!("expected a skip")
        };
        let msg = r.collapse.expect("collapse warning").to_string();
        assert!(
            msg.contains(
                "has been below 1 for the last 24 overflowing steps (1.1920929e-7 on this one)"
            ),
            "{msg}"
        );
        assert!(!msg.contains("minimum"), "{msg}");
    }

    /// The step whose overflow finds the scale at its floor with no hysteresis credit
    /// left is DeepSpeed's "Current loss scale already at minimum"; torch's scaler, with
    /// no floor, reaches it at f32's least normal scale.
    #[test]
    fn at_min_scale_is_deepspeeds_condition() {
        let skip_at_min = |s: &mut LossScaler, found_inf| match s.update(found_inf) {
            StepDecision::Skip(r) => Some(r.at_min_scale),
            StepDecision::Step => None,
        };
        let mut s = LossScaler::new(dynamic(|c| {
            c.init_scale = 4.0;
            c.hysteresis = 2;
            c.min_scale = 1.0;
        }))
        .unwrap();
        // 4 (a credit spent), 4 -> 2, 2 -> 1: lowered each time, never at the floor.
        for _ in 0..3 {
            assert_eq!(skip_at_min(&mut s, true), Some(false));
        }
        assert_eq!(s.scale(), 1.0);
        assert_eq!(skip_at_min(&mut s, true), Some(true));
        assert_eq!(skip_at_min(&mut s, false), None);
        // Credits are restored only on growth: the next overflow at the floor is at it.
        assert_eq!(skip_at_min(&mut s, true), Some(true));

        let mut t = LossScaler::new(ScalerConfig::torch()).unwrap();
        let mut n = 0;
        while skip_at_min(&mut t, true) == Some(false) {
            n += 1;
            assert!(n < 1000, "torch's scale never reached 0");
        }
        // 2^16 halved 16 + 126 times is f32's least normal, 2^-126, where the scale stays
        // (torch's would go on to 0, 24 halvings later).
        assert_eq!((n, t.scale()), (142, f32::MIN_POSITIVE));
        let mut fixed = LossScaler::new(ScalerConfig::Static(1.0)).unwrap();
        assert_eq!(skip_at_min(&mut fixed, true), Some(false));
    }

    #[test]
    fn a_state_goes_on_under_new_settings() {
        let mut a = LossScaler::new(ScalerConfig::torch()).unwrap();
        for i in 0..40 {
            a.update(i < 16);
        }
        let saved = a.state().clone();
        assert_eq!(saved.scale, 1.0);
        // The same settings: the same state, bit for bit.
        assert_eq!(saved.clone().under(ScalerConfig::torch()).unwrap(), saved);
        // DeepSpeed's: the floor (1) holds the scale, one credit of two is left, and the
        // counters go on.
        let ds = saved.clone().under(ScalerConfig::deepspeed()).unwrap();
        assert_eq!(ds.config, ScalerConfig::deepspeed());
        assert_eq!((ds.scale, ds.hysteresis_left), (1.0, 1));
        assert_eq!(
            (ds.growth_tracker, ds.steps, &ds.overflow),
            (24, 40, &saved.overflow)
        );
        let raised = saved.clone().under(dynamic(|c| c.min_scale = 8.0)).unwrap();
        assert_eq!(raised.scale, 8.0);
        assert_eq!(
            saved
                .clone()
                .under(ScalerConfig::Static(512.0))
                .unwrap()
                .scale,
            512.0
        );
        assert!(matches!(
            saved.under(dynamic(|c| c.hysteresis = 0)),
            Err(PrecisionError::InvalidConfig {
                field: "hysteresis",
                ..
            })
        ));
    }

    /// A state saved at a scale of 0 (torch's collapse, before the floor) resumes at 2^-126,
    /// and a first scale below it is refused; one saved below `min_scale` before its first
    /// back-off resumes as it was.
    #[test]
    fn a_scale_below_the_least_normal_is_raised_or_refused() {
        let mut s = LossScaler::new(ScalerConfig::torch()).unwrap();
        let mut st = s.state().clone();
        st.scale = 0.0;
        s.restore(st).unwrap();
        assert_eq!(s.scale(), f32::MIN_POSITIVE);
        let below = dynamic(|c| (c.init_scale, c.min_scale) = (0.25, 1.0));
        let mut a = LossScaler::new(below.clone()).unwrap();
        a.update(false);
        let mut b = LossScaler::new(below).unwrap();
        b.restore(a.state().clone()).unwrap();
        assert_eq!(b.state(), a.state());
        assert_eq!(b.scale(), 0.25);
        assert!(matches!(
            LossScaler::new(dynamic(|c| c.init_scale = 1e-40)),
            Err(PrecisionError::InvalidConfig {
                field: "init_scale",
                ..
            })
        ));
    }

    #[test]
    fn state_round_trips_through_json() {
        let mut a = LossScaler::new(ScalerConfig::deepspeed()).unwrap();
        for i in 0..2500 {
            a.update(i % 700 == 3);
        }
        let json = serde_json::to_string(a.state()).unwrap();
        let mut b = LossScaler::new(ScalerConfig::torch()).unwrap();
        b.restore(serde_json::from_str(&json).unwrap()).unwrap();
        for i in 0..3000 {
            let f = i % 911 == 5;
            assert_eq!(a.update(f), b.update(f));
            assert_eq!(a.state(), b.state());
        }
    }
}
