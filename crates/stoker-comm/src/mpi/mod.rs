//! The MPI backend: rsmpi on the system's MPI (Debian's MPICH), launched by `mpirun -n N`
//! or Slurm's `srun`; rank and world size come from MPI.
//!
//! Every collective is MPI's non-blocking form (`MPI_Iallreduce`, ...) completed by
//! polling `MPI_Test` against a deadline, so no wait can hang: a wait that runs past the
//! timeout names the collective, the rank, the bytes and, for ranks on this host, which
//! peer processes are gone (their pids are exchanged at start). A blocking collective
//! whose deadline passes ends the job there and then (MPI offers no way to cancel a
//! started collective, and returning would leave MPI writing into memory the caller may
//! free); a [`Pending`] one keeps its buffers alive and returns the error. Errors from
//! MPI itself are returned, not fatal (`MPI_ERRORS_RETURN`).
//!
//! MPI moves data only inside MPI calls: [`Communicator::progress`] drives it between
//! backward blocks, which is what makes bucketed all-reduces overlap the backward.

use std::ffi::{c_int, c_void};
use std::time::{Duration, Instant};

use mpi::ffi;
use mpi::traits::{AsRaw, Communicator as _, CommunicatorCollectives};

use crate::communicator::{check_args, Communicator, Pending, PendingOp};
use crate::element::{Buf, BufMut, Buffer, DType};
use crate::error::{CommError, Result};
use crate::stats::{CommStats, Op, StatsCell};

extern "C" {
    fn stoker_mpi_in_place() -> *mut c_void;
}

/// Tag of [`Communicator::send_recv`] messages (collectives do not use tags).
const SEND_RECV_TAG: c_int = 0x570c;

/// The MPI world communicator of this process.
pub struct MpiComm {
    universe: Option<mpi::environment::Universe>,
    ctx: Ctx,
    stats: StatsCell,
    watch: watch::Watch,
}

mod watch;

/// What waits and error messages need; pending operations keep a copy.
#[derive(Clone)]
struct Ctx {
    raw: ffi::MPI_Comm,
    rank: usize,
    world: usize,
    timeout: Duration,
    peers: std::sync::Arc<Vec<Peer>>,
}

/// Where another rank runs, exchanged at start so a timeout can tell whether it died.
#[derive(Debug, Clone, Copy)]
struct Peer {
    host: u64,
    pid: u64,
}

