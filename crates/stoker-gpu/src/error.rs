//! What a GPU kernel call refuses, naming the kernel and the buffer.

/// A kernel call's arguments that do not fit its shapes.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum GpuError {
    /// A buffer of the wrong length.
    #[error("{kernel}: `{buffer}` holds {got} elements, expected {want}")]
    Length {
        /// The kernel.
        kernel: &'static str,
        /// The argument.
        buffer: &'static str,
        /// Its length.
        got: usize,
        /// The length the other arguments imply.
        want: usize,
    },
    /// A token id or target outside the vocabulary (the kernel would read out of bounds).
    #[error("{kernel}: `{buffer}`[{index}] = {value} is outside 0..{limit}")]
    OutOfRange {
        /// The kernel.
        kernel: &'static str,
        /// The argument.
        buffer: &'static str,
        /// Where.
        index: usize,
        /// The value found.
        value: i64,
        /// One past the largest value allowed.
        limit: usize,
    },
    /// The CUDA driver refused something (no device, a failed launch or copy).
    #[error("cuda: {what}: {error}")]
    Driver {
        /// What was being done.
        what: String,
        /// The driver's message.
        error: String,
    },
    /// Work ordered wrongly on a backend: a buffer written while a copy into it was still
    /// landing.
    #[error("{what}")]
    Order {
        /// What happened, and where.
        what: String,
    },
    /// Something a graph capture cannot hold (a read back, a write from the host), or a
    /// backend that cannot capture.
    #[error("graph capture: {what}")]
    Capture {
        /// What was asked.
        what: String,
    },
    /// A dimension that is zero, too large for the kernels' 32-bit sizes, or
    /// inconsistent with another.
    #[error("{kernel}: {what}")]
    Shape {
        /// The kernel.
        kernel: &'static str,
        /// What is wrong.
        what: String,
    },
}

/// `got == want`, or a [`GpuError::Length`] naming the buffer.
pub(crate) fn check_len(
    kernel: &'static str,
    buffer: &'static str,
    got: usize,
    want: usize,
) -> Result<(), GpuError> {
    if got == want {
        Ok(())
    } else {
        Err(GpuError::Length {
            kernel,
            buffer,
            got,
            want,
        })
    }
}

/// `n` as the kernels' 32-bit size, nonzero.
pub(crate) fn dim(kernel: &'static str, name: &str, n: usize) -> Result<i32, GpuError> {
    match i32::try_from(n) {
        Ok(v) if v > 0 => Ok(v),
        _ => Err(GpuError::Shape {
            kernel,
            what: format!("{name} = {n} must be in 1..=2^31-1"),
        }),
    }
}

/// A [`GpuError::Capture`] for `op`, which waits for the backend or writes from the host,
/// asked while a graph is being captured.
pub(crate) fn not_while_capturing(op: &str) -> GpuError {
    GpuError::Capture {
        what: format!(
            "{op} waits for the backend or copies from the host, which a captured graph \
             cannot replay: it belongs before or after the capture"
        ),
    }
}
