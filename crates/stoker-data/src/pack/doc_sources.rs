//! Documents read from users' files, a batch at a time so that memory stays flat in the
//! input's size: Parquet (the Hugging Face hub's format: one string column, read row
//! group by row group) and JSON Lines (one object per line, one string field). Every
//! error names the file, the row group or line, and the field.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use arrow_array::{Array, LargeStringArray, RecordBatch, StringArray, StringViewArray};
use parquet::arrow::arrow_reader::{
    ArrowReaderOptions, ParquetRecordBatchReader, ParquetRecordBatchReaderBuilder,
};
use parquet::arrow::ProjectionMask;

use crate::{DataError, Result};

/// Documents a JSON Lines batch holds at most (a Parquet batch is one row group's rows,
/// as many at a time).
pub const JSONL_BATCH: usize = 4096;

/// Where documents come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DocFormat {
    /// Apache Parquet, a string column.
    Parquet,
    /// JSON Lines, a string field of each object.
    Jsonl,
}

impl DocFormat {
    /// The format a file's name says (`.parquet`, `.jsonl` / `.json` / `.ndjson`, in any
    /// case).
    pub fn of(path: &Path) -> Option<DocFormat> {
        match path.extension()?.to_str()?.to_ascii_lowercase().as_str() {
            "parquet" => Some(DocFormat::Parquet),
            "jsonl" | "ndjson" | "json" => Some(DocFormat::Jsonl),
            _ => None,
        }
    }
}

/// The files [`expand_inputs`] found: those it reads, and those it passed over.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct InputFiles {
    /// The Parquet and JSON Lines files, each with its format, in the order read.
    pub read: Vec<(PathBuf, DocFormat)>,
    /// Files inside the directories given that are neither (a dataset card, a licence),
    /// for the caller to name: nothing is dropped without a word. Hidden entries (`.git`,
    /// `.cache`, `.gitattributes`) are not listed.
    pub passed_over: Vec<PathBuf>,
}

/// The input files of `inputs` in the order given, a directory standing for the Parquet
/// and JSON Lines files under it, its sub-directories included (a hub dataset's
/// `data/train-00000-of-00042.parquet`), in path order. A compressed one
/// (`.jsonl.gz`, `.parquet.zst`) is refused rather than passed over: it is data that
/// this reader cannot read.
pub fn expand_inputs(inputs: &[PathBuf]) -> Result<InputFiles> {
    let mut found = InputFiles::default();
    for input in inputs {
        if input.is_dir() {
            let mut files = Vec::new();
            walk(input, 0, &mut files)?;
            files.sort();
            let before = found.read.len();
            for p in files {
                match DocFormat::of(&p) {
                    Some(f) => found.read.push((p, f)),
                    None if compressed_docs(&p) => return Err(compressed_error(&p)),
                    None => found.passed_over.push(p),
                }
            }
            if found.read.len() == before {
                return Err(DataError::format(
                    input,
                    "inputs",
                    "a directory with no .parquet or .jsonl files (sub-directories included)",
                ));
            }
        } else {
            let f = DocFormat::of(input).ok_or_else(|| {
                if compressed_docs(input) {
                    compressed_error(input)
                } else {
                    DataError::format(
                        input,
                        "inputs",
                        "expected a .parquet or .jsonl file (or a directory of them)",
                    )
                }
            })?;
            found.read.push((input.clone(), f));
        }
    }
    Ok(found)
}

/// How deep [`walk`] goes below a directory given: deeper is a link that loops.
const MAX_DEPTH: usize = 32;

/// Every file under `dir` (`depth` below a directory given), hidden entries left out.
fn walk(dir: &Path, depth: usize, files: &mut Vec<PathBuf>) -> Result<()> {
    if depth > MAX_DEPTH {
        return Err(DataError::format(
            dir,
            "inputs",
            "a directory at most 32 levels below an input (does a link loop?)",
        ));
    }
    for entry in std::fs::read_dir(dir).map_err(|e| DataError::io(dir, e))? {
        let path = entry.map_err(|e| DataError::io(dir, e))?.path();
        if path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with('.'))
        {
            continue;
        }
        if path.is_dir() {
            walk(&path, depth + 1, files)?;
        } else {
            files.push(path);
        }
    }
    Ok(())
}

