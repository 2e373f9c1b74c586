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

/// Checks that `prefix` names files, not a folder: `outdir/` (or an existing folder)
/// would write `outdir/_train_000000.bin` and a hidden `outdir/.vocab.json`, and an earlier
/// pack's shards there would go unseen (they are looked for as `PREFIX_*` beside it).
pub fn check_prefix(prefix: &Path) -> Result<()> {
    let text = prefix.as_os_str().as_encoded_bytes();
    let folder =
        text.is_empty() || text.ends_with(b"/") || prefix.file_name().is_none() || prefix.is_dir();
    match folder {
        true => Err(DataError::Config {
            field: "output prefix",
            message: format!(
                "{:?} names a folder; an output prefix begins the names of the files to \
                 write: {:?} writes files named {name}.* and {name}_* in that folder",
                prefix.display().to_string(),
                prefix.join("name").display().to_string(),
                name = prefix.join("name").display(),
            ),
        }),
        false => Ok(()),
    }
}

/// Creates the folder that will hold files named after `prefix` (each `stoker pack`
/// has called [`check_prefix`] on it first, before reading its inputs).
pub fn create_parent(prefix: &Path) -> Result<()> {
    match prefix.parent().filter(|d| !d.as_os_str().is_empty()) {
        Some(dir) => std::fs::create_dir_all(dir).map_err(|e| DataError::io(dir, e)),
        None => Ok(()),
    }
}
