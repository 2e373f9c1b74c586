//! Non-blocking collectives over buffers the operation owns, completed by polling
//! `MPI_Test` against the timeout (MPI moves data only inside MPI calls, so polling is
//! also what makes them progress).

use std::ffi::{c_int, c_void};
use std::time::Instant;

use mpi::ffi;

use super::peers::timeout_error;
use super::raw::{buf_mut_ptr, buf_ptr, in_place, null_request};
use super::Ctx;
use crate::communicator::{Pending, PendingOp};
use crate::element::Buffer;
use crate::error::{CommError, Result};
use crate::stats::Op;

/// `MPI_Test` calls a wait makes before it starts yielding its core between them.
const SPINS_BEFORE_YIELD: u32 = 256;

/// Polls `reqs` until every one completed, `deadline` passed (Err(None)) or MPI reported
/// an error (Err(Some)).
pub(super) fn poll(
    reqs: &mut [ffi::MPI_Request],
    deadline: Instant,
) -> std::result::Result<(), Option<c_int>> {
    let mut spins = 0u32;
    loop {
        let mut done = true;
        for r in reqs.iter_mut() {
            if *r == null_request() {
                continue;
            }
            let mut flag: c_int = 0;
            // SAFETY: `r` is a live request this backend started (null ones are skipped);
            // MPI_Test sets it to null when it completes.
            let code = unsafe { ffi::MPI_Test(r, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
            if code != 0 {
                return Err(Some(code));
            }
            done &= flag != 0;
        }
        if done {
            return Ok(());
        }
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(1024) && Instant::now() >= deadline {
            return Err(None);
        }
        if spins > SPINS_BEFORE_YIELD {
            // With more ranks than cores (4 ranks on this 2-core machine) the rank being
            // waited for may need this core: a pure spin holds it for a whole scheduler
            // slice per wait, which made ZeRO-3's ~20 waits per micro-batch 10x slower.
            std::thread::yield_now();
        }
    }
}

/// The buffers a started collective owns until it completes.
pub(super) struct Owned {
    /// The input of reduce-scatter / all-gather (None: in place).
    pub(super) send: Option<Buffer>,
    /// The buffer MPI writes the result into.
    pub(super) recv: Buffer,
    /// Counts and displacements MPI reads until completion.
    pub(super) counts: Vec<c_int>,
    pub(super) displs: Vec<c_int>,
}

/// A started MPI collective.
struct MpiPending {
    req: ffi::MPI_Request,
    bufs: Owned,
    op: Op,
    bytes: usize,
    ctx: Ctx,
}

impl PendingOp for MpiPending {
    fn test(&mut self) -> Result<bool> {
        if self.req == null_request() {
            return Ok(true);
        }
        let mut flag: c_int = 0;
        // SAFETY: `req` is this operation's live request.
        let code = unsafe { ffi::MPI_Test(&mut self.req, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
        self.ctx.check_code(self.op, code)?;
        Ok(flag != 0)
    }

    fn wait(mut self: Box<Self>) -> Result<(Buffer, Option<Buffer>)> {
        let mut reqs = [self.req];
        match poll(&mut reqs, Instant::now() + self.ctx.timeout) {
            Ok(()) => {
                self.req = null_request();
                let out = std::mem::replace(&mut self.bufs.recv, Buffer::U64(Vec::new()));
                Ok((out, self.bufs.send.take()))
            }
            Err(code) => {
                let e = match code {
                    Some(c) => self.ctx.check_code(self.op, c).unwrap_err(),
                    None => timeout_error(
                        self.op,
                        self.bytes,
                        (self.ctx.rank, self.ctx.world),
                        self.ctx.timeout,
                        &self.ctx.peers,
                    ),
                };
                // MPI may still write the buffers: leak them rather than free them.
                std::mem::forget(self);
                Err(e)
            }
        }
    }

    fn abandon(self: Box<Self>) {
        if self.req != null_request() {
            // MPI may still write the buffers: leak them rather than free them.
            std::mem::forget(self);
        }
    }
}

/// Starts a collective over `bufs` with `start(send, recv, counts, displs, request)`,
/// given pointers into the buffers the returned [`Pending`] owns from now on.
pub(super) fn start(
    ctx: &Ctx,
    (op, bytes): (Op, usize),
    bufs: Owned,
    start: impl FnOnce(*const c_void, *mut c_void, &[c_int], &[c_int], *mut ffi::MPI_Request) -> c_int,
) -> Result<Pending> {
    // Boxed first: the buffers' heap memory never moves, and neither does the request.
    let mut p = Box::new(MpiPending {
        req: null_request(),
        bufs,
        op,
        bytes,
        ctx: ctx.clone(),
    });
    let send_ptr = match &p.bufs.send {
        Some(b) => buf_ptr(&b.as_buf()),
        None => in_place() as *const c_void,
    };
    let recv_ptr = buf_mut_ptr(&mut p.bufs.recv.as_buf_mut());
    let req_ptr: *mut ffi::MPI_Request = &mut p.req;
    let code = start(send_ptr, recv_ptr, &p.bufs.counts, &p.bufs.displs, req_ptr);
    if code != 0 {
        // Nothing started: the buffers are free to go.
        return Err(CommError::Backend {
            op: op.name(),
            rank: ctx.rank,
            backend: "mpi",
            code,
            message: super::raw::error_string(code),
        });
    }
    Ok(Pending::new(p))
}
