//! Loading the single-file checkpoints of versions 1 and 2 (written by rank 0 alone):
//! `model.safetensors` (FP32 master weights by name), `optimizer.safetensors` (whole-buffer
//! moments), `state.json` and `state.json.crc32`. Version 1's name-order layout loads
//! by parameter name.

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::tensor::Dtype as StDtype;
use serde::{Deserialize, Serialize};
use stoker_data::SamplerState;
use stoker_precision::ScalerState;

use super::state::{LoadedState, Stateful};
use crate::error::{io_err, Result, TrainError};
use crate::layout::FlatLayout;
use crate::optim::OptimState;
use crate::precision::LayerScalers;

use super::{DataPosition, FORMAT};

/// The last single-file version (2 added every rank's data position).
const VERSION: u32 = 2;

/// The JSON part of a checkpoint.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CheckpointState {
    /// Always `stoker-checkpoint`.
    pub format: String,
    /// Format version.
    pub version: u32,
    /// Optimizer steps taken.
    pub step: u64,
    /// Optimizer's own step count (bias correction).
    pub optimizer_step: u64,
    /// Where rank 0's training loader stands.
    pub sampler: SamplerState,
    /// Where every rank's data stands (absent in version 1 checkpoints).
    #[serde(default)]
    pub data: Option<DataPosition>,
    /// Loss-scaler state (fp16).
    pub scaler: Option<ScalerState>,
    /// FP8 delayed scalers by layer (fp8).
    pub fp8: Option<BTreeMap<String, LayerScalers>>,
    /// The run's seed.
    pub seed: u64,
    /// Parameter layout of the master buffer.
    pub layout: FlatLayout,
    /// CRC-32 of `model.safetensors`.
    pub model_crc32: u32,
    /// CRC-32 of `optimizer.safetensors`.
    pub optimizer_crc32: u32,
}

