//! The in-process backend: N ranks as N threads of one process, for fast deterministic
//! tests at world sizes 1-8 and for running the data-parallel code without a launcher.
//!
//! Every collective is a rendezvous: each rank deposits its buffer under the call's
//! sequence number; the last to arrive computes the result (sums in rank order 0, 1, 2,
//! ..., so results are reproducible) and wakes the others, who copy out their part. A
//! rank whose communicator is dropped (its thread returned or panicked) is marked gone,
//! and every wait that needs it fails at once naming it; other waits fail at the timeout
//! naming the ranks that never arrived. Ranks that call different collectives at the
//! same point fail with [`CommError::Mismatch`] instead of hanging.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::communicator::{check_args, Communicator, Pending, PendingOp};
use crate::element::{Buf, BufMut, Buffer, DType};
use crate::error::{CommError, Result};
use crate::stats::{CommStats, Op, StatsCell};

/// What a call asks for, compared across ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Kind {
    AllReduce,
    ReduceScatter(Vec<usize>),
    AllGather(Vec<usize>),
    Broadcast(usize),
    Barrier,
}

impl Kind {
    fn op(&self) -> Op {
        match self {
            Kind::AllReduce => Op::AllReduce,
            Kind::ReduceScatter(_) => Op::ReduceScatter,
            Kind::AllGather(_) => Op::AllGather,
            Kind::Broadcast(_) => Op::Broadcast,
            Kind::Barrier => Op::Barrier,
        }
    }
}

/// One collective call in progress.
struct Slot {
    kind: Kind,
    dtype: DType,
    /// Elements each rank contributes (all-gather: checked against the counts instead).
    len: usize,
    first: usize,
    inputs: Vec<Option<Buffer>>,
    arrived: usize,
    result: Option<Arc<Buffer>>,
    taken: usize,
    error: Option<String>,
}

#[derive(Default)]
struct State {
    slots: HashMap<u64, Slot>,
    gone: Vec<bool>,
    /// Point-to-point messages by (from, to), in order.
    mail: HashMap<(usize, usize), VecDeque<Buffer>>,
}

struct Shared {
    world: usize,
    state: Mutex<State>,
    cv: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A rank that panicked while holding the lock left consistent data (every
        // mutation completes before any call that can panic).
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One rank of an in-process group.
pub struct LocalComm {
    shared: Arc<Shared>,
    rank: usize,
    seq: std::cell::Cell<u64>,
    timeout: Duration,
    stats: StatsCell,
}

/// `world` communicators of one group, rank 0 first; hand one to each thread.
pub fn local_group(world: usize, timeout: Duration) -> Vec<LocalComm> {
    assert!(world >= 1, "a group has at least one rank");
    let shared = Arc::new(Shared {
        world,
        state: Mutex::new(State {
            gone: vec![false; world],
            ..State::default()
        }),
        cv: Condvar::new(),
    });
    (0..world)
        .map(|rank| LocalComm {
            shared: shared.clone(),
            rank,
            seq: std::cell::Cell::new(0),
            timeout,
            stats: StatsCell::default(),
        })
        .collect()
}

/// Runs `f` on `world` threads, one rank each, and returns their results in rank order.
/// A panic on any rank is re-raised here after every thread has ended (the others see
/// the panicked rank as gone, so none of them hangs).
pub fn run_local<T, F>(world: usize, timeout: Duration, f: F) -> Vec<T>
where
    T: Send,
    F: Fn(LocalComm) -> T + Sync,
{
    let comms = local_group(world, timeout);
    let results: Vec<std::thread::Result<T>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let f = &f;
                std::thread::Builder::new()
                    .name(format!("rank-{}", c.rank))
                    .spawn_scoped(s, move || f(c))
                    .expect("spawning a rank thread")
            })
            .collect();
        handles.into_iter().map(|h| h.join()).collect()
    });
    let mut out = Vec::with_capacity(world);
    for r in results {
        match r {
            Ok(v) => out.push(v),
            Err(p) => std::panic::resume_unwind(p),
        }
    }
    out
}

