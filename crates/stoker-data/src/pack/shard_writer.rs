//! Token shards as llm.c's data scripts write them: `PREFIX_val_000000.bin` first (the
//! first documents, whole, until `val_tokens` tokens), then `PREFIX_train_000001.bin`,
//! `..._000002.bin`, ... of `shard_tokens` tokens each (the last one shorter), every one
//! an llm.c shard (1024-byte header, u16 tokens). Tokens stream through one shard-sized
//! buffer.

use std::path::{Path, PathBuf};

use crate::paths::prefixed;
use crate::tokens::{write_tokens, TokenFormat};
use crate::{DataError, Result};

/// The shards written so far, split by split.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WrittenShards {
    /// Validation shards and their tokens.
    pub val: Vec<(PathBuf, usize)>,
    /// Training shards and their tokens.
    pub train: Vec<(PathBuf, usize)>,
}

impl WrittenShards {
    /// Tokens in `split`'s shards.
    pub fn tokens(split: &[(PathBuf, usize)]) -> usize {
        split.iter().map(|(_, n)| n).sum()
    }
}

/// Writes documents' tokens into validation and training shards.
pub struct ShardWriter {
    prefix: PathBuf,
    shard_tokens: usize,
    val_tokens: usize,
    /// Tokens of the shard being filled.
    buf: Vec<u16>,
    /// Whether the buffer is the validation shard's.
    in_val: bool,
    /// The next shard's number (the validation shard is 0).
    next: usize,
    written: WrittenShards,
}

impl ShardWriter {
    /// Shards named after `prefix`: the first documents up to `val_tokens` tokens in the
    /// validation shard (none for 0), then training shards of `shard_tokens` tokens.
    pub fn new(prefix: &Path, shard_tokens: usize, val_tokens: usize) -> Result<Self> {
        if shard_tokens == 0 || shard_tokens > i32::MAX as usize {
            return Err(DataError::Config {
                field: "shard_tokens",
                message: format!("{shard_tokens}: expected 1 to 2^31 - 1 tokens per shard"),
            });
        }
        let earlier = earlier_shards(prefix)?;
        if !earlier.is_empty() {
            let names: Vec<String> = earlier.iter().map(|p| p.display().to_string()).collect();
            return Err(DataError::format(
                prefix,
                "out",
                format!(
                    "a prefix with no shards yet, but an earlier pack's are there ({}): a glob \
                     like PREFIX_train_*.bin would read them with the new ones; remove them or \
                     choose another prefix",
                    names.join(", ")
                ),
            ));
        }
        Ok(ShardWriter {
            prefix: prefix.to_path_buf(),
            shard_tokens,
            val_tokens,
            buf: Vec::new(),
            in_val: val_tokens > 0,
            next: 1,
            written: WrittenShards::default(),
        })
    }

    /// Adds one document's tokens (its end-of-text token included): whole to the
    /// validation shard until it holds `val_tokens`, then across training shards.
    pub fn push(&mut self, doc: &[u16]) -> Result<()> {
        if self.in_val {
            self.buf.extend_from_slice(doc);
            if self.buf.len() >= self.val_tokens {
                self.flush(0)?;
                self.in_val = false;
            }
            return Ok(());
        }
        let mut rest = doc;
        while !rest.is_empty() {
            let room = self.shard_tokens - self.buf.len();
            let (now, later) = rest.split_at(room.min(rest.len()));
            self.buf.extend_from_slice(now);
            rest = later;
            if self.buf.len() == self.shard_tokens {
                let n = self.next;
                self.flush(n)?;
                self.next += 1;
            }
        }
        Ok(())
    }

    /// Writes what is left and returns every shard written.
    pub fn finish(mut self) -> Result<WrittenShards> {
        if !self.buf.is_empty() {
            let n = if self.in_val { 0 } else { self.next };
            self.flush(n)?;
        }
        Ok(self.written)
    }

    fn flush(&mut self, number: usize) -> Result<()> {
        let split = if number == 0 { "val" } else { "train" };
        let path = prefixed(&self.prefix, &format!("_{split}_{number:06}.bin"));
        write_tokens(&path, &self.buf, TokenFormat::Llmc)?;
        let entry = (path, self.buf.len());
        match number {
            0 => self.written.val.push(entry),
            _ => self.written.train.push(entry),
        }
        self.buf.clear();
        Ok(())
    }
}

/// The `PREFIX` of a shard this writer names, `PREFIX_train_000001.bin` or
/// `PREFIX_val_000000.bin`, or of a pattern over them (`PREFIX_train_*.bin`, as
/// `data.train` gives it): where `PREFIX.vocab.json` is. `None` for other names.
pub fn shard_prefix(shard: &Path) -> Option<PathBuf> {
    let name = shard.file_name()?.to_str()?;
    let stem = name.strip_suffix(".bin")?;
    ["_train_", "_val_"].iter().find_map(|split| {
        let (prefix, n) = stem.rsplit_once(split)?;
        let numbered = !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit());
        (!prefix.is_empty() && (numbered || n == "*")).then(|| shard.with_file_name(prefix))
    })
}

/// The shards already at `prefix` (`PREFIX_train_*.bin`, `PREFIX_val_*.bin`), by name.
fn earlier_shards(prefix: &Path) -> Result<Vec<PathBuf>> {
    let dir = match prefix.parent().filter(|d| !d.as_os_str().is_empty()) {
        Some(d) => d,
        None => Path::new("."),
    };
    let Some(stem) = prefix.file_name().and_then(|n| n.to_str()) else {
        return Ok(Vec::new());
    };
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(DataError::io(dir, e)),
    };
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| DataError::io(dir, e))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let path = entry.path();
        let ours = !name.contains('*')
            && shard_prefix(&path)
                .is_some_and(|p| p.file_name().and_then(|n| n.to_str()) == Some(stem));
        if ours {
            found.push(path);
        }
    }
    found.sort();
    Ok(found)
}
