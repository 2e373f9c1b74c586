//! Errors of the planner: each names the field or key at fault and what was expected.

use std::path::PathBuf;

/// Everything that can go wrong while reading inputs or planning.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// A numeric input was zero, negative, not finite or out of range.
    #[error("{field} must be {expected}, got {got}")]
    InvalidValue {
        /// Dotted name of the field, e.g. `hardware.nodes`.
        field: String,
        /// What a valid value looks like.
        expected: String,
        /// The offending value as written.
        got: String,
    },
    /// A required input was not given by any source.
    #[error("{field} is required: {hint}")]
    Missing {
        /// Dotted name of the missing field.
        field: String,
        /// How to provide it.
        hint: String,
    },
    /// A preset name that stoker does not know.
    #[error("unknown {kind} preset {name:?}; known: {known}")]
    UnknownPreset {
        /// "model" or "hardware".
        kind: &'static str,
        /// The name given.
        name: String,
        /// Comma-separated known names.
        known: String,
    },
    /// An enumerated option with a value outside its set.
    #[error("{field}: unknown value {got:?}; expected one of {expected}")]
    UnknownOption {
        /// Dotted name of the field.
        field: String,
        /// The value given.
        got: String,
        /// The accepted values.
        expected: String,
    },
    /// Batch arithmetic that does not add up (global = micro x accumulation x world).
    #[error("batch arithmetic: {0}")]
    Batch(String),
    /// A DeepSpeed configuration whose keys contradict each other or stoker's model.
    #[error("DeepSpeed config {path}: {message}")]
    DeepSpeed {
        /// The file read.
        path: String,
        /// What is wrong, naming the keys.
        message: String,
    },
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// Malformed JSON (DeepSpeed config or loader benchmark).
    #[error("{path}: malformed JSON: {source}")]
    Json {
        /// The file.
        path: String,
        /// The parser's message (with line and column).
        source: serde_json::Error,
    },
    /// Malformed TOML plan input.
    #[error("{path}: malformed TOML: {message}")]
    Toml {
        /// The file.
        path: String,
        /// The parser's message on one line, with the line it points at
        /// ([`toml_error_line`]).
        message: String,
    },
    /// A combination of options that cannot be planned.
    #[error("{0}")]
    Unsupported(String),
}

/// Result alias of the planner.
pub type Result<T> = std::result::Result<T, PlanError>;

/// Builds an [`PlanError::InvalidValue`] from displayable parts.
pub(crate) fn invalid(field: &str, expected: &str, got: impl std::fmt::Display) -> PlanError {
    PlanError::InvalidValue {
        field: field.to_string(),
        expected: expected.to_string(),
        got: got.to_string(),
    }
}

/// Checks that `v` is a positive integer (given as i64 so negative input reaches us).
pub(crate) fn positive_int(field: &str, v: i64) -> Result<u64> {
    if v <= 0 {
        return Err(invalid(field, "a positive integer", v));
    }
    Ok(v as u64)
}

/// Checks that `v` is finite and strictly positive.
pub(crate) fn positive_f64(field: &str, v: f64) -> Result<f64> {
    if !v.is_finite() || v <= 0.0 {
        return Err(invalid(field, "a positive number", v));
    }
    Ok(v)
}

/// A TOML error on one line: ``line L, column C (`THE LINE`): MESSAGE``, the line as the
/// file has it (which names the key where toml's message does not). toml's own display
/// spans several lines with a caret, which rank prefixes and log lines split apart. The
/// message alone where the error has no place in `text` or is the whole document's (a
/// missing top-level key).
pub fn toml_error_line<'a>(text: &'a str, e: &toml::de::Error) -> String {
    let message = match e.message().trim() {
        "" => "a value is missing or malformed".to_string(),
        m => m.replace('\n', "; "),
    };
    let span = e
        .span()
        .filter(|s| s.start > 0 || s.end < text.trim_end().len());
    let Some(before) = span.and_then(|s| text.get(..s.start)) else {
        return message;
    };
    let number = before.matches('\n').count() + 1;
    // Characters, not bytes, and not the file's leading byte-order mark's (one, on the
    // first line: another is a character of the file, which the parser refused).
    let unmarked = |l: &'a str| match number {
        1 => l.strip_prefix('\u{feff}').unwrap_or(l),
        _ => l,
    };
    let line_start = &before[before.rfind('\n').map_or(0, |i| i + 1)..];
    let column = unmarked(line_start).chars().count() + 1;
    let line = text.lines().nth(number - 1);
    match line.map(|l| unmarked(l).trim()) {
        Some(line) if !line.is_empty() => {
            format!("line {number}, column {column} (`{line}`): {message}")
        }
        _ => format!("line {number} (the end of the file): {message}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line_of(text: &str) -> String {
        let e = toml::from_str::<toml::Table>(text).unwrap_err();
        toml_error_line(text, &e)
    }

    /// One line, with the line and column the parser points at; the message alone for
    /// the whole document's error; the end of the file said, not an empty line.
    #[test]
    fn a_toml_error_is_one_line_with_its_place() {
        assert_eq!(
            line_of("a = 1\nb = 2\nb = 3\n"),
            "line 3, column 1 (`b = 3`): duplicate key `b` in document root"
        );
        // Columns count characters, past a byte-order mark: the `x` is the 10th.
        assert_eq!(
            line_of("\u{feff}a = \"\u{e9}\u{20ac}\" x\n"),
            "line 1, column 10 (`a = \"\u{e9}\u{20ac}\" x`): expected newline, `#`"
        );
        let cut = line_of("x = [1,\n");
        assert!(cut.starts_with("line 2 (the end of the file): "), "{cut}");
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code)]
        struct Needs {
            run_dir: String,
        }
        let text = "# my experiment\nseed = 1\n";
        let e = toml::from_str::<Needs>(text).unwrap_err();
        assert_eq!(toml_error_line(text, &e), "missing field `run_dir`");
        // A byte-order mark past the file's first is a character the parser refused:
        // shown, not taken for the end of the file.
        let inner = line_of("seed = 1\n\u{feff}\nrun_dir = \"x\"\n");
        assert!(
            inner.starts_with("line 2, column 1 (`\u{feff}`)"),
            "{inner}"
        );
        for text in ["a = 1\nb = 2\nb = 3\n", "x = [1,\n", "x = \n", "[t\nx=1"] {
            let m = line_of(text);
            assert!(!m.contains('\n') && !m.ends_with(": "), "{text:?}: {m}");
        }
    }
}
