//! The collectives a resident step's data parallelism runs on a backend's buffers.
//! [`ThroughHost`] goes through any stoker-comm [`Communicator`] on host memory: each
//! buffer copied down, reduced or gathered, copied back. It is the in-process ranks' path
//! in the tests (the same code at every world size) and a GPU's path through MPI; NCCL on
//! device memory, which needs no copies, is the device backend's `device::nccl` (feature
//! `cuda`).

use std::ops::Deref;

use stoker_comm::shard::{ShardPlan, DEFAULT_ALIGN};
use stoker_comm::{CommExt, Communicator};

use crate::backend::{Backend, View};
use crate::elem::Act;
use crate::error::{check_len, GpuError};

/// Sums and gathers over the ranks, on a backend's buffers.
pub trait Collectives<B: Backend> {
    /// This rank.
    fn rank(&self) -> usize;
    /// Ranks in all.
    fn world(&self) -> usize;
    /// Replaces `buf` on every rank by its sum over the ranks.
    fn all_reduce(&self, be: &B, buf: View<f32>) -> Result<(), GpuError>;
    /// Replaces `buf` (amaxes: >= 0 or NaN) on every rank by its largest value over the
    /// ranks, element by element, NaN where any rank has one: FP8's amax all-reduce. A
    /// max of such values is a max of their bits as unsigned integers
    /// ([`stoker_comm::CommExt::max_of_amaxes`]), exact in any order, in order, after
    /// every launch so far and before every later one.
    fn max_of_amaxes(&self, be: &B, buf: View<f32>) -> Result<(), GpuError>;
    /// Starts [`Collectives::all_reduce`] of `buf` after every launch so far, without
    /// holding back later launches: DDP's bucket overlapping the rest of the backward.
    /// The default runs it at once.
    ///
    /// # Safety
    /// Until [`Collectives::finish`] is called, nothing may write `buf`, and its buffer
    /// must stay alive: on a device the reduction may still be running.
    unsafe fn start_all_reduce(&self, be: &B, buf: View<f32>) -> Result<(), GpuError> {
        self.all_reduce(be, buf)
    }
    /// Starts [`Collectives::reduce_scatter`] of `input` into `out` (`counts`, rank order)
    /// after every launch so far, without holding back later launches: ZeRO's bucket
    /// overlapping the rest of the backward. The default runs it at once.
    ///
    /// # Safety
    /// Until [`Collectives::finish`] is called, nothing may write `input` or touch `out`,
    /// and their buffers must stay alive: on a device the reduction may still be running.
    unsafe fn start_reduce_scatter(
        &self,
        be: &B,
        input: View<f32>,
        counts: &[usize],
        out: View<f32>,
    ) -> Result<(), GpuError> {
        self.reduce_scatter(be, input, counts, out)
    }
    /// Starts [`Collectives::all_gather`] of `buf` (this rank's piece already in place)
    /// after every launch so far, without holding back later launches: ZeRO-3's next
    /// block gathered while this one runs. The default runs it at once.
    ///
    /// # Safety
    /// Until a [`Collectives::wait`] for a later mark (or [`Collectives::finish`]), nothing
    /// may touch `buf`, and its buffer must stay alive: on a device the gather may still be
    /// running.
    unsafe fn start_all_gather<E: Act>(
        &self,
        be: &B,
        buf: View<E>,
        counts: &[usize],
    ) -> Result<(), GpuError> {
        self.all_gather(be, buf, counts)
    }
    /// A point after every collective started so far, for [`Collectives::wait`] to order
    /// later launches after those alone (not after ones started since). The default,
    /// whose collectives run at once, marks nothing.
    fn mark(&self, _be: &B) -> Result<Mark, GpuError> {
        Ok(Mark(0))
    }
    /// Orders every later launch after the collectives started before `mark` (on a device
    /// perhaps after some started since: waiting longer is safe). The default waits for
    /// nothing.
    fn wait(&self, _be: &B, _mark: Mark) -> Result<(), GpuError> {
        Ok(())
    }
    /// Orders every later launch after the reductions started so far.
    fn finish(&self, _be: &B) -> Result<(), GpuError> {
        Ok(())
    }
    /// Sums `input` (the same length on every rank) over the ranks and leaves this rank's
    /// piece of the sum in `out`: piece `r` is `counts[r]` elements, rank order.
    fn reduce_scatter(
        &self,
        be: &B,
        input: View<f32>,
        counts: &[usize],
        out: View<f32>,
    ) -> Result<(), GpuError>;
    /// Fills `buf` on every rank with every rank's piece of it (`counts`, rank order),
    /// this rank's piece already in place.
    fn all_gather<E: Act>(&self, be: &B, buf: View<E>, counts: &[usize]) -> Result<(), GpuError>;
    /// `xs` summed over the ranks, element by element (a window's tallies, the pieces of
    /// a squared norm): at most [`MAX_SCALARS`] values, one collective.
    fn sum(&self, be: &B, xs: &[f64]) -> Result<Vec<f64>, GpuError>;
}

/// ZeRO's split of a flat buffer of `len` elements over `world` ranks, the CPU
/// trainer's ([`ShardPlan`] at the layouts' alignment): ZeRO-1's master and moments,
/// ZeRO-2's gradients and ZeRO-3's compute copy are all cut by it.
pub fn shard_plan(len: usize, world: usize) -> ShardPlan {
    ShardPlan::new(len, world, DEFAULT_ALIGN)
}

/// Elements of rank `rank`'s shard of a flat buffer of `len` over `world` ranks
/// ([`shard_plan`]), planned before anything is made (an out-of-range rank counts as the
/// last, a world of 0 as 1: the plan's caller checks them when it makes the buffers).
pub fn shard_len(len: usize, (rank, world): (usize, usize)) -> usize {
    let world = world.max(1);
    shard_plan(len, world).range(rank.min(world - 1)).len()
}

