//! What checkpoints and exported models share: files written and synced to disk before
//! anything depends on them, errors that name the model file, and the little-endian
//! f32s safetensors stores.

use std::io::Write;
use std::path::Path;

use crate::error::{io_err, Result, TrainError};

/// Writes `bytes` to `path` and fsyncs it.
pub(crate) fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    write_synced_with(path, bytes, || {})
}

/// [`write_synced`], calling `before_sync` between the write and the fsync (where the
/// crash tests stop a save).
pub(crate) fn write_synced_with(
    path: &Path,
    bytes: &[u8],
    before_sync: impl FnOnce(),
) -> Result<()> {
    let mut f = std::fs::File::create(path).map_err(|e| io_err(path, e))?;
    f.write_all(bytes).map_err(|e| io_err(path, e))?;
    before_sync();
    f.sync_all().map_err(|e| io_err(path, e))
}

/// Gives `path` the permissions a file created now gets (0666 less the umask, as the
/// checkpoint's manifest gets): safetensors writes through a temporary file, created
/// 0600, which teammates sharing a project directory could not read. The mode is taken
/// from a probe file beside `path` (reading the umask would set it, process-wide).
pub(crate) fn give_created_mode(path: &Path) -> Result<()> {
    let probe = path.with_extension("mode-probe");
    let mode = std::fs::File::create(&probe)
        .and_then(|f| f.metadata())
        .map(|m| m.permissions())
        .map_err(|e| io_err(&probe, e))?;
    std::fs::remove_file(&probe).map_err(|e| io_err(&probe, e))?;
    std::fs::set_permissions(path, mode).map_err(|e| io_err(path, e))
}

/// An error in the checkpoint or model file `path`.
pub(crate) fn ckpt_err(path: &Path, e: impl std::fmt::Display) -> TrainError {
    TrainError::Checkpoint {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

/// Little-endian f32s from bytes.
pub(crate) fn f32s(bytes: &[u8]) -> impl Iterator<Item = f32> + '_ {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
}
