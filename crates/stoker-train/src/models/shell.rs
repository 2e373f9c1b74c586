//! A ZeRO-3 rank's stand-in for its candle model: the rank keeps only its shard of the
//! parameters, so it keeps no full-size candle variables either. The shell answers what
//! the run needs of a model without its weights (which inputs fit, which loss); a forward
//! needs the parameters gathered into a full model first (the trainer's step, evaluation
//! and sampling do that).

use candle_core::Tensor;

use crate::config::ModelConfig;
use crate::error::{Result, TrainError};
use crate::params::ParamSet;
use crate::precision::Fx;

use super::{LossKind, Model};

fn sharded() -> TrainError {
    TrainError::Layout(
        "the parameters are sharded over the ranks (zero3): gather them into a full model first"
            .into(),
    )
}

/// A model without variables.
pub struct Shell {
    config: ModelConfig,
    params: ParamSet,
}

impl Shell {
    /// The shell of the model `config` describes.
    pub fn new(config: ModelConfig) -> Self {
        Shell {
            config,
            params: ParamSet::default(),
        }
    }
}

impl Model for Shell {
    fn params(&self) -> &ParamSet {
        &self.params
    }

    fn forward(&self, _fx: &Fx, _input: &Tensor) -> Result<Tensor> {
        Err(sharded())
    }

    /// None: a shell has no parameters to run.
    fn units(&self) -> usize {
        0
    }

    fn unit_groups(&self, _u: usize) -> Vec<usize> {
        Vec::new()
    }

    fn unit_forward(&self, _fx: &Fx, _u: usize, _x: &Tensor) -> Result<Tensor> {
        Err(sharded())
    }

    fn loss_kind(&self) -> LossKind {
        match self.config {
            ModelConfig::Gpt(_) => LossKind::Token,
            ModelConfig::Cnn(_) | ModelConfig::Mlp(_) => LossKind::Sample,
        }
    }

    fn check_input(&self, shape: &[usize], dtype: &str) -> std::result::Result<(), String> {
        match &self.config {
            ModelConfig::Gpt(c) => super::gpt::check_tokens(c, shape, dtype),
            ModelConfig::Cnn(c) => super::cnn::check_images(c, shape),
            ModelConfig::Mlp(c) => super::mlp::check_vectors(c, shape),
        }
    }
}
