//! The resident steps' FP8 scalers as the CPU trainer keeps them: by layer, named as the
//! CPU models name their linear layers (`h.0.attn.qkv`, `layers.0.self_attn.q_proj`,
//! ...), three scalers each (input, weight, output gradient), so that a checkpoint holds
//! them the same way on either path. The steps keep them in their own order
//! (`stoker_gpu::step::gpt`: four layers a block; `llama`: seven; three scalers a
//! layer); this is the one place that maps the two.
//!
//! The CPU's simulation also casts the tied head (`lm_head`); the resident step keeps it
//! in bf16, as Transformer Engine does, so its scalers are not carried across.

use std::collections::BTreeMap;

use stoker_gpu::fp8::ScalerValues;
use stoker_precision::{DelayedScaler, DelayedScalingConfig, TensorRole};

use crate::error::{Result, TrainError};
use crate::precision::LayerScalers;

/// The GPT step's linear layers in a block, in its order, as the CPU model names them.
const GPT_LAYERS: [&str; 4] = ["attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"];

/// The Llama step's, likewise.
const LLAMA_LAYERS: [&str; 7] = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
];

/// How a model's CPU twin names the resident step's FP8 layers: its blocks' prefix and
/// each block's layers in the step's order.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fp8Names {
    prefix: &'static str,
    layers: &'static [&'static str],
}

impl Fp8Names {
    /// The names for `model`'s resident step; None for a model without one.
    pub(crate) fn of(model: &crate::models::ModelConfig) -> Option<Self> {
        use crate::models::ModelConfig;
        match model {
            ModelConfig::Gpt(_) => Some(Fp8Names {
                prefix: "h",
                layers: &GPT_LAYERS,
            }),
            ModelConfig::Llama(_) => Some(Fp8Names {
                prefix: "layers",
                layers: &LLAMA_LAYERS,
            }),
            _ => None,
        }
    }

    /// The step's `l`-th FP8 layer's name.
    fn layer(&self, l: usize) -> String {
        let n = self.layers.len();
        format!("{}.{}.{}", self.prefix, l / n, self.layers[l % n])
    }
}

/// A layer's three scalers' roles: input, weight (E4M3), output gradient (E5M2).
const ROLES: [TensorRole; 3] = [
    TensorRole::Forward,
    TensorRole::Forward,
    TensorRole::Backward,
];

fn state_err(e: impl std::fmt::Display) -> TrainError {
    TrainError::Strategy(format!("the resident step's FP8 scalers: {e}"))
}

/// The step's scalers' values as the CPU trainer's layers (TE's default recipe, as both
/// sides make them).
pub(crate) fn to_layers(
    values: &[ScalerValues],
    names: Fp8Names,
) -> Result<BTreeMap<String, LayerScalers>> {
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
            Ok((names.layer(l), [scaler(0)?, scaler(1)?, scaler(2)?]))
        })
        .collect()
}

/// The CPU trainer's layers as the step's `count` scalers' values: a layer the map does
/// not hold (a checkpoint from before, or from the CPU's path without it) starts as a
/// new scaler does (scale 1, an empty history).
pub(crate) fn to_values(
    layers: &BTreeMap<String, LayerScalers>,
    count: usize,
    names: Fp8Names,
) -> Result<Vec<ScalerValues>> {
    let cfg = DelayedScalingConfig::default();
    let value = |s: &DelayedScaler| ScalerValues {
        scale: s.scale(),
        scale_inv: s.scale_inv(),
        history: s.history(),
    };
    let mut out = Vec::with_capacity(count);
    for l in 0..count / ROLES.len() {
        match layers.get(&names.layer(l)) {
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

    const GPT: Fp8Names = Fp8Names {
        prefix: "h",
        layers: &GPT_LAYERS,
    };

    #[test]
    fn layers_are_named_as_the_cpu_model_names_them_and_round_trip() {
        assert_eq!(GPT.layer(0), "h.0.attn.qkv");
        assert_eq!(GPT.layer(3), "h.0.mlp.proj");
        assert_eq!(GPT.layer(6), "h.1.mlp.fc");
        let llama = Fp8Names {
            prefix: "layers",
            layers: &LLAMA_LAYERS,
        };
        assert_eq!(llama.layer(1), "layers.0.self_attn.k_proj");
        assert_eq!(llama.layer(13), "layers.1.mlp.down_proj");
        let values: Vec<ScalerValues> = (0..24)
            .map(|k| ScalerValues {
                scale: 1.0 + k as f32,
                scale_inv: 1.0 / (1.0 + k as f32),
                history: (0..1024).map(|j| (j * k) as f32).collect(),
            })
            .collect();
        let layers = to_layers(&values, GPT).unwrap();
        assert_eq!(layers.len(), 8);
        assert_eq!(to_values(&layers, 24, GPT).unwrap(), values);
        // A layer missing from a checkpoint starts fresh.
        let mut fewer = layers.clone();
        fewer.remove("h.1.attn.proj");
        let back = to_values(&fewer, 24, GPT).unwrap();
        assert_eq!(back[15].scale, 1.0);
        assert!(back[15].history.iter().all(|&a| a == 0.0));
        assert_eq!(back[..15], values[..15]);
        assert!(to_layers(&values[..5], GPT).is_err());
    }
}
