//! The [`Communicator`] trait: rank, world size and the collectives data-parallel
//! training needs, blocking and non-blocking, every wait bounded by a timeout.
//!
//! The trait is object-safe (buffers travel as [`Buf`] / [`BufMut`] / [`Buffer`]); the
//! typed calls are [`CommExt`]. Every backend gives the same results for the same inputs
//! up to the order of floating-point additions, which MPI chooses; where the order must
//! be fixed, [`crate::tree`] builds the reduction from point-to-point exchanges.

use std::time::Duration;

use crate::element::{Buf, BufMut, Buffer, Element};
use crate::error::{CommError, Result};
use crate::stats::{CommStats, Op};

/// A group of ranks that run collectives together. One thread uses a communicator;
/// every rank must call the same collectives in the same order with matching sizes.
pub trait Communicator {
    /// This rank, `0..world_size()`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// The backend's name (`local`, `mpi`, `nccl`).
    fn backend(&self) -> &'static str;
    /// How long any wait may take before it fails with [`CommError::Timeout`].
    fn timeout(&self) -> Duration;
    /// Sum over ranks, in place: every rank ends with the same sums.
    fn all_reduce_buf(&self, buf: BufMut<'_>) -> Result<()>;
    /// Sum over ranks of `input` (`counts.iter().sum()` elements); this rank receives the
    /// sums of its segment (`counts[rank]` elements, after the segments of lower ranks).
    fn reduce_scatter_buf(
        &self,
        input: Buf<'_>,
        counts: &[usize],
        output: BufMut<'_>,
    ) -> Result<()>;
    /// Every rank's `input` (`counts[rank]` elements) concatenated in rank order into
    /// `output` (`counts.iter().sum()` elements) on every rank.
    fn all_gather_buf(&self, input: Buf<'_>, counts: &[usize], output: BufMut<'_>) -> Result<()>;
    /// `root`'s `buf` copied into every rank's `buf`.
    fn broadcast_buf(&self, buf: BufMut<'_>, root: usize) -> Result<()>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()>;
    /// Sends `send` to `peer` and receives `recv` from it (the building block of
    /// [`crate::tree`]).
    fn send_recv_buf(&self, peer: usize, send: Buf<'_>, recv: BufMut<'_>) -> Result<()>;
    /// Starts a sum all-reduce of `buf`; [`Pending::wait`] gives the sums back.
    fn start_all_reduce(&self, buf: Buffer) -> Result<Pending>;
    /// Starts a reduce-scatter of `input` into `output` (`counts[rank]` elements, a buffer
    /// to reuse); the wait gives `output` with this rank's sums.
    fn start_reduce_scatter(
        &self,
        input: Buffer,
        counts: &[usize],
        output: Buffer,
    ) -> Result<Pending>;
    /// Starts an all-gather of `input` into `output` (`counts.iter().sum()` elements);
    /// the wait gives `output` with the concatenation.
    fn start_all_gather(&self, input: Buffer, counts: &[usize], output: Buffer) -> Result<Pending>;
    /// Lets outstanding non-blocking collectives advance. MPI moves data only inside MPI
    /// calls: a caller that computes between starting and waiting calls this now and
    /// then, or its "overlap" happens at the wait.
    fn progress(&self) {}
    /// Calls and bytes so far.
    fn stats(&self) -> CommStats;
    /// How many ranks of the group run on this rank's machine, itself included: they
    /// share its cores and memory. All of them unless the backend knows where each runs.
    fn ranks_on_this_host(&self) -> usize {
        self.world_size()
    }
    /// Ends the whole job, every rank, after printing `message` (MPI_Abort under MPI).
    fn abort(&self, code: i32, message: &str) -> !;
}

/// A started non-blocking collective, as a backend implements it.
pub trait PendingOp {
    /// Whether it has completed (and lets it progress).
    fn test(&mut self) -> Result<bool>;
    /// Waits (up to the communicator's timeout) and gives the result buffer and, where
    /// the backend can, the input buffer back for reuse.
    fn wait(self: Box<Self>) -> Result<(Buffer, Option<Buffer>)>;
    /// Gives up on the operation without waiting, on an error path where the job is
    /// about to end (a backend that may still write its buffers leaks them).
    fn abandon(self: Box<Self>) {}
}

/// The output and input of a collective that completed when it started.
struct Ready(Buffer, Option<Buffer>);

impl PendingOp for Ready {
    fn test(&mut self) -> Result<bool> {
        Ok(true)
    }

    fn wait(self: Box<Self>) -> Result<(Buffer, Option<Buffer>)> {
        Ok((self.0, self.1))
    }
}

/// A started non-blocking collective: test it, or wait for its result. Dropping it
/// before completion waits for it (a backend may still be writing its buffer).
pub struct Pending {
    op: Option<Box<dyn PendingOp>>,
}

impl Pending {
    /// Wraps a backend's pending operation.
    pub fn new(op: Box<dyn PendingOp>) -> Self {
        Pending { op: Some(op) }
    }

    /// A collective that completed before it was returned (a backend that runs it at
    /// once): the wait gives `output` and, where given, the input back.
    pub fn ready(output: Buffer, input: Option<Buffer>) -> Self {
        Pending::new(Box::new(Ready(output, input)))
    }

    /// Whether it has completed.
    pub fn test(&mut self) -> Result<bool> {
        self.op.as_mut().expect("taken only by wait").test()
    }

    /// Waits for the result.
    pub fn wait(self) -> Result<Buffer> {
        self.wait_with_input().map(|(out, _)| out)
    }

    /// Waits for the result, and gives the input buffer back where the backend can (the
    /// MPI and NCCL backends do; the in-process one consumes it), so that loops reuse
    /// their buffers instead of allocating (first touch of fresh pages runs at about
    /// 1 GB/s here, slower than the collectives themselves).
    pub fn wait_with_input(mut self) -> Result<(Buffer, Option<Buffer>)> {
        self.op.take().expect("taken only by wait").wait()
    }

    /// Gives up on it without waiting (an error elsewhere is ending the job): dropping it
    /// would wait up to the timeout first.
    pub fn abandon(mut self) {
        if let Some(op) = self.op.take() {
            op.abandon();
        }
    }

    /// Waits for the result as a typed vector.
    pub fn wait_vec<T: Element>(self) -> Result<Vec<T>> {
        let b = self.wait()?;
        let got = b.dtype();
        T::unwrap(b).ok_or_else(|| CommError::Argument {
            op: "wait",
            rank: 0,
            detail: format!("result is {}, asked for {}", got.name(), T::DTYPE.name()),
        })
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(op) = self.op.take() {
            let _ = op.wait();
        }
    }
}

/// The typed calls over any [`Communicator`].
pub trait CommExt: Communicator {
    /// [`Communicator::all_reduce_buf`] on a typed slice.
    fn all_reduce<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        self.all_reduce_buf(T::buf_mut(buf))
    }

    /// [`Communicator::reduce_scatter_buf`] on typed slices.
    fn reduce_scatter<T: Element>(
        &self,
        input: &[T],
        counts: &[usize],
        out: &mut [T],
    ) -> Result<()> {
        self.reduce_scatter_buf(T::buf(input), counts, T::buf_mut(out))
    }

    /// [`Communicator::all_gather_buf`] on typed slices.
    fn all_gather<T: Element>(&self, input: &[T], counts: &[usize], out: &mut [T]) -> Result<()> {
        self.all_gather_buf(T::buf(input), counts, T::buf_mut(out))
    }

    /// [`Communicator::broadcast_buf`] on a typed slice.
    fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.broadcast_buf(T::buf_mut(buf), root)
    }

