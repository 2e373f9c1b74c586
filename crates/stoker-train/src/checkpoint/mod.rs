//! Checkpoints: a directory `step_NNNNNNNN/` per saved step.
//!
//! Version 3 ([`sharded`], written by every rank together) holds one
//! `shard_RRRRR.safetensors` per rank of the saving world, a `manifest.json` (rank 0)
//! and a `COMMITTED` marker written last; any world size and any strategy loads it
//! ([`load`]), and [`consolidate`] turns one into a single `model.safetensors`.
//! Versions 1 and 2 ([`legacy`], one rank's single files) still load. [`verify`] checks
//! one without a model; [`latest_intact`] finds the newest that checks out.

pub mod consolidate;
pub mod continues;
pub mod legacy;
pub mod retain;
pub mod sharded;
pub mod state;
pub mod verify;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use stoker_data::SamplerState;

use crate::error::{io_err, Result, TrainError};
use crate::model_files::ckpt_err;

pub use consolidate::consolidate;
pub use continues::{check_continues, RunRecord};
pub use sharded::{save, Manifest, SaveFault, SavePoint};
pub use state::{LoadedState, RankState, Stateful};
pub use verify::{
    latest_intact, latest_intact_on, skipped_line, verify, verify_share, Intact, PassedOver, Share,
    Verified,
};

/// Every checkpoint's `format` field.
pub const FORMAT: &str = "stoker-checkpoint";

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
    /// The training samples the sampler ordered (absent in checkpoints written before
    /// it was recorded): another count orders other samples.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_samples: Option<usize>,
    /// Their fingerprint (`Datasets::train_fingerprint`; absent in checkpoints written
    /// before it was recorded): another file of the same size differs in it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_crc32: Option<u32>,
    /// `data.shuffle` (absent in checkpoints written before it was recorded): the other
    /// setting orders the samples otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shuffle: Option<bool>,
}

impl DataPosition {
    /// The position of every rank of a world of `world` ranks that have each consumed
    /// `state` (the same number of micro-batches: the world-size-independent sampler gives
    /// every rank an equal share of each global batch), over `train_samples` training
    /// samples (None where unknown).
    pub fn of(
        state: SamplerState,
        global_batch: usize,
        world: usize,
        accumulation_steps: usize,
        train_samples: Option<usize>,
    ) -> Self {
        DataPosition {
            epoch: state.epoch,
            global_batches_done: state.batches_done / accumulation_steps.max(1),
            global_batch,
            world_size: world,
            accumulation_steps,
            ranks: vec![state; world],
            train_samples,
            train_crc32: None,
            shuffle: None,
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

/// What a loaded checkpoint says about where training stands.
#[derive(Debug, Clone, PartialEq)]
pub struct Resumed {
    /// Optimizer steps taken.
    pub step: u64,
    /// Rank 0's loader position when written.
    pub sampler: SamplerState,
    /// Every rank's data position (absent in version 1 checkpoints).
    pub data: Option<DataPosition>,
    /// The run's seed, which orders its data (absent before version 3).
    pub seed: Option<u64>,
    /// The run's `[model]` table, resolved (absent in older checkpoints).
    pub model: Option<crate::models::ModelConfig>,
    /// The run's precision (absent in older checkpoints).
    pub precision: Option<crate::precision::Precision>,
    /// Seconds the run had run when it was written (absent in older checkpoints).
    pub elapsed_s: Option<f64>,
    /// The evaluation due at this step did not finish (a signal stopped the run): a
    /// resume runs it first.
    pub eval_pending: bool,
}

/// Where a run stands when a checkpoint is written, beside its weights: every rank's data
/// position, the run's seconds so far (its earlier lives included), and whether the
/// evaluation due at this step is still owed.
#[derive(Debug, Clone, PartialEq)]
pub struct RunProgress {
    /// Every rank's data position.
    pub data: DataPosition,
    /// The run's seconds so far.
    pub elapsed_s: f64,
    /// The evaluation due at this step was skipped or cut short by a signal.
    pub eval_pending: bool,
}

/// The directory name of step `step`'s checkpoint.
pub fn step_dir(root: &Path, step: u64) -> PathBuf {
    root.join(format!("step_{step:08}"))
}

/// The step of a checkpoint directory named by [`step_dir`], from its name.
pub fn step_of(dir: &Path) -> Option<u64> {
    dir.file_name()?
        .to_str()?
        .strip_prefix("step_")?
        .parse()
        .ok()
}

/// Loads the checkpoint in `dir`, of any version, world size and strategy, into this
/// rank's `trainer` (the whole parameter buffer and its range of the optimizer state),
/// after verifying every checksum and that the layout matches the model; nothing is
/// changed when anything fails.
pub fn load(trainer: &mut dyn Stateful, dir: &Path) -> Result<Resumed> {
    if dir.join(sharded::MANIFEST).exists() {
        return sharded::load(trainer, dir);
    }
    if dir.join("state.json").exists() {
        let s = legacy::load(trainer, dir)?;
        return Ok(Resumed {
            step: s.step,
            sampler: s.sampler,
            data: s.data,
            seed: None,
            model: None,
            precision: None,
            elapsed_s: None,
            eval_pending: false,
        });
    }
    Err(not_a_checkpoint(dir))
}

/// Whether `dir` is a complete checkpoint: version 3 with its commit marker, or a
/// single-file version (those were renamed into place whole).
pub fn is_complete(dir: &Path) -> bool {
    dir.join(sharded::COMMITTED).exists() || dir.join("state.json").exists()
}

/// The complete checkpoints under `root` (a save that crashed before its commit marker
/// is not complete), oldest first.
pub fn complete(root: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("step_"))
                && is_complete(p)
        })
        .collect();
    dirs.sort();
    dirs
}

