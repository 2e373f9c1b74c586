//! Hugging Face interop: a trained model as a `transformers` directory (`config.json` +
//! `model.safetensors`) and back. The GPT is GPT-2 ([`gpt2`]: `GPT2LMHeadModel`), the
//! Llama is `LlamaForCausalLM` ([`llama`]). [`export`] and [`import`] pick by the
//! model's kind; CNNs and MLPs have no such form.

pub mod gpt2;
pub mod llama;

use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype as StDtype, TensorView};

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

/// A flat buffer laid out by `layout` from `dir/model.safetensors`: each slot's values as
/// `values_of(slot, file, path)` reads them (a name and shape of the format's, checked).
pub(crate) fn read_weights(
    dir: &Path,
    layout: &FlatLayout,
    values_of: impl Fn(&crate::layout::Slot, &safetensors::SafeTensors<'_>, &Path) -> Result<Vec<f32>>,
) -> Result<Vec<f32>> {
    let sp = dir.join("model.safetensors");
    let bytes = std::fs::read(&sp).map_err(|e| io_err(&sp, e))?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| ckpt_err(&sp, e))?;
    let mut master = vec![0f32; layout.total_len()];
    for s in layout.slots() {
        let x = values_of(s, &st, &sp)?;
        master[s.offset..s.offset + s.len].copy_from_slice(&x);
    }
    Ok(master)
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

/// Tensor `name` of `st` (read from `path`) as f32, checked to be `shape`; F32, F16 and
/// BF16 are read.
pub(crate) fn read_f32(
    st: &safetensors::SafeTensors<'_>,
    path: &Path,
    name: &str,
    shape: &[usize],
) -> Result<Vec<f32>> {
    let t = st
        .tensor(name)
        .map_err(|e| ckpt_err(path, format!("tensor `{name}`: {e}")))?;
    if t.shape() != shape {
        return Err(ckpt_err(
            path,
            format!("tensor `{name}`: shape {:?}, expected {shape:?}", t.shape()),
        ));
    }
    let values: Vec<f32> = match t.dtype() {
        StDtype::F32 => crate::model_files::f32s(t.data()).collect(),
        StDtype::F16 => t
            .data()
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        StDtype::BF16 => t
            .data()
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        other => {
            return Err(ckpt_err(
                path,
                format!("tensor `{name}`: dtype {other:?}, expected F32, F16 or BF16"),
            ))
        }
    };
    // A NaN or infinity would start the run on weights no step can mend.
    if let Some(i) = values.iter().position(|v| !v.is_finite()) {
        return Err(ckpt_err(
            path,
            format!(
                "tensor `{name}`: element {i} is {}, expected finite weights",
                values[i]
            ),
        ));
    }
    Ok(values)
}
