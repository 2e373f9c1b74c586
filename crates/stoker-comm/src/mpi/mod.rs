//! The MPI backend: rsmpi on the system's MPI (Debian's MPICH), launched by `mpirun -n N`
//! or Slurm's `srun`; rank and world size come from MPI.
//!
//! - Blocking collectives are MPI's own blocking calls (in place where MPI allows), each
//!   under a [`watchdog`] that ends the job if the call outlives the timeout, naming the
//!   collective, the rank, the bytes and which peers on this host are gone (MPI cannot
//!   interrupt a blocking call, nor cancel a started collective).
//! - Non-blocking collectives ([`pending`]) own their buffers and complete by polling
//!   `MPI_Test` against the timeout; a wait that times out returns the error (and leaks
//!   the buffers MPI may still write). MPI moves data only inside MPI calls:
//!   [`Communicator::progress`] drives it between backward blocks, which is what makes
//!   bucketed all-reduces overlap the backward.
//! - A [`watch`] thread notices at once when a peer process on this host dies.
//!
//! Errors from MPI itself are returned, not fatal (`MPI_ERRORS_RETURN`).

mod peers;
mod pending;
mod raw;
mod watch;
mod watchdog;

use std::ffi::c_int;
use std::time::Duration;

use mpi::ffi;
use mpi::traits::{AsRaw, Communicator as _, CommunicatorCollectives};

use crate::communicator::{check_args, Communicator, Pending};
use crate::element::{Buf, BufMut, Buffer};
use crate::error::{CommError, Result};
use crate::stats::{CommStats, Op, StatsCell};
use pending::Owned;
use raw::{
    buf_mut_ptr, buf_ptr, c_count, counts_displs, datatype, equal, iallgather, in_place,
    ireduce_scatter, sum_op, SEND_RECV_TAG,
};

pub use crate::launch::{host_name, launched_world};

/// The MPI world communicator of this process.
pub struct MpiComm {
    universe: Option<mpi::environment::Universe>,
    ctx: Ctx,
    stats: StatsCell,
    watch: watch::Watch,
    dog: watchdog::Watchdog,
}

/// What waits and error messages need; pending operations keep a copy.
#[derive(Clone)]
struct Ctx {
    raw: ffi::MPI_Comm,
    rank: usize,
    world: usize,
    timeout: Duration,
    peers: peers::Peers,
}

impl Ctx {
    fn arg(&self, op: Op, detail: &str) -> CommError {
        CommError::Argument {
            op: op.name(),
            rank: self.rank,
            detail: detail.into(),
        }
    }

    fn check_code(&self, op: Op, code: c_int) -> Result<()> {
        if code == 0 {
            return Ok(());
        }
        Err(CommError::Backend {
            op: op.name(),
            rank: self.rank,
            backend: "mpi",
            code,
            message: raw::error_string(code),
        })
    }
}

/// Ends every rank of the job from anywhere, without the communicator object (a panic
/// hook): prints nothing itself, gives the launcher a moment to forward what the caller
/// printed, then ends this process, which makes the launcher end the others. Makes no
/// MPI call, so any thread may call it.
pub fn abort_world(code: i32) -> ! {
    std::thread::sleep(Duration::from_millis(500));
    // SAFETY: _exit ends the process at once, from any thread.
    unsafe { libc::_exit(code) }
}

impl MpiComm {
    /// Initializes MPI (the main thread alone calls it) and exchanges every rank's host
    /// and pid; collectives time out after `timeout`.
    pub fn init(timeout: Duration) -> Result<MpiComm> {
        let (universe, _threading) = mpi::initialize_with_threading(mpi::Threading::Funneled)
            .ok_or_else(|| CommError::Launch {
                backend: "mpi",
                message: "MPI was already initialized in this process".into(),
            })?;
        let world = universe.world();
        let raw = world.as_raw();
        // SAFETY: `raw` is the valid world communicator; the handler is a predefined one.
        unsafe { ffi::MPI_Comm_set_errhandler(raw, ffi::RSMPI_ERRORS_RETURN) };
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        let me = [peers::host_key(), std::process::id() as u64];
        let mut all = vec![0u64; 2 * size];
        world.all_gather_into(&me[..], &mut all[..]);
        let peers: peers::Peers = std::sync::Arc::new(
            all.chunks_exact(2)
                .map(|c| peers::Peer {
                    host: c[0],
                    pid: c[1],
                })
                .collect(),
        );
        let watch = watch::Watch::start(rank, size, peers::local(&peers, rank));
        let dog = watchdog::Watchdog::start(rank, size, peers.clone());
        Ok(MpiComm {
            universe: Some(universe),
            ctx: Ctx {
                raw,
                rank,
                world: size,
                timeout,
                peers,
            },
            stats: StatsCell::default(),
            watch,
            dog,
        })
    }