/// The file naming the checkpoint a run wrote last (DeepSpeed's `latest`), beside them.
pub const LATEST: &str = "LATEST";

/// Records `dir` as the checkpoint written last under `root` (a temporary file renamed
/// over [`LATEST`]), before its commit marker: after a resume from an earlier checkpoint,
/// the newer ones of the timeline left behind are not this run's latest.
pub(crate) fn record_latest(root: &Path, dir: &Path) -> Result<()> {
    let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    let tmp = root.join(format!(".{LATEST}.tmp"));
    crate::model_files::write_synced(&tmp, format!("{name}\n").as_bytes())?;
    let path = root.join(LATEST);
    std::fs::rename(&tmp, &path).map_err(|e| crate::error::io_err(&path, e))
}

/// The complete checkpoints a resume may take, newest first: those up to the one
/// [`LATEST`] names (with why each newer one is passed over; below it where its save did
/// not commit), else all of them (runs before the file).
pub fn candidates(root: &Path) -> (Vec<PathBuf>, Vec<(PathBuf, String)>) {
    let mut dirs = complete(root);
    dirs.reverse();
    let named = std::fs::read_to_string(root.join(LATEST))
        .ok()
        .map(|s| root.join(s.trim()))
        .filter(|d| step_of(d).is_some());
    let Some(last) = named else {
        return (dirs, Vec::new());
    };
    // Those after it are another timeline's; it itself is among the rest where it committed.
    let gone = !last.exists();
    let (newer, mine): (Vec<PathBuf>, Vec<PathBuf>) = dirs.into_iter().partition(|d| *d > last);
    let why = |d: PathBuf| {
        let note = format!(
            "newer than {}, the checkpoint this run wrote last ({LATEST}): left by the run \
             before a resume from an earlier checkpoint",
            last.display()
        );
        (d, note)
    };
    let mut passed: Vec<(PathBuf, String)> = newer.into_iter().map(why).collect();
    // LATEST naming a checkpoint that is not there (removed by hand): said, so that the
    // newer ones passed over are not taken for failed ones.
    if gone {
        let note = format!(
            "named by {} but not there (removed?): the newer checkpoints are passed over \
             as another timeline's; resume one of them with --resume DIR, or remove {LATEST}",
            root.join(LATEST).display()
        );
        passed.push((last, note));
    }
    (mine, passed)
}

/// The checkpoint a resume takes under `root`, unverified: the one [`LATEST`] names, else
/// the complete one with the highest step (a save that crashed before its commit marker
/// is skipped).
pub fn latest(root: &Path) -> Option<PathBuf> {
    candidates(root).0.into_iter().next()
}

/// The error for a directory holding neither checkpoint format.
/// Given a run directory or its `checkpoints/` (DeepSpeed's `zero_to_fp32` takes the
/// root), it names the newest checkpoint under it to pass instead.
pub(crate) fn not_a_checkpoint(dir: &Path) -> TrainError {
    let root = match dir.join("checkpoints").is_dir() {
        true => dir.join("checkpoints"),
        false => dir.to_path_buf(),
    };
    let hint = match latest(&root) {
        Some(newest) => format!(": give one checkpoint, e.g. {}", newest.display()),
        None if !dir.exists() => ": it does not exist".to_string(),
        None => String::new(),
    };
    TrainError::Checkpoint {
        path: dir.to_path_buf(),
        message: format!(
            "no {} (version 3) or state.json (versions 1-2): not a stoker checkpoint \
             directory{hint}",
            sharded::MANIFEST
        ),
    }
}

/// Reads `path` and checks its CRC-32 against `want` (recorded in `by`).
pub(crate) fn read_checked(path: &Path, want: u32, by: &str) -> Result<Vec<u8>> {
    let bytes = std::fs::read(path).map_err(|e| match e.kind() {
        // A file the manifest lists but the directory lacks is a broken checkpoint, not a
        // failing disk.
        std::io::ErrorKind::NotFound => ckpt_err(path, format!("missing: {by} lists it")),
        _ => io_err(path, e),
    })?;
    let got = crc32fast::hash(&bytes);
    if got != want {
        return Err(ckpt_err(
            path,
            format!(
                "checksum mismatch: CRC-32 {got:08x}, {by} records {want:08x} (file corrupt, \
                 truncated or replaced; it holds {} bytes)",
                bytes.len()
            ),
        ));
    }
    Ok(bytes)
}
