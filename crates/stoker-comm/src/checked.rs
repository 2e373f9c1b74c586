//! A communicator that checks, before every collective, that every rank is calling the
//! same one: PyTorch's `TORCH_DISTRIBUTED_DEBUG=DETAIL` wraps its process group the same
//! way. Ranks that call different collectives (or one with other sizes) hang in MPI until
//! the timeout, and the timeout names only the collective each rank waits in. [`Checked`]
//! first all-gathers a fixed-size fingerprint of the call (its number, the collective, the
//! dtype, the sizes), which matches on every rank whatever the call; where the
//! fingerprints differ, every rank fails at once with [`CommError::Mismatch`] naming each
//! rank's call. It also records the sequence of calls, so a test can hold the ranks'
//! sequences side by side.
//!
//! The fingerprints cost one small all-gather per collective and are not counted in
//! [`Communicator::stats`]: the traffic a run holds against the planner's stays the
//! training's own. `stoker train` wraps its communicator in it under
//! `[parallel] check_collectives = true`.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Duration;

use crate::communicator::{CommExt, Communicator, Pending};
use crate::element::{Buf, BufMut, Buffer, DType};
use crate::error::{CommError, Result};
use crate::stats::{CommStats, Op};

/// Words in a fingerprint: call number, collective, dtype, elements, sizes or root.
const WORDS: usize = 5;

/// One collective call as every rank must make it alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Call {
    /// The call's number on this communicator (collectives only, from 0).
    pub seq: u64,
    /// The collective.
    pub op: Op,
    /// The element type (None for a barrier).
    pub dtype: Option<DType>,
    /// Elements every rank passes alike: the buffer (all-reduce, broadcast), the whole
    /// input (reduce-scatter), the whole output (all-gather).
    pub elements: u64,
    /// A hash of the per-rank counts (reduce-scatter, all-gather) or the root (broadcast).
    pub detail: u64,
}

impl Call {
    fn words(&self) -> [u64; WORDS] {
        [
            self.seq,
            op_code(self.op),
            self.dtype.map_or(0, dtype_code),
            self.elements,
            self.detail,
        ]
    }

    fn from_words(w: &[u64]) -> Option<Call> {
        Some(Call {
            seq: w[0],
            op: op_of(w[1])?,
            dtype: match w[2] {
                0 => None,
                c => Some(dtype_of(c)?),
            },
            elements: w[3],
            detail: w[4],
        })
    }

    /// `all_gather (f32, 14592 elements)`, for messages.
    pub fn describe(&self) -> String {
        let dtype = self.dtype.map_or("no data", |d| d.name());
        match self.op {
            Op::Broadcast => format!(
                "{} ({dtype}, {} elements, root {})",
                self.op.name(),
                self.elements,
                self.detail
            ),
            Op::Barrier => "barrier".into(),
            _ => format!("{} ({dtype}, {} elements)", self.op.name(), self.elements),
        }
    }
}

fn op_code(op: Op) -> u64 {
    match op {
        Op::AllReduce => 1,
        Op::ReduceScatter => 2,
        Op::AllGather => 3,
        Op::Broadcast => 4,
        Op::Barrier => 5,
        Op::SendRecv => 6,
    }
}

fn op_of(code: u64) -> Option<Op> {
    [
        Op::AllReduce,
        Op::ReduceScatter,
        Op::AllGather,
        Op::Broadcast,
        Op::Barrier,
        Op::SendRecv,
    ]
    .into_iter()
    .find(|&o| op_code(o) == code)
}

fn dtype_code(d: DType) -> u64 {
    match d {
        DType::F32 => 1,
        DType::F64 => 2,
        DType::U64 => 3,
    }
}

fn dtype_of(code: u64) -> Option<DType> {
    [DType::F32, DType::F64, DType::U64]
        .into_iter()
        .find(|&d| dtype_code(d) == code)
}

