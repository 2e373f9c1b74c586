//! Hugging Face interop: a trained model as a `transformers` directory (`config.json` +
//! `model.safetensors`) and back. The GPT is GPT-2 ([`gpt2`]: `GPT2LMHeadModel`), the
//! Llama is `LlamaForCausalLM` ([`llama`]). [`export`] and [`import`] pick by the
//! model's kind; CNNs and MLPs have no such form.

pub mod gpt2;
pub mod llama;
mod weights;

use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype as StDtype, TensorView};

pub(crate) use weights::{read_weights, Wanted};

use crate::error::{config_err, io_err, Result};
use crate::layout::FlatLayout;
use crate::model_files::{ckpt_err, write_synced};
use crate::models::ModelConfig;

pub use gpt2::{gpt2_name, Gpt2Config};
pub use llama::LlamaHfConfig;

/// Writes `model`'s weights `master` (laid out by `layout`) as a Hugging Face directory
/// `out` (its bos and eos tokens `end_of_text`, the vocabulary's).
pub fn export(
    model: &ModelConfig,
    layout: &FlatLayout,
    master: &[f32],
    end_of_text: Option<u32>,
    out: &Path,
) -> Result<PathBuf> {
    match model {
        ModelConfig::Gpt(g) => gpt2::export(g, layout, master, end_of_text, out),
        ModelConfig::Llama(l) => llama::export(l, layout, master, end_of_text, out),
        ModelConfig::Cnn(_) | ModelConfig::Mlp(_) => Err(no_form()),
    }
}

/// Reads the Hugging Face directory `dir` into a flat buffer laid out by `layout` for
/// `model`; errors name the file and the key or tensor that does not fit.
pub fn import(model: &ModelConfig, layout: &FlatLayout, dir: &Path) -> Result<Vec<f32>> {
    match model {
        ModelConfig::Gpt(g) => gpt2::import(g, layout, dir),
        ModelConfig::Llama(l) => llama::import(l, layout, dir),
        ModelConfig::Cnn(_) | ModelConfig::Mlp(_) => Err(no_form()),
    }
}

fn no_form() -> crate::error::TrainError {
    config_err(
        "model.kind",
        "only the GPT (GPT-2) and the Llama (LlamaForCausalLM) have a Hugging Face form",
    )
}

/// Writes the directory `out`: `model.safetensors` of `(name, shape, f32 values)` and
/// `config.json` of `config`.
pub(crate) fn write_dir(
    out: &Path,
    tensors: &[(String, Vec<usize>, Vec<f32>)],
    config: &impl serde::Serialize,
) -> Result<PathBuf> {
    std::fs::create_dir_all(out).map_err(|e| io_err(out, e))?;
    write_tensors(out, tensors)?;
    let json = serde_json::to_vec_pretty(config).map_err(|e| ckpt_err(out, e))?;
    write_synced(&out.join("config.json"), &json)?;
    Ok(out.to_path_buf())
}

/// `dir/config.json` parsed as `T`, and its path (for errors naming it).
pub(crate) fn read_config<T: serde::de::DeserializeOwned>(dir: &Path) -> Result<(T, PathBuf)> {
    let cp = dir.join("config.json");
    let text = std::fs::read(&cp).map_err(|e| io_err(&cp, e))?;
    let config = serde_json::from_slice(&text).map_err(|e| ckpt_err(&cp, e))?;
    Ok((config, cp))
}

/// Writes `(name, shape, f32 values)` as `out/model.safetensors` (PyTorch's format tag).
fn write_tensors(out: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)]) -> Result<()> {
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, shape, d)| {
            let v = TensorView::new(StDtype::F32, shape.clone(), bytemuck::cast_slice(d))
                .expect("sizes match");
            (n.clone(), v)
        })
        .collect();
    let mut meta = std::collections::HashMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    let st = out.join("model.safetensors");
    let bytes = safetensors::serialize(views, Some(meta)).map_err(|e| ckpt_err(&st, e))?;
    write_synced(&st, &bytes)
}
