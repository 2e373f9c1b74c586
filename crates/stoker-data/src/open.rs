//! Opening a dataset from a path, for tools that take "DATASET" on the command line.
//!
//! The path says what it is: `X.npy` (one array, field `data`), `X.bin` (a token shard,
//! nanoGPT or llm.c; `X_*.bin` every shard that matches, in name order), a prefix with `PREFIX.manifest.json` (JPEG records + labels), or a prefix
//! with `PREFIX.FIELD.npy` arrays (e.g. `mnist/train` -> `train.image.npy`, `train.label.npy`).

use std::path::{Path, PathBuf};

use crate::image_folder::ImageRecordDataset;
use crate::npy::NpyArray;
use crate::records::RecordPaths;
use crate::transform::{ImageScratch, ImageTransformConfig};
use crate::{
    ArrayDataset, DType, DataError, Dataset, FieldSpec, MappedBytes, Result, SampleContext,
    TokenShard, TokenWindows,
};

/// Options for the formats that need them.
#[derive(Debug, Clone)]
pub struct OpenOptions {
    /// Tokens per window for token shards.
    pub context: usize,
    /// Integer type token windows are delivered in.
    pub token_dtype: DType,
    /// The ids token windows may hold, checked as each window is read (None: not
    /// checked).
    pub token_vocab: Option<crate::tokens::IdLimit>,
    /// Transform applied to JPEG records.
    pub image: ImageTransformConfig,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            context: 256,
            token_dtype: DType::I64,
            token_vocab: None,
            image: ImageTransformConfig::default(),
        }
    }
}

/// Any dataset stoker can open from a path.
pub enum AnyDataset {
    /// `.npy` arrays.
    Arrays(ArrayDataset),
    /// Token windows.
    Tokens(TokenWindows),
    /// JPEG records with labels.
    Images(Box<ImageRecordDataset>),
}

/// Per-worker scratch for [`AnyDataset`].
#[derive(Default)]
pub struct AnyWorker {
    image: ImageScratch,
}

impl AnyDataset {
    /// A one-word name of the format, for reports.
    pub fn kind(&self) -> &'static str {
        match self {
            AnyDataset::Arrays(_) => "npy",
            AnyDataset::Tokens(_) => "tokens",
            AnyDataset::Images(_) => "jpeg-records",
        }
    }
}

/// Opens `path` as described in the module docs.
pub fn open_dataset(path: impl AsRef<Path>, opts: &OpenOptions) -> Result<AnyDataset> {
    let path = path.as_ref();
    let ext = extension(path);
    if ext == "npy" {
        return Ok(AnyDataset::Arrays(ArrayDataset::new(vec![(
            "data".into(),
            NpyArray::open(path)?,
        )])?));
    }
    if ext == "bin" {
        let shards = token_shards(path)?;
        let tokens: usize = shards.iter().map(TokenShard::len).sum();
        let (count, longest) = (shards.len(), shards.iter().map(TokenShard::len).max());
        let windows = TokenWindows::new(shards, opts.context, opts.token_dtype)?;
        if crate::dataset::Dataset::len(&windows) == 0 {
            let need = opts.context + 1;
            let message = match (count, longest) {
                (2.., Some(longest)) => format!(
                    "{tokens} tokens in {count} shards, the longest {longest}: a window never \
                     spans shards, and none holds context {} + 1 = {need} (pack with a larger \
                     --shard-tokens, or use a shorter model.context)",
                    opts.context
                ),
                _ => format!(
                    "{tokens} tokens: not one window of context {} + 1 (the next-token target)",
                    opts.context
                ),
            };
            return Err(DataError::format(path, "tokens", message));
        }
        return Ok(AnyDataset::Tokens(match opts.token_vocab {
            Some(v) => windows.with_vocab(v),
            None => windows,
        }));
    }
    let records = RecordPaths::new(path);
    if records.manifest.exists() {
        let images = ImageRecordDataset::open(path, opts.image.clone())?;
        return Ok(AnyDataset::Images(Box::new(images)));
    }
    // Records whose manifest is missing were not completely written (the manifest comes
    // last) or not completely copied; without this check their labels alone would open as
    // an array dataset.
    if records.data.exists() || records.index.exists() {
        return Err(DataError::format(
            &records.manifest,
            "manifest",
            format!(
                "missing, but {} exists: record shards write their manifest last, so these were not completely written or copied",
                if records.data.exists() { records.data.display() } else { records.index.display() }
            ),
        ));
    }
    let fields = npy_fields(path)?;
    if fields.is_empty() {
        return Err(DataError::not_found(
            path,
            "DATASET",
            "not found: expected a .npy file, a .bin token shard, a PREFIX with PREFIX.manifest.json (JPEG records), or a PREFIX with PREFIX.FIELD.npy arrays",
        ));
    }
    let names: Vec<&str> = fields.iter().map(String::as_str).collect();
    Ok(AnyDataset::Arrays(ArrayDataset::open_prefix(path, &names)?))
}