/// FNV-1a over the counts: equal counts give equal hashes on every rank and platform.
fn counts_hash(counts: &[usize]) -> u64 {
    counts.iter().fold(0xcbf2_9ce4_8422_2325, |h, &c| {
        (h ^ c as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// `inner` with every collective checked against the other ranks' first (see the module
/// doc). Point-to-point exchanges pass unchecked: their peers differ by design.
pub struct Checked {
    inner: Rc<dyn Communicator>,
    next: Cell<u64>,
    calls: RefCell<Vec<Call>>,
    /// What the fingerprints themselves moved, left out of [`Communicator::stats`].
    overhead: RefCell<CommStats>,
}

impl Checked {
    /// Checks every collective called through it on `inner`.
    pub fn new(inner: Rc<dyn Communicator>) -> Self {
        Checked {
            inner,
            next: Cell::new(0),
            calls: RefCell::new(Vec::new()),
            overhead: RefCell::new(CommStats::default()),
        }
    }

    /// The collectives called so far, in order.
    pub fn calls(&self) -> Vec<Call> {
        self.calls.borrow().clone()
    }

    /// Agrees with every rank that they are all making call `op` with these sizes, or
    /// fails on every rank naming each rank's call.
    fn agree(&self, op: Op, dtype: Option<DType>, elements: usize, detail: u64) -> Result<()> {
        let call = Call {
            seq: self.next.get(),
            op,
            dtype,
            elements: elements as u64,
            detail,
        };
        self.next.set(call.seq + 1);
        self.calls.borrow_mut().push(call);
        let world = self.inner.world_size();
        if world == 1 {
            return Ok(());
        }
        let before = self.inner.stats();
        let mut all = vec![0u64; WORDS * world];
        self.inner
            .all_gather(&call.words(), &vec![WORDS; world], &mut all)?;
        let spent = self.inner.stats().since(&before);
        let sum = self.overhead.borrow().plus(&spent);
        *self.overhead.borrow_mut() = sum;
        let theirs: Vec<&[u64]> = all.chunks(WORDS).collect();
        if theirs.iter().all(|w| *w == call.words()) {
            return Ok(());
        }
        let described: Vec<String> = theirs
            .iter()
            .enumerate()
            .map(|(r, w)| match Call::from_words(w) {
                Some(c) if c.seq == call.seq => format!("rank {r}: {}", c.describe()),
                Some(c) => format!("rank {r}: its call {}, {}", c.seq, c.describe()),
                None => format!("rank {r}: an unreadable fingerprint {w:?}"),
            })
            .collect();
        Err(CommError::Mismatch {
            rank: self.inner.rank(),
            call: call.seq,
            detail: format!(
                "the ranks called different collectives: {}",
                described.join("; ")
            ),
        })
    }
}

impl Communicator for Checked {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }

    fn all_reduce_buf(&self, buf: BufMut<'_>) -> Result<()> {
        self.agree(Op::AllReduce, Some(buf.dtype()), buf.len(), 0)?;
        self.inner.all_reduce_buf(buf)
    }

    fn reduce_scatter_buf(
        &self,
        input: Buf<'_>,
        counts: &[usize],
        output: BufMut<'_>,
    ) -> Result<()> {
        let h = counts_hash(counts);
        self.agree(Op::ReduceScatter, Some(input.dtype()), input.len(), h)?;
        self.inner.reduce_scatter_buf(input, counts, output)
    }

    fn all_gather_buf(&self, input: Buf<'_>, counts: &[usize], output: BufMut<'_>) -> Result<()> {
        let h = counts_hash(counts);
        self.agree(Op::AllGather, Some(output.dtype()), output.len(), h)?;
        self.inner.all_gather_buf(input, counts, output)
    }

    fn broadcast_buf(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        self.agree(Op::Broadcast, Some(buf.dtype()), buf.len(), root as u64)?;
        self.inner.broadcast_buf(buf, root)
    }

    fn barrier(&self) -> Result<()> {
        self.agree(Op::Barrier, None, 0, 0)?;
        self.inner.barrier()
    }

    fn send_recv_buf(&self, peer: usize, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        self.inner.send_recv_buf(peer, send, recv)
    }

    fn start_all_reduce(&self, buf: Buffer) -> Result<Pending> {
        self.agree(Op::AllReduce, Some(buf.dtype()), buf.len(), 0)?;
        self.inner.start_all_reduce(buf)
    }

    fn start_reduce_scatter(
        &self,
        input: Buffer,
        counts: &[usize],
        output: Buffer,
    ) -> Result<Pending> {
        let h = counts_hash(counts);
        self.agree(Op::ReduceScatter, Some(input.dtype()), input.len(), h)?;
        self.inner.start_reduce_scatter(input, counts, output)
    }

    fn start_all_gather(&self, input: Buffer, counts: &[usize], output: Buffer) -> Result<Pending> {
        let h = counts_hash(counts);
        self.agree(Op::AllGather, Some(output.dtype()), output.len(), h)?;
        self.inner.start_all_gather(input, counts, output)
    }

    fn progress(&self) {
        self.inner.progress()
    }

    fn stats(&self) -> CommStats {
        self.inner.stats().since(&self.overhead.borrow())
    }

    fn ranks_on_this_host(&self) -> usize {
        self.inner.ranks_on_this_host()
    }

    fn abort(&self, code: i32, message: &str) -> ! {
        self.inner.abort(code, message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{run_local, DEFAULT_TIMEOUT};

    #[test]
    fn ranks_that_call_different_collectives_fail_at_once_naming_each_call() {
        let errors = run_local(3, DEFAULT_TIMEOUT, |comm| {
            let c = Checked::new(Rc::new(comm));
            let mut x = vec![1f32; 4];
            c.all_reduce(&mut x).unwrap();
            assert_eq!(x, vec![3.0; 4]);
            // Rank 0 gathers where the others sum three f64s (ZeRO-3's uneven evaluation).
            let e = match c.rank() {
                0 => {
                    let mut out = vec![0f32; 6];
                    c.all_gather(&[1.0, 2.0], &[2, 2, 2], &mut out).unwrap_err()
                }
                _ => c.all_reduce(&mut [0f64; 3]).unwrap_err(),
            };
            (e.to_string(), c.calls().len(), c.stats())
        });
        for (r, (e, calls, stats)) in errors.iter().enumerate() {
            assert!(e.contains("collective call 1"), "rank {r}: {e}");
            assert!(
                e.contains("rank 0: all_gather (f32, 6 elements)")
                    && e.contains("rank 1: all_reduce (f64, 3 elements)")
                    && e.contains("rank 2: all_reduce (f64, 3 elements)"),
                "rank {r}: {e}"
            );
            assert_eq!(*calls, 2);
            // The fingerprints are not the training's traffic: one all-reduce of 16 bytes.
            assert_eq!(stats.op(Op::AllReduce).calls, 1);
            assert_eq!(stats.op(Op::AllReduce).bytes, 16);
            assert_eq!(stats.op(Op::AllGather).calls, 0);
        }
    }

    #[test]
    fn the_same_collectives_pass_and_are_recorded_in_order() {
        let calls = run_local(2, DEFAULT_TIMEOUT, |comm| {
            let c = Checked::new(Rc::new(comm));
            let mut out = vec![0f32; 3];
            let mine: &[f32] = if c.rank() == 0 { &[1.0, 2.0] } else { &[3.0] };
            c.all_gather(mine, &[2, 1], &mut out).unwrap();
            assert_eq!(out, vec![1.0, 2.0, 3.0]);
            let mut b = [c.rank() as u64; 2];
            c.broadcast(&mut b, 1).unwrap();
            assert_eq!(b, [1, 1]);
            let p = c.start_all_reduce(Buffer::F64(vec![1.0])).unwrap();
            assert_eq!(p.wait_vec::<f64>().unwrap(), vec![2.0]);
            c.barrier().unwrap();
            c.calls()
        });
        assert_eq!(calls[0], calls[1]);
        let described: Vec<String> = calls[0].iter().map(Call::describe).collect();
        assert_eq!(
            described,
            [
                "all_gather (f32, 3 elements)",
                "broadcast (u64, 2 elements, root 1)",
                "all_reduce (f64, 1 elements)",
                "barrier"
            ]
        );
    }
}