/// A point in the collectives a rank has started ([`Collectives::mark`]): its count of
/// marks so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mark(pub u64);

/// The most scalars one [`Collectives::sum`] carries.
pub const MAX_SCALARS: usize = 8;

/// `xs` within [`MAX_SCALARS`].
pub(crate) fn check_scalars(xs: &[f64]) -> Result<(), GpuError> {
    if xs.len() > MAX_SCALARS {
        return Err(GpuError::Shape {
            kernel: "sum",
            what: format!("{} scalars, more than {MAX_SCALARS}", xs.len()),
        });
    }
    Ok(())
}

/// `counts` as a split of `len` elements over `world` ranks: where this rank's piece
/// starts and how long it is.
pub(crate) fn piece(
    op: &'static str,
    counts: &[usize],
    world: usize,
    rank: usize,
    len: usize,
) -> Result<(usize, usize), GpuError> {
    if counts.len() != world || counts.iter().sum::<usize>() != len {
        return Err(GpuError::Shape {
            kernel: op,
            what: format!(
                "counts {counts:?} for {world} ranks must add up to the buffer's {len} elements"
            ),
        });
    }
    Ok((counts[..rank].iter().sum(), counts[rank]))
}

/// Through a [`Communicator`] on host memory, held by any pointer to one (a reference,
/// an `Rc<dyn Communicator>`). A group of one needs no collective: its sums and gathers
/// are the buffers as they are (a reduce-scatter a copy on the backend), with nothing
/// copied through the host (a single GPU's ZeRO strategies run that way).
#[derive(Debug)]
pub struct ThroughHost<P>(pub P);

impl<P: Deref<Target = C>, C: Communicator + ?Sized> ThroughHost<P> {
    /// `buf` copied down, `op` over the ranks on the host copy, and copied back (nothing
    /// at one rank); an error says `doing` `n` `things`.
    fn in_place<B: Backend>(
        &self,
        be: &B,
        buf: View<f32>,
        doing: &str,
        things: &str,
        op: impl FnOnce(&C, &mut [f32]) -> stoker_comm::Result<()>,
    ) -> Result<(), GpuError> {
        if self.0.world_size() == 1 {
            return Ok(());
        }
        let mut host = be.read(buf)?;
        let what = format!("{doing} {} {things}", host.len());
        op(&*self.0, &mut host).map_err(self.err(what))?;
        be.write_at(buf, &host)
    }

    fn err(&self, what: String) -> impl FnOnce(stoker_comm::CommError) -> GpuError + '_ {
        move |e| GpuError::Driver {
            what: format!(
                "{what} over {} ranks ({})",
                self.0.world_size(),
                self.0.backend()
            ),
            error: e.to_string(),
        }
    }
}

impl<B: Backend, P: Deref<Target = C>, C: Communicator + ?Sized> Collectives<B> for ThroughHost<P> {
    fn rank(&self) -> usize {
        self.0.rank()
    }

    fn world(&self) -> usize {
        self.0.world_size()
    }

    fn all_reduce(&self, be: &B, buf: View<f32>) -> Result<(), GpuError> {
        self.in_place(be, buf, "all-reducing", "gradients", |c, h| c.all_reduce(h))
    }

    fn max_of_amaxes(&self, be: &B, buf: View<f32>) -> Result<(), GpuError> {
        self.in_place(be, buf, "taking the largest of", "amaxes", |c, h| {
            c.max_of_amaxes(h)
        })
    }

    fn reduce_scatter(
        &self,
        be: &B,
        input: View<f32>,
        counts: &[usize],
        out: View<f32>,
    ) -> Result<(), GpuError> {
        let (world, rank) = (self.0.world_size(), self.0.rank());
        let (_, mine) = piece("reduce-scatter", counts, world, rank, input.len())?;
        check_len("reduce-scatter", "out", out.len(), mine)?;
        if world == 1 {
            return be.copy(out, input);
        }
        let host = be.read(input)?;
        let mut piece = vec![0f32; mine];
        let what = format!("reduce-scattering {} gradients", host.len());
        self.0
            .reduce_scatter(&host, counts, &mut piece)
            .map_err(self.err(what))?;
        be.write_at(out, &piece)
    }

    fn all_gather<E: Act>(&self, be: &B, buf: View<E>, counts: &[usize]) -> Result<(), GpuError> {
        let (world, rank) = (self.0.world_size(), self.0.rank());
        let (at, mine) = piece("all-gather", counts, world, rank, buf.len())?;
        if world == 1 {
            return Ok(());
        }
        // bf16 widens to f32 and back exactly: the communicators carry f32.
        let host: Vec<f32> = be
            .read(buf.slice(at..at + mine)?)?
            .into_iter()
            .map(E::to_f32)
            .collect();
        let mut all = vec![0f32; buf.len()];
        let what = format!("all-gathering {} parameters", buf.len());
        self.0
            .all_gather(&host, counts, &mut all)
            .map_err(self.err(what))?;
        let all: Vec<E> = all.into_iter().map(E::from_f32).collect();
        be.write_at(buf, &all)
    }

    fn sum(&self, _: &B, xs: &[f64]) -> Result<Vec<f64>, GpuError> {
        check_scalars(xs)?;
        let mut v = xs.to_vec();
        if self.0.world_size() == 1 {
            return Ok(v);
        }
        let what = format!("summing {} scalars", v.len());
        self.0.all_reduce(&mut v).map_err(self.err(what))?;
        Ok(v)
    }
}
