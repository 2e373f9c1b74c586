//! A small CNN for MNIST / Fashion-MNIST: two 3x3 conv + ReLU + 2x2 max-pool stages, then
//! a hidden linear layer and the classifier. Convolutions run in f32 under bf16 / f16
//! (candle's bf16 conv2d fails on CPU); the linear layers follow the compute dtype.

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

use super::{LossKind, Model};
use crate::error::Result;
use crate::ops::{linear, max_pool2x2};
use crate::params::{Init, ParamBuilder, ParamSet};
use crate::precision::Fx;

/// CNN size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CnnConfig {
    /// Input channels (1 for MNIST).
    pub in_channels: usize,
    /// Input height and width (28 for MNIST; must be divisible by 4).
    pub image_size: usize,
    /// Channels of the first conv stage.
    pub channels1: usize,
    /// Channels of the second conv stage.
    pub channels2: usize,
    /// Width of the hidden linear layer.
    pub hidden: usize,
    /// Number of classes.
    pub classes: usize,
}

/// The CNN model.
pub struct Cnn {
    config: CnnConfig,
    conv1: [Tensor; 2],
    conv2: [Tensor; 2],
    fc1: [Tensor; 2],
    fc2: [Tensor; 2],
    params: ParamSet,
}

/// Pixel normalization for 8-bit images: (x / 255 - mean) / std, MNIST's statistics.
const MEAN: f64 = 0.1307;
const STD: f64 = 0.3081;

impl Cnn {
    /// Declares the parameters (torch's default uniform(+-1/sqrt(fan_in)) init).
    pub fn new(config: CnnConfig, device: &Device, dtype: DType, seed: u64) -> Result<Self> {
        Self::with_builder(config, ParamBuilder::new(device.clone(), dtype, seed))
    }

    /// As [`Cnn::new`] with the values `b` gives (drawn, or a flat buffer's).
    pub fn with_builder(config: CnnConfig, mut b: ParamBuilder) -> Result<Self> {
        let c = &config;
        // One group per layer, in execution order.
        let mut group = 0;
        let mut layer = |name: &str, shape: &[usize]| -> Result<[Tensor; 2]> {
            b.set_group(group)?;
            group += 1;
            let fan_in: usize = shape[1..].iter().product();
            let bound = 1.0 / (fan_in as f32).sqrt();
            Ok([
                b.param(&format!("{name}.weight"), shape, Init::Uniform(bound))?
                    .as_tensor()
                    .clone(),
                b.param(&format!("{name}.bias"), &[shape[0]], Init::Uniform(bound))?
                    .as_tensor()
                    .clone(),
            ])
        };
        let conv1 = layer("conv1", &[c.channels1, c.in_channels, 3, 3])?;
        let conv2 = layer("conv2", &[c.channels2, c.channels1, 3, 3])?;
        let flat = c.channels2 * (c.image_size / 4) * (c.image_size / 4);
        let fc1 = layer("fc1", &[c.hidden, flat])?;
        let fc2 = layer("fc2", &[c.classes, c.hidden])?;
        Ok(Cnn {
            config,
            conv1,
            conv2,
            fc1,
            fc2,
            params: b.finish(),
        })
    }

    fn conv_stage(fx: &Fx, x: &Tensor, p: &[Tensor; 2]) -> Result<Tensor> {
        let w = p[0].to_dtype(fx.high)?;
        let b = p[1].to_dtype(fx.high)?.reshape((1, (), 1, 1))?;
        let y = x.conv2d(&w, 1, 1, 1, 1)?.broadcast_add(&b)?.relu()?;
        max_pool2x2(&y)
    }
}

impl Model for Cnn {
    fn params(&self) -> &ParamSet {
        &self.params
    }

    /// Four units, one per layer: conv1 (from images `(B, C, H, W)`, u8 normalized here,
    /// or float), conv2, fc1, fc2 (logits `(B, classes)`).
    fn units(&self) -> usize {
        4
    }

    fn unit_groups(&self, u: usize) -> Vec<usize> {
        vec![u]
    }

    fn unit_forward(&self, fx: &Fx, u: usize, x: &Tensor) -> Result<Tensor> {
        Ok(match u {
            0 => {
                let x = if x.dtype() == DType::U8 {
                    ((x.to_dtype(fx.high)? / 255.0)? - MEAN)? / STD
                } else {
                    x.to_dtype(fx.high)
                }?;
                Self::conv_stage(fx, &x, &self.conv1)?
            }
            1 => Self::conv_stage(fx, x, &self.conv2)?,
            2 => linear(
                fx,
                "fc1",
                &x.flatten_from(1)?,
                &self.fc1[0],
                Some(&self.fc1[1]),
            )?
            .relu()?,
            3 => linear(fx, "fc2", x, &self.fc2[0], Some(&self.fc2[1]))?.to_dtype(fx.high)?,
            _ => {
                return Err(crate::error::TrainError::Model(format!(
                    "the CNN has no unit {u}"
                )))
            }
        })
    }

    fn loss_kind(&self) -> LossKind {
        LossKind::Sample
    }

    fn check_input(&self, shape: &[usize], _dtype: &str) -> std::result::Result<(), String> {
        check_images(&self.config, shape)
    }
}

/// Whether images of per-sample `shape` fit a CNN of `config` ([`Model::check_input`]).
pub fn check_images(c: &CnnConfig, shape: &[usize]) -> std::result::Result<(), String> {
    let want = [c.in_channels, c.image_size, c.image_size];
    if shape != want {
        return Err(format!(
            "images of per-sample shape {shape:?}, the CNN expects {want:?} (model.in_channels, model.image_size)"
        ));
    }
    Ok(())
}
