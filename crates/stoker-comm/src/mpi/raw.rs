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

pub(super) fn datatype(d: DType) -> ffi::MPI_Datatype {
    // SAFETY: reading rsmpi's exported constants, initialized by the C runtime at load.
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
    // SAFETY: the shim only returns the MPI_IN_PLACE constant of the mpi.h we built with.
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
        at += n;
    }
    Ok((c, d))
}

/// Whether every count is the same (MPI's faster block forms apply).
pub(super) fn equal(counts: &[c_int]) -> bool {
    counts.windows(2).all(|w| w[0] == w[1])
}

pub(super) fn buf_ptr(b: &Buf<'_>) -> *const c_void {
    match b {
        Buf::F32(x) => x.as_ptr().cast(),
        Buf::F64(x) => x.as_ptr().cast(),
        Buf::U64(x) => x.as_ptr().cast(),
    }
}

pub(super) fn buf_mut_ptr(b: &mut BufMut<'_>) -> *mut c_void {
    match b {
        BufMut::F32(x) => x.as_mut_ptr().cast(),
        BufMut::F64(x) => x.as_mut_ptr().cast(),
        BufMut::U64(x) => x.as_mut_ptr().cast(),
    }
}

/// MPI's text for an error code.
pub(super) fn error_string(code: c_int) -> String {
    let mut buf = vec![0u8; 1024];
    let mut len: c_int = 0;
    // SAFETY: the buffer holds MPI_MAX_ERROR_STRING (512 in MPICH) bytes and more.
    unsafe { ffi::MPI_Error_string(code, buf.as_mut_ptr().cast(), &mut len) };
    buf.truncate(len.max(0) as usize);
    String::from_utf8_lossy(&buf).into_owned()
}

/// Starts a sum reduce-scatter with `counts[r]` elements for rank `r`:
/// `MPI_Ireduce_scatter_block` when every count is the same, `MPI_Ireduce_scatter`
/// otherwise.
///
/// # Safety
/// `send` must be valid for the counts' sum and `recv` for this rank's count, and both,
/// `counts` and `req` must stay valid until the request completes.
pub(super) unsafe fn ireduce_scatter(
    send: *const c_void,
    recv: *mut c_void,
    counts: &[c_int],
    dt: ffi::MPI_Datatype,
    comm: ffi::MPI_Comm,
    req: *mut ffi::MPI_Request,
) -> c_int {
    match counts.first() {
        Some(&n) if equal(counts) => {
            ffi::MPI_Ireduce_scatter_block(send, recv, n, dt, sum_op(), comm, req)
        }
        _ => ffi::MPI_Ireduce_scatter(send, recv, counts.as_ptr(), dt, sum_op(), comm, req),
    }
}

/// Starts an all-gather of `counts[r]` elements from rank `r` at `displs[r]` (this rank
/// sends `n`): `MPI_Iallgather` when every count is the same, `MPI_Iallgatherv` otherwise.
///
/// # Safety
/// As [`ireduce_scatter`], with `send` valid for `n` elements, `recv` for the counts' sum
/// and `displs` alive too.
pub(super) unsafe fn iallgather(
    (send, n): (*const c_void, c_int),
    recv: *mut c_void,
    (counts, displs): (&[c_int], &[c_int]),
    dt: ffi::MPI_Datatype,
    comm: ffi::MPI_Comm,
    req: *mut ffi::MPI_Request,
) -> c_int {
    if equal(counts) {
        ffi::MPI_Iallgather(send, n, dt, recv, n, dt, comm, req)
    } else {
        ffi::MPI_Iallgatherv(
            send,
            n,
            dt,
            recv,
            counts.as_ptr(),
            displs.as_ptr(),
            dt,
            comm,
            req,
        )
    }
}
