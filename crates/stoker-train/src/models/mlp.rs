//! A multi-layer perceptron: flatten, then linear + ReLU layers, then the classifier.

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

use super::{LossKind, Model};
use crate::error::Result;
use crate::ops::linear;
use crate::params::{Init, ParamBuilder, ParamSet};
use crate::precision::Fx;

/// MLP size.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MlpConfig {
    /// Per-sample input shape (flattened).
    pub input_shape: Vec<usize>,
    /// Hidden layer widths.
    pub hidden: Vec<usize>,
    /// Number of classes.
    pub classes: usize,
}

/// The MLP model.
pub struct Mlp {
    config: MlpConfig,
    layers: Vec<[Tensor; 2]>,
    params: ParamSet,
}

impl Mlp {
    /// Declares the parameters (uniform(+-1/sqrt(fan_in))).
    pub fn new(config: MlpConfig, device: &Device, dtype: DType, seed: u64) -> Result<Self> {
        Self::with_builder(config, ParamBuilder::new(device.clone(), dtype, seed))
    }

    /// As [`Mlp::new`] with the values `b` gives (drawn, or a flat buffer's).
    pub fn with_builder(config: MlpConfig, mut b: ParamBuilder) -> Result<Self> {
        let mut widths = vec![config.input_shape.iter().product::<usize>()];
        widths.extend(&config.hidden);
        widths.push(config.classes);
        let mut layers = Vec::new();
        for (i, w) in widths.windows(2).enumerate() {
            b.set_group(i)?; // one group per layer, in execution order
            let bound = 1.0 / (w[0] as f32).sqrt();
            layers.push([
                b.param(
                    &format!("layers.{i}.weight"),
                    &[w[1], w[0]],
                    Init::Uniform(bound),
                )?
                .as_tensor()
                .clone(),
                b.param(&format!("layers.{i}.bias"), &[w[1]], Init::Uniform(bound))?
                    .as_tensor()
                    .clone(),
            ]);
        }
        Ok(Mlp {
            config,
            layers,
            params: b.finish(),
        })
    }
}

impl Model for Mlp {
    fn params(&self) -> &ParamSet {
        &self.params
    }

    /// One unit per layer; unit 0 takes `(B, ..input_shape)`, u8 (scaled to [0, 1]) or
    /// float; the last gives logits `(B, classes)`.
    fn units(&self) -> usize {
        self.layers.len()
    }

    fn unit_groups(&self, u: usize) -> Vec<usize> {
        vec![u]
    }

    fn unit_forward(&self, fx: &Fx, u: usize, x: &Tensor) -> Result<Tensor> {
        let x = match u {
            0 if x.dtype() == DType::U8 => (x.flatten_from(1)?.to_dtype(fx.high)? / 255.0)?,
            0 => x.flatten_from(1)?.to_dtype(fx.high)?,
            _ => x.clone(),
        };
        let [w, b] = self
            .layers
            .get(u)
            .ok_or_else(|| crate::error::TrainError::Model(format!("the MLP has no unit {u}")))?;
        let y = linear(fx, &format!("layers.{u}"), &x, w, Some(b))?;
        Ok(match u + 1 == self.layers.len() {
            true => y.to_dtype(fx.high)?,
            false => y.relu()?,
        })
    }

    fn loss_kind(&self) -> LossKind {
        LossKind::Sample
    }

    fn check_input(&self, shape: &[usize], _dtype: &str) -> std::result::Result<(), String> {
        check_vectors(&self.config, shape)
    }
}

/// Whether samples of per-sample `shape` fit an MLP of `config` ([`Model::check_input`]).
pub fn check_vectors(config: &MlpConfig, shape: &[usize]) -> std::result::Result<(), String> {
    if shape.iter().product::<usize>() != config.input_shape.iter().product::<usize>() {
        return Err(format!(
            "per-sample shape {shape:?}, model.input_shape is {:?}",
            config.input_shape
        ));
    }
    Ok(())
}
