//! `stoker ckpt consolidate`: one `model.safetensors` (FP32 weights by parameter name,
//! what Hugging Face's `safetensors` tools read) from a sharded checkpoint,
//! reading only the parameter part of each shard: the optimizer state is never gathered
//! (DeepSpeed's `zero_to_fp32` and FSDP's full state dict gather it all on one rank).

use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype as StDtype, TensorView};

use super::sharded::{
    check_recorded_model, copy_overlap, for_shards, read_manifest, COMMITTED, MANIFEST,
};
use crate::error::Result;
use crate::layout::FlatLayout;
use crate::model_files::{ckpt_err, write_synced};

/// The whole FP32 parameter buffer of the sharded checkpoint in `dir`, and its layout
/// (checked against the model table the checkpoint records).
pub fn read_params(dir: &Path) -> Result<(FlatLayout, Vec<f32>)> {
    let m = read_manifest(dir)?;
    check_recorded_model(dir, &m)?;
    let len = m.layout.total_len();
    let mut master = vec![0f32; len];
    let whole = crate::pieces::Pieces::one(0..len);
    for_shards(dir, &m, &whole, &["master"], |shard, st| {
        copy_overlap(shard, st, "master", &(0..len), &mut master);
        Ok(())
    })?;
    Ok((m.layout, master))
}

/// Writes the weights of the sharded checkpoint in `dir` as one safetensors file by
/// parameter name at `out` (default `dir/model.safetensors`); returns its path.
pub fn consolidate(dir: &Path, out: Option<&Path>) -> Result<PathBuf> {
    let (layout, master) = read_params(dir)?;
    let views: Vec<(String, TensorView)> = layout
        .slots()
        .iter()
        .map(|s| {
            let bytes = bytemuck::cast_slice(&master[s.offset..s.offset + s.len]);
            (
                s.name.clone(),
                TensorView::new(StDtype::F32, s.shape.clone(), bytes).expect("sizes match"),
            )
        })
        .collect();
    let out = out.map_or_else(|| dir.join("model.safetensors"), Path::to_path_buf);
    // Not over a file of the checkpoint read (its manifest, marker or a shard): that
    // destroyed the checkpoint and said "wrote".
    let inside =
        |p: &Path| p.parent().and_then(|d| d.canonicalize().ok()) == dir.canonicalize().ok();
    let name = out.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if inside(&out) && (name == MANIFEST || name == COMMITTED || name.starts_with("shard_")) {
        return Err(ckpt_err(
            &out,
            "is a file of the checkpoint being consolidated: give --out another path",
        ));
    }
    let bytes = safetensors::serialize(views, None).map_err(|e| ckpt_err(&out, e))?;
    write_synced(&out, &bytes)?;
    Ok(out)
}