/// Whether `path` names a compressed Parquet or JSON Lines file (`x.jsonl.gz`).
fn compressed_docs(path: &Path) -> bool {
    let compressed = path.extension().and_then(|e| e.to_str()).is_some_and(|e| {
        ["gz", "zst", "bz2", "xz", "lz4", "zip"].contains(&e.to_ascii_lowercase().as_str())
    });
    compressed
        && path
            .file_stem()
            .is_some_and(|s| DocFormat::of(Path::new(s)).is_some())
}

fn compressed_error(path: &Path) -> DataError {
    DataError::format(
        path,
        "inputs",
        "a compressed file: decompress it first (e.g. gunzip -k); .parquet and .jsonl are read as they are",
    )
}

/// One batch of documents and where it came from (for messages).
pub struct DocBatch {
    /// The documents, in file order.
    pub docs: Vec<String>,
}

/// The batches of documents of one file.
pub enum DocSource {
    /// A Parquet file's column, row group by row group.
    Parquet(ParquetDocs),
    /// A JSON Lines file's field, [`JSONL_BATCH`] lines at a time.
    Jsonl(JsonlDocs),
}

impl DocSource {
    /// Opens `path` as `format`, reading `field` (a Parquet column, a JSON Lines key).
    pub fn open(path: &Path, format: DocFormat, field: &str) -> Result<DocSource> {
        Ok(match format {
            DocFormat::Parquet => DocSource::Parquet(ParquetDocs::open(path, field)?),
            DocFormat::Jsonl => DocSource::Jsonl(JsonlDocs::open(path, field)?),
        })
    }

    /// The next batch, None at the end of the file.
    pub fn next_batch(&mut self) -> Result<Option<DocBatch>> {
        match self {
            DocSource::Parquet(p) => p.next_batch(),
            DocSource::Jsonl(j) => j.next_batch(),
        }
    }
}

/// A Parquet file's string column, read row group by row group.
pub struct ParquetDocs {
    path: PathBuf,
    field: String,
    reader: ParquetRecordBatchReader,
    /// Rows per row group, to name the row group of a batch.
    group_rows: Vec<i64>,
    /// Rows read so far.
    rows: i64,
}

impl ParquetDocs {
    /// Opens `path` and checks that it has a string column `field`.
    pub fn open(path: &Path, field: &str) -> Result<ParquetDocs> {
        let bad = |what: &str, message: String| DataError::format(path, what, message);
        let file = File::open(path).map_err(|e| DataError::io(path, e))?;
        // The Arrow schema a writer embeds is a hint only (the Parquet schema says the
        // same); decoding a damaged one panics inside arrow-ipc, so it is not read.
        let options = ArrowReaderOptions::new().with_skip_arrow_metadata(true);
        let builder = guarded(path, "footer", || {
            ParquetRecordBatchReaderBuilder::try_new_with_options(file, options)
        })?
        .map_err(|e| {
            bad(
                "footer",
                format!("not a readable Parquet file (truncated, or another format): {e}"),
            )
        })?;
        let schema = builder.schema().clone();
        let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
        let Some(index) = names.iter().position(|n| *n == field) else {
            return Err(bad(
                field,
                format!("no such column (the file has {names:?}): name it with --column"),
            ));
        };
        let dt = schema.field(index).data_type().clone();
        use arrow_schema::DataType;
        if !matches!(
            dt,
            DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View
        ) {
            return Err(bad(field, format!("a column of {dt}, expected strings")));
        }
        let meta = builder.metadata().clone();
        let group_rows: Vec<i64> = meta.row_groups().iter().map(|g| g.num_rows()).collect();
        let mask = ProjectionMask::roots(meta.file_metadata().schema_descr(), [index]);
        // One batch per row group at most (the reader does not cross a row group's end
        // when the batch holds all of it); memory is bounded by the largest row group.
        let batch_rows = group_rows.iter().copied().max().unwrap_or(1).max(1) as usize;
        let reader = builder
            .with_projection(mask)
            .with_batch_size(batch_rows.min(65_536))
            .build()
            .map_err(|e| bad("row group 0", e.to_string()))?;
        Ok(ParquetDocs {
            path: path.to_path_buf(),
            field: field.to_string(),
            reader,
            group_rows,
            rows: 0,
        })
    }

    /// The row group holding row `row`.
    fn group_of(&self, row: i64) -> usize {
        let mut end = 0;
        for (g, n) in self.group_rows.iter().enumerate() {
            end += n;
            if row < end {
                return g;
            }
        }
        self.group_rows.len()
    }

