//! Rewrites an exported Hugging Face directory into the other layouts transformers and
//! the hub leave: tensors renamed (the hub's GPT-2 has no `transformer.` prefix), extra
//! buffers beside them (GPT-2's `attn.bias` masks), several shards with
//! `model.safetensors.index.json` (what `save_pretrained` writes past its shard size).

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::tensor::{Dtype, TensorView};

/// Writes `out/` from `from/`: `config.json` copied, every tensor of
/// `from/model.safetensors` under `rename(name)`, plus `extra` (f32), in `shards` files
/// (one: `model.safetensors`; more: `model-0000K-of-0000N.safetensors` and the index).
pub fn rewrite(
    from: &Path,
    out: &Path,
    rename: impl Fn(&str) -> String,
    extra: &[(String, Vec<usize>, Vec<f32>)],
    shards: usize,
) {
    std::fs::create_dir_all(out).unwrap();
    std::fs::copy(from.join("config.json"), out.join("config.json")).unwrap();
    let bytes = std::fs::read(from.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
    names.sort();
    let mut tensors: Vec<(String, TensorView<'_>)> = names
        .iter()
        .map(|n| (rename(n), st.tensor(n).unwrap()))
        .collect();
    for (name, shape, data) in extra {
        let view = TensorView::new(Dtype::F32, shape.clone(), bytemuck::cast_slice(data)).unwrap();
        tensors.push((name.clone(), view));
    }
    if shards == 1 {
        let file = safetensors::serialize(tensors, None).unwrap();
        std::fs::write(out.join("model.safetensors"), file).unwrap();
        return;
    }
    let per = tensors.len().div_ceil(shards);
    let mut weight_map = BTreeMap::new();
    let mut rest = tensors;
    for k in 1..=shards {
        let part: Vec<_> = rest.drain(..per.min(rest.len())).collect();
        let file = format!("model-{k:05}-of-{shards:05}.safetensors");
        for (name, _) in &part {
            weight_map.insert(name.clone(), file.clone());
        }
        std::fs::write(out.join(&file), safetensors::serialize(part, None).unwrap()).unwrap();
    }
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
    std::fs::write(out.join("model.safetensors.index.json"), index.to_string()).unwrap();
}
