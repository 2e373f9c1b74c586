//! The one error type of stoker-data: every variant names the file or field at fault.

use std::path::PathBuf;

/// An error from reading, packing or loading data. Messages name the file, the field and what
/// was expected, so a user can fix the input without reading stoker's source.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// An I/O failure on a named file.
    #[error("{path}: {source}")]
    Io {
        /// The file being read or written.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A file whose contents do not follow its format.
    #[error("{path}: {field}: {message}")]
    Format {
        /// The file at fault.
        path: PathBuf,
        /// The header field, record or section at fault.
        field: String,
        /// What was found and what was expected.
        message: String,
    },
    /// A dataset path or pattern that names no file: what was looked for at `path`
    /// (`field`: what the path was, `DATASET` or `shards`), and what would be found.
    #[error("{path}: {field}: {message}")]
    NotFound {
        /// The path or pattern.
        path: PathBuf,
        /// What it was read as.
        field: String,
        /// What was expected there.
        message: String,
    },
    /// Datasets or batches whose shapes or lengths disagree.
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// A configuration value outside its valid range.
    #[error("invalid config: {field}: {message}")]
    Config {
        /// The configuration field at fault.
        field: &'static str,
        /// What was found and what was expected.
        message: String,
    },
    /// A sample failed to decode or transform.
    #[error("sample {index}: {message}")]
    Sample {
        /// The dataset index of the sample.
        index: u64,
        /// What went wrong.
        message: String,
    },
    /// A loader worker failed or panicked; the loader stops rather than hang.
    #[error("loader worker {worker}: {message}")]
    Worker {
        /// The worker's number.
        worker: usize,
        /// The error or panic message.
        message: String,
    },
}

impl DataError {
    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        DataError::Io {
            path: path.into(),
            source,
        }
    }

    /// A path or pattern `path` that names no file (`field`: what it was read as).
    pub fn not_found(
        path: impl Into<PathBuf>,
        field: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        DataError::NotFound {
            path: path.into(),
            field: field.into(),
            message: message.into(),
        }
    }

    /// A format error in `path` at `field`.
    pub fn format(
        path: impl Into<PathBuf>,
        field: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        DataError::Format {
            path: path.into(),
            field: field.into(),
            message: message.into(),
        }
    }
}

/// Result with [`DataError`].
pub type Result<T, E = DataError> = std::result::Result<T, E>;
