//! Checkpoints: a directory `step_NNNNNNNN/` holding
//!
//! - `model.safetensors`: the FP32 master weights by parameter name (loadable by Hugging
//!   Face `safetensors` tools);
//! - `optimizer.safetensors`: the optimizer's flat moment buffers;
//! - `state.json`: format and version, step, the data position (every rank's loader
//!   position and the world-size-independent one: epoch and global batches done, which
//!   is what a resume at another world size continues from), loss-scaler and FP8 scaler
//!   state, the seed (the only random state: data order and sampling derive from it),
//!   the parameter layout, and the CRC-32 of both tensor files;
//! - `state.json.crc32`: the CRC-32 of `state.json`.
//!
//! Every file is written to a temporary directory, fsynced, and the directory renamed into
//! place, so a crash leaves either the old checkpoints or the complete new one. Loading
//! verifies every checksum and that the layout matches the model, and refuses otherwise.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype as StDtype, TensorView};
use serde::{Deserialize, Serialize};
use stoker_data::SamplerState;
use stoker_precision::ScalerState;

use crate::error::{io_err, Result, TrainError};
use crate::layout::FlatLayout;
use crate::optim::OptimState;
use crate::precision::LayerScalers;
use crate::trainer::Trainer;

const FORMAT: &str = "stoker-checkpoint";
/// 2: adds the data position of every rank (version 1 checkpoints still load).
const VERSION: u32 = 2;

/// Where the training data stands, for every rank and independently of the world size.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataPosition {
    /// Current epoch.
    pub epoch: u64,
    /// Global batches (optimizer steps' worth of samples) of this epoch already consumed.
    pub global_batches_done: usize,
    /// Samples per global batch: a resume must use the same.
    pub global_batch: usize,
    /// The world size that wrote the checkpoint.
    pub world_size: usize,
    /// Micro-batches per step and rank when written.
    pub accumulation_steps: usize,
    /// Every rank's loader position when written, rank order.
    pub ranks: Vec<SamplerState>,
}

impl DataPosition {
    /// The position of every rank of a world of `world` ranks that have each consumed
    /// `state` (the same number of micro-batches: the world-size-independent sampler gives
    /// every rank an equal share of each global batch).
    pub fn of(
        state: SamplerState,
        global_batch: usize,
        world: usize,
        accumulation_steps: usize,
    ) -> Self {
        DataPosition {
            epoch: state.epoch,
            global_batches_done: state.batches_done / accumulation_steps.max(1),
            global_batch,
            world_size: world,
            accumulation_steps,
            ranks: vec![state; world],
        }
    }

    /// This rank's loader position in a run of `global_batch` samples per step with
    /// `accumulation_steps` micro-batches per rank, at any world size; an error naming
    /// `batch.global_batch` if the global batch changed (the data order would not continue).
    pub fn resume_at(
        &self,
        global_batch: usize,
        accumulation_steps: usize,
    ) -> Result<SamplerState> {
        if global_batch != self.global_batch {
            return Err(crate::error::config_err(
                "batch.global_batch",
                format!(
                    "{global_batch}, but the checkpoint was written with global batches of {}: resume with the same global batch (the world size may change)",
                    self.global_batch
                ),
            ));
        }
        Ok(SamplerState {
            epoch: self.epoch,
            batches_done: self.global_batches_done * accumulation_steps,
        })
    }
}

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

fn f32_bytes(v: &[f32]) -> &[u8] {
    bytemuck::cast_slice(v)
}