impl Drop for LocalComm {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        st.gone[self.rank] = true;
        drop(st);
        self.shared.cv.notify_all();
    }
}

impl LocalComm {
    fn next_seq(&self) -> u64 {
        let s = self.seq.get();
        self.seq.set(s + 1);
        s
    }

    /// Deposits this rank's input for call `seq`; the last rank computes the result.
    fn deposit(&self, seq: u64, kind: Kind, input: Buffer) -> Result<()> {
        let world = self.shared.world;
        let me = self.rank;
        let op = kind.op();
        self.stats.count(
            op,
            match &kind {
                Kind::AllGather(c) => c.iter().sum::<usize>() * input.dtype().size(),
                _ => input.bytes(),
            },
            world,
        );
        let mut st = self.shared.lock();
        let slot = st.slots.entry(seq).or_insert_with(|| Slot {
            kind: kind.clone(),
            dtype: input.dtype(),
            len: input.len(),
            first: me,
            inputs: (0..world).map(|_| None).collect(),
            arrived: 0,
            result: None,
            taken: 0,
            error: None,
        });
        let same_len = matches!(kind, Kind::AllGather(_)) || slot.len == input.len();
        if slot.kind != kind || slot.dtype != input.dtype() || !same_len {
            let detail = format!(
                "rank {me} called {} ({:?}, {} x {}) where rank {} called {} ({:?}, {} x {})",
                op.name(),
                kind,
                input.len(),
                input.dtype().name(),
                slot.first,
                slot.kind.op().name(),
                slot.kind,
                slot.len,
                slot.dtype.name()
            );
            slot.error = Some(detail.clone());
            drop(st);
            self.shared.cv.notify_all();
            return Err(CommError::Mismatch {
                rank: me,
                call: seq,
                detail,
            });
        }
        slot.inputs[me] = Some(input);
        slot.arrived += 1;
        if slot.arrived == world {
            let inputs: Vec<Buffer> = slot
                .inputs
                .iter_mut()
                .map(|b| b.take().expect("every rank arrived"))
                .collect();
            slot.result = Some(Arc::new(combine(&slot.kind, inputs)));
            drop(st);
            self.shared.cv.notify_all();
        }
        Ok(())
    }

    /// Deposit and collect in one call, for the blocking collectives.
    fn rendezvous(&self, kind: Kind, input: Buffer) -> Result<Arc<Buffer>> {
        let (op, bytes) = (kind.op(), input.bytes());
        let seq = self.next_seq();
        self.deposit(seq, kind, input)?;
        collect(&self.shared, self.rank, seq, op, bytes, self.timeout)
    }

    fn check(
        &self,
        op: Op,
        counts: Option<&[usize]>,
        input: Option<Buf<'_>>,
        output: Option<&BufMut<'_>>,
    ) -> Result<()> {
        check_args(op, self.rank, self.shared.world, counts, input, output)
    }
}

