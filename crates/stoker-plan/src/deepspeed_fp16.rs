//! A DeepSpeed config's `fp16` loss-scaler keys, kept for the training config a plan emits
//! (its `[loss_scale]` table): `loss_scale` (0 means dynamic), `initial_scale_power`,
//! `loss_scale_window`, `hysteresis`, `consecutive_hysteresis` and `min_loss_scale`.
//! Unset keys are DeepSpeed's defaults, which the trainer's `deepspeed` preset holds.
//! A fixed `loss_scale` (> 0) reads no dynamic key, as DeepSpeed checks them only for a
//! dynamic scale. Values must be JSON numbers and booleans (DeepSpeed reads them as given,
//! so a numeric string fails there too, with a Python `TypeError`); `min_loss_scale` may be
//! a fraction (DeepSpeed's is an integer), and every scale must be an f32 scale (from
//! 2^-126 to f32's largest).

use serde_json::Value;

/// The `fp16` block's scaler keys that are set (`"auto"` counts as unset).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DsLossScale {
    /// `loss_scale`: a fixed scale where > 0; 0 or unset is dynamic.
    pub loss_scale: Option<f64>,
    /// `initial_scale_power`: the first dynamic scale is 2 to this power.
    pub initial_scale_power: Option<i32>,
    /// `loss_scale_window`: finite steps before the scale grows.
    pub loss_scale_window: Option<u32>,
    /// `hysteresis`: overflows tolerated before the scale backs off.
    pub hysteresis: Option<u32>,
    /// `consecutive_hysteresis`: credits restored after every finite step.
    pub consecutive_hysteresis: Option<bool>,
    /// `min_loss_scale`: the floor.
    pub min_loss_scale: Option<f64>,
    /// Whether the block names any of the five dynamic keys (`initial_scale_power`,
    /// `loss_scale_window`, `hysteresis`, `consecutive_hysteresis`, `min_loss_scale`),
    /// whatever their values. DeepSpeed passes its scaler settings only then
    /// (`get_dynamic_loss_scale_args`); otherwise its scalers take their class defaults,
    /// which differ from the documented `fp16` defaults (ZeRO's `DynamicLossScaler()`:
    /// 2^32 and no hysteresis).
    pub dynamic_keys_given: bool,
}

/// Reads the scaler keys of the `fp16` object `block`; errors name the key (`fp16.KEY`)
/// and what it must be.
pub(crate) fn read(block: &Value) -> Result<DsLossScale, String> {
    let get = |key: &str| {
        block
            .get(key)
            .filter(|v| !v.is_null() && v.as_str() != Some("auto"))
    };
    // A scale: 0 where `zero` allows it (a dynamic `loss_scale`), else an f32 scale.
    let scale = |key: &str, zero: bool| -> Result<Option<f64>, String> {
        let f32_scale = |x: f64| (x as f32).is_finite() && x as f32 >= f32::MIN_POSITIVE;
        match get(key) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if (zero && x == 0.0) || f32_scale(x) => Ok(Some(x)),
                _ => Err(format!(
                    "fp16.{key} must be {}a number from 2^-126 to f32's largest, got {v}",
                    if zero { "0 (dynamic) or " } else { "" }
                )),
            },
        }
    };
    let whole = |key: &str, least: u64| -> Result<Option<u32>, String> {
        match get(key) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) if n >= least && n <= u32::MAX as u64 => Ok(Some(n as u32)),
                _ => Err(format!(
                    "fp16.{key} must be an integer from {least} to 2^32 - 1, got {v}"
                )),
            },
        }
    };
    let loss_scale = scale("loss_scale", true)?;
    if loss_scale.is_some_and(|s| s > 0.0) {
        return Ok(DsLossScale {
            loss_scale,
            ..Default::default()
        });
    }
    let power = match get("initial_scale_power") {
        None => None,
        Some(v) => match v.as_i64() {
            // 2^127 is f32's largest power of two.
            Some(p) if (-126..=127).contains(&p) => Some(p as i32),
            _ => {
                return Err(format!(
                    "fp16.initial_scale_power must be an integer from -126 to 127, got {v}"
                ))
            }
        },
    };
    let consecutive = match get("consecutive_hysteresis") {
        None => None,
        Some(Value::Bool(b)) => Some(*b),
        Some(v) => {
            return Err(format!(
                "fp16.consecutive_hysteresis must be true or false, got {v}"
            ))
        }
    };
    const DYNAMIC: [&str; 5] = [
        "initial_scale_power",
        "loss_scale_window",
        "hysteresis",
        "consecutive_hysteresis",
        "min_loss_scale",
    ];
    Ok(DsLossScale {
        dynamic_keys_given: DYNAMIC.iter().any(|k| block.get(k).is_some()),
        loss_scale,
        initial_scale_power: power,
        loss_scale_window: whole("loss_scale_window", 1)?,
        hysteresis: whole("hysteresis", 1)?,
        consecutive_hysteresis: consecutive,
        min_loss_scale: scale("min_loss_scale", false)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_keys_are_kept_and_bad_ones_named() {
        let v: Value = serde_json::from_str(
            r#"{"enabled": true, "loss_scale": 0, "initial_scale_power": 12,
                "loss_scale_window": 500, "hysteresis": 4, "min_loss_scale": "auto"}"#,
        )
        .unwrap();
        assert_eq!(
            read(&v).unwrap(),
            DsLossScale {
                loss_scale: Some(0.0),
                initial_scale_power: Some(12),
                loss_scale_window: Some(500),
                hysteresis: Some(4),
                consecutive_hysteresis: None,
                min_loss_scale: None,
                dynamic_keys_given: true,
            }
        );
        // A fixed scale reads no dynamic key.
        let fixed: Value = serde_json::from_str(r#"{"loss_scale": 128, "hysteresis": 0}"#).unwrap();
        assert_eq!(
            read(&fixed).unwrap(),
            DsLossScale {
                loss_scale: Some(128.0),
                ..Default::default()
            }
        );
        for (text, key) in [
            (r#"{"hysteresis": 0}"#, "fp16.hysteresis"),
            (r#"{"loss_scale": -1}"#, "fp16.loss_scale"),
            (r#"{"loss_scale": 1e300}"#, "fp16.loss_scale"),
            (r#"{"loss_scale": 1e-50}"#, "fp16.loss_scale"),
            (r#"{"min_loss_scale": 0}"#, "fp16.min_loss_scale"),
            (r#"{"min_loss_scale": 1e300}"#, "fp16.min_loss_scale"),
            (
                r#"{"initial_scale_power": 200}"#,
                "fp16.initial_scale_power",
            ),
            (
                r#"{"consecutive_hysteresis": 1}"#,
                "fp16.consecutive_hysteresis",
            ),
            (r#"{"loss_scale_window": 1.5}"#, "fp16.loss_scale_window"),
        ] {
            let e = read(&serde_json::from_str(text).unwrap()).unwrap_err();
            assert!(e.starts_with(key), "{text}: {e}");
        }
    }
}
