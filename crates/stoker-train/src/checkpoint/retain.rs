//! Keeping a run's newest checkpoints and removing the older ones (`train.keep_checkpoints`,
//! torchtitan's `keep_latest_k`, Hugging Face's `save_total_limit`): a long run that
//! checkpoints often would otherwise fill its disk with states no resume takes.
//!
//! Only this timeline's committed checkpoints count ([`candidates`](super::candidates):
//! those up to the one `LATEST` names). Newer ones that an earlier resume left behind are
//! not this run's to remove, and a save without its commit marker is not a checkpoint.

use std::path::{Path, PathBuf};

/// Removes the committed checkpoints under `root` older than its newest `keep` (0 keeps
/// all), oldest first; returns each that could not be removed, with why (a removal that
/// fails costs disk, not the run: the caller warns).
pub fn remove_older(root: &Path, keep: usize) -> Vec<(PathBuf, String)> {
    let mut failed = Vec::new();
    if keep == 0 {
        return failed;
    }
    let (newest_first, _) = super::candidates(root);
    for dir in newest_first.into_iter().skip(keep).rev() {
        // What makes it complete goes first (the commit marker; a version 1-2
        // checkpoint's `state.json`): a removal cut short leaves no half-checkpoint that
        // a resume would take for complete.
        let markers = [super::sharded::COMMITTED, "state.json"].map(|m| dir.join(m));
        let gone = markers
            .iter()
            .filter(|m| m.exists())
            .try_for_each(std::fs::remove_file)
            .and_then(|()| std::fs::remove_dir_all(&dir));
        if let Err(e) = gone {
            failed.push((dir, e.to_string()));
        }
    }
    failed
}
