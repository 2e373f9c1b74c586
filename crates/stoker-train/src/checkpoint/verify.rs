//! Checking a checkpoint without a model, and finding the newest one that checks out.
//!
//! [`verify`] reads every file of a checkpoint directory and checks what the writer
//! recorded: the commit marker against the manifest, each shard's CRC-32 and size, that
//! every tensor the manifest names is there in F32 with its shard's length (version 3);
//! `state.json`'s own checksum and the two tensor files' (versions 1-2). [`latest_intact`]
//! walks a run's checkpoints newest first and returns the first that passes, with the
//! reason each newer one was passed over, so `--resume latest` survives a corrupt newest
//! checkpoint (a disk error, a file replaced) by resuming from the one before.
//!
//! The ranks of a run split that check ([`Share`], [`latest_intact_on`]): each reads the
//! manifest and every `world`-th shard file, and they agree on the verdict, so a resume
//! at N ranks reads the checkpoint once, not N times.

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

/// The part of a checkpoint's check one rank of `world` does: the manifest and its commit
/// marker, and the shard files whose index is `rank` modulo `world` (a single-file
/// version 1-2 checkpoint: rank 0 alone). The shares of ranks `0..world` cover the whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Share {
    /// This rank.
    pub rank: usize,
    /// Ranks splitting the check.
    pub world: usize,
}

impl Share {
    /// The whole check, by one process ([`verify`]).
    pub const WHOLE: Share = Share { rank: 0, world: 1 };

    fn holds(&self, file_index: usize) -> bool {
        file_index % self.world.max(1) == self.rank
    }
}

/// Checks every file of the checkpoint in `dir`; the error names the first file and
/// field that fails.
pub fn verify(dir: &Path) -> Result<Verified> {
    verify_share(dir, Share::WHOLE)
}

/// Checks `share` of the checkpoint in `dir` (its manifest always); the error names the
/// first file and field that fails. [`Verified::files`] and [`Verified::bytes`] count
/// what this share read; a share without a single-file checkpoint's files reads nothing
/// and returns zeros.
pub fn verify_share(dir: &Path, share: Share) -> Result<Verified> {
    if dir.join(sharded::MANIFEST).exists() {
        let m = sharded::read_manifest(dir)?;
        sharded::check_recorded_model(dir, &m)?;
        let mut names = vec!["master"];
        names.extend(m.optimizer_buffers.iter().map(String::as_str));
        let (mut files, mut bytes) = (usize::from(share.rank == 0), 0u64);
        let mine = m.shards.iter().enumerate().filter(|(i, _)| share.holds(*i));
        for s in mine.map(|(_, s)| s) {
            let read = sharded::read_shard(dir, s, &names)?;
            let st = safetensors::SafeTensors::deserialize(&read).expect("checked by read_shard");
            files += 1;
            bytes += st
                .tensors()
                .iter()
                .map(|(_, t)| t.data().len() as u64)
                .sum::<u64>();
        }
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
    if !share.holds(0) {
        // Another rank reads the single-file checkpoint whole.
        return Ok(Verified {
            step: 0,
            version: 0,
            world_size: 1,
            files: 0,
            bytes: 0,
        });
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
    pub skipped: Vec<(PathBuf, PassedOver)>,
}

/// Why a checkpoint was passed over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PassedOver {
    /// Not read: newer than the checkpoint [`LATEST`](super::LATEST) names, or named by it
    /// and gone (the same on every rank).
    Unread(String),
    /// This process's check of it failed: the file and field.
    Failed(String),
    /// Another rank's share of the check failed (that rank's [`PassedOver::Failed`] names
    /// the file).
    FailedElsewhere,
}

impl std::fmt::Display for PassedOver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PassedOver::Unread(why) | PassedOver::Failed(why) => f.write_str(why),
            PassedOver::FailedElsewhere => {
                f.write_str("a file another rank checked failed (that rank names it)")
            }
        }
    }
}

/// The warning that says checkpoint `dir` was passed over, and why.
pub fn skipped_line(dir: &Path, why: &PassedOver) -> String {
    format!(
        "stoker: warning: skipping checkpoint {}: {why}",
        dir.display()
    )
}

/// Walks the complete checkpoints under `root` newest first (a save without its commit
/// marker is not complete and not listed), from the one [`LATEST`](super::LATEST) names,
/// until one passes [`verify`].
pub fn latest_intact(root: &Path) -> Intact {
    let alone = |ok: bool| Ok(ok);
    latest_intact_on(root, Share::WHOLE, alone).expect("one process agrees with itself")
}

/// [`latest_intact`] checked by the ranks of a run together: each checks its `share` of
/// a checkpoint, and `all_passed` (a collective every rank calls once per checkpoint, in
/// the same order) says whether every rank's share passed. Every rank returns the same
/// choice and the same checkpoints passed over, each with this rank's reason.
pub fn latest_intact_on(
    root: &Path,
    share: Share,
    mut all_passed: impl FnMut(bool) -> Result<bool>,
) -> Result<Intact> {
    let (dirs, passed_over) = super::candidates(root);
    let mut out = Intact {
        skipped: passed_over
            .into_iter()
            .map(|(d, why)| (d, PassedOver::Unread(why)))
            .collect(),
        dir: None,
    };
    for dir in dirs {
        let mine = verify_share(&dir, share);
        if all_passed(mine.is_ok())? {
            out.dir = Some(dir);
            break;
        }
        let why = match mine {
            Err(e) => PassedOver::Failed(e.to_string()),
            Ok(_) => PassedOver::FailedElsewhere,
        };
        out.skipped.push((dir, why));
    }
    Ok(out)
}
