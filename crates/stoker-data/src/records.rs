//! Record shards: variable-length byte records (e.g. JPEG files) in three files.
//!
//! - `NAME.data`: the records back to back;
//! - `NAME.index`: `count + 1` little-endian u64 offsets into the data file (record `i` is
//!   `data[offset[i]..offset[i + 1]]`, `offset[0] = 0`, `offset[count]` = data size);
//! - `NAME.manifest.json`: format "stoker-records", version 1, the record count, and the byte
//!   size and crc32 of the data and index files. It is written last, so a shard with a manifest
//!   was completely written.
//!
//! [`RecordShard::open`] memory-maps both files and checks the manifest, both sizes and every
//! offset (monotone, inside the data file): reading the index is cheap (8 bytes a record) and
//! afterwards `get` cannot slice out of bounds. It does not compute the checksums: that reads
//! every byte of the data file (140 GB for ImageNet) at the start of every run; call
//! [`RecordShard::verify`] once after copying a shard, or when a decode error makes you doubt it.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use crate::mapped::Mapped;
use serde::{Deserialize, Serialize};

use crate::{DataError, Result};

/// The `format` field of every record manifest.
pub const RECORDS_FORMAT: &str = "stoker-records";
/// The manifest version this build writes and reads.
pub const RECORDS_VERSION: u32 = 1;

/// Size and checksum of one file of a shard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileDigest {
    /// Size in bytes.
    pub bytes: u64,
    /// crc32 (IEEE) of the whole file.
    pub crc32: u32,
}

/// The contents of `NAME.manifest.json` (unknown fields are refused: a manifest of a newer
/// layout carries a new version).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecordManifest {
    /// Always [`RECORDS_FORMAT`].
    pub format: String,
    /// The layout version, [`RECORDS_VERSION`].
    pub version: u32,
    /// Number of records.
    pub records: u64,
    /// The data file.
    pub data: FileDigest,
    /// The index file.
    pub index: FileDigest,
}

/// The three paths of the shard with prefix `prefix` (`out/train` -> `out/train.data`, ...).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordPaths {
    /// `PREFIX` itself.
    pub prefix: PathBuf,
    /// `PREFIX.data`.
    pub data: PathBuf,
    /// `PREFIX.index`.
    pub index: PathBuf,
    /// `PREFIX.manifest.json`.
    pub manifest: PathBuf,
}

impl RecordPaths {
    /// The paths for `prefix`; a path to the manifest itself is accepted too.
    pub fn new(prefix: impl AsRef<Path>) -> Self {
        let prefix = prefix.as_ref();
        let s = prefix.as_os_str().to_string_lossy();
        let base = match s.strip_suffix(".manifest.json") {
            Some(stem) => PathBuf::from(stem),
            None => prefix.to_path_buf(),
        };
        RecordPaths {
            data: with_suffix(&base, ".data"),
            index: with_suffix(&base, ".index"),
            manifest: with_suffix(&base, ".manifest.json"),
            prefix: base,
        }
    }

    /// A companion file of the shard, e.g. `sidecar(".labels.npy")` -> `PREFIX.labels.npy`.
    pub fn sidecar(&self, suffix: &str) -> PathBuf {
        with_suffix(&self.prefix, suffix)
    }
}

fn with_suffix(base: &Path, suffix: &str) -> PathBuf {
    crate::paths::prefixed(base, suffix)
}

/// A file being written, with its running size and checksum.
struct HashedFile {
    path: PathBuf,
    out: BufWriter<File>,
    crc: crc32fast::Hasher,
    bytes: u64,
}

impl HashedFile {
    fn create(path: PathBuf) -> Result<Self> {
        let file = File::create(&path).map_err(|e| DataError::io(&path, e))?;
        Ok(HashedFile {
            path,
            out: BufWriter::with_capacity(1 << 20, file),
            crc: crc32fast::Hasher::new(),
            bytes: 0,
        })
    }

    fn write(&mut self, buf: &[u8]) -> Result<()> {
        self.out
            .write_all(buf)
            .map_err(|e| DataError::io(&self.path, e))?;
        self.crc.update(buf);
        self.bytes += buf.len() as u64;
        Ok(())
    }