    /// [`Communicator::send_recv_buf`] on typed slices.
    fn send_recv<T: Element>(&self, peer: usize, send: &[T], recv: &mut [T]) -> Result<()> {
        self.send_recv_buf(peer, T::buf(send), T::buf_mut(recv))
    }

    /// Every rank's `mine`, whatever its length, rank order: one all-gather of the lengths,
    /// then one of the values (what each rank holds of something split unevenly, such as
    /// ZeRO-3's pieces).
    fn all_gather_varying<T: Element>(&self, mine: &[T]) -> Result<Vec<Vec<T>>> {
        let world = self.world_size();
        let mut lens = vec![0u64; world];
        self.all_gather(&[mine.len() as u64], &vec![1; world], &mut lens)?;
        let counts: Vec<usize> = lens.iter().map(|&n| n as usize).collect();
        let mut all = vec![T::default(); counts.iter().sum()];
        self.all_gather(mine, &counts, &mut all)?;
        let mut rest = all.as_slice();
        Ok(counts
            .iter()
            .map(|&n| {
                let (this, next) = rest.split_at(n);
                rest = next;
                this.to_vec()
            })
            .collect())
    }

    /// Replaces `x` by its largest value over ranks, element by element, for values that
    /// are >= 0 or NaN (FP8's amaxes, Transformer Engine's amax all-reduce): NaN where any
    /// rank has one. Such values order as their bits do as unsigned integers (NaN above
    /// +inf), so this is an integer max: exact in any order, the same bits on every rank
    /// and at every world size, and what a device's max over `u32` gives (NCCL's floats
    /// would drop a NaN). Two all-gathers (the lengths, then the values); ranks holding
    /// other lengths, or a value below 0 (-0 included) on any rank, are an error on every
    /// rank.
    fn max_of_amaxes(&self, x: &mut [f32]) -> Result<()> {
        let all = self.all_gather_varying(x)?;
        let bad = |detail: String| crate::CommError::Argument {
            op: "max of amaxes",
            rank: self.rank(),
            detail,
        };
        for (r, theirs) in all.iter().enumerate() {
            if let Some((i, v)) = theirs
                .iter()
                .enumerate()
                .find(|(_, v)| v.is_sign_negative() && !v.is_nan())
            {
                return Err(bad(format!(
                    "rank {r}'s value {i} is {v:?}: amaxes are >= 0 or NaN"
                )));
            }
        }
        for (r, theirs) in all.iter().enumerate() {
            if theirs.len() != x.len() {
                return Err(bad(format!(
                    "rank {r} holds {} values, this rank {}",
                    theirs.len(),
                    x.len()
                )));
            }
            for (mine, t) in x.iter_mut().zip(theirs) {
                *mine = f32::from_bits(mine.to_bits().max(t.to_bits()));
            }
        }
        Ok(())
    }