    /// Sets the collective timeout.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.ctx.timeout = timeout;
    }

    /// The same all-reduce as [`Communicator::all_reduce_buf`] made as one plain blocking
    /// `MPI_Allreduce` (in place) with none of stoker's bookkeeping: the baseline of
    /// `stoker bench comm`.
    pub fn all_reduce_direct(&self, buf: &mut [f32]) -> Result<()> {
        let n = c_count(Op::AllReduce, self.ctx.rank, buf.len())?;
        // SAFETY: `buf` is valid for `n` f32 elements for the whole blocking call.
        let code = unsafe {
            ffi::MPI_Allreduce(
                in_place(),
                buf.as_mut_ptr().cast(),
                n,
                datatype(crate::DType::F32),
                sum_op(),
                self.ctx.raw,
            )
        };
        self.ctx.check_code(Op::AllReduce, code)
    }

    /// Plain blocking `MPI_Reduce_scatter_block` (equal segments), the baseline of
    /// `stoker bench comm`.
    pub fn reduce_scatter_direct(&self, input: &[f32], out: &mut [f32]) -> Result<()> {
        let n = c_count(Op::ReduceScatter, self.ctx.rank, out.len())?;
        if input.len() != out.len() * self.ctx.world {
            return Err(self
                .ctx
                .arg(Op::ReduceScatter, "input must hold world x output elements"));
        }
        // SAFETY: both buffers are valid for their lengths for the whole blocking call.
        let code = unsafe {
            ffi::MPI_Reduce_scatter_block(
                input.as_ptr().cast(),
                out.as_mut_ptr().cast(),
                n,
                datatype(crate::DType::F32),
                sum_op(),
                self.ctx.raw,
            )
        };
        self.ctx.check_code(Op::ReduceScatter, code)
    }

    /// Plain blocking `MPI_Allgather` (equal segments), the baseline of `stoker bench comm`.
    pub fn all_gather_direct(&self, input: &[f32], out: &mut [f32]) -> Result<()> {
        let n = c_count(Op::AllGather, self.ctx.rank, input.len())?;
        if out.len() != input.len() * self.ctx.world {
            return Err(self
                .ctx
                .arg(Op::AllGather, "output must hold world x input elements"));
        }
        let dt = datatype(crate::DType::F32);
        // SAFETY: both buffers are valid for their lengths for the whole blocking call.
        let code = unsafe {
            ffi::MPI_Allgather(
                input.as_ptr().cast(),
                n,
                dt,
                out.as_mut_ptr().cast(),
                n,
                dt,
                self.ctx.raw,
            )
        };
        self.ctx.check_code(Op::AllGather, code)
    }

    /// Finalizes MPI. Every rank stops watching its peers and meets the others in a
    /// barrier first (with ten times the collective timeout: rank 0 may still be writing
    /// a sample), so that no rank mistakes another's clean exit for a death. A finished
    /// job must not depend on `MPI_Finalize` returning (4-rank MPICH jobs over UCX
    /// sometimes hang in it after their results are out): if it has not returned within
    /// `grace`, the process exits with `exit_code` there.
    pub fn finalize(mut self, grace: Duration, exit_code: i32) {
        self.watch.disarm();
        self.ctx.timeout *= 10;
        let _ = self.barrier();
        let universe = self.universe.take();
        std::thread::spawn(move || {
            std::thread::sleep(grace);
            crate::say(&format!(
                "stoker: MPI_Finalize did not return within {grace:?}; exiting"
            ));
            // SAFETY: _exit ends the process without running destructors or flushing,
            // which is what a hung finalize leaves us; stdout was flushed by the caller.
            unsafe { libc::_exit(exit_code) };
        });
        drop(universe);
    }

    /// Runs a blocking MPI call under the watchdog and checks its return code.
    fn blocking(&self, op: Op, bytes: usize, call: impl FnOnce() -> c_int) -> Result<()> {
        self.stats.count(op, bytes, self.ctx.world);
        let code = self.dog.guard(op, bytes, self.ctx.timeout, call);
        self.ctx.check_code(op, code)
    }
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.ctx.rank
    }

    fn world_size(&self) -> usize {
        self.ctx.world
    }

    fn backend(&self) -> &'static str {
        "mpi"
    }

    fn timeout(&self) -> Duration {
        self.ctx.timeout
    }

    fn all_reduce_buf(&self, mut buf: BufMut<'_>) -> Result<()> {
        let (bytes, dt) = (buf.bytes(), buf.dtype());
        let n = c_count(Op::AllReduce, self.ctx.rank, buf.len())?;
        let ptr = buf_mut_ptr(&mut buf);
        // SAFETY: `buf` is valid for `n` elements of its dtype for the whole blocking call.
        self.blocking(Op::AllReduce, bytes, || unsafe {
            ffi::MPI_Allreduce(in_place(), ptr, n, datatype(dt), sum_op(), self.ctx.raw)
        })
    }

    fn reduce_scatter_buf(
        &self,
        input: Buf<'_>,
        counts: &[usize],
        mut output: BufMut<'_>,
    ) -> Result<()> {
        check_args(
            Op::ReduceScatter,
            self.ctx.rank,
            self.ctx.world,
            Some(counts),
            Some(input),
            Some(&output),
        )?;
        let (c, _) = counts_displs(Op::ReduceScatter, self.ctx.rank, counts)?;
        let (send, recv, dt) = (
            buf_ptr(&input),
            buf_mut_ptr(&mut output),
            datatype(input.dtype()),
        );
        // SAFETY: the lengths were checked against the counts; both buffers and `c` stay
        // borrowed for the whole blocking call.
        self.blocking(Op::ReduceScatter, input.bytes(), || unsafe {
            match equal(&c) {
                true => ffi::MPI_Reduce_scatter_block(send, recv, c[0], dt, sum_op(), self.ctx.raw),
                false => {
                    ffi::MPI_Reduce_scatter(send, recv, c.as_ptr(), dt, sum_op(), self.ctx.raw)
                }
            }
        })
    }

    fn all_gather_buf(
        &self,
        input: Buf<'_>,
        counts: &[usize],
        mut output: BufMut<'_>,
    ) -> Result<()> {
        check_args(
            Op::AllGather,
            self.ctx.rank,
            self.ctx.world,
            Some(counts),
            Some(input),
            Some(&output),
        )?;
        let (c, d) = counts_displs(Op::AllGather, self.ctx.rank, counts)?;
        let n = c[self.ctx.rank];
        let (send, recv, dt) = (
            buf_ptr(&input),
            buf_mut_ptr(&mut output),
            datatype(input.dtype()),
        );
        // SAFETY: as in reduce_scatter_buf.
        self.blocking(Op::AllGather, output.bytes(), || unsafe {
            match equal(&c) {
                true => ffi::MPI_Allgather(send, n, dt, recv, n, dt, self.ctx.raw),
                false => {
                    ffi::MPI_Allgatherv(send, n, dt, recv, c.as_ptr(), d.as_ptr(), dt, self.ctx.raw)
                }
            }
        })
    }

    fn broadcast_buf(&self, mut buf: BufMut<'_>, root: usize) -> Result<()> {
        if root >= self.ctx.world {
            return Err(self.ctx.arg(
                Op::Broadcast,
                &format!("root {root} is not below world size {}", self.ctx.world),
            ));
        }
        let n = c_count(Op::Broadcast, self.ctx.rank, buf.len())?;
        let (bytes, dt, ptr) = (buf.bytes(), datatype(buf.dtype()), buf_mut_ptr(&mut buf));
        // SAFETY: `buf` is valid for `n` elements for the whole blocking call.
        self.blocking(Op::Broadcast, bytes, || unsafe {
            ffi::MPI_Bcast(ptr, n, dt, root as c_int, self.ctx.raw)
        })
    }

    fn barrier(&self) -> Result<()> {
        // SAFETY: no buffers.
        self.blocking(Op::Barrier, 0, || unsafe { ffi::MPI_Barrier(self.ctx.raw) })
    }

    fn send_recv_buf(&self, peer: usize, send: Buf<'_>, mut recv: BufMut<'_>) -> Result<()> {
        if peer >= self.ctx.world || peer == self.ctx.rank {
            return Err(self.ctx.arg(
                Op::SendRecv,
                &format!(
                    "peer {peer}: expected another rank below world size {}",
                    self.ctx.world
                ),
            ));
        }
        let ns = c_count(Op::SendRecv, self.ctx.rank, send.len())?;
        let nr = c_count(Op::SendRecv, self.ctx.rank, recv.len())?;
        let (sp, sdt) = (buf_ptr(&send), datatype(send.dtype()));
        let (rp, rdt) = (buf_mut_ptr(&mut recv), datatype(recv.dtype()));
        let p = peer as c_int;
        // SAFETY: both buffers are valid for their counts for the whole blocking call.
        self.blocking(Op::SendRecv, send.bytes(), || unsafe {
            ffi::MPI_Sendrecv(
                sp,
                ns,
                sdt,
                p,
                SEND_RECV_TAG,
                rp,
                nr,
                rdt,
                p,
                SEND_RECV_TAG,
                self.ctx.raw,
                ffi::RSMPI_STATUS_IGNORE,
            )
        })
    }

    fn start_all_reduce(&self, buf: Buffer) -> Result<Pending> {
        let (bytes, dt) = (buf.bytes(), buf.dtype());
        self.stats.count(Op::AllReduce, bytes, self.ctx.world);
        let n = c_count(Op::AllReduce, self.ctx.rank, buf.len())?;
        let raw = self.ctx.raw;
        let bufs = Owned {
            send: None,
            recv: buf,
            counts: vec![],
            displs: vec![],
        };
        pending::start(
            &self.ctx,
            (Op::AllReduce, bytes),
            bufs,
            |s, r, _, _, req| {
                // SAFETY: the pending operation owns the buffer until it completes.
                unsafe { ffi::MPI_Iallreduce(s, r, n, datatype(dt), sum_op(), raw, req) }
            },
        )
    }

    fn start_reduce_scatter(
        &self,
        input: Buffer,
        counts: &[usize],
        mut recv: Buffer,
    ) -> Result<Pending> {
        check_args(
            Op::ReduceScatter,
            self.ctx.rank,
            self.ctx.world,
            Some(counts),
            Some(input.as_buf()),
            Some(&recv.as_buf_mut()),
        )?;
        let (bytes, dt) = (input.bytes(), input.dtype());
        self.stats.count(Op::ReduceScatter, bytes, self.ctx.world);
        let (c, _) = counts_displs(Op::ReduceScatter, self.ctx.rank, counts)?;
        let raw = self.ctx.raw;
        let bufs = Owned {
            send: Some(input),
            recv,
            counts: c,
            displs: vec![],
        };
        pending::start(
            &self.ctx,
            (Op::ReduceScatter, bytes),
            bufs,
            |s, r, c, _, req| {
                // SAFETY: the pending operation owns both buffers and the counts until it
                // completes.
                unsafe { ireduce_scatter(s, r, c, datatype(dt), raw, req) }
            },
        )
    }

    fn start_all_gather(
        &self,
        input: Buffer,
        counts: &[usize],
        mut recv: Buffer,
    ) -> Result<Pending> {
        check_args(
            Op::AllGather,
            self.ctx.rank,
            self.ctx.world,
            Some(counts),
            Some(input.as_buf()),
            Some(&recv.as_buf_mut()),
        )?;
        let dt = input.dtype();
        let total: usize = counts.iter().sum();
        let bytes = total * dt.size();
        self.stats.count(Op::AllGather, bytes, self.ctx.world);
        let (c, d) = counts_displs(Op::AllGather, self.ctx.rank, counts)?;
        let n = c[self.ctx.rank];
        let raw = self.ctx.raw;
        let bufs = Owned {
            send: Some(input),
            recv,
            counts: c,
            displs: d,
        };
        pending::start(
            &self.ctx,
            (Op::AllGather, bytes),
            bufs,
            |s, r, c, d, req| {
                // SAFETY: the pending operation owns both buffers, the counts and the
                // displacements until it completes.
                unsafe { iallgather((s, n), r, (c, d), datatype(dt), raw, req) }
            },
        )
    }

    fn progress(&self) {
        let mut flag: c_int = 0;
        // SAFETY: a probe with an ignored status only drives MPI's progress engine.
        unsafe {
            ffi::MPI_Iprobe(
                ffi::RSMPI_ANY_SOURCE,
                ffi::RSMPI_ANY_TAG,
                self.ctx.raw,
                &mut flag,
                ffi::RSMPI_STATUS_IGNORE,
            )
        };
    }

    fn stats(&self) -> CommStats {
        self.stats.snapshot()
    }

    fn abort(&self, code: i32, message: &str) -> ! {
        use std::io::Write;
        crate::say(&format!(
            "stoker: rank {} of {}: {message}",
            self.ctx.rank, self.ctx.world
        ));
        let _ = std::io::stdout().flush();
        // MPI_Abort tears the job down at once, and the launcher may drop output it has
        // not yet forwarded: give it a moment to pass the message on.
        std::thread::sleep(Duration::from_millis(500));
        // SAFETY: MPI_Abort on the valid world communicator ends every rank; it does not
        // return in practice, and _exit covers an implementation where it would.
        unsafe {
            ffi::MPI_Abort(self.ctx.raw, code);
            libc::_exit(code)
        }
    }
}