fn st_err(path: &Path, e: impl std::fmt::Display) -> TrainError {
    TrainError::Checkpoint {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = std::fs::File::create(path).map_err(|e| io_err(path, e))?;
    f.write_all(bytes).map_err(|e| io_err(path, e))?;
    f.sync_all().map_err(|e| io_err(path, e))
}

/// The directory name of step `step`'s checkpoint.
pub fn step_dir(root: &Path, step: u64) -> PathBuf {
    root.join(format!("step_{step:08}"))
}

/// Writes `trainer`'s checkpoint under `root` atomically (one rank writes it: every
/// rank of a data-parallel run holds the same state); returns its directory. `data` is
/// every rank's data position (one rank's, from its sampler state, when None).
pub fn save(
    trainer: &Trainer,
    root: &Path,
    seed: u64,
    data: Option<DataPosition>,
) -> Result<PathBuf> {
    std::fs::create_dir_all(root).map_err(|e| io_err(root, e))?;
    let dir = step_dir(root, trainer.step);
    let tmp = root.join(format!(".tmp_step_{:08}", trainer.step));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| io_err(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| io_err(&tmp, e))?;
    let layout = &trainer.layout;
    let views: Vec<(String, TensorView)> = layout
        .slots()
        .iter()
        .map(|s| {
            let bytes = f32_bytes(&trainer.master[s.offset..s.offset + s.len]);
            (
                s.name.clone(),
                TensorView::new(StDtype::F32, s.shape.clone(), bytes).expect("sizes match"),
            )
        })
        .collect();
    let model = safetensors::serialize(views, None).map_err(|e| st_err(&tmp, e))?;
    let opt = trainer.optimizer.state();
    let oviews: Vec<(String, TensorView)> = opt
        .buffers
        .iter()
        .map(|(n, b)| {
            (
                n.clone(),
                TensorView::new(StDtype::F32, vec![b.len()], f32_bytes(b)).expect("sizes match"),
            )
        })
        .collect();
    let optim = safetensors::serialize(oviews, None).map_err(|e| st_err(&tmp, e))?;
    let state = CheckpointState {
        format: FORMAT.into(),
        version: VERSION,
        step: trainer.step,
        optimizer_step: opt.step,
        sampler: trainer.sampler_state,
        data,
        scaler: trainer.scaler.as_ref().map(|s| s.state().clone()),
        fp8: trainer.fp8.as_ref().map(|f| f.state()),
        seed,
        layout: layout.clone(),
        model_crc32: crc32fast::hash(&model),
        optimizer_crc32: crc32fast::hash(&optim),
    };
    let json = serde_json::to_vec_pretty(&state).map_err(|e| st_err(&tmp, e))?;
    write_synced(&tmp.join("model.safetensors"), &model)?;
    write_synced(&tmp.join("optimizer.safetensors"), &optim)?;
    write_synced(&tmp.join("state.json"), &json)?;
    write_synced(
        &tmp.join("state.json.crc32"),
        format!("{:08x}\n", crc32fast::hash(&json)).as_bytes(),
    )?;
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(|e| io_err(&dir, e))?;
    }
    std::fs::rename(&tmp, &dir).map_err(|e| io_err(&dir, e))?;
    if let Ok(d) = std::fs::File::open(root) {
        let _ = d.sync_all(); // make the rename durable
    }
    Ok(dir)
}

fn read_checked(path: &Path, want: u32) -> Result<Vec<u8>> {
    let bytes = std::fs::read(path).map_err(|e| io_err(path, e))?;
    let got = crc32fast::hash(&bytes);
    if got != want {
        return Err(st_err(path, format!("checksum mismatch: CRC-32 {got:08x}, state.json records {want:08x} (file corrupt or replaced)")));
    }
    Ok(bytes)
}

/// Loads the checkpoint in `dir` into `trainer`, after verifying every checksum and that
/// its layout matches the model.
pub fn load(trainer: &mut Trainer, dir: &Path) -> Result<CheckpointState> {
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
    // The same parameters in another order or alignment (a version 1 checkpoint's name
    // order) load by name; other parameters or shapes do not load at all.
    if state.layout != trainer.layout {
        let probe = vec![0f32; state.layout.total_len()];
        if trainer.layout.remap_from(&state.layout, &probe).is_err() {
            let diff = describe_mismatch(&state.layout, &trainer.layout);
            return Err(st_err(dir, format!("does not match the model: {diff}")));
        }
    }
    let mp = dir.join("model.safetensors");
    let model = read_checked(&mp, state.model_crc32)?;
    let st = safetensors::SafeTensors::deserialize(&model).map_err(|e| st_err(&mp, e))?;
    let mut master = vec![0f32; trainer.layout.total_len()];
    for s in trainer.layout.slots() {
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
        let v = match state.layout == trainer.layout {
            true => v,
            false => trainer
                .layout
                .remap_from(&state.layout, &v)
                .map_err(|e| st_err(&op, format!("optimizer buffer `{name}`: {e}")))?,
        };
        buffers.push((name, v));
    }
    trainer
        .optimizer
        .restore(OptimState {
            step: state.optimizer_step,
            buffers,
        })
        .map_err(|m| st_err(&op, m))?;
    match (&mut trainer.scaler, &state.scaler) {
        (Some(s), Some(saved)) => s.restore(saved.clone())?,
        (None, None) => {}
        _ => {
            return Err(st_err(
                &sp,
                "loss-scaler state does not match the precision mode",
            ))
        }
    }
    if let (Some(f), Some(saved)) = (&trainer.fp8, &state.fp8) {
        f.restore(saved.clone());
    }
    trainer.master = master;
    trainer
        .layout
        .unflatten(&trainer.master, trainer.model.params())?;
    trainer.step = state.step;
    trainer.sampler_state = state.sampler;
    Ok(state)
}

fn describe_mismatch(saved: &FlatLayout, model: &FlatLayout) -> String {
    for (a, b) in saved.slots().iter().zip(model.slots()) {
        if a.name != b.name || a.shape != b.shape {
            return format!(
                "checkpoint has `{}` {:?} where the model has `{}` {:?}",
                a.name, a.shape, b.name, b.shape
            );
        }
    }
    format!(
        "checkpoint has {} parameters, the model {}",
        saved.slots().len(),
        model.slots().len()
    )
}

/// The checkpoint with the highest step under `root`, if any.
pub fn latest(root: &Path) -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(root)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("step_"))
        })
        .collect();
    dirs.sort();
    dirs.pop()
}