    /// The sum of one value over ranks.
    fn sum<T: Element>(&self, x: T) -> Result<T> {
        let mut v = [x];
        self.all_reduce(&mut v)?;
        Ok(v[0])
    }
}

impl<C: Communicator + ?Sized> CommExt for C {}

/// Checks the arguments every backend takes alike; the error names the collective and
/// the rank. `input` / `output` are lengths and dtypes where the collective has them.
pub(crate) fn check_args(
    op: Op,
    rank: usize,
    world: usize,
    counts: Option<&[usize]>,
    input: Option<Buf<'_>>,
    output: Option<&BufMut<'_>>,
) -> Result<()> {
    let bad = |detail: String| CommError::Argument {
        op: op.name(),
        rank,
        detail,
    };
    if let (Some(i), Some(o)) = (input, output) {
        if i.dtype() != o.dtype() && op != Op::SendRecv {
            return Err(bad(format!(
                "input is {}, output is {}",
                i.dtype().name(),
                o.dtype().name()
            )));
        }
    }
    let Some(counts) = counts else {
        return Ok(());
    };
    if counts.len() != world {
        return Err(bad(format!(
            "{} counts for world size {world}: one per rank expected",
            counts.len()
        )));
    }
    let total: usize = counts.iter().sum();
    let (whole, part) = match op {
        Op::ReduceScatter => (input.map(|b| b.len()), output.map(|b| b.len())),
        _ => (output.map(|b| b.len()), input.map(|b| b.len())),
    };
    let whole_name = if op == Op::ReduceScatter {
        "input"
    } else {
        "output"
    };
    let part_name = if op == Op::ReduceScatter {
        "output"
    } else {
        "input"
    };
    if let Some(w) = whole {
        if w != total {
            return Err(bad(format!(
                "{whole_name} has {w} elements, the counts {counts:?} add up to {total}"
            )));
        }
    }
    if let Some(p) = part {
        if p != counts[rank] {
            return Err(bad(format!(
                "{part_name} has {p} elements, counts[{rank}] is {}",
                counts[rank]
            )));
        }
    }
    Ok(())
}

/// `Duration` from seconds, for config values (`0` or negative means the default).
pub fn timeout_from_secs(secs: f64, default: Duration) -> Duration {
    if secs > 0.0 && secs.is_finite() {
        Duration::from_secs_f64(secs)
    } else {
        default
    }
}

/// The default collective timeout: 60 s, long enough for any step on a slow machine and
/// short enough that a lost rank ends the job within a minute.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
