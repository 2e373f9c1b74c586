//! Documents read from users' files, a batch at a time so that memory stays flat in the
//! input's size: Parquet (the Hugging Face hub's format: one string column, read row
//! group by row group) and JSON Lines (one object per line, one string field). Every
//! error names the file, the row group or line, and the field.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use arrow_array::{Array, LargeStringArray, RecordBatch, StringArray, StringViewArray};
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReader,
    ParquetRecordBatchReaderBuilder,
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

    /// Unpaired UTF-16 surrogates read as U+FFFD so far (JSON Lines), and the first line
    /// that held one; None where there was none.
    pub fn surrogates_replaced(&self) -> Option<(usize, usize)> {
        match self {
            DocSource::Jsonl(j) => j.first_surrogate_line.map(|line| (j.surrogates, line)),
            DocSource::Parquet(_) => None,
        }
    }
}

/// A Parquet file's string column, read row group by row group.
pub struct ParquetDocs {
    path: PathBuf,
    field: String,
    file: File,
    meta: ArrowReaderMetadata,
    mask: ProjectionMask,
    /// Rows per row group.
    group_rows: Vec<i64>,
    /// The row group being read, and its reader (None before its first batch).
    group: usize,
    reader: Option<ParquetRecordBatchReader>,
    /// Rows of this row group read so far.
    rows_in_group: i64,
}

impl ParquetDocs {
    /// Opens `path` and checks that it has a string column `field`.
    pub fn open(path: &Path, field: &str) -> Result<ParquetDocs> {
        let bad = |what: &str, message: String| DataError::format(path, what, message);
        let file = File::open(path).map_err(|e| DataError::io(path, e))?;
        // The Arrow schema a writer embeds is a hint only (the Parquet schema says the
        // same); decoding a damaged one panics inside arrow-ipc, so it is not read.
        let options = ArrowReaderOptions::new().with_skip_arrow_metadata(true);
        let meta = guarded(path, "footer", || ArrowReaderMetadata::load(&file, options))?.map_err(
            |e| {
                bad(
                    "footer",
                    format!("not a readable Parquet file (truncated, or another format): {e}"),
                )
            },
        )?;
        let schema = meta.schema().clone();
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
        let parquet_meta = meta.metadata().clone();
        let group_rows: Vec<i64> = parquet_meta
            .row_groups()
            .iter()
            .map(|g| g.num_rows())
            .collect();
        let mask = ProjectionMask::roots(parquet_meta.file_metadata().schema_descr(), [index]);
        Ok(ParquetDocs {
            path: path.to_path_buf(),
            field: field.to_string(),
            file,
            meta,
            mask,
            group_rows,
            group: 0,
            reader: None,
            rows_in_group: 0,
        })
    }

    /// Where the row group being read is, for messages.
    fn place(&self) -> String {
        format!("row group {}, column {}", self.group, self.field)
    }

    /// A reader of row group `self.group` alone: each batch, and so each message, is
    /// one row group's (at most 65,536 of its rows; memory is bounded by that).
    fn group_reader(&self) -> Result<ParquetRecordBatchReader> {
        let place = self.place();
        let file = self
            .file
            .try_clone()
            .map_err(|e| DataError::io(&self.path, e))?;
        let rows = self.group_rows[self.group].clamp(1, 65_536) as usize;
        let built = guarded(&self.path, &place, || {
            ParquetRecordBatchReaderBuilder::new_with_metadata(file, self.meta.clone())
                .with_row_groups(vec![self.group])
                .with_projection(self.mask.clone())
                .with_batch_size(rows)
                .build()
        })?;
        built.map_err(|e| DataError::format(&self.path, place, parquet_message(e)))
    }

