//! The raw MPI calls the backend makes through rsmpi's `ffi`, and the conversions they
//! need: datatypes, `MPI_IN_PLACE`, counts, pointers and error strings.

use std::ffi::{c_int, c_void};

use mpi::ffi;

use crate::element::{Buf, BufMut, DType};
use crate::error::{CommError, Result};
use crate::stats::Op;

extern "C" {
    fn stoker_mpi_in_place() -> *mut c_void;
}

/// Tag of `send_recv` messages (collectives do not use tags).
pub(super) const SEND_RECV_TAG: c_int = 0x570c;

/// The MPI datatype of elements of `d`: f32 is C `float`, f64 `double`, u64 `uint64_t`.
pub(super) fn datatype(d: DType) -> ffi::MPI_Datatype {
    // SAFETY: reads of mpi-sys's immutable extern statics, which its C shim initializes
    // statically (no MPI call, valid before MPI_Init and after MPI_Finalize alike).
    unsafe {
        match d {
            DType::F32 => ffi::RSMPI_FLOAT,
            DType::F64 => ffi::RSMPI_DOUBLE,
            DType::U64 => ffi::RSMPI_UINT64_T,
        }
    }
}

pub(super) fn sum_op() -> ffi::MPI_Op {
    // SAFETY: as in `datatype`.
    unsafe { ffi::RSMPI_SUM }
}

pub(super) fn in_place() -> *mut c_void {
    // SAFETY: `shim.c` takes no arguments and only returns the MPI_IN_PLACE constant of the
    // mpi.h it was compiled against; the declaration above matches its signature.
    unsafe { stoker_mpi_in_place() }
}

pub(super) fn null_request() -> ffi::MPI_Request {
    // SAFETY: as in `datatype`.
    unsafe { ffi::RSMPI_REQUEST_NULL }
}

/// A count as MPI's `int`; the error names the collective.
pub(super) fn c_count(op: Op, rank: usize, n: usize) -> Result<c_int> {
    c_int::try_from(n).map_err(|_| CommError::Argument {
        op: op.name(),
        rank,
        detail: format!("{n} elements: MPI counts are 32-bit; split the buffer"),
    })
}

/// A count MPI gave back (or [`c_count`] made) as a length; a negative one panics rather
/// than wrap to a huge length.
pub(super) fn len_of(n: c_int) -> usize {
    usize::try_from(n).expect("MPI counts are not negative")
}

/// The sum of `counts` as a length, None when it does not fit a usize (or one is negative).
pub(super) fn total(counts: &[c_int]) -> Option<usize> {
    counts
        .iter()
        .try_fold(0usize, |at, &n| at.checked_add(usize::try_from(n).ok()?))
}

/// Whether every rank's segment, `displs[r]..displs[r] + counts[r]`, lies inside a buffer
/// of `len` elements (checked arithmetic: nothing wraps into range).
pub(super) fn segments_fit(counts: &[c_int], displs: &[c_int], len: usize) -> bool {
    counts.len() == displs.len()
        && counts.iter().zip(displs).all(|(&n, &at)| {
            match (usize::try_from(at), usize::try_from(n)) {
                (Ok(at), Ok(n)) => at.checked_add(n).is_some_and(|end| end <= len),
                _ => false,
            }
        })
}

/// Counts and displacements (each rank's segment starts after the lower ranks').
pub(super) fn counts_displs(
    op: Op,
    rank: usize,
    counts: &[usize],
) -> Result<(Vec<c_int>, Vec<c_int>)> {
    let c: Vec<c_int> = counts
        .iter()
        .map(|&n| c_count(op, rank, n))
        .collect::<Result<_>>()?;
    let mut d = Vec::with_capacity(c.len());
    let mut at: usize = 0;
    for &n in counts {
        d.push(c_count(op, rank, at)?);
        // Both terms fit a c_int here (checked above), so this cannot overflow.
        at += n;
    }
    Ok((c, d))
}

/// Whether every count is the same (MPI's faster block forms apply).
pub(super) fn equal(counts: &[c_int]) -> bool {
    counts.windows(2).all(|w| w[0] == w[1])
}

/// A buffer as MPI takes it: its data pointer, its length in elements and their type, all
/// from the one slice (so the pointer, the length and the datatype always agree).
pub(super) fn raw(b: &Buf<'_>) -> (*const c_void, usize, DType) {
    match b {
        Buf::F32(x) => (x.as_ptr().cast(), x.len(), DType::F32),
        Buf::F64(x) => (x.as_ptr().cast(), x.len(), DType::F64),
        Buf::U64(x) => (x.as_ptr().cast(), x.len(), DType::U64),
    }
}

/// [`raw`] of an output buffer.
pub(super) fn raw_mut(b: &mut BufMut<'_>) -> (*mut c_void, usize, DType) {
    match b {
        BufMut::F32(x) => (x.as_mut_ptr().cast(), x.len(), DType::F32),
        BufMut::F64(x) => (x.as_mut_ptr().cast(), x.len(), DType::F64),
        BufMut::U64(x) => (x.as_mut_ptr().cast(), x.len(), DType::U64),
    }
}

/// Room for MPI's longest error text.
const ERROR_STRING_BYTES: usize = 1024;
const _: () = assert!(ffi::MPI_MAX_ERROR_STRING as usize <= ERROR_STRING_BYTES);

/// MPI's text for an error code.
pub(super) fn error_string(code: c_int) -> String {
    let mut buf = vec![0u8; ERROR_STRING_BYTES];
    let mut len: c_int = 0;
    // SAFETY: MPI_Error_string writes at most MPI_MAX_ERROR_STRING bytes, which `buf` holds
    // (asserted at compile time above), and one c_int to `len`.
    unsafe { ffi::MPI_Error_string(code, buf.as_mut_ptr().cast(), &mut len) };
    buf.truncate(usize::try_from(len).unwrap_or(0));
    String::from_utf8_lossy(&buf).into_owned()
}
