//! GPT-2 for the GPT: stoker's GPT is GPT-2's architecture (learned
//! positions, pre-LayerNorm with eps 1e-5, tanh GELU, packed QKV split as q | k | v and
//! then by head, LM head tied to the token embedding), so its weights are a GPT-2
//! checkpoint under other names. [`export`] writes `model.safetensors` with
//! `GPT2LMHeadModel`'s tensor names and a `config.json` that
//! `transformers.GPT2LMHeadModel.from_pretrained` loads; [`import`] reads such a
//! directory back into a flat buffer (`[model] init_from`).
//!
//! Names: `wte.weight` <-> `transformer.wte.weight`, `h.L.attn.qkv` <->
//! `transformer.h.L.attn.c_attn`, `attn.proj` <-> `attn.c_proj`, `mlp.fc` <-> `mlp.c_fc`,
//! `mlp.proj` <-> `mlp.c_proj`, LayerNorms keep their names under `transformer.`. GPT-2's
//! linear layers are `Conv1D`s whose weights are `[in, out]`, the transpose of stoker's
//! `[out, in]`. The tied `lm_head.weight` is not written (transformers ties it on load).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::layout::FlatLayout;
use crate::model_files::ckpt_err;
use crate::models::GptConfig;

/// The LayerNorm epsilon of stoker's GPT and of GPT-2.
const LN_EPS: f64 = 1e-5;

/// The `config.json` fields stoker writes and checks (transformers' `GPT2Config`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Gpt2Config {
    /// `["GPT2LMHeadModel"]`.
    #[serde(default)]
    pub architectures: Vec<String>,
    /// `gpt2`.
    pub model_type: String,
    /// Vocabulary.
    pub vocab_size: usize,
    /// Positions.
    pub n_positions: usize,
    /// Width.
    pub n_embd: usize,
    /// Blocks.
    pub n_layer: usize,
    /// Heads.
    pub n_head: usize,
    /// MLP width (`None`: 4 x width).
    #[serde(default)]
    pub n_inner: Option<usize>,
    /// `gelu_new` (tanh approximation).
    pub activation_function: String,
    /// LayerNorm epsilon.
    pub layer_norm_epsilon: f64,
    /// The LM head shares the token embedding.
    #[serde(default = "yes")]
    pub tie_word_embeddings: bool,
    /// Scores scaled by 1/sqrt(head dim).
    #[serde(default = "yes")]
    pub scale_attn_weights: bool,
    /// Scores also divided by the block's number plus one (Stanford CRFM's GPT-2s): not
    /// stoker's attention, so it must be false. Written only where true.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub scale_attn_by_inverse_layer_idx: bool,
    /// Dropouts (0 for stoker's model).
    #[serde(default)]
    pub resid_pdrop: f64,
    /// Embedding dropout.
    #[serde(default)]
    pub embd_pdrop: f64,
    /// Attention dropout.
    #[serde(default)]
    pub attn_pdrop: f64,
    /// The beginning-of-text token: GPT-2's end-of-text token where the vocabulary is
    /// GPT-2's BPE, else null (a character vocabulary has none; transformers' default,
    /// 50256, would lie outside a small vocabulary).
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    /// The end-of-text token, as `bos_token_id`.
    #[serde(default)]
    pub eos_token_id: Option<u32>,
}

fn yes() -> bool {
    true
}

impl Gpt2Config {
    /// GPT-2's config for `c`, whose vocabulary's end-of-text token is `end_of_text`.
    pub fn of(c: &GptConfig, end_of_text: Option<u32>) -> Self {
        Gpt2Config {
            architectures: vec!["GPT2LMHeadModel".into()],
            model_type: "gpt2".into(),
            vocab_size: c.vocab,
            n_positions: c.context,
            n_embd: c.d_model,
            n_layer: c.n_layer,
            n_head: c.n_head,
            n_inner: None,
            activation_function: "gelu_new".into(),
            layer_norm_epsilon: LN_EPS,
            tie_word_embeddings: true,
            scale_attn_weights: true,
            scale_attn_by_inverse_layer_idx: false,
            resid_pdrop: 0.0,
            embd_pdrop: 0.0,
            attn_pdrop: 0.0,
            bos_token_id: end_of_text,
            eos_token_id: end_of_text,
        }
    }
}

