//! The resident GPT's FP8 scalers as the CPU trainer keeps them: by layer, named as the
//! CPU model names its linear layers (`h.0.attn.qkv`, ...), three scalers each (input,
//! weight, output gradient), so that a checkpoint holds them the same way on either
//! path. The step keeps them in its own order (`stoker_gpu::step::gpt`: four layers a
//! block, three scalers a layer); this is the one place that maps the two.
//!
//! The CPU's simulation also casts the tied head (`lm_head`); the resident step keeps it
//! in bf16, as Transformer Engine does, so its scalers are not carried across.

use std::collections::BTreeMap;

use stoker_gpu::fp8::ScalerValues;
use stoker_precision::{DelayedScaler, DelayedScalingConfig, TensorRole};

use crate::error::{Result, TrainError};
use crate::precision::LayerScalers;

/// The step's linear layers in a block, in its order, as the CPU model names them.
const BLOCK_LAYERS: [&str; 4] = ["attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"];

/// A layer's three scalers' roles: input, weight (E4M3), output gradient (E5M2).
const ROLES: [TensorRole; 3] = [
    TensorRole::Forward,
    TensorRole::Forward,
    TensorRole::Backward,
];

/// The step's `l`-th FP8 layer's name.
fn layer_name(l: usize) -> String {
    format!(
        "h.{}.{}",
        l / BLOCK_LAYERS.len(),
        BLOCK_LAYERS[l % BLOCK_LAYERS.len()]
    )
}

fn state_err(e: impl std::fmt::Display) -> TrainError {
    TrainError::Strategy(format!("the resident step's FP8 scalers: {e}"))
}

/// The step's scalers' values as the CPU trainer's layers (TE's default recipe, as both
/// sides make them).
pub(crate) fn to_layers(values: &[ScalerValues]) -> Result<BTreeMap<String, LayerScalers>> {
    if !values.len().is_multiple_of(ROLES.len()) {
        return Err(state_err(format!(
            "{} scalers are not three a layer",
            values.len()
        )));
    }
    let cfg = DelayedScalingConfig::default();
    values
        .chunks(ROLES.len())
        .enumerate()
        .map(|(l, three)| {
            let scaler = |k: usize| {
                DelayedScaler::with_state(&cfg, ROLES[k], three[k].scale, &three[k].history)
                    .map_err(state_err)
            };
            Ok((layer_name(l), [scaler(0)?, scaler(1)?, scaler(2)?]))
        })
        .collect()
}

/// The CPU trainer's layers as the step's `count` scalers' values: a layer the map does
/// not hold (a checkpoint from before, or from the CPU's path without it) starts as a
/// new scaler does (scale 1, an empty history).
pub(crate) fn to_values(
    layers: &BTreeMap<String, LayerScalers>,
    count: usize,
) -> Result<Vec<ScalerValues>> {
    let cfg = DelayedScalingConfig::default();
    let value = |s: &DelayedScaler| ScalerValues {
        scale: s.scale(),
        scale_inv: s.scale_inv(),
        history: s.history(),
    };
    let mut out = Vec::with_capacity(count);
    for l in 0..count / ROLES.len() {
        match layers.get(&layer_name(l)) {
            Some(three) => out.extend(three.iter().map(value)),
            None => {
                for role in ROLES {
                    out.push(value(&DelayedScaler::new(&cfg, role).map_err(state_err)?));
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_are_named_as_the_cpu_model_names_them_and_round_trip() {
        assert_eq!(layer_name(0), "h.0.attn.qkv");
        assert_eq!(layer_name(3), "h.0.mlp.proj");
        assert_eq!(layer_name(6), "h.1.mlp.fc");
        let values: Vec<ScalerValues> = (0..24)
            .map(|k| ScalerValues {
                scale: 1.0 + k as f32,
                scale_inv: 1.0 / (1.0 + k as f32),
                history: (0..1024).map(|j| (j * k) as f32).collect(),
            })
            .collect();
        let layers = to_layers(&values).unwrap();
        assert_eq!(layers.len(), 8);
        assert_eq!(to_values(&layers, 24).unwrap(), values);
        // A layer missing from a checkpoint starts fresh.
        let mut fewer = layers.clone();
        fewer.remove("h.1.attn.proj");
        let back = to_values(&fewer, 24).unwrap();
        assert_eq!(back[15].scale, 1.0);
        assert!(back[15].history.iter().all(|&a| a == 0.0));
        assert_eq!(back[..15], values[..15]);
        assert!(to_layers(&values[..5]).is_err());
    }
}