    fn next_batch(&mut self) -> Result<Option<DocBatch>> {
        let batch: RecordBatch = loop {
            if self.group >= self.group_rows.len() {
                return Ok(None);
            }
            if self.reader.is_none() {
                self.reader = Some(self.group_reader()?);
            }
            let place = self.place();
            let reader = self.reader.as_mut().expect("made above");
            match guarded(&self.path, &place, || reader.next())? {
                Some(Ok(b)) => break b,
                Some(Err(e)) => {
                    let message = parquet_message(&e);
                    // The reader names no row for a string that is not UTF-8: found by
                    // reading the row group again as bytes.
                    let message = match (message.contains("non UTF-8"), self.first_non_utf8()) {
                        (true, Some((row, in_group, at))) => format!(
                            "row {row} (row {in_group} of the group) is not UTF-8 at byte {at} \
                             of its text: re-encode the column as UTF-8"
                        ),
                        _ => message,
                    };
                    return Err(DataError::format(&self.path, place, message));
                }
                None => (self.group, self.reader, self.rows_in_group) = (self.group + 1, None, 0),
            }
        };
        let col = batch.column(0);
        let mut docs = Vec::with_capacity(col.len());
        let null = |i: usize| {
            let in_group = self.rows_in_group + i as i64;
            let before: i64 = self.group_rows[..self.group].iter().sum();
            DataError::format(
                &self.path,
                self.place(),
                format!(
                    "row {} is null (row {in_group} of the group), expected a string",
                    before + in_group
                ),
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
                    self.place(),
                    format!("a column of {other}, expected strings"),
                ))
            }
        }
        self.rows_in_group += docs.len() as i64;
        Ok(Some(DocBatch { docs }))
    }
}

impl ParquetDocs {
    /// The first row of the row group being read whose text is not UTF-8: its row in the
    /// file, in the group, and the byte where its text stops being UTF-8. Read again as
    /// the column's raw bytes (the Arrow reader refuses to read a string column as bytes);
    /// None where that read fails too.
    fn first_non_utf8(&self) -> Option<(i64, i64, usize)> {
        use parquet::column::reader::ColumnReader;
        use parquet::file::reader::{FileReader, SerializedFileReader};
        let file = self.file.try_clone().ok()?;
        let place = self.place();
        let before: i64 = self.group_rows[..self.group].iter().sum();
        let found = guarded(&self.path, &place, || -> Option<(i64, i64, usize)> {
            let reader = SerializedFileReader::new(file).ok()?;
            let group = reader.get_row_group(self.group).ok()?;
            let leaf = (0..group.num_columns()).find(|&i| {
                group.metadata().column(i).column_path().parts() == [self.field.clone()]
            })?;
            let max_def = group.metadata().column(leaf).column_descr().max_def_level();
            let ColumnReader::ByteArrayColumnReader(mut column) =
                group.get_column_reader(leaf).ok()?
            else {
                return None;
            };
            let (mut defs, mut values, mut row) = (Vec::new(), Vec::new(), 0i64);
            loop {
                defs.clear();
                values.clear();
                let (records, _, _) = column
                    .read_records(65_536, Some(&mut defs), None, &mut values)
                    .ok()?;
                if records == 0 {
                    return None;
                }
                // A row's value where its definition level is the greatest (nulls have
                // none); a required column has no levels, a value a row.
                let mut next = values.iter();
                for r in 0..records {
                    let present = defs.is_empty() || defs[r] == max_def;
                    if let Some(Err(e)) = present
                        .then(|| next.next())
                        .flatten()
                        .map(|v| std::str::from_utf8(v.data()))
                    {
                        let in_group = row + r as i64;
                        return Some((before + in_group, in_group, e.valid_up_to()));
                    }
                }
                row += records as i64;
            }
        });
        found.ok().flatten()
    }
}

