//! Typed errors for the kernels; each names the op and the offending shape or dtype.

use candle_core::{DType, Shape};

/// What went wrong in a fused kernel, with the op's name.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// The inputs' shapes do not fit the op.
    #[error("{op}: {msg} (shape {shape:?})")]
    Shape {
        /// The op.
        op: &'static str,
        /// What does not fit.
        msg: String,
        /// The offending shape.
        shape: Shape,
    },
    /// The op has no kernel for this dtype.
    #[error("{op}: dtype {dtype:?} not supported (use f32 or bf16{extra})")]
    DType {
        /// The op.
        op: &'static str,
        /// The offending dtype.
        dtype: DType,
        /// More detail, e.g. for target indices.
        extra: &'static str,
    },
    /// The kernel needs a contiguous input; the public wrappers make inputs contiguous.
    #[error("{op}: input is not contiguous (call the public wrapper, which makes it so)")]
    NotContiguous {
        /// The op.
        op: &'static str,
    },
    /// Flat buffers handed to an optimizer differ in length.
    #[error("{op}: {what} has {len} elements, params have {expected}")]
    Length {
        /// The op.
        op: &'static str,
        /// Which buffer.
        what: &'static str,
        /// Its length.
        len: usize,
        /// The parameter buffer's length.
        expected: usize,
    },
    /// The requested kernel cannot run on this CPU.
    #[error("{op}: {what} is not supported")]
    Unsupported {
        /// The op.
        op: &'static str,
        /// What is missing.
        what: String,
    },
    /// A token id is outside the embedding table.
    #[error("{op}: id {id} at position {pos} is outside the table's {rows} rows")]
    Index {
        /// The op.
        op: &'static str,
        /// Position in the flattened ids.
        pos: usize,
        /// The id.
        id: i64,
        /// Rows in the table.
        rows: usize,
    },
    /// A parameter table and a flat layout do not fit together.
    #[error("{op}: {msg}")]
    Layout {
        /// The op.
        op: &'static str,
        /// What is missing or does not fit.
        msg: String,
    },
    /// Where a step's parameters come from failed to provide them (a collective that
    /// gathers them, for one): the source has the full error.
    #[error("{op}: parameter group {group}: {msg}")]
    Source {
        /// The op.
        op: &'static str,
        /// The group asked for.
        group: usize,
        /// What failed.
        msg: String,
    },
    /// A target index is out of range and is not the ignore index.
    #[error("{op}: target {target} at row {row} is outside 0..{vocab} and not the ignore index {ignore}")]
    Target {
        /// The op.
        op: &'static str,
        /// The row holding it.
        row: usize,
        /// The target value.
        target: i64,
        /// The number of classes.
        vocab: usize,
        /// The ignore index.
        ignore: i64,
    },
}

impl From<KernelError> for candle_core::Error {
    fn from(e: KernelError) -> Self {
        candle_core::Error::wrap(e)
    }
}

/// A shape error for `op`.
pub(crate) fn shape_err(
    op: &'static str,
    msg: impl Into<String>,
    shape: &Shape,
) -> candle_core::Error {
    KernelError::Shape {
        op,
        msg: msg.into(),
        shape: shape.clone(),
    }
    .into()
}
