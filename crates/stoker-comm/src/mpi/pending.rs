//! Non-blocking collectives over buffers the operation owns, completed by polling
//! `MPI_Test` against the timeout (MPI moves data only inside MPI calls, so polling is
//! also what makes them progress).
//!
//! The one place a non-blocking collective starts is [`start`], which boxes the buffers
//! first and checks every length against the counts it hands MPI. From then on
//! [`MpiPending`] keeps them: while its request is live (not `MPI_REQUEST_NULL`) nothing frees
//! or moves them; a wait that fails, an abandoned operation and one dropped without
//! completing all leak them instead (see its `Drop`).

use std::ffi::c_int;
use std::sync::atomic::Ordering;
use std::time::Instant;

use mpi::ffi;

use super::peers::timeout_error;
use super::raw::{
    c_count, datatype, equal, in_place, len_of, null_request, raw, raw_mut, segments_fit, sum_op,
    total,
};
use super::Ctx;
use crate::communicator::{Pending, PendingOp};
use crate::element::Buffer;
use crate::error::{CommError, Result};
use crate::stats::Op;

/// `MPI_Test` calls a wait makes before it starts yielding its core between them.
const SPINS_BEFORE_YIELD: u32 = 256;

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

impl Owned {
    /// Nothing: what stays behind when the buffers are handed back or leaked.
    fn empty() -> Owned {
        Owned {
            send: None,
            recv: Buffer::U64(Vec::new()),
            counts: Vec::new(),
            displs: Vec::new(),
        }
    }
}

/// A started MPI collective.
///
/// Invariant: `req` is `MPI_REQUEST_NULL` or the live request that [`start`] began over
/// `bufs` (whose heap memory does not move while this value keeps it), and only `MPI_Test`
/// on `req` changes it.
struct MpiPending {
    req: ffi::MPI_Request,
    bufs: Owned,
    op: Op,
    bytes: usize,
    ctx: Ctx,
}

impl MpiPending {
    /// The error of an operation that outlived MPI itself.
    fn finalized(&self) -> CommError {
        self.ctx.arg(
            self.op,
            "MPI was finalized before this collective completed (wait for it first)",
        )
    }

