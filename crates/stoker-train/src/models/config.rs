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

    /// The Hugging Face directory a token model starts from (`init_from`), if any.
    pub fn init_from(&self) -> Option<&std::path::Path> {
        match self {
            ModelConfig::Gpt(g) => g.init_from.as_deref(),
            ModelConfig::Llama(l) => l.init_from.as_deref(),
            ModelConfig::Cnn(_) | ModelConfig::Mlp(_) => None,
        }
    }
}
