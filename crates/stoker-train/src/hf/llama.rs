//! `LlamaForCausalLM` for the Llama: stoker's parameter names are transformers' without
//! the `model.` prefix (the head is `lm_head.weight` in both), weights are `[out, in]` in
//! both, and the rotary layout is transformers' (rotate-half), so export and import are
//! a rename: no transposes, no permutation of q and k.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::layout::FlatLayout;
use crate::model_files::ckpt_err;
use crate::models::LlamaConfig;

/// The `config.json` fields stoker writes and checks (transformers' `LlamaConfig`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LlamaHfConfig {
    /// `["LlamaForCausalLM"]`.
    #[serde(default)]
    pub architectures: Vec<String>,
    /// `llama`.
    pub model_type: String,
    /// Vocabulary.
    pub vocab_size: usize,
    /// Width.
    pub hidden_size: usize,
    /// SwiGLU's inner width.
    pub intermediate_size: usize,
    /// Blocks.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (absent: as many as the query heads).
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Longest window.
    pub max_position_embeddings: usize,
    /// RMSNorm's epsilon.
    pub rms_norm_eps: f64,
    /// Rotary base, where the file keeps it at the top (transformers 4).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    /// Rotary settings (transformers 5 keeps the base here: `rope_theta`, with
    /// `rope_type` "default"); read where present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_parameters: Option<serde_json::Value>,
    /// A scaled rotary variant (Llama 3.1's `llama3`, YaRN): stoker has none, so it must
    /// be absent or null.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<serde_json::Value>,
    /// `silu` (SwiGLU's gate).
    pub hidden_act: String,
    /// The head is its own matrix.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// No biases in the attention projections.
    #[serde(default)]
    pub attention_bias: bool,
    /// No biases in the MLP.
    #[serde(default)]
    pub mlp_bias: bool,
    /// The beginning-of-text token (the vocabulary's end-of-text token, or null).
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    /// The end-of-text token, as `bos_token_id`.
    #[serde(default)]
    pub eos_token_id: Option<u32>,
}

impl LlamaHfConfig {
    /// transformers' config for `c`, whose vocabulary's end-of-text token is
    /// `end_of_text`. The rotary base is written both ways, so transformers 4 and 5 read it.
    pub fn of(c: &LlamaConfig, end_of_text: Option<u32>) -> Self {
        let d = c.dims();
        LlamaHfConfig {
            architectures: vec!["LlamaForCausalLM".into()],
            model_type: "llama".into(),
            vocab_size: d.vocab,
            hidden_size: d.d_model,
            intermediate_size: d.ffn_hidden,
            num_hidden_layers: d.n_layer,
            num_attention_heads: d.n_head,
            num_key_value_heads: Some(d.n_kv_head),
            max_position_embeddings: d.context,
            rms_norm_eps: c.norm_eps,
            rope_theta: Some(c.rope_theta),
            rope_parameters: Some(serde_json::json!({
                "rope_type": "default",
                "rope_theta": c.rope_theta,
            })),
            rope_scaling: None,
            hidden_act: "silu".into(),
            tie_word_embeddings: false,
            attention_bias: false,
            mlp_bias: false,
            bos_token_id: end_of_text,
            eos_token_id: end_of_text,
        }
    }

    /// The rotary base, from `rope_parameters` or the top-level `rope_theta` (default
    /// 10,000, transformers' own).
    pub fn base(&self) -> f64 {
        self.rope_parameters
            .as_ref()
            .and_then(|p| p.get("rope_theta"))
            .and_then(|v| v.as_f64())
            .or(self.rope_theta)
            .unwrap_or(10_000.0)
    }
}

/// transformers' name for stoker's Llama parameter `name`.
pub fn hf_name(name: &str) -> String {
    match name {
        "lm_head.weight" => name.to_string(),
        _ => format!("model.{name}"),
    }
}