    /// Polls the request until it completed, `deadline` passed (Err(None)) or MPI
    /// reported an error (Err(Some)).
    fn poll(&mut self, deadline: Instant) -> std::result::Result<(), Option<c_int>> {
        let mut spins = 0u32;
        while self.req != null_request() {
            let mut flag: c_int = 0;
            // SAFETY: `req` is this operation's live request (type invariant; checked not
            // null by the loop) and MPI is still initialized (checked by the callers, `wait`,
            // on this thread just before); MPI_Test writes `flag` and, once the request
            // completed, sets `req` to null.
            let code = unsafe { ffi::MPI_Test(&mut self.req, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
            if code != 0 {
                return Err(Some(code));
            }
            if flag != 0 {
                break;
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
        Ok(())
    }
}

impl PendingOp for MpiPending {
    fn test(&mut self) -> Result<bool> {
        if self.req == null_request() {
            return Ok(true);
        }
        if !self.ctx.live.load(Ordering::SeqCst) {
            return Err(self.finalized());
        }
        let mut flag: c_int = 0;
        // SAFETY: `req` is this operation's live request (type invariant; not null, checked
        // above) and MPI is still initialized (checked just above).
        let code = unsafe { ffi::MPI_Test(&mut self.req, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
        self.ctx.check_code(self.op, code)?;
        Ok(flag != 0)
    }

    fn wait(mut self: Box<Self>) -> Result<(Buffer, Option<Buffer>)> {
        if self.req != null_request() && !self.ctx.live.load(Ordering::SeqCst) {
            // Dropping `self` leaks the buffers (the request is live).
            return Err(self.finalized());
        }
        match self.poll(Instant::now() + self.ctx.timeout) {
            Ok(()) => {
                let out = std::mem::replace(&mut self.bufs.recv, Buffer::U64(Vec::new()));
                Ok((out, self.bufs.send.take()))
            }
            // Dropping `self` on the way out leaks the buffers MPI may still write.
            Err(Some(c)) => Err(self.ctx.check_code(self.op, c).unwrap_err()),
            Err(None) => Err(timeout_error(
                self.op,
                self.bytes,
                (self.ctx.rank, self.ctx.world),
                self.ctx.timeout,
                &self.ctx.peers,
            )),
        }
    }

    // `abandon`: the default (drop) leaks the buffers of a live request, see `Drop`.
}

impl Drop for MpiPending {
    fn drop(&mut self) {
        if self.req != null_request() {
            // MPI may still read or write the buffers: leak them rather than free them.
            std::mem::forget(std::mem::replace(&mut self.bufs, Owned::empty()));
        }
    }
}

/// Starts `op` (all-reduce in place into `bufs.recv`, reduce-scatter or all-gather of
/// `bufs.send` into `bufs.recv` with `bufs.counts` / `bufs.displs`); the returned
/// [`Pending`] owns the buffers from now on.
///
/// Panics when a length disagrees with the counts (the callers return those as argument
/// errors first) or `op` is not one of the three.
pub(super) fn start(ctx: &Ctx, (op, bytes): (Op, usize), bufs: Owned) -> Result<Pending> {
    // Boxed first: from here on the buffers' heap memory stays where it is until the
    // request completes or the buffers are leaked (`MpiPending`'s invariant).
    let mut p = Box::new(MpiPending {
        req: null_request(),
        bufs,
        op,
        bytes,
        ctx: ctx.clone(),
    });
    assert!(ctx.live.load(Ordering::SeqCst), "MPI is initialized");
    let MpiPending { req, bufs, ctx, .. } = &mut *p;
    let (world, rank, comm) = (ctx.world, ctx.rank, ctx.raw);
    let (recv, recv_len, dt) = raw_mut(&mut bufs.recv.as_buf_mut());
    let code = match op {
        Op::AllReduce => {
            assert!(bufs.send.is_none(), "all_reduce is in place");
            let n = c_count(op, rank, recv_len)?;
            // SAFETY: MPI is initialized (asserted above); `recv` holds `n` elements of `dt`
            // (both from the one buffer, `n` its length via a checked conversion); `p` owns
            // it and `req` until the request completes (`MpiPending`'s invariant), and in
            // place there is no send buffer.
            unsafe { ffi::MPI_Iallreduce(in_place(), recv, n, datatype(dt), sum_op(), comm, req) }
        }
        Op::ReduceScatter | Op::AllGather => {
            let send = bufs
                .send
                .as_ref()
                .expect("reduce_scatter / all_gather have an input");
            let (send, send_len, send_dt) = raw(&send.as_buf());
            let counts = &bufs.counts;
            let sum = total(counts).expect("the counts add up to a usize");
            assert!(
                counts.len() == world && send_dt == dt,
                "{}: one count per rank and one dtype",
                op.name()
            );
            let mine = counts[rank];
            if op == Op::ReduceScatter {
                assert!(
                    send_len == sum && recv_len == len_of(mine),
                    "reduce_scatter: buffer lengths do not match the counts"
                );
                // SAFETY: MPI is initialized (asserted above). It reads `counts` (one per rank
                // of `comm`, asserted) and `sum` elements of `dt` from `send`, and writes
                // `counts[rank]` to `recv` (both asserted just above; equal counts:
                // `counts[0] == mine`, `world * counts[0] == sum`). `p` owns the buffers, the
                // counts and `req` until the request completes (`MpiPending`'s invariant).
                unsafe {
                    match equal(counts) {
                        true => ffi::MPI_Ireduce_scatter_block(
                            send,
                            recv,
                            counts[0],
                            datatype(dt),
                            sum_op(),
                            comm,
                            req,
                        ),
                        false => ffi::MPI_Ireduce_scatter(
                            send,
                            recv,
                            counts.as_ptr(),
                            datatype(dt),
                            sum_op(),
                            comm,
                            req,
                        ),
                    }
                }
            } else {
                let displs = &bufs.displs;
                assert!(
                    send_len == len_of(mine)
                        && recv_len == sum
                        && displs.len() == world
                        && segments_fit(counts, displs, recv_len),
                    "all_gather: buffer lengths do not match the counts"
                );
                // SAFETY: MPI is initialized (asserted above). It reads `mine` elements of
                // `dt` from `send` and writes `counts[r]` at `displs[r]` of `recv` for every
                // rank `r` (one count and one displacement per rank of `comm`, each segment
                // inside `recv`: asserted just above; equal counts: `world * mine == sum`).
                // `p` owns the buffers, counts, displacements and `req` until the request
                // completes (`MpiPending`'s invariant).
                unsafe {
                    let t = datatype(dt);
                    match equal(counts) {
                        true => ffi::MPI_Iallgather(send, mine, t, recv, mine, t, comm, req),
                        false => ffi::MPI_Iallgatherv(
                            send,
                            mine,
                            t,
                            recv,
                            counts.as_ptr(),
                            displs.as_ptr(),
                            t,
                            comm,
                            req,
                        ),
                    }
                }
            }
        }
        other => panic!("{} is not a non-blocking collective", other.name()),
    };
    if code != 0 {
        // Nothing started: the buffers are free to go.
        return Err(p.ctx.check_code(op, code).unwrap_err());
    }
    Ok(Pending::new(p))
}
