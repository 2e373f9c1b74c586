//! The one place a model is built from its config: whole (values drawn from the seed), or
//! declared without values (every variable an empty placeholder: the flat layout, the data
//! checks and a ZeRO-3 rank's own pieces need its shapes alone).

use candle_core::Device;

use crate::error::Result;
use crate::models::ModelConfig;
use crate::params::ParamBuilder;
use crate::precision::{Kernels, Precision};

use super::{Cnn, Gpt, Llama, Mlp, Model};

/// Builds the configured model with its variables in `kernels.param_dtype(precision)`,
/// in host memory.
pub fn build_model(
    model: &ModelConfig,
    precision: Precision,
    kernels: Kernels,
    seed: u64,
) -> Result<Box<dyn Model>> {
    build_model_on(model, precision, kernels, seed, &Device::Cpu)
}

/// [`build_model`] with its variables on `dev` (a GPU: the optimizer is offloaded to the
/// host, [`crate::offload`]).
pub fn build_model_on(
    model: &ModelConfig,
    precision: Precision,
    kernels: Kernels,
    seed: u64,
    dev: &Device,
) -> Result<Box<dyn Model>> {
    let dt = kernels.param_dtype(precision);
    Ok(match model {
        ModelConfig::Gpt(c) => Box::new(Gpt::new(c.clone(), dev, dt, seed)?),
        ModelConfig::Cnn(c) => Box::new(Cnn::new(*c, dev, dt, seed)?),
        ModelConfig::Mlp(c) => Box::new(Mlp::new(c.clone(), dev, dt, seed)?),
        ModelConfig::Llama(c) => Box::new(Llama::new(c.clone(), dev, dt, seed)?),
    })
}

/// The configured model declared without values (every variable an empty placeholder,
/// [`ParamBuilder::meta`]) on `dev`: its flat layout, and a ZeRO-3 rank's pieces of its
/// initial values ([`crate::params::ParamSet::init_pieces`]), without the whole model in
/// memory.
pub fn build_meta_model_on(
    model: &ModelConfig,
    precision: Precision,
    kernels: Kernels,
    seed: u64,
    dev: &Device,
) -> Result<Box<dyn Model>> {
    let dt = kernels.param_dtype(precision);
    model_with_builder(model, ParamBuilder::meta(dev.clone(), dt, seed))
}

/// The model `config` describes, its parameters from `b`.
pub(crate) fn model_with_builder(model: &ModelConfig, b: ParamBuilder) -> Result<Box<dyn Model>> {
    Ok(match model {
        ModelConfig::Gpt(c) => Box::new(Gpt::with_builder(c.clone(), b)?),
        ModelConfig::Cnn(c) => Box::new(Cnn::with_builder(*c, b)?),
        ModelConfig::Mlp(c) => Box::new(Mlp::with_builder(c.clone(), b)?),
        ModelConfig::Llama(c) => Box::new(Llama::with_builder(c.clone(), b)?),
    })
}

/// Bytes of `model`'s candle variables.
pub(crate) fn vars_bytes(model: &dyn Model) -> usize {
    model
        .params()
        .iter()
        .map(|p| p.var.elem_count() * p.var.dtype().size_in_bytes())
        .sum()
}
