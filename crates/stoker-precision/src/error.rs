//! The crate's error type: bad input is reported, never a panic.

/// Everything that can go wrong in stoker-precision.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum PrecisionError {
    /// A slice-to-slice operation got slices of different lengths.
    #[error(
        "{op}: source has {src} elements but destination has {dst}; pass slices of equal length"
    )]
    LengthMismatch {
        /// The operation that was called.
        op: &'static str,
        /// Source length.
        src: usize,
        /// Destination length.
        dst: usize,
    },
    /// A configuration value is outside its valid range.
    #[error("invalid {what} config: {field} = {value} ({reason})")]
    InvalidConfig {
        /// Which configuration (e.g. "loss scaler", "delayed scaling").
        what: &'static str,
        /// The offending field.
        field: &'static str,
        /// Its value, formatted.
        value: String,
        /// What a valid value looks like.
        reason: &'static str,
    },
    /// A parameter span reaches past the end of the flat gradient buffer.
    #[error(
        "parameter '{name}' spans [{offset}, {end}) but the gradient buffer has {len} elements; \
         rebuild the ParamTable from the same flat layout as the buffer"
    )]
    SpanOutOfBounds {
        /// Parameter name.
        name: String,
        /// First element.
        offset: usize,
        /// One past the last element.
        end: usize,
        /// Buffer length.
        len: usize,
    },
    /// A saved state cannot be restored into this object.
    #[error("cannot restore state: {0}")]
    BadState(String),
}

/// Shorthand for results of this crate.
pub type Result<T> = std::result::Result<T, PrecisionError>;

pub(crate) fn check_len(op: &'static str, src: usize, dst: usize) -> Result<()> {
    if src == dst {
        Ok(())
    } else {
        Err(PrecisionError::LengthMismatch { op, src, dst })
    }
}