/// Waits for call `seq`'s result on behalf of `rank`.
fn collect(
    shared: &Shared,
    rank: usize,
    seq: u64,
    op: Op,
    bytes: usize,
    timeout: Duration,
) -> Result<Arc<Buffer>> {
    let deadline = Instant::now() + timeout;
    let mut st = shared.lock();
    loop {
        let world = shared.world;
        let gone = st.gone.clone();
        let slot = st.slots.get_mut(&seq).expect("deposited before collecting");
        if let Some(e) = &slot.error {
            return Err(CommError::Mismatch {
                rank,
                call: seq,
                detail: e.clone(),
            });
        }
        if let Some(res) = slot.result.clone() {
            slot.taken += 1;
            if slot.taken == world {
                st.slots.remove(&seq);
            }
            return Ok(res);
        }
        let missing: Vec<usize> = (0..world).filter(|&r| slot.inputs[r].is_none()).collect();
        if let Some(&lost) = missing.iter().find(|&&r| gone[r]) {
            return Err(CommError::RankLost {
                op: op.name(),
                rank,
                lost,
                bytes,
                detail: format!(
                    "its communicator was dropped before it joined collective call {seq}"
                ),
            });
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(CommError::Timeout {
                op: op.name(),
                rank,
                world,
                bytes,
                after: timeout,
                detail: format!(
                    "ranks {missing:?} never joined collective call {seq} (in-process group)"
                ),
            });
        }
        st = shared
            .cv
            .wait_timeout(st, deadline - now)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}

/// The result of a collective from every rank's input, in rank order.
fn combine(kind: &Kind, inputs: Vec<Buffer>) -> Buffer {
    let mut it = inputs.into_iter();
    match kind {
        Kind::AllReduce | Kind::ReduceScatter(_) => {
            let mut acc = it.next().expect("at least one rank");
            for b in it {
                acc.add_assign(b.as_buf());
            }
            acc
        }
        Kind::AllGather(_) => {
            let mut acc = it.next().expect("at least one rank");
            for b in it {
                match (&mut acc, b) {
                    (Buffer::F32(a), Buffer::F32(b)) => a.extend(b),
                    (Buffer::F64(a), Buffer::F64(b)) => a.extend(b),
                    (Buffer::U64(a), Buffer::U64(b)) => a.extend(b),
                    _ => unreachable!("dtypes checked at deposit"),
                }
            }
            acc
        }
        Kind::Broadcast(root) => it.nth(*root).expect("root below world"),
        Kind::Barrier => Buffer::U64(Vec::new()),
    }
}

/// A started in-process collective.
struct LocalPending {
    comm: Arc<Shared>,
    rank: usize,
    seq: u64,
    op: Op,
    bytes: usize,
    timeout: Duration,
    /// Reduce-scatter: this rank's segment `(start, len)`; otherwise the whole result.
    segment: Option<(usize, usize)>,
    /// The caller's output buffer (reduce-scatter, all-gather); None: a copy of the result.
    output: Option<Buffer>,
}

impl PendingOp for LocalPending {
    fn test(&mut self) -> Result<bool> {
        let st = self.comm.lock();
        let slot = st.slots.get(&self.seq).expect("deposited");
        Ok(slot.result.is_some() || slot.error.is_some())
    }

    fn wait(self: Box<Self>) -> Result<(Buffer, Option<Buffer>)> {
        let res = collect(
            &self.comm,
            self.rank,
            self.seq,
            self.op,
            self.bytes,
            self.timeout,
        )?;
        let mut out = self.output;
        match self.segment {
            None => match out.take() {
                Some(mut o) => {
                    o.as_buf_mut().copy_from(&res, 0);
                    out = Some(o);
                }
                None => out = Some((*res).clone()),
            },
            Some((start, _)) => {
                let mut o = out.take().expect("reduce-scatter has an output");
                o.as_buf_mut().copy_from(&res, start);
                out = Some(o);
            }
        }
        Ok((out.expect("set above"), None))
    }
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn backend(&self) -> &'static str {
        "local"
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn all_reduce_buf(&self, mut buf: BufMut<'_>) -> Result<()> {
        let res = self.rendezvous(Kind::AllReduce, buf.as_buf().to_owned())?;
        buf.copy_from(&res, 0);
        Ok(())
    }

    fn reduce_scatter_buf(
        &self,
        input: Buf<'_>,
        counts: &[usize],
        mut output: BufMut<'_>,
    ) -> Result<()> {
        self.check(Op::ReduceScatter, Some(counts), Some(input), Some(&output))?;
        let res = self.rendezvous(Kind::ReduceScatter(counts.to_vec()), input.to_owned())?;
        let start: usize = counts[..self.rank].iter().sum();
        output.copy_from(&res, start);
        Ok(())
    }

    fn all_gather_buf(
        &self,
        input: Buf<'_>,
        counts: &[usize],
        mut output: BufMut<'_>,
    ) -> Result<()> {
        self.check(Op::AllGather, Some(counts), Some(input), Some(&output))?;
        let res = self.rendezvous(Kind::AllGather(counts.to_vec()), input.to_owned())?;
        output.copy_from(&res, 0);
        Ok(())
    }

    fn broadcast_buf(&self, mut buf: BufMut<'_>, root: usize) -> Result<()> {
        if root >= self.shared.world {
            return Err(CommError::Argument {
                op: "broadcast",
                rank: self.rank,
                detail: format!("root {root} is not below world size {}", self.shared.world),
            });
        }
        let res = self.rendezvous(Kind::Broadcast(root), buf.as_buf().to_owned())?;
        buf.copy_from(&res, 0);
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.rendezvous(Kind::Barrier, Buffer::U64(Vec::new()))
            .map(|_| ())
    }

    fn send_recv_buf(&self, peer: usize, send: Buf<'_>, mut recv: BufMut<'_>) -> Result<()> {
        let world = self.shared.world;
        let me = self.rank;
        if peer >= world || peer == me {
            return Err(CommError::Argument {
                op: "send_recv",
                rank: me,
                detail: format!("peer {peer}: expected another rank below world size {world}"),
            });
        }
        self.stats.count(Op::SendRecv, send.bytes(), world);
        let bytes = send.bytes();
        let mut st = self.shared.lock();
        st.mail
            .entry((me, peer))
            .or_default()
            .push_back(send.to_owned());
        self.shared.cv.notify_all();
        let deadline = Instant::now() + self.timeout;
        loop {
            if let Some(msg) = st.mail.get_mut(&(peer, me)).and_then(|q| q.pop_front()) {
                if msg.dtype() != recv.dtype() || msg.len() != recv.len() {
                    return Err(CommError::Mismatch {
                        rank: me,
                        call: self.seq.get(),
                        detail: format!(
                            "send_recv: rank {peer} sent {} x {}, rank {me} expected {} x {}",
                            msg.len(),
                            msg.dtype().name(),
                            recv.len(),
                            recv.dtype().name()
                        ),
                    });
                }
                recv.copy_from(&msg, 0);
                return Ok(());
            }
            if st.gone[peer] {
                return Err(CommError::RankLost {
                    op: "send_recv",
                    rank: me,
                    lost: peer,
                    bytes,
                    detail: "its communicator was dropped before it sent".into(),
                });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(CommError::Timeout {
                    op: "send_recv",
                    rank: me,
                    world,
                    bytes,
                    after: self.timeout,
                    detail: format!("rank {peer} never sent (in-process group)"),
                });
            }
            st = self
                .shared
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn start_all_reduce(&self, buf: Buffer) -> Result<Pending> {
        self.start(Kind::AllReduce, buf, None, None)
    }

    fn start_reduce_scatter(
        &self,
        input: Buffer,
        counts: &[usize],
        mut output: Buffer,
    ) -> Result<Pending> {
        self.check(
            Op::ReduceScatter,
            Some(counts),
            Some(input.as_buf()),
            Some(&output.as_buf_mut()),
        )?;
        let start: usize = counts[..self.rank].iter().sum();
        let seg = Some((start, counts[self.rank]));
        self.start(
            Kind::ReduceScatter(counts.to_vec()),
            input,
            seg,
            Some(output),
        )
    }

    fn start_all_gather(
        &self,
        input: Buffer,
        counts: &[usize],
        mut output: Buffer,
    ) -> Result<Pending> {
        self.check(
            Op::AllGather,
            Some(counts),
            Some(input.as_buf()),
            Some(&output.as_buf_mut()),
        )?;
        self.start(Kind::AllGather(counts.to_vec()), input, None, Some(output))
    }

    fn stats(&self) -> CommStats {
        self.stats.snapshot()
    }

    fn abort(&self, code: i32, message: &str) -> ! {
        panic!(
            "rank {} aborted the in-process group (code {code}): {message}",
            self.rank
        )
    }
}

impl LocalComm {
    fn start(
        &self,
        kind: Kind,
        input: Buffer,
        segment: Option<(usize, usize)>,
        output: Option<Buffer>,
    ) -> Result<Pending> {
        let (op, bytes) = (kind.op(), input.bytes());
        let seq = self.next_seq();
        self.deposit(seq, kind, input)?;
        Ok(Pending::new(Box::new(LocalPending {
            comm: self.shared.clone(),
            rank: self.rank,
            seq,
            op,
            bytes,
            timeout: self.timeout,
            segment,
            output,
        })))
    }
}