    fn finish(self) -> Result<FileDigest> {
        let file = self
            .out
            .into_inner()
            .map_err(|e| DataError::io(&self.path, e.into_error()))?;
        file.sync_all().map_err(|e| DataError::io(&self.path, e))?;
        Ok(FileDigest {
            bytes: self.bytes,
            crc32: self.crc.finalize(),
        })
    }
}

/// Appends byte records to a new shard; [`finish`](Self::finish) writes the manifest.
pub struct RecordWriter {
    paths: RecordPaths,
    data: HashedFile,
    index: HashedFile,
    records: u64,
}

impl RecordWriter {
    /// Creates (truncates) `PREFIX.data` and `PREFIX.index`.
    pub fn create(prefix: impl AsRef<Path>) -> Result<Self> {
        let paths = RecordPaths::new(prefix);
        let data = HashedFile::create(paths.data.clone())?;
        let mut index = HashedFile::create(paths.index.clone())?;
        index.write(&0u64.to_le_bytes())?;
        Ok(RecordWriter {
            paths,
            data,
            index,
            records: 0,
        })
    }

    /// Appends one record and returns its index.
    pub fn append(&mut self, record: &[u8]) -> Result<u64> {
        self.data.write(record)?;
        let end = self.data.bytes;
        self.index.write(&end.to_le_bytes())?;
        self.records += 1;
        Ok(self.records - 1)
    }

    /// Records appended so far.
    pub fn len(&self) -> u64 {
        self.records
    }

    /// True before the first append.
    pub fn is_empty(&self) -> bool {
        self.records == 0
    }

    /// Flushes and syncs both files, then writes the manifest.
    pub fn finish(self) -> Result<RecordManifest> {
        let manifest = RecordManifest {
            format: RECORDS_FORMAT.to_string(),
            version: RECORDS_VERSION,
            records: self.records,
            data: self.data.finish()?,
            index: self.index.finish()?,
        };
        let json = serde_json::to_string_pretty(&manifest).expect("manifest serializes");
        let path = &self.paths.manifest;
        std::fs::write(path, json + "\n").map_err(|e| DataError::io(path, e))?;
        Ok(manifest)
    }
}

/// A memory-mapped, validated record shard.
#[derive(Debug)]
pub struct RecordShard {
    paths: RecordPaths,
    manifest: RecordManifest,
    /// `None` for an empty data file, which cannot be mapped.
    data: Option<Mapped>,
    index: Mapped,
}

fn map(path: &Path) -> Result<(File, u64)> {
    let file = crate::mapped::open_file(path)?;
    let len = file.metadata().map_err(|e| DataError::io(path, e))?.len();
    Ok((file, len))
}

impl RecordShard {
    /// Bytes of the shard's mapped files (data and index).
    pub fn mapped_bytes(&self) -> u64 {
        (self.data.as_ref().map_or(0, |d| d.len()) + self.index.len()) as u64
    }

    /// Opens the shard at `prefix` (or its manifest path) and validates manifest, sizes and
    /// offsets; see the module docs for why checksums wait for [`verify`](Self::verify).
    pub fn open(prefix: impl AsRef<Path>) -> Result<Self> {
        let paths = RecordPaths::new(prefix);
        let manifest = read_manifest(&paths.manifest)?;
        let (data_file, data_len) = map(&paths.data)?;
        let (index_file, index_len) = map(&paths.index)?;
        let size_err = |path: &Path, found: u64, expected: u64| {
            let what = if found < expected {
                "truncated"
            } else {
                "too long"
            };
            DataError::format(
                path,
                "size",
                format!("{what}: {found} bytes, the manifest says {expected} (re-copy or re-pack the shard)"),
            )
        };
        if data_len != manifest.data.bytes {
            return Err(size_err(&paths.data, data_len, manifest.data.bytes));
        }
        let expected_index = manifest
            .records
            .checked_add(1)
            .and_then(|n| n.checked_mul(8));
        if expected_index != Some(manifest.index.bytes) {
            return Err(DataError::format(
                &paths.manifest,
                "index.bytes",
                format!(
                    "{} for {} records (expected 8 x (records + 1))",
                    manifest.index.bytes, manifest.records
                ),
            ));
        }
        if index_len != manifest.index.bytes {
            return Err(size_err(&paths.index, index_len, manifest.index.bytes));
        }
        // A file truncated by another process while mapped ends in `Mapped`'s handler.
        let index = Mapped::map(&index_file, &paths.index)?;
        let data = if data_len == 0 {
            None
        } else {
            Some(Mapped::map(&data_file, &paths.data)?)
        };
        let shard = RecordShard {
            paths,
            manifest,
            data,
            index,
        };
        shard.check_offsets(data_len)?;
        Ok(shard)
    }