thread_local! {
    /// Whether this thread is inside [`guarded`].
    static GUARDED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread is panicking inside a guarded Parquet read, whose panic becomes
/// an error naming the file: a binary's panic hook can leave such a panic unprinted
/// (the error says it), where the default hook prints it, and its backtrace, first.
pub fn panicking_in_guarded_read() -> bool {
    GUARDED.with(std::cell::Cell::get)
}

/// `read()`, with a panic inside the Parquet reader (it trusts lengths and offsets in the
/// file: a damaged one can send it out of bounds) turned into an error naming the file and
/// `place`. Nothing read after the panic is used: the reader is dropped with the error.
fn guarded<T>(path: &Path, place: &str, read: impl FnOnce() -> T) -> Result<T> {
    GUARDED.with(|g| g.set(true));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(read));
    GUARDED.with(|g| g.set(false));
    result.map_err(|payload| {
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
    /// Unpaired UTF-16 surrogates read as U+FFFD, and the first line that held one.
    surrogates: usize,
    first_surrogate_line: Option<usize>,
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
            surrogates: 0,
            first_surrogate_line: None,
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
            // A byte-order mark (Windows' "UTF-8 with BOM") before the first line's object.
            let text = match self.line {
                1 => text.trim_start_matches('\u{feff}'),
                _ => text,
            };
            let text = text.trim();
            if text.is_empty() {
                continue;
            }
            let mut surrogates = 0;
            let parsed = serde_json::from_str::<serde_json::Value>(text).or_else(|e| {
                // Python's unpaired surrogates as U+FFFD, and its NaN and Infinity as
                // Python and pyarrow read them.
                let (fixed, n) = super::json_surrogates::lone_surrogates_replaced(text)
                    .unwrap_or_else(|| (text.to_string(), 0));
                let fixed = super::json_nonfinite::nonfinite_as_null(&fixed).unwrap_or(fixed);
                let v = serde_json::from_str::<serde_json::Value>(&fixed).map_err(|_| e)?;
                surrogates = n;
                Ok(v)
            });
            if surrogates > 0 {
                self.surrogates += surrogates;
                self.first_surrogate_line.get_or_insert(self.line);
            }
            let v: serde_json::Value = parsed.map_err(|e: serde_json::Error| {
                let hint = match (text.trim_start().starts_with('['), e.is_eof()) {
                    (true, _) => {
                        " (a JSON array over several lines is not JSON Lines, one object a line)"
                    }
                    (false, true) => " (the line ends early: a truncated file?)",
                    (false, false) => "",
                };
                DataError::format(&self.path, at(), format!("not a JSON object: {e}{hint}"))
            })?;
            match v.get(&self.field) {
                Some(serde_json::Value::String(s)) => docs.push(s.clone()),
                Some(other) => {
                    return Err(DataError::format(
                        &self.path,
                        format!("{}, field {}", at(), self.field),
                        format!("{}, expected a string", json_kind_with_article(other)),
                    ))
                }
                None if !v.is_object() => {
                    return Err(DataError::format(
                        &self.path,
                        at(),
                        format!(
                            "a JSON {}, expected an object: JSON Lines holds one object a line \
                             (a file that is one JSON array is not JSON Lines)",
                            json_kind(&v)
                        ),
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

/// [`json_kind`] with its article: "an object", "a number".
fn json_kind_with_article(v: &serde_json::Value) -> String {
    let kind = json_kind(v);
    match kind.starts_with(['a', 'e', 'i', 'o', 'u']) {
        true => format!("an {kind}"),
        false => format!("a {kind}"),
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
/// The Parquet reader's message, with the codecs this build reads where a page is
/// compressed with another (the reader says only "Disabled feature at compile time").
fn parquet_message(e: impl std::fmt::Display) -> String {
    let message = e.to_string();
    match message.contains("Disabled feature at compile time") {
        true => format!(
            "{message}: this build reads Parquet pages uncompressed or compressed with snappy, \
             zstd or gzip (the hub's are snappy or zstd); re-save the file with one of them \
             (pyarrow: `pq.write_table(t, path, compression=\"zstd\")`)"
        ),
        false => message,
    }
}

#[cfg(test)]
mod codec_tests {
    use super::*;

    /// The reader's words for a codec this build leaves out (as parquet 56 words them for
    /// an lz4 page: checked by hand on a pyarrow file) gain the codecs it reads; other
    /// errors pass as they are.
    #[test]
    fn a_codec_left_out_of_the_build_is_named_with_those_it_reads() {
        let m = parquet_message("Parquet error: Disabled feature at compile time: lz4");
        assert!(
            m.starts_with("Parquet error: Disabled feature at compile time: lz4: this build")
                && m.contains("snappy, zstd or gzip"),
            "{m}"
        );
        assert_eq!(parquet_message("EOF"), "EOF");
    }
}