/// `path`'s extension in lower case (`T.BIN` is a token shard as `t.bin` is).
fn extension(path: &Path) -> String {
    path.extension()
        .and_then(|e| e.to_str())
        .unwrap_or("")
        .to_ascii_lowercase()
}

/// The files [`open_dataset`] reads for `path`: the `.npy`, the token shards a pattern
/// names, a record set's data and index, or a prefix's `PREFIX.FIELD.npy` arrays. Empty
/// where `path` names none (opening it says why).
pub fn dataset_files(path: impl AsRef<Path>) -> Vec<PathBuf> {
    let path = path.as_ref();
    match extension(path).as_str() {
        "npy" => vec![path.to_path_buf()],
        "bin" => shard_paths(path).unwrap_or_default(),
        _ => {
            let records = RecordPaths::new(path);
            if records.manifest.exists() {
                return vec![records.data, records.index];
            }
            npy_fields(path)
                .unwrap_or_default()
                .iter()
                .map(|f| crate::paths::prefixed(path, &format!(".{f}.npy")))
                .collect()
        }
    }
}

/// The token shards `path` names: one file, or with a `*` in its file name every file of
/// its directory that matches, in name order (`data/fineweb/fineweb_train_*.bin`, as
/// `stoker pack docs` writes them).
fn token_shards(path: &Path) -> Result<Vec<TokenShard>> {
    shard_paths(path)?
        .iter()
        .map(TokenShard::open_detect)
        .collect()
}

/// The paths of [`token_shards`].
fn shard_paths(path: &Path) -> Result<Vec<PathBuf>> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let Some((head, tail)) = name.split_once('*') else {
        return Ok(vec![path.to_path_buf()]);
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(|e| DataError::io(&dir, e))?
        .filter_map(|e| e.ok())
        .filter(|e| {
            let n = e.file_name();
            let n = n.to_string_lossy();
            n.len() >= head.len() + tail.len() && n.starts_with(head) && n.ends_with(tail)
        })
        .map(|e| e.path())
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(DataError::not_found(
            path,
            "shards",
            "no file matches the pattern",
        ));
    }
    Ok(files)
}

/// Field names of the `PREFIX.FIELD.npy` files beside `prefix`, sorted.
fn npy_fields(prefix: &Path) -> Result<Vec<String>> {
    let dir = match prefix.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let stem = prefix
        .file_name()
        .and_then(|s| s.to_str())
        .unwrap_or("")
        .to_string()
        + ".";
    let entries = match std::fs::read_dir(&dir) {
        Ok(e) => e,
        Err(_) => return Ok(Vec::new()),
    };
    let mut fields: Vec<String> = entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|n| Some(n.strip_prefix(&stem)?.strip_suffix(".npy")?.to_string()))
        .filter(|f| !f.is_empty() && !f.contains('.'))
        .collect();
    fields.sort();
    Ok(fields)
}

impl Dataset for AnyDataset {
    type Worker = AnyWorker;

    fn len(&self) -> usize {
        match self {
            AnyDataset::Arrays(d) => d.len(),
            AnyDataset::Tokens(d) => d.len(),
            AnyDataset::Images(d) => d.len(),
        }
    }

    fn fields(&self) -> &[FieldSpec] {
        match self {
            AnyDataset::Arrays(d) => d.fields(),
            AnyDataset::Tokens(d) => d.fields(),
            AnyDataset::Images(d) => d.fields(),
        }
    }

    fn read_sample(
        &self,
        w: &mut AnyWorker,
        ctx: SampleContext,
        out: &mut [&mut [u8]],
    ) -> Result<()> {
        match self {
            AnyDataset::Arrays(d) => d.read_sample(&mut (), ctx, out),
            AnyDataset::Tokens(d) => d.read_sample(&mut (), ctx, out),
            AnyDataset::Images(d) => d.read_sample(&mut w.image, ctx, out),
        }
    }

    fn mapped_run(&self, field: usize, start: usize, count: usize) -> Option<MappedBytes> {
        match self {
            AnyDataset::Arrays(d) => d.mapped_run(field, start, count),
            AnyDataset::Tokens(d) => d.mapped_run(field, start, count),
            AnyDataset::Images(d) => d.mapped_run(field, start, count),
        }
    }

    fn mapped_bytes(&self) -> u64 {
        match self {
            AnyDataset::Arrays(d) => d.mapped_bytes(),
            AnyDataset::Tokens(d) => d.mapped_bytes(),
            AnyDataset::Images(d) => d.mapped_bytes(),
        }
    }
}
