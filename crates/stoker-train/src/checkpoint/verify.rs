//! Checking a checkpoint without a model, and finding the newest one that checks out.
//!
//! [`verify`] reads every file of a checkpoint directory and checks what the writer
//! recorded: the commit marker against the manifest, each shard's CRC-32 and size, that
//! every tensor the manifest names is there in F32 with its shard's length (version 3);
//! `state.json`'s own checksum and the two tensor files' (versions 1-2). [`latest_intact`]
//! walks a run's checkpoints newest first and returns the first that passes, with the
//! reason each newer one was passed over, so `--resume latest` survives a corrupt newest
//! checkpoint (a disk error, a file replaced) by resuming from the one before.

use std::path::{Path, PathBuf};

use super::{legacy, sharded};
use crate::error::Result;

/// What a checkpoint that passed [`verify`] holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// Optimizer steps it was written after.
    pub step: u64,
    /// Format version (1-3).
    pub version: u32,
    /// Ranks that wrote it (1 for versions 1-2).
    pub world_size: usize,
    /// Files read and checked.
    pub files: usize,
    /// Bytes read.
    pub bytes: u64,
}

/// Checks every file of the checkpoint in `dir`; the error names the first file and
/// field that fails.
pub fn verify(dir: &Path) -> Result<Verified> {
    if dir.join(sharded::MANIFEST).exists() {
        let m = sharded::read_manifest(dir)?;
        let len = m.layout.total_len();
        let mut names = vec!["master"];
        names.extend(m.optimizer_buffers.iter().map(String::as_str));
        let (mut files, mut bytes) = (1, 0u64);
        sharded::for_shards(
            dir,
            &m,
            &crate::pieces::Pieces::one(0..len),
            &names,
            |_, st| {
                files += 1;
                bytes += st
                    .tensors()
                    .iter()
                    .map(|(_, t)| t.data().len() as u64)
                    .sum::<u64>();
                Ok(())
            },
        )?;
        return Ok(Verified {
            step: m.step,
            version: m.version,
            world_size: m.world_size,
            files,
            bytes,
        });
    }
    if !dir.join("state.json").exists() {
        return Err(super::not_a_checkpoint(dir));
    }
    let state = legacy::verify(dir)?;
    let size = |f: &str| std::fs::metadata(dir.join(f)).map_or(0, |m| m.len());
    Ok(Verified {
        step: state.step,
        version: state.version,
        world_size: 1,
        files: 3,
        bytes: size("model.safetensors") + size("optimizer.safetensors"),
    })
}

/// The newest checkpoint under `root` that passes [`verify`], and every newer complete
/// one that did not, newest first, each with the reason.
#[derive(Debug, Default)]
pub struct Intact {
    /// The checkpoint to resume from, if any passed.
    pub dir: Option<PathBuf>,
    /// Newer checkpoints passed over, with why.
    pub skipped: Vec<(PathBuf, String)>,
}

/// Walks the complete checkpoints under `root` newest first (a save without its commit
/// marker is not complete and not listed), from the one [`LATEST`](super::LATEST) names,
/// until one passes [`verify`].
pub fn latest_intact(root: &Path) -> Intact {
    let (dirs, passed_over) = super::candidates(root);
    let mut out = Intact {
        skipped: passed_over,
        ..Intact::default()
    };
    for dir in dirs {
        match verify(&dir) {
            Ok(_) => {
                out.dir = Some(dir);
                break;
            }
            Err(e) => out.skipped.push((dir, e.to_string())),
        }
    }
    out
}