fn st_err(path: &Path, e: impl std::fmt::Display) -> TrainError {
    TrainError::Checkpoint {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

fn read_checked(path: &Path, want: u32) -> Result<Vec<u8>> {
    let bytes = std::fs::read(path).map_err(|e| io_err(path, e))?;
    let got = crc32fast::hash(&bytes);
    if got != want {
        return Err(st_err(path, format!("checksum mismatch: CRC-32 {got:08x}, state.json records {want:08x} (file corrupt or replaced)")));
    }
    Ok(bytes)
}

/// `state.json` of the version 1-2 checkpoint in `dir`, its checksum and format checked.
pub fn read_state(dir: &Path) -> Result<CheckpointState> {
    let sp = dir.join("state.json");
    let json = std::fs::read(&sp).map_err(|e| io_err(&sp, e))?;
    let cp = dir.join("state.json.crc32");
    let recorded = std::fs::read_to_string(&cp).map_err(|e| io_err(&cp, e))?;
    let want = u32::from_str_radix(recorded.trim(), 16).map_err(|e| st_err(&cp, e))?;
    if crc32fast::hash(&json) != want {
        return Err(st_err(
            &sp,
            format!(
                "checksum mismatch: CRC-32 {:08x}, state.json.crc32 says {want:08x}",
                crc32fast::hash(&json)
            ),
        ));
    }
    let state: CheckpointState = serde_json::from_slice(&json).map_err(|e| st_err(&sp, e))?;
    if state.format != FORMAT || !(1..=VERSION).contains(&state.version) {
        return Err(st_err(
            &sp,
            format!(
                "format {} v{}, expected {FORMAT} v1..=v{VERSION}",
                state.format, state.version
            ),
        ));
    }
    // The weights file holds every parameter as f32: a layout past its size is damaged.
    let mp = dir.join("model.safetensors");
    let max = std::fs::metadata(&mp).map_or(usize::MAX, |m| (m.len() / 4) as usize);
    if let Some(why) = state.layout.problem(max) {
        return Err(st_err(&sp, format!("layout: {why}")));
    }
    Ok(state)
}

/// Checks every checksum of the version 1-2 checkpoint in `dir` (no model needed).
pub fn verify(dir: &Path) -> Result<CheckpointState> {
    let state = read_state(dir)?;
    read_checked(&dir.join("model.safetensors"), state.model_crc32)?;
    read_checked(&dir.join("optimizer.safetensors"), state.optimizer_crc32)?;
    Ok(state)
}

/// Loads the checkpoint in `dir` into `trainer`, after verifying every checksum and that
/// its layout matches the model.
pub fn load(trainer: &mut dyn Stateful, dir: &Path) -> Result<CheckpointState> {
    let ours = trainer.state();
    let (layout, pieces, held) = (
        ours.layout.clone(),
        ours.optimizer.pieces.clone(),
        ours.held.clone(),
    );
    let has_scaler = ours.scaler.is_some();
    drop(ours);
    let state = read_state(dir)?;
    // The same parameters in another order or alignment (a version 1 checkpoint's name
    // order) load by name; other parameters or shapes do not load at all.
    if state.layout != layout {
        let probe = vec![0f32; state.layout.total_len()];
        if layout.remap_from(&state.layout, &probe).is_err() {
            let diff = describe_mismatch(&state.layout, &layout);
            return Err(st_err(dir, format!("does not match the model: {diff}")));
        }
    }
    let mp = dir.join("model.safetensors");
    let model = read_checked(&mp, state.model_crc32)?;
    let st = safetensors::SafeTensors::deserialize(&model).map_err(|e| st_err(&mp, e))?;
    let mut master = vec![0f32; layout.total_len()];
    for s in layout.slots() {
        let t = st
            .tensor(&s.name)
            .map_err(|e| st_err(&mp, format!("parameter `{}`: {e}", s.name)))?;
        if t.dtype() != StDtype::F32 || t.shape() != s.shape.as_slice() {
            return Err(st_err(
                &mp,
                format!(
                    "parameter `{}`: {:?} {:?}, the model has F32 {:?}",
                    s.name,
                    t.dtype(),
                    t.shape(),
                    s.shape
                ),
            ));
        }
        for (o, c) in master[s.offset..s.offset + s.len]
            .iter_mut()
            .zip(t.data().chunks_exact(4))
        {
            *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
    }
    let op = dir.join("optimizer.safetensors");
    let optim = read_checked(&op, state.optimizer_crc32)?;
    let ost = safetensors::SafeTensors::deserialize(&optim).map_err(|e| st_err(&op, e))?;
    let mut buffers = Vec::new();
    for (name, view) in ost.tensors() {
        let v: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let v = match state.layout == layout {
            true => v,
            false => layout
                .remap_from(&state.layout, &v)
                .map_err(|e| st_err(&op, format!("optimizer buffer `{name}`: {e}")))?,
        };
        if v.len() != layout.total_len() {
            return Err(st_err(
                &op,
                format!(
                    "optimizer buffer `{name}` has {} elements, the layout {}",
                    v.len(),
                    layout.total_len()
                ),
            ));
        }
        buffers.push((name, pieces.take(&v)));
    }
    if has_scaler != state.scaler.is_some() {
        return Err(st_err(
            &dir.join("state.json"),
            "loss-scaler state does not match the precision mode",
        ));
    }
    trainer
        .load_state(LoadedState {
            step: state.step,
            sampler: state.sampler,
            master: held.take(&master),
            optimizer: OptimState {
                step: state.optimizer_step,
                pieces,
                buffers,
            },
            scaler: state.scaler.clone(),
            fp8: state.fp8.clone(),
        })
        .map_err(|e| st_err(&op, e))?;
    Ok(state)
}

pub(super) fn describe_mismatch(saved: &FlatLayout, model: &FlatLayout) -> String {
    for (a, b) in saved.slots().iter().zip(model.slots()) {
        if a.name != b.name || a.shape != b.shape {
            return format!(
                "checkpoint has `{}` {:?} where the model has `{}` {:?}",
                a.name, a.shape, b.name, b.shape
            );
        }
    }
    if saved.slots().len() != model.slots().len() {
        return format!(
            "checkpoint has {} parameters, the model {}",
            saved.slots().len(),
            model.slots().len()
        );
    }
    for (a, b) in saved.slots().iter().zip(model.slots()) {
        if (a.offset, a.len) != (b.offset, b.len) {
            return format!(
                "checkpoint has `{}` at offset {} ({} elements) where the model has it at {} ({})",
                a.name, a.offset, a.len, b.offset, b.len
            );
        }
    }
    format!(
        "checkpoint lays out {} elements (alignment {}), the model {} (alignment {})",
        saved.total_len(),
        saved.align(),
        model.total_len(),
        model.align()
    )
}

#[cfg(test)]
mod tests {
    use super::describe_mismatch;
    use crate::layout::{FlatLayout, ParamSpec};

    /// Layouts alike in names and shapes say where they differ: the first slot placed
    /// elsewhere, else the totals (before: "checkpoint has 2 parameters, the model 2").
    #[test]
    fn a_mismatch_of_places_names_the_slot_and_its_offsets() {
        let specs = [ParamSpec::new("a", &[3]), ParamSpec::new("b", &[3])];
        let at = |align| FlatLayout::new(&specs, align).unwrap();
        assert_eq!(
            describe_mismatch(&at(4), &at(8)),
            "checkpoint has `b` at offset 4 (3 elements) where the model has it at 8 (3)"
        );
        let one = [ParamSpec::new("a", &[4])];
        let (four, two) = (
            FlatLayout::new(&one, 4).unwrap(),
            FlatLayout::new(&one, 8).unwrap(),
        );
        assert_eq!(
            describe_mismatch(&four, &two),
            "checkpoint lays out 4 elements (alignment 4), the model 8 (alignment 8)"
        );
    }
}