/// Writes the Llama `config`'s weights `master` (laid out by `layout`) as a
/// `LlamaForCausalLM` directory `out`.
pub fn export(
    config: &LlamaConfig,
    layout: &FlatLayout,
    master: &[f32],
    end_of_text: Option<u32>,
    out: &Path,
) -> Result<PathBuf> {
    let tensors: Vec<(String, Vec<usize>, Vec<f32>)> = layout
        .slots()
        .iter()
        .map(|s| {
            let x = master[s.offset..s.offset + s.len].to_vec();
            (hf_name(&s.name), s.shape.clone(), x)
        })
        .collect();
    super::write_dir(out, &tensors, &LlamaHfConfig::of(config, end_of_text))
}

/// Reads the `LlamaForCausalLM` directory `dir` into a flat buffer laid out by `layout`
/// for the Llama `config`; errors name the file and the key or tensor that does not fit.
pub fn import(config: &LlamaConfig, layout: &FlatLayout, dir: &Path) -> Result<Vec<f32>> {
    let (hf, cp): (LlamaHfConfig, _) = super::read_config(dir)?;
    let want = LlamaHfConfig::of(config, None);
    let sizes = [
        ("vocab_size", hf.vocab_size, want.vocab_size),
        ("hidden_size", hf.hidden_size, want.hidden_size),
        (
            "intermediate_size",
            hf.intermediate_size,
            want.intermediate_size,
        ),
        (
            "num_hidden_layers",
            hf.num_hidden_layers,
            want.num_hidden_layers,
        ),
        (
            "num_attention_heads",
            hf.num_attention_heads,
            want.num_attention_heads,
        ),
        (
            "num_key_value_heads",
            hf.num_key_value_heads.unwrap_or(hf.num_attention_heads),
            config.dims().n_kv_head,
        ),
        (
            "max_position_embeddings",
            hf.max_position_embeddings,
            want.max_position_embeddings,
        ),
    ];
    let mut wrong: Vec<String> = sizes
        .iter()
        .filter(|(_, got, expected)| got != expected)
        .map(|(key, got, expected)| {
            format!("`{key}` is {got}, the [model] config needs {expected}")
        })
        .collect();
    for (key, got, expected) in [
        ("model_type", hf.model_type.as_str(), "llama"),
        ("hidden_act", hf.hidden_act.as_str(), "silu"),
    ] {
        if got != expected {
            wrong.push(format!(
                "`{key}` is {got:?}, stoker's Llama has {expected:?}"
            ));
        }
    }
    if (hf.base() - config.rope_theta).abs() > 1e-9 * config.rope_theta {
        wrong.push(format!(
            "the rotary base (`rope_theta`) is {}, the [model] config has {} (model.rope_theta)",
            hf.base(),
            config.rope_theta
        ));
    }
    if (hf.rms_norm_eps - config.norm_eps).abs() > 1e-12 {
        wrong.push(format!(
            "`rms_norm_eps` is {}, the [model] config has {} (model.norm_eps)",
            hf.rms_norm_eps, config.norm_eps
        ));
    }
    if hf.rope_scaling.as_ref().is_some_and(|v| !v.is_null()) {
        wrong.push("`rope_scaling` is set: stoker's Llama has plain rotary embeddings".into());
    }
    // transformers 5 writes a scaled variant here (`llama3`, `yarn`, ...).
    let rope_type = hf
        .rope_parameters
        .as_ref()
        .and_then(|p| p.get("rope_type"))
        .filter(|t| !t.is_null());
    if let Some(t) = rope_type.filter(|t| t.as_str() != Some("default")) {
        wrong.push(format!(
            "`rope_parameters.rope_type` is {t}: stoker's Llama has plain rotary embeddings (\"default\")"
        ));
    }
    if hf.tie_word_embeddings || hf.attention_bias || hf.mlp_bias {
        wrong.push(format!(
            "`tie_word_embeddings` {}, `attention_bias` {}, `mlp_bias` {}: stoker's Llama has false for all",
            hf.tie_word_embeddings, hf.attention_bias, hf.mlp_bias
        ));
    }
    if let Some(first) = wrong.into_iter().next() {
        return Err(ckpt_err(&cp, first));
    }
    super::read_weights(
        dir,
        layout,
        "model",
        |s| super::Wanted {
            name: hf_name(&s.name),
            shape: s.shape.clone(),
        },
        |_, x| x,
    )
}