/// GPT-2's name for stoker's parameter `name`, and whether the weight is transposed.
pub fn gpt2_name(name: &str) -> (String, bool) {
    let renamed = name
        .replace(".attn.qkv.", ".attn.c_attn.")
        .replace(".attn.proj.", ".attn.c_proj.")
        .replace(".mlp.fc.", ".mlp.c_fc.")
        .replace(".mlp.proj.", ".mlp.c_proj.");
    let conv = renamed.contains(".c_") && renamed.ends_with(".weight");
    (format!("transformer.{renamed}"), conv)
}

/// `[rows, cols]` row-major to `[cols, rows]`.
fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = x[r * cols + c];
        }
    }
    out
}

/// Writes the GPT `config`'s weights `master` (laid out by `layout`) as a Hugging Face
/// GPT-2 directory `out`: `model.safetensors` and `config.json` (its bos and eos tokens
/// `end_of_text`, the vocabulary's: `stoker_data::pack::text::Vocab::end_of_text`).
pub fn export(
    config: &GptConfig,
    layout: &FlatLayout,
    master: &[f32],
    end_of_text: Option<u32>,
    out: &Path,
) -> Result<PathBuf> {
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    for s in layout.slots() {
        let (name, conv) = gpt2_name(&s.name);
        let x = &master[s.offset..s.offset + s.len];
        let (shape, data) = match conv {
            true => (
                vec![s.shape[1], s.shape[0]],
                transpose(x, s.shape[0], s.shape[1]),
            ),
            false => (s.shape.clone(), x.to_vec()),
        };
        tensors.push((name, shape, data));
    }
    super::write_dir(out, &tensors, &Gpt2Config::of(config, end_of_text))
}

/// Reads the Hugging Face GPT-2 directory `dir` into a flat buffer laid out by `layout`
/// for the GPT `config`; errors name the file and the key or tensor that does not fit.
pub fn import(config: &GptConfig, layout: &FlatLayout, dir: &Path) -> Result<Vec<f32>> {
    let (hf, cp): (Gpt2Config, _) = super::read_config(dir)?;
    let want = Gpt2Config::of(config, None);
    let checks: [(&str, String, String); 8] = [
        ("model_type", hf.model_type.clone(), want.model_type.clone()),
        (
            "vocab_size",
            hf.vocab_size.to_string(),
            want.vocab_size.to_string(),
        ),
        (
            "n_positions",
            hf.n_positions.to_string(),
            want.n_positions.to_string(),
        ),
        ("n_embd", hf.n_embd.to_string(), want.n_embd.to_string()),
        ("n_layer", hf.n_layer.to_string(), want.n_layer.to_string()),
        ("n_head", hf.n_head.to_string(), want.n_head.to_string()),
        (
            "n_inner",
            hf.n_inner.unwrap_or(4 * hf.n_embd).to_string(),
            (4 * want.n_embd).to_string(),
        ),
        (
            "activation_function",
            hf.activation_function.clone(),
            want.activation_function.clone(),
        ),
    ];
    for (key, got, expected) in checks {
        if got != expected {
            return Err(ckpt_err(
                &cp,
                format!("`{key}` is {got}, the [model] config needs {expected}"),
            ));
        }
    }
    if (hf.layer_norm_epsilon - LN_EPS).abs() > 1e-12
        || !hf.tie_word_embeddings
        || !hf.scale_attn_weights
    {
        return Err(ckpt_err(
            &cp,
            format!(
                "`layer_norm_epsilon` {}, `tie_word_embeddings` {}, `scale_attn_weights` {}: stoker's GPT has 1e-5, true, true",
                hf.layer_norm_epsilon, hf.tie_word_embeddings, hf.scale_attn_weights
            ),
        ));
    }
    if hf.scale_attn_by_inverse_layer_idx {
        return Err(ckpt_err(
            &cp,
            "`scale_attn_by_inverse_layer_idx` is true: stoker's GPT scales scores by \
             1/sqrt(head dim) alone",
        ));
    }
    super::read_weights(
        dir,
        layout,
        "transformer",
        |s| {
            let (name, conv) = gpt2_name(&s.name);
            let shape = match conv {
                true => vec![s.shape[1], s.shape[0]],
                false => s.shape.clone(),
            };
            super::Wanted { name, shape }
        },
        |s, x| match gpt2_name(&s.name).1 {
            true => transpose(&x, s.shape[1], s.shape[0]),
            false => x,
        },
    )
}
