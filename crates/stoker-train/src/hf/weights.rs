//! Reading a Hugging Face directory's weights as `save_pretrained` and the hub leave them:
//! one `model.safetensors`, or shards (`model-00001-of-00004.safetensors`, ...) that
//! `model.safetensors.index.json` maps tensor names to; names with the base model's prefix
//! (`transformer.` for GPT-2, `model.` for Llama) or without it, as the hub's own GPT-2
//! has them (transformers strips and adds the prefix on load). Tensors the model does not
//! use (GPT-2's `attn.bias` masks, a tied `lm_head.weight`) are passed over.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::Dtype as StDtype;
use safetensors::SafeTensors;

use crate::error::{io_err, Result};
use crate::layout::{FlatLayout, Slot};
use crate::model_files::ckpt_err;

/// The one-file form's name.
const SINGLE: &str = "model.safetensors";
/// The sharded form's index.
const INDEX: &str = "model.safetensors.index.json";

/// A tensor a slot is read from: its Hugging Face name and shape.
pub(crate) struct Wanted {
    /// The name with the base model's prefix (`transformer.wte.weight`).
    pub name: String,
    /// The shape stored (GPT-2's Conv1D weights are the transpose of the slot's).
    pub shape: Vec<usize>,
}

/// A flat buffer laid out by `layout` from the weights in `dir`: slot `s` is the tensor
/// `want(s)` names (found with or without `base_prefix.`), then `finish(s, values)` (a
/// transpose, say). Each file is read once, the slots it holds filled, and dropped, so
/// the bytes held are one shard's.
pub(crate) fn read_weights(
    dir: &Path,
    layout: &FlatLayout,
    base_prefix: &str,
    want: impl Fn(&Slot) -> Wanted,
    finish: impl Fn(&Slot, Vec<f32>) -> Vec<f32>,
) -> Result<Vec<f32>> {
    let shards = Shards::find(dir)?;
    // The slots each file holds, in the files' order.
    let mut by_file: BTreeMap<PathBuf, Vec<(&Slot, Wanted)>> = BTreeMap::new();
    for s in layout.slots() {
        let w = want(s);
        let file = shards.file_of(&w.name, base_prefix)?;
        by_file.entry(file).or_default().push((s, w));
    }
    let mut master = vec![0f32; layout.total_len()];
    for (path, slots) in by_file {
        let bytes = std::fs::read(&path).map_err(|e| io_err(&path, e))?;
        let st = SafeTensors::deserialize(&bytes).map_err(|e| ckpt_err(&path, e))?;
        for (s, w) in slots {
            let name = stored_name(&st, &w.name, base_prefix);
            let x = finish(s, read_f32(&st, &path, name, &w.shape)?);
            master[s.offset..s.offset + s.len].copy_from_slice(&x);
        }
    }
    Ok(master)
}

/// `name` without `prefix.`, where it has it.
fn unprefixed<'a>(name: &'a str, prefix: &str) -> Option<&'a str> {
    name.strip_prefix(prefix)?.strip_prefix('.')
}

/// The name `st` holds `name` under: as given, else without the base prefix (the error
/// of a tensor under neither names the first).
fn stored_name<'a>(st: &SafeTensors<'_>, name: &'a str, base_prefix: &str) -> &'a str {
    match unprefixed(name, base_prefix) {
        Some(short) if st.tensor(name).is_err() && st.tensor(short).is_ok() => short,
        _ => name,
    }
}

/// Where a directory's tensors are.
enum Shards {
    /// All in `model.safetensors`.
    Single(PathBuf),
    /// In the files the index maps each name to.
    Indexed {
        index: PathBuf,
        map: BTreeMap<String, PathBuf>,
    },
}

/// `model.safetensors.index.json`'s part that says where each tensor is.
#[derive(serde::Deserialize)]
struct IndexFile {
    weight_map: BTreeMap<String, String>,
}

impl Shards {
    /// The form `dir` holds: the single file where there is one, else the index, in
    /// transformers' order (a stale index beside a newer single file, as re-saving a
    /// sharded model smaller can leave, is not read).
    fn find(dir: &Path) -> Result<Shards> {
        let single = dir.join(SINGLE);
        if single.is_file() {
            return Ok(Shards::Single(single));
        }
        let index = dir.join(INDEX);
        if index.is_file() {
            let text = std::fs::read(&index).map_err(|e| io_err(&index, e))?;
            let parsed: IndexFile = serde_json::from_slice(&text).map_err(|e| {
                ckpt_err(
                    &index,
                    format!("expected {{\"weight_map\": {{tensor: file}}}}: {e}"),
                )
            })?;
            let mut map = BTreeMap::new();
            for (name, file) in parsed.weight_map {
                // A shard is a file beside the index, not a path elsewhere.
                if Path::new(&file).components().count() != 1 {
                    return Err(ckpt_err(
                        &index,
                        format!("`{name}` maps to {file:?}: expected a file name beside the index"),
                    ));
                }
                map.insert(name, dir.join(file));
            }
            return Ok(Shards::Indexed { index, map });
        }
        Err(ckpt_err(
            dir,
            format!(
                "neither {SINGLE} nor {INDEX} (and its shards) is here: expected a directory \
                 that transformers' save_pretrained wrote"
            ),
        ))
    }

    /// The file that holds `name` (or `name` without `base_prefix.`).
    fn file_of(&self, name: &str, base_prefix: &str) -> Result<PathBuf> {
        match self {
            Shards::Single(path) => Ok(path.clone()),
            Shards::Indexed { index, map } => map
                .get(name)
                .or_else(|| unprefixed(name, base_prefix).and_then(|short| map.get(short)))
                .cloned()
                .ok_or_else(|| {
                    ckpt_err(
                        index,
                        format!("tensor `{name}` is in no shard's weight_map"),
                    )
                }),
        }
    }
}

/// Tensor `name` of `st` (read from `path`) as f32, checked to be `shape`; F32, F16 and
/// BF16 are read.
pub(crate) fn read_f32(
    st: &SafeTensors<'_>,
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
