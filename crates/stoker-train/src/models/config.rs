//! `[model]`: which model a run trains and its sizes, tagged by `kind`. The one place a
//! model's config is defined; [`super::factory`] builds the model from it.

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize};

use super::{CnnConfig, GptConfig, LlamaConfig, MlpConfig};

/// `[model]`, tagged by `kind`. Read by hand ([`ModelConfig::deserialize`]) so that an
/// error names its key: serde's tagged enums buffer the table and lose it, and a TOML
/// file's error pointed at the `[model]` header with no key ("invalid value: integer
/// `-1`, expected usize").
#[derive(Debug, Clone, PartialEq, Serialize)]
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

/// The `kind`s `[model]` takes.
const KINDS: &[&str] = &["gpt", "llama", "cnn", "mlp"];

impl<'de> Deserialize<'de> for ModelConfig {
    /// The table's `kind`, then its other keys as that model's config; an error in them
    /// names the key (`model.n_head: invalid value: integer `-1`, expected usize`).
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let mut table = toml::Table::deserialize(d)?;
        let kind = match table.remove("kind") {
            Some(toml::Value::String(k)) if KINDS.contains(&k.as_str()) => k,
            Some(other) => {
                return Err(D::Error::custom(format!(
                    "model.kind: {other}, expected one of `gpt`, `llama`, `cnn`, `mlp`"
                )))
            }
            None => {
                return Err(D::Error::custom(
                    "model.kind: missing, expected one of `gpt`, `llama`, `cnn`, `mlp`",
                ))
            }
        };
        let body = toml::Value::Table(table);
        let read = match kind.as_str() {
            "gpt" => body.try_into().map(ModelConfig::Gpt),
            "llama" => body.try_into().map(ModelConfig::Llama),
            "cnn" => body.try_into().map(ModelConfig::Cnn),
            _ => body.try_into().map(ModelConfig::Mlp),
        };
        read.map_err(|e| D::Error::custom(keyed(&e.to_string())))
    }
}

/// toml's "MESSAGE\nin `KEY`\n" as "model.KEY: MESSAGE", on one line.
fn keyed(message: &str) -> String {
    let message = message.trim_end();
    match message.rsplit_once("\nin `") {
        Some((what, key)) => format!("model.{}: {what}", key.trim_end_matches('`')),
        None => format!("model: {message}"),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A document holding `[model]`, as a training config does.
    #[derive(Debug, Deserialize)]
    struct Doc {
        model: ModelConfig,
    }

    fn error_of(table: &str) -> String {
        toml::from_str::<Doc>(table)
            .unwrap_err()
            .message()
            .to_string()
    }

    /// Every error in `[model]` names its key (before, a bad value pointed at the table's
    /// header alone), and a good table reads as the derived reading did.
    #[test]
    fn a_bad_model_key_is_named() {
        let gpt = "[model]\nkind = \"gpt\"\nvocab = 24\ncontext = 16\nd_model = 32\n\
                   n_layer = 2\nn_head = 4\n";
        for (text, want) in [
            (
                gpt.replace("n_head = 4", "n_head = -1"),
                "model.n_head: invalid value: integer `-1`, expected usize",
            ),
            (
                gpt.replace("vocab = 24", "vocab = \"x\""),
                "model.vocab: invalid type: string \"x\", expected usize",
            ),
            (
                gpt.replace("n_layer = 2", "n_layers = 2"),
                "model: unknown field `n_layers`, expected one of `vocab`, `context`, \
                 `d_model`, `n_layer`, `n_head`, `init_from`",
            ),
            (
                gpt.replace("kind = \"gpt\"", "kind = \"gtp\""),
                "model.kind: \"gtp\", expected one of `gpt`, `llama`, `cnn`, `mlp`",
            ),
            (
                gpt.replace("kind = \"gpt\"\n", ""),
                "model.kind: missing, expected one of `gpt`, `llama`, `cnn`, `mlp`",
            ),
            (
                gpt.replace("kind = \"gpt\"", "kind = 3"),
                "model.kind: 3, expected one of `gpt`, `llama`, `cnn`, `mlp`",
            ),
        ] {
            assert_eq!(error_of(&text), want, "{text}");
        }
        let good = toml::from_str::<Doc>(gpt).unwrap().model;
        let again: ModelConfig = toml::from_str(&toml::to_string(&good).unwrap()).unwrap();
        assert_eq!(good, again);
        let json: ModelConfig =
            serde_json::from_str(&serde_json::to_string(&good).unwrap()).unwrap();
        assert_eq!(good, json);
    }
}
