//! `[model]`: which model a run trains and its sizes, tagged by `kind`. The one place a
//! model's config is defined; [`super::factory`] builds the model from it.

use serde::{Deserialize, Serialize};

use super::{CnnConfig, GptConfig, LlamaConfig, MlpConfig};

/// `[model]`, tagged by `kind`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum ModelConfig {
    /// GPT (token model).
    Gpt(GptConfig),
    /// Llama (token model).
    Llama(LlamaConfig),
    /// CNN (image classifier).
    Cnn(CnnConfig),
    /// MLP (classifier).
    Mlp(MlpConfig),
}

impl ModelConfig {
    /// Checks the sizes (a training config's `[model]`, or the table a checkpoint
    /// records); the error names the key under `model.`.
    pub fn validate(&self) -> std::result::Result<(), (&'static str, String)> {
        match self {
            ModelConfig::Gpt(g) => g.validate(),
            ModelConfig::Llama(l) => l.validate(),
            ModelConfig::Cnn(c) if c.image_size % 4 != 0 || c.image_size == 0 => Err((
                "image_size",
                format!(
                    "{}: must be a positive multiple of 4 (two 2x2 pools)",
                    c.image_size
                ),
            )),
            ModelConfig::Cnn(_) | ModelConfig::Mlp(_) => Ok(()),
        }
    }

    /// The token window a token model reads (the GPT's or Llama's context); None for
    /// classifiers.
    pub fn context(&self) -> Option<usize> {
        match self {
            ModelConfig::Gpt(g) => Some(g.context),
            ModelConfig::Llama(l) => Some(l.context),
            ModelConfig::Cnn(_) | ModelConfig::Mlp(_) => None,
        }
    }

    /// The vocabulary a token model predicts over; None for classifiers.
    pub fn vocab(&self) -> Option<usize> {
        match self {
            ModelConfig::Gpt(g) => Some(g.vocab),
            ModelConfig::Llama(l) => Some(l.vocab),
            ModelConfig::Cnn(_) | ModelConfig::Mlp(_) => None,
        }
    }

    /// The classes a classifier predicts over; None for token models.
    pub fn classes(&self) -> Option<usize> {
        match self {
            ModelConfig::Cnn(c) => Some(c.classes),
            ModelConfig::Mlp(m) => Some(m.classes),
            ModelConfig::Gpt(_) | ModelConfig::Llama(_) => None,
        }
    }

    /// The table as a checkpoint records it: the defaults a key left out stands for
    /// filled in (Llama's `n_kv_head` and `ffn_hidden`), and `init_from` left out (where
    /// the first weights came from is no part of the model a resume continues).
    pub fn resolved(&self) -> ModelConfig {
        match self {
            ModelConfig::Gpt(g) => ModelConfig::Gpt(super::GptConfig {
                init_from: None,
                ..g.clone()
            }),
            ModelConfig::Llama(l) => {
                let d = l.dims();
                ModelConfig::Llama(super::LlamaConfig {
                    n_kv_head: Some(d.n_kv_head),
                    ffn_hidden: Some(d.ffn_hidden),
                    init_from: None,
                    ..l.clone()
                })
            }
            ModelConfig::Cnn(_) | ModelConfig::Mlp(_) => self.clone(),
        }
    }

    /// The Hugging Face directory a token model starts from (`init_from`), if any.
    pub fn init_from(&self) -> Option<&std::path::Path> {
        match self {
            ModelConfig::Gpt(g) => g.init_from.as_deref(),
            ModelConfig::Llama(l) => l.init_from.as_deref(),
            ModelConfig::Cnn(_) | ModelConfig::Mlp(_) => None,
        }
    }
}
