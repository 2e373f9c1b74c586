//! The naming convention every stoker format shares: a PREFIX plus a suffix per file
//! (`data/mnist/train` -> `train.image.npy`, `train.label.npy`; `shard` -> `shard.bin`,
//! `shard.vocab.json`; `photos` -> `photos.data`, `photos.index`, `photos.manifest.json`).

use std::path::{Path, PathBuf};

use crate::{DataError, Result};

/// `prefix` with `suffix` appended to its last component (not a new path component).
pub fn prefixed(prefix: &Path, suffix: &str) -> PathBuf {
    let mut p = prefix.as_os_str().to_os_string();
    p.push(suffix);
    PathBuf::from(p)
}

/// Creates the folder that will hold files named after `prefix`.
pub fn create_parent(prefix: &Path) -> Result<()> {
    match prefix.parent().filter(|d| !d.as_os_str().is_empty()) {
        Some(dir) => std::fs::create_dir_all(dir).map_err(|e| DataError::io(dir, e)),
        None => Ok(()),
    }
}