    fn next_batch(&mut self) -> Result<Option<DocBatch>> {
        let group = self.group_of(self.rows);
        let where_ = || format!("row group {group}, column {}", self.field);
        let place = where_();
        let reader = &mut self.reader;
        let batch: RecordBatch = match guarded(&self.path, &place, || reader.next())? {
            None => return Ok(None),
            Some(b) => b.map_err(|e| DataError::format(&self.path, where_(), e.to_string()))?,
        };
        let col = batch.column(0);
        let mut docs = Vec::with_capacity(col.len());
        let null = |i: usize| {
            DataError::format(
                &self.path,
                where_(),
                format!("row {} is null, expected a string", self.rows + i as i64),
            )
        };
        macro_rules! strings {
            ($t:ty) => {{
                let a = col.as_any().downcast_ref::<$t>().expect("checked type");
                for i in 0..a.len() {
                    if a.is_null(i) {
                        return Err(null(i));
                    }
                    docs.push(a.value(i).to_string());
                }
            }};
        }
        use arrow_schema::DataType;
        match col.data_type() {
            DataType::Utf8 => strings!(StringArray),
            DataType::LargeUtf8 => strings!(LargeStringArray),
            DataType::Utf8View => strings!(StringViewArray),
            other => {
                return Err(DataError::format(
                    &self.path,
                    where_(),
                    format!("a column of {other}, expected strings"),
                ))
            }
        }
        self.rows += docs.len() as i64;
        Ok(Some(DocBatch { docs }))
    }
}

/// `read()`, with a panic inside the Parquet reader (it trusts lengths and offsets in the
/// file: a damaged one can send it out of bounds) turned into an error naming the file and
/// `place`. Nothing read after the panic is used: the reader is dropped with the error.
fn guarded<T>(path: &Path, place: &str, read: impl FnOnce() -> T) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(read)).map_err(|payload| {
        let why = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or("no message");
        DataError::format(
            path,
            place.to_string(),
            format!("the Parquet reader failed on damaged data ({why}): the file is corrupt"),
        )
    })
}

/// A JSON Lines file's string field, a batch of lines at a time.
pub struct JsonlDocs {
    path: PathBuf,
    field: String,
    lines: BufReader<File>,
    /// Lines read so far (1-based numbers in messages).
    line: usize,
}

impl JsonlDocs {
    /// Opens `path`, whose objects carry the string `field`.
    pub fn open(path: &Path, field: &str) -> Result<JsonlDocs> {
        let file = File::open(path).map_err(|e| DataError::io(path, e))?;
        Ok(JsonlDocs {
            path: path.to_path_buf(),
            field: field.to_string(),
            lines: BufReader::with_capacity(1 << 20, file),
            line: 0,
        })
    }

    fn next_batch(&mut self) -> Result<Option<DocBatch>> {
        let mut docs = Vec::new();
        let mut buf = Vec::new();
        while docs.len() < JSONL_BATCH {
            buf.clear();
            let n = self
                .lines
                .read_until(b'\n', &mut buf)
                .map_err(|e| DataError::io(&self.path, e))?;
            if n == 0 {
                break;
            }
            self.line += 1;
            let at = || format!("line {}", self.line);
            let text = std::str::from_utf8(&buf).map_err(|e| {
                DataError::format(
                    &self.path,
                    at(),
                    format!("not UTF-8 at byte {} of the line", e.valid_up_to()),
                )
            })?;
            let text = text.trim();
            if text.is_empty() {
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(text).map_err(|e| {
                let hint = match e.is_eof() {
                    true => " (the line ends early: a truncated file?)",
                    false => "",
                };
                DataError::format(&self.path, at(), format!("not a JSON object: {e}{hint}"))
            })?;
            match v.get(&self.field) {
                Some(serde_json::Value::String(s)) => docs.push(s.clone()),
                Some(other) => {
                    return Err(DataError::format(
                        &self.path,
                        format!("{}, field {}", at(), self.field),
                        format!("a {}, expected a string", json_kind(other)),
                    ))
                }
                None => {
                    return Err(DataError::format(
                        &self.path,
                        format!("{}, field {}", at(), self.field),
                        "missing: name the text field with --column".to_string(),
                    ))
                }
            }
        }
        Ok((!docs.is_empty()).then_some(DocBatch { docs }))
    }
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "boolean",
        serde_json::Value::Number(_) => "number",
        serde_json::Value::String(_) => "string",
        serde_json::Value::Array(_) => "array",
        serde_json::Value::Object(_) => "object",
    }
}