fn host_hash() -> u64 {
    let mut name = [0u8; 256];
    // SAFETY: the buffer is valid for its whole length and gethostname NUL-terminates
    // within it (or truncates, which only shortens the hashed name).
    unsafe { libc::gethostname(name.as_mut_ptr().cast(), name.len()) };
    let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    name[..end].iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

fn datatype(d: DType) -> ffi::MPI_Datatype {
    // SAFETY: reading rsmpi's exported constants, initialized by the C runtime at load.
    unsafe {
        match d {
            DType::F32 => ffi::RSMPI_FLOAT,
            DType::F64 => ffi::RSMPI_DOUBLE,
            DType::U64 => ffi::RSMPI_UINT64_T,
        }
    }
}

fn sum_op() -> ffi::MPI_Op {
    // SAFETY: as in `datatype`.
    unsafe { ffi::RSMPI_SUM }
}

fn in_place() -> *mut c_void {
    // SAFETY: the shim only returns the MPI_IN_PLACE constant.
    unsafe { stoker_mpi_in_place() }
}

fn null_request() -> ffi::MPI_Request {
    // SAFETY: as in `datatype`.
    unsafe { ffi::RSMPI_REQUEST_NULL }
}

/// A count as MPI's `int`; the error names the collective.
fn c_count(op: Op, rank: usize, n: usize) -> Result<c_int> {
    c_int::try_from(n).map_err(|_| CommError::Argument {
        op: op.name(),
        rank,
        detail: format!("{n} elements: MPI counts are 32-bit; split the buffer"),
    })
}

fn buf_ptr(b: &Buf<'_>) -> *const c_void {
    match b {
        Buf::F32(x) => x.as_ptr().cast(),
        Buf::F64(x) => x.as_ptr().cast(),
        Buf::U64(x) => x.as_ptr().cast(),
    }
}

fn buf_mut_ptr(b: &mut BufMut<'_>) -> *mut c_void {
    match b {
        BufMut::F32(x) => x.as_mut_ptr().cast(),
        BufMut::F64(x) => x.as_mut_ptr().cast(),
        BufMut::U64(x) => x.as_mut_ptr().cast(),
    }
}

pub use crate::launch::{host_name, launched_world};

/// Ends every rank of the job from anywhere (a panic hook): `MPI_Abort` on the world
/// communicator, without needing the communicator object.
pub fn abort_world(code: i32) -> ! {
    // Let the launcher forward what was just printed (see `Communicator::abort`).
    std::thread::sleep(Duration::from_millis(500));
    // SAFETY: MPI_Abort on the predefined world communicator; _exit if it returns.
    unsafe {
        ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, code);
        libc::_exit(code)
    }
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
        let me = [host_hash(), std::process::id() as u64];
        let mut all = vec![0u64; 2 * size];
        world.all_gather_into(&me[..], &mut all[..]);
        let peers: Vec<Peer> = all
            .chunks_exact(2)
            .map(|c| Peer {
                host: c[0],
                pid: c[1],
            })
            .collect();
        let here = host_hash();
        let local = peers
            .iter()
            .enumerate()
            .filter(|(r, p)| *r != rank && p.host == here)
            .map(|(r, p)| (r, p.pid))
            .collect();
        let watch = watch::Watch::start(rank, size, local);
        Ok(MpiComm {
            watch,
            universe: Some(universe),
            ctx: Ctx {
                raw,
                rank,
                world: size,
                timeout,
                peers: std::sync::Arc::new(peers),
            },
            stats: StatsCell::default(),
        })
    }

    /// Sets the collective timeout.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.ctx.timeout = timeout;
    }

    /// The raw world communicator, for benchmarks that call MPI directly.
    pub fn raw(&self) -> ffi::MPI_Comm {
        self.ctx.raw
    }

    /// The same all-reduce as [`Communicator::all_reduce_buf`], made as one plain
    /// blocking `MPI_Allreduce` (in place) without stoker's polling: the baseline of
    /// `stoker bench comm`.
    pub fn all_reduce_direct(&self, buf: &mut [f32]) -> Result<()> {
        let n = c_count(Op::AllReduce, self.ctx.rank, buf.len())?;
        // SAFETY: `buf` is valid for `n` f32 elements for the whole blocking call.
        let code = unsafe {
            ffi::MPI_Allreduce(
                in_place(),
                buf.as_mut_ptr().cast(),
                n,
                datatype(DType::F32),
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
                datatype(DType::F32),
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
        // SAFETY: both buffers are valid for their lengths for the whole blocking call.
        let code = unsafe {
            ffi::MPI_Allgather(
                input.as_ptr().cast(),
                n,
                datatype(DType::F32),
                out.as_mut_ptr().cast(),
                n,
                datatype(DType::F32),
                self.ctx.raw,
            )
        };
        self.ctx.check_code(Op::AllGather, code)
    }

    /// Finalizes MPI. A finished job must not depend on `MPI_Finalize` returning (4-rank
    /// MPICH jobs over UCX sometimes hang in it after their results are out): if it has
    /// not returned within `grace`, the process exits with `exit_code` there.
    ///
    /// Every rank stops watching its peers and meets the others in a barrier first (with
    /// ten times the collective timeout: rank 0 may still be writing a sample), so that
    /// no rank mistakes another's clean exit for a death.
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

    /// Waits for a request over borrowed memory: success, an MPI error, or (past the
    /// deadline) the end of the job, since the request would outlive the borrow.
    fn finish_blocking(&self, op: Op, bytes: usize, reqs: &mut [ffi::MPI_Request]) -> Result<()> {
        match self.ctx.poll(reqs, Instant::now() + self.ctx.timeout) {
            Ok(()) => Ok(()),
            Err(Some(code)) => {
                let e = self.ctx.check_code(op, code).unwrap_err();
                self.abort(1, &e.to_string())
            }
            Err(None) => {
                let e = self.ctx.timeout_error(op, bytes);
                self.abort(1, &e.to_string())
            }
        }
    }
}

impl Ctx {
    fn start_code(&self, op: Op, code: c_int) -> Result<()> {
        self.check_code(op, code)
    }

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
            message: error_string(code),
        })
    }

    /// Which peers are gone, for a timeout message: ranks on this host whose process no
    /// longer exists; ranks elsewhere cannot be checked from here.
    fn lost_peers(&self) -> (Vec<usize>, String) {
        let here = host_hash();
        let mut lost = Vec::new();
        let mut remote = 0;
        for (r, p) in self.peers.iter().enumerate() {
            if r == self.rank {
                continue;
            }
            if p.host != here {
                remote += 1;
                continue;
            }
            // SAFETY: signal 0 only checks that the pid exists; no signal is sent.
            let alive = unsafe { libc::kill(p.pid as libc::pid_t, 0) } == 0
                || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
            if !alive {
                lost.push(r);
            }
        }
        let mut detail = match lost.as_slice() {
            [] => {
                "every rank on this host is still running (one may be stuck or slower)".to_string()
            }
            l => format!(
                "rank(s) {l:?} are gone (pid {} no longer exists)",
                l.iter()
                    .map(|&r| self.peers[r].pid.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        if remote > 0 {
            detail.push_str(&format!("; {remote} rank(s) on other hosts not checked"));
        }
        (lost, detail)
    }

    fn timeout_error(&self, op: Op, bytes: usize) -> CommError {
        let (lost, detail) = self.lost_peers();
        match lost.first() {
            Some(&l) => CommError::RankLost {
                op: op.name(),
                rank: self.rank,
                lost: l,
                bytes,
                detail: format!(
                    "noticed after {:.1} s: {detail}",
                    self.timeout.as_secs_f64()
                ),
            },
            None => CommError::Timeout {
                op: op.name(),
                rank: self.rank,
                world: self.world,
                bytes,
                after: self.timeout,
                detail,
            },
        }
    }

    /// Polls `reqs` until every one completed, the deadline passed (Err(None)) or MPI
    /// reported an error (Err(Some)).
    fn poll(
        &self,
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
                // SAFETY: `r` is a request this backend started (or null, skipped above);
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
        }
    }
}

fn error_string(code: c_int) -> String {
    let mut buf = vec![0u8; 1024];
    let mut len: c_int = 0;
    // SAFETY: the buffer holds MPI_MAX_ERROR_STRING (512 in MPICH) bytes and more.
    unsafe { ffi::MPI_Error_string(code, buf.as_mut_ptr().cast(), &mut len) };
    buf.truncate(len.max(0) as usize);
    String::from_utf8_lossy(&buf).into_owned()
}

/// A started MPI collective over buffers it owns.
struct MpiPending {
    req: ffi::MPI_Request,
    /// Kept alive until completion: the input of reduce-scatter / all-gather.
    _send: Option<Buffer>,
    /// The result buffer MPI writes.
    recv: Buffer,
    /// Counts and displacements MPI reads until completion.
    _counts: Vec<c_int>,
    _displs: Vec<c_int>,
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

    fn wait(mut self: Box<Self>) -> Result<Buffer> {
        let comm = self.ctx.clone();
        let mut reqs = [self.req];
        match comm.poll(&mut reqs, Instant::now() + comm.timeout) {
            Ok(()) => {
                self.req = null_request();
                Ok(std::mem::replace(&mut self.recv, Buffer::U64(Vec::new())))
            }
            Err(code) => {
                let e = match code {
                    Some(c) => comm.check_code(self.op, c).unwrap_err(),
                    None => comm.timeout_error(self.op, self.bytes),
                };
                // MPI may still write the buffers: leak them rather than free them.
                std::mem::forget(self);
                Err(e)
            }
        }
    }
}

impl MpiComm {
    /// A pending operation over `send` / `recv` (and the counts and displacements MPI
    /// reads), started by `start` with pointers into the buffers it now owns.
    fn pending(
        &self,
        (op, bytes): (Op, usize),
        (send, recv): (Option<Buffer>, Buffer),
        (counts, displs): (Vec<c_int>, Vec<c_int>),
        start: impl FnOnce(
            *const c_void,
            *mut c_void,
            &[c_int],
            &[c_int],
            *mut ffi::MPI_Request,
        ) -> c_int,
    ) -> Result<Pending> {
        let mut p = Box::new(MpiPending {
            req: null_request(),
            _send: send,
            recv,
            _counts: counts,
            _displs: displs,
            op,
            bytes,
            ctx: self.ctx.clone(),
        });
        let send_ptr = match &p._send {
            Some(b) => buf_ptr(&b.as_buf()),
            None => in_place() as *const c_void,
        };
        let recv_ptr = buf_mut_ptr(&mut p.recv.as_buf_mut());
        let req_ptr: *mut ffi::MPI_Request = &mut p.req;
        let code = start(send_ptr, recv_ptr, &p._counts, &p._displs, req_ptr);
        self.ctx.start_code(op, code)?;
        Ok(Pending::new(p))
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
        self.stats.count(Op::AllReduce, bytes, self.ctx.world);
        let n = c_count(Op::AllReduce, self.ctx.rank, buf.len())?;
        let mut req = [null_request()];
        // SAFETY: `buf` stays borrowed (valid, unaliased) until finish_blocking returns
        // or ends the process.
        let code = unsafe {
            ffi::MPI_Iallreduce(
                in_place(),
                buf_mut_ptr(&mut buf),
                n,
                datatype(dt),
                sum_op(),
                self.ctx.raw,
                &mut req[0],
            )
        };
        self.ctx.start_code(Op::AllReduce, code)?;
        self.finish_blocking(Op::AllReduce, bytes, &mut req)
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
        let bytes = input.bytes();
        self.stats.count(Op::ReduceScatter, bytes, self.ctx.world);
        let c: Vec<c_int> = counts
            .iter()
            .map(|&n| c_count(Op::ReduceScatter, self.ctx.rank, n))
            .collect::<Result<_>>()?;
        let mut req = [null_request()];
        // SAFETY: both buffers and `c` stay borrowed until finish_blocking returns or
        // ends the process; lengths were checked against the counts.
        let code = unsafe {
            ireduce_scatter(
                buf_ptr(&input),
                buf_mut_ptr(&mut output),
                &c,
                datatype(input.dtype()),
                self.ctx.raw,
                &mut req[0],
            )
        };
        self.ctx.start_code(Op::ReduceScatter, code)?;
        self.finish_blocking(Op::ReduceScatter, bytes, &mut req)
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
        let bytes = output.bytes();
        self.stats.count(Op::AllGather, bytes, self.ctx.world);
        let (c, d) = counts_displs(Op::AllGather, self.ctx.rank, counts)?;
        let mut req = [null_request()];
        // SAFETY: as in reduce_scatter_buf.
        let code = unsafe {
            iallgather(
                (buf_ptr(&input), c[self.ctx.rank]),
                buf_mut_ptr(&mut output),
                (&c, &d),
                datatype(input.dtype()),
                self.ctx.raw,
                &mut req[0],
            )
        };
        self.ctx.start_code(Op::AllGather, code)?;
        self.finish_blocking(Op::AllGather, bytes, &mut req)
    }

    fn broadcast_buf(&self, mut buf: BufMut<'_>, root: usize) -> Result<()> {
        if root >= self.ctx.world {
            return Err(self.ctx.arg(
                Op::Broadcast,
                &format!("root {root} is not below world size {}", self.ctx.world),
            ));
        }
        let bytes = buf.bytes();
        self.stats.count(Op::Broadcast, bytes, self.ctx.world);
        let n = c_count(Op::Broadcast, self.ctx.rank, buf.len())?;
        let dt = buf.dtype();
        let mut req = [null_request()];
        // SAFETY: as in all_reduce_buf.
        let code = unsafe {
            ffi::MPI_Ibcast(
                buf_mut_ptr(&mut buf),
                n,
                datatype(dt),
                root as c_int,
                self.ctx.raw,
                &mut req[0],
            )
        };
        self.ctx.start_code(Op::Broadcast, code)?;
        self.finish_blocking(Op::Broadcast, bytes, &mut req)
    }

    fn barrier(&self) -> Result<()> {
        self.stats.count(Op::Barrier, 0, self.ctx.world);
        let mut req = [null_request()];
        // SAFETY: no buffers; the request is polled to completion below.
        let code = unsafe { ffi::MPI_Ibarrier(self.ctx.raw, &mut req[0]) };
        self.ctx.start_code(Op::Barrier, code)?;
        self.finish_blocking(Op::Barrier, 0, &mut req)
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
        let bytes = send.bytes();
        self.stats.count(Op::SendRecv, bytes, self.ctx.world);
        let ns = c_count(Op::SendRecv, self.ctx.rank, send.len())?;
        let nr = c_count(Op::SendRecv, self.ctx.rank, recv.len())?;
        let mut reqs = [null_request(), null_request()];
        // SAFETY: both buffers stay borrowed until finish_blocking returns or ends the
        // process.
        let code = unsafe {
            let rdt = datatype(recv.dtype());
            let c1 = ffi::MPI_Irecv(
                buf_mut_ptr(&mut recv),
                nr,
                rdt,
                peer as c_int,
                SEND_RECV_TAG,
                self.ctx.raw,
                &mut reqs[0],
            );
            if c1 != 0 {
                c1
            } else {
                ffi::MPI_Isend(
                    buf_ptr(&send),
                    ns,
                    datatype(send.dtype()),
                    peer as c_int,
                    SEND_RECV_TAG,
                    self.ctx.raw,
                    &mut reqs[1],
                )
            }
        };
        self.ctx.start_code(Op::SendRecv, code)?;
        self.finish_blocking(Op::SendRecv, bytes, &mut reqs)
    }

    fn start_all_reduce(&self, buf: Buffer) -> Result<Pending> {
        let (bytes, dt, len) = (buf.bytes(), buf.dtype(), buf.len());
        self.stats.count(Op::AllReduce, bytes, self.ctx.world);
        let n = c_count(Op::AllReduce, self.ctx.rank, len)?;
        let raw = self.ctx.raw;
        self.pending(
            (Op::AllReduce, bytes),
            (None, buf),
            (vec![], vec![]),
            |s, r, _, _, req| {
                // SAFETY: the pending operation owns the buffer until it completes.
                unsafe { ffi::MPI_Iallreduce(s, r, n, datatype(dt), sum_op(), raw, req) }
            },
        )
    }

    fn start_reduce_scatter(&self, input: Buffer, counts: &[usize]) -> Result<Pending> {
        check_args(
            Op::ReduceScatter,
            self.ctx.rank,
            self.ctx.world,
            Some(counts),
            Some(input.as_buf()),
            None,
        )?;
        let (bytes, dt) = (input.bytes(), input.dtype());
        self.stats.count(Op::ReduceScatter, bytes, self.ctx.world);
        let (c, _) = counts_displs(Op::ReduceScatter, self.ctx.rank, counts)?;
        let out = Buffer::zeros(dt, counts[self.ctx.rank]);
        let raw = self.ctx.raw;
        self.pending(
            (Op::ReduceScatter, bytes),
            (Some(input), out),
            (c, vec![]),
            |s, r, c, _, req| {
                // SAFETY: the pending operation owns both buffers and the counts until it
                // completes.
                unsafe { ireduce_scatter(s, r, c, datatype(dt), raw, req) }
            },
        )
    }

    fn start_all_gather(&self, input: Buffer, counts: &[usize]) -> Result<Pending> {
        check_args(
            Op::AllGather,
            self.ctx.rank,
            self.ctx.world,
            Some(counts),
            Some(input.as_buf()),
            None,
        )?;
        let dt = input.dtype();
        let total: usize = counts.iter().sum();
        self.stats
            .count(Op::AllGather, total * dt.size(), self.ctx.world);
        let (c, d) = counts_displs(Op::AllGather, self.ctx.rank, counts)?;
        let n = c[self.ctx.rank];
        let out = Buffer::zeros(dt, total);
        let raw = self.ctx.raw;
        self.pending(
            (Op::AllGather, total * dt.size()),
            (Some(input), out),
            (c, d),
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

/// Starts a sum reduce-scatter with `counts[r]` elements for rank `r`:
/// `MPI_Ireduce_scatter_block` when every count is the same (MPICH runs faster algorithms
/// for it), `MPI_Ireduce_scatter` otherwise.
///
/// # Safety
/// `send` must be valid for the counts' sum and `recv` for this rank's count, and both,
/// `counts` and `req` must stay valid until the request completes.
unsafe fn ireduce_scatter(
    send: *const c_void,
    recv: *mut c_void,
    counts: &[c_int],
    dt: ffi::MPI_Datatype,
    comm: ffi::MPI_Comm,
    req: *mut ffi::MPI_Request,
) -> c_int {
    match counts.first() {
        Some(&n) if counts.iter().all(|&c| c == n) => {
            ffi::MPI_Ireduce_scatter_block(send, recv, n, dt, sum_op(), comm, req)
        }
        _ => ffi::MPI_Ireduce_scatter(send, recv, counts.as_ptr(), dt, sum_op(), comm, req),
    }
}

/// Starts an all-gather of `counts[r]` elements from rank `r` at `displs[r]` (this
/// rank sends `n`): `MPI_Iallgather` when every count is the same, `MPI_Iallgatherv`
/// otherwise.
///
/// # Safety
/// As [`ireduce_scatter`], with `send` valid for `n` elements, `recv` for the counts' sum
/// and `displs` alive too.
unsafe fn iallgather(
    (send, n): (*const c_void, c_int),
    recv: *mut c_void,
    (counts, displs): (&[c_int], &[c_int]),
    dt: ffi::MPI_Datatype,
    comm: ffi::MPI_Comm,
    req: *mut ffi::MPI_Request,
) -> c_int {
    if counts.iter().all(|&c| c == n) {
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

fn counts_displs(op: Op, rank: usize, counts: &[usize]) -> Result<(Vec<c_int>, Vec<c_int>)> {
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