    fn offset(&self, i: usize) -> u64 {
        let b = &self.index[i * 8..i * 8 + 8];
        u64::from_le_bytes(b.try_into().expect("8 bytes"))
    }

    fn check_offsets(&self, data_len: u64) -> Result<()> {
        let path = &self.paths.index;
        if self.offset(0) != 0 {
            return Err(DataError::format(
                path,
                "offset[0]",
                format!("{} (expected 0)", self.offset(0)),
            ));
        }
        let mut prev = 0;
        for i in 1..=self.len() {
            let off = self.offset(i);
            if off < prev {
                return Err(DataError::format(
                    path,
                    format!("offset[{i}]"),
                    format!(
                        "{off} is below offset[{}] = {prev}: offsets must not decrease",
                        i - 1
                    ),
                ));
            }
            if off > data_len {
                return Err(DataError::format(
                    path,
                    format!("offset[{i}]"),
                    format!(
                        "{off} is past the end of {} ({data_len} bytes)",
                        self.paths.data.display()
                    ),
                ));
            }
            prev = off;
        }
        if prev != data_len {
            return Err(DataError::format(
                path,
                format!("offset[{}]", self.len()),
                format!("{prev} (expected the data file size {data_len})"),
            ));
        }
        Ok(())
    }

    /// Number of records.
    pub fn len(&self) -> usize {
        self.manifest.records as usize
    }

    /// True when the shard holds no records.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Record `i`, or `None` when `i >= len()`.
    pub fn get(&self, i: usize) -> Option<&[u8]> {
        if i >= self.len() {
            return None;
        }
        let (start, end) = (self.offset(i) as usize, self.offset(i + 1) as usize);
        Some(self.data.as_ref().map_or(&[][..], |d| &d[start..end]))
    }

    /// The manifest read at open.
    pub fn manifest(&self) -> &RecordManifest {
        &self.manifest
    }

    /// The shard's file paths.
    pub fn paths(&self) -> &RecordPaths {
        &self.paths
    }

    /// Computes the crc32 of the data and index files and compares them with the manifest.
    /// Reads every byte of the data file.
    pub fn verify(&self) -> Result<()> {
        let data: &[u8] = self.data.as_deref().unwrap_or(&[]);
        for (path, bytes, digest) in [
            (&self.paths.data, data, &self.manifest.data),
            (&self.paths.index, &self.index[..], &self.manifest.index),
        ] {
            let crc = crc32fast::hash(bytes);
            if crc != digest.crc32 {
                return Err(DataError::format(
                    path,
                    "crc32",
                    format!("checksum mismatch: {crc:#010x}, the manifest says {:#010x} (the file is corrupt: re-copy or re-pack it)", digest.crc32),
                ));
            }
        }
        Ok(())
    }
}

fn read_manifest(path: &Path) -> Result<RecordManifest> {
    let text = std::fs::read_to_string(path).map_err(|e| DataError::io(path, e))?;
    let value: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| DataError::format(path, "json", format!("not valid JSON: {e}")))?;
    let format = value.get("format").and_then(|v| v.as_str()).unwrap_or("");
    if format != RECORDS_FORMAT {
        return Err(DataError::format(
            path,
            "format",
            format!("{format:?} (expected {RECORDS_FORMAT:?})"),
        ));
    }
    match value.get("version").and_then(|v| v.as_u64()) {
        Some(v) if v == u64::from(RECORDS_VERSION) => {}
        other => {
            return Err(DataError::format(
                path,
                "version",
                format!(
                    "unknown version {} (this build reads version {RECORDS_VERSION}; re-pack with this stoker or use a matching one)",
                    other.map_or("(missing)".to_string(), |v| v.to_string())
                ),
            ))
        }
    }
    serde_json::from_value(value).map_err(|e| DataError::format(path, "manifest", e.to_string()))
}
