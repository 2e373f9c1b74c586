//! One run at a time in a run directory: rank 0 holds an advisory lock on
//! `run_dir/.lock` for its whole run. Two runs writing one directory would delete each
//! other's checkpoint saves in progress, interleave their metrics and leave checkpoints
//! of one inside the other's history; the second is refused instead, naming the first's
//! process. The kernel drops the lock when the holder exits, however it ends, so a killed
//! run leaves nothing to clean up.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::Path;

use crate::error::{config_err, io_err, Result};

/// The lock, held while this value lives.
pub(super) struct RunDirLock {
    _file: Option<File>,
}

impl RunDirLock {
    /// Takes `run_dir`'s lock, creating the directory; refuses where another process
    /// holds it. Where the file system cannot lock (some network mounts), warns and goes
    /// on unlocked.
    pub fn take(run_dir: &Path) -> Result<RunDirLock> {
        std::fs::create_dir_all(run_dir).map_err(|e| io_err(run_dir, e))?;
        let path = run_dir.join(".lock");
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| io_err(&path, e))?;
        match file.try_lock() {
            Ok(()) => {
                // The holder's pid, for the message a second run prints.
                let pid = format!("{}\n", std::process::id());
                file.set_len(0)
                    .and_then(|_| file.rewind())
                    .and_then(|_| file.write_all(pid.as_bytes()))
                    .map_err(|e| io_err(&path, e))?;
                Ok(RunDirLock { _file: Some(file) })
            }
            Err(TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = match holder.trim() {
                    "" => "another process".to_string(),
                    pid => format!("process {pid}"),
                };
                Err(config_err(
                    "run_dir",
                    format!(
                        "{} is in use by another run ({holder} holds {}): two runs in one \
                         run_dir would delete each other's checkpoint saves and mix their \
                         metrics; wait for it to end, or choose another run_dir",
                        run_dir.display(),
                        path.display()
                    ),
                ))
            }
            Err(TryLockError::Error(e)) => {
                tracing::warn!(
                    "could not lock {} ({e}): nothing stops a second run from writing {} at \
                     the same time",
                    path.display(),
                    run_dir.display()
                );
                Ok(RunDirLock { _file: None })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A second taker is refused naming the first's process (flock's locks belong to
    /// open files, so a second open in one process conflicts as another process's does);
    /// once the first is dropped the directory is free again.
    #[test]
    fn a_second_run_is_refused_until_the_first_ends() {
        let dir = tempfile::tempdir().unwrap();
        let run_dir = dir.path().join("run");
        let first = RunDirLock::take(&run_dir).unwrap();
        let e = RunDirLock::take(&run_dir).err().unwrap().to_string();
        assert!(
            e.contains("is in use by another run")
                && e.contains(&format!("process {}", std::process::id())),
            "{e}"
        );
        drop(first);
        RunDirLock::take(&run_dir).unwrap();
    }
}
