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
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use mpi::ffi;
use mpi::traits::{AsRaw, Communicator as _, CommunicatorCollectives};

use crate::communicator::{check_args, Communicator, Pending};
use crate::element::{Buf, BufMut, Buffer};
use crate::error::{CommError, Result};
use crate::stats::{CommStats, Op, StatsCell};
use pending::Owned;
use raw::{
    c_count, counts_displs, datatype, equal, in_place, len_of, raw, raw_mut, segments_fit, sum_op,
    total, SEND_RECV_TAG,
};

pub use crate::launch::{host_name, launched_world, local_ranks};

/// The MPI world communicator of this process.
///
/// Neither Send nor Sync: MPI is initialized `MPI_THREAD_FUNNELED`, so only the thread that
/// called [`MpiComm::init`] may make MPI calls, and every MPI call goes through this value
/// (or a [`Pending`] it started, which is not Send either).
pub struct MpiComm {
    universe: Option<mpi::environment::Universe>,
    ctx: Ctx,
    stats: StatsCell,
    watch: watch::Watch,
    dog: watchdog::Watchdog,
    _funneled: std::marker::PhantomData<*const ()>,
}

/// What waits and error messages need; pending operations keep a copy.
///
/// Invariant (set once by [`MpiComm::init`]): `raw` is MPI's world communicator, valid
/// while `live` is true, `world` its size (a positive c_int) and `rank < world` this
/// process's rank in it.
#[derive(Clone)]
struct Ctx {
    raw: ffi::MPI_Comm,
    rank: usize,
    world: usize,
    timeout: Duration,
    peers: peers::Peers,
    /// True until MPI_Finalize: a pending operation that outlives the communicator makes no
    /// MPI call after it.
    live: Arc<AtomicBool>,
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
    // SAFETY: _exit(2) has no preconditions; it ends the process at once, from any thread.
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
        // SAFETY: MPI was initialized just above (`universe` holds it), `raw` is its world
        // communicator and the handler a predefined one; the call takes no buffers.
        unsafe { ffi::MPI_Comm_set_errhandler(raw, ffi::RSMPI_ERRORS_RETURN) };
        let (rank, size) = (world.rank(), world.size());
        // Checked once here: every count and rank handed to MPI below relies on these.
        assert!(
            0 <= rank && rank < size,
            "MPI rank {rank} of world size {size}"
        );
        let (rank, size) = (len_of(rank), len_of(size));
        let me = [
            peers::host_key(),
            std::process::id() as u64,
            peers::machine_key(),
        ];
        let mut all = vec![0u64; 3 * size];
        world.all_gather_into(&me[..], &mut all[..]);
        let peers: peers::Peers = std::sync::Arc::new(
            all.chunks_exact(3)
                .map(|c| peers::Peer {
                    host: c[0],
                    pid: c[1],
                    machine: c[2],
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
                live: Arc::new(AtomicBool::new(true)),
            },
            stats: StatsCell::default(),
            watch,
            dog,
            _funneled: std::marker::PhantomData,
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
        // SAFETY: `buf` holds `n` f32 (MPI_FLOAT) elements (`n` is its length, converted
        // with a check) and stays borrowed for the whole blocking call; in place there is no
        // send buffer.
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
        if out.len().checked_mul(self.ctx.world) != Some(input.len()) {
            return Err(self
                .ctx
                .arg(Op::ReduceScatter, "input must hold world x output elements"));
        }
        // SAFETY: MPI reads world x `n` f32 elements from `input` and writes `n` to `out`,
        // their lengths (checked just above, without overflow); both stay borrowed for the
        // whole blocking call.
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
        if input.len().checked_mul(self.ctx.world) != Some(out.len()) {
            return Err(self
                .ctx
                .arg(Op::AllGather, "output must hold world x input elements"));
        }
        let dt = datatype(crate::DType::F32);
        // SAFETY: MPI reads `n` f32 elements from `input` and writes world x `n` to `out`,
        // their lengths (checked just above, without overflow); both stay borrowed for the
        // whole blocking call.
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
        // Pending operations still held make no MPI call from now on.
        self.ctx.live.store(false, Ordering::SeqCst);
        let universe = self.universe.take();
        std::thread::spawn(move || {
            std::thread::sleep(grace);
            crate::say(&format!(
                "stoker: MPI_Finalize did not return within {grace:?}; exiting"
            ));
            // SAFETY: _exit(2) has no preconditions; it ends the process without running
            // destructors or flushing, which is what a hung finalize leaves us (stdout was
            // flushed by the caller).
            unsafe { libc::_exit(exit_code) };
        });
        drop(universe);
    }

    /// Runs a blocking MPI call under the watchdog and checks its return code. (`&self`
    /// keeps MPI initialized: only `finalize(self)` or dropping the communicator ends it.)
    fn blocking(&self, op: Op, bytes: usize, call: impl FnOnce() -> c_int) -> Result<()> {
        self.stats.count(op, bytes, self.ctx.world);
        let code = self.dog.guard(op, bytes, self.ctx.timeout, call);
        self.ctx.check_code(op, code)
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        // The universe (dropped after this body) finalizes MPI: pending operations still
        // held make no MPI call from now on.
        self.ctx.live.store(false, Ordering::SeqCst);
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
        let bytes = buf.bytes();
        let (ptr, len, dt) = raw_mut(&mut buf);
        let n = c_count(Op::AllReduce, self.ctx.rank, len)?;
        // SAFETY: `ptr` holds `n` elements of `dt` (pointer, length and dtype all from `buf`;
        // `n` converted with a check) and `buf` stays borrowed for the whole blocking call;
        // in place there is no send buffer.
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
        let (send, send_len, send_dt) = raw(&input);
        let (recv, recv_len, dt) = raw_mut(&mut output);
        // Checked again on the very values MPI gets (check_args returned these as errors).
        assert!(
            c.len() == self.ctx.world
                && send_dt == dt
                && Some(send_len) == total(&c)
                && recv_len == len_of(c[self.ctx.rank]),
            "reduce_scatter: buffer lengths do not match the counts"
        );
        let dt = datatype(dt);
        // SAFETY: MPI reads `c` (one count per rank, asserted) and their sum of elements of
        // `dt` from `send`, and writes `c[rank]` to `recv` (both asserted just above; equal
        // counts: `c[0] == c[rank]`, world x `c[0]` is the sum); both buffers and `c` stay
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
        let bytes = output.bytes();
        let (send, send_len, send_dt) = raw(&input);
        let (recv, recv_len, dt) = raw_mut(&mut output);
        // Checked again on the very values MPI gets (check_args returned these as errors).
        assert!(
            c.len() == self.ctx.world
                && send_dt == dt
                && send_len == len_of(n)
                && Some(recv_len) == total(&c)
                && segments_fit(&c, &d, recv_len),
            "all_gather: buffer lengths do not match the counts"
        );
        let dt = datatype(dt);
        // SAFETY: MPI reads `n` elements of `dt` from `send` and writes `c[r]` at `d[r]` of
        // `recv` for every rank `r` (one count and displacement per rank, each segment inside
        // `recv`: asserted just above; equal counts: world x `n` is `recv`'s length); both
        // buffers, `c` and `d` stay borrowed for the whole blocking call.
        self.blocking(Op::AllGather, bytes, || unsafe {
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
        let root = c_int::try_from(root).expect("root < world size, a c_int");
        let bytes = buf.bytes();
        let (ptr, len, dt) = raw_mut(&mut buf);
        let n = c_count(Op::Broadcast, self.ctx.rank, len)?;
        let dt = datatype(dt);
        // SAFETY: `ptr` holds `n` elements of `dt` (pointer, length and dtype all from `buf`;
        // `n` converted with a check) and `buf` stays borrowed for the whole blocking call.
        self.blocking(Op::Broadcast, bytes, || unsafe {
            ffi::MPI_Bcast(ptr, n, dt, root, self.ctx.raw)
        })
    }

    fn barrier(&self) -> Result<()> {
        // SAFETY: a barrier on the live world communicator (`&self`) takes no buffers.
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
        let (sp, send_len, sdt) = raw(&send);
        let (rp, recv_len, rdt) = raw_mut(&mut recv);
        let ns = c_count(Op::SendRecv, self.ctx.rank, send_len)?;
        let nr = c_count(Op::SendRecv, self.ctx.rank, recv_len)?;
        let (sdt, rdt) = (datatype(sdt), datatype(rdt));
        let p = c_int::try_from(peer).expect("peer < world size, a c_int");
        // SAFETY: MPI reads `ns` elements of `sdt` from `sp` and writes at most `nr` of
        // `rdt` to `rp` (a longer message is a truncation error); each pointer, length and
        // dtype come from one buffer (counts converted with a check), and both buffers stay
        // borrowed for the whole blocking call.
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
        let bytes = buf.bytes();
        self.stats.count(Op::AllReduce, bytes, self.ctx.world);
        let bufs = Owned {
            send: None,
            recv: buf,
            counts: vec![],
            displs: vec![],
        };
        pending::start(&self.ctx, (Op::AllReduce, bytes), bufs)
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
        let bytes = input.bytes();
        self.stats.count(Op::ReduceScatter, bytes, self.ctx.world);
        let (c, _) = counts_displs(Op::ReduceScatter, self.ctx.rank, counts)?;
        let bufs = Owned {
            send: Some(input),
            recv,
            counts: c,
            displs: vec![],
        };
        pending::start(&self.ctx, (Op::ReduceScatter, bytes), bufs)
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
        // check_args matched `recv`'s length to the counts' sum.
        let bytes = recv.bytes();
        self.stats.count(Op::AllGather, bytes, self.ctx.world);
        let (c, d) = counts_displs(Op::AllGather, self.ctx.rank, counts)?;
        let bufs = Owned {
            send: Some(input),
            recv,
            counts: c,
            displs: d,
        };
        pending::start(&self.ctx, (Op::AllGather, bytes), bufs)
    }

    fn progress(&self) {
        let mut flag: c_int = 0;
        // SAFETY: a probe on the live world communicator (`&self`) writes only `flag` (the
        // status is ignored); it drives MPI's progress engine.
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

    fn ranks_on_this_host(&self) -> usize {
        // The peers exchanged at start: the same host name and boot.
        peers::on_machine_of(&self.ctx.peers, self.rank())
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
        // SAFETY: MPI_Abort on the live world communicator (`&self`) takes no buffers and
        // ends every rank; it does not return in practice, and _exit(2), which has no
        // preconditions, covers an implementation where it would.
        unsafe {
            ffi::MPI_Abort(self.ctx.raw, code);
            libc::_exit(code)
        }
    }
}
