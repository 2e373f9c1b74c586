//! What offload's copies between host and backend cost, how much of a copy on the copy
//! stream the compute stream hides, and what its work on the host costs: the
//! measurements behind parameter and optimizer offload and the loader's overlap
//! (docs/gpu.md, "Streams"). Each way of copying runs `reps` times and
//! its median wall time is reported; every copy's landed bytes are checked against its
//! source once, so the same code is a correctness check on the host build (where the
//! times mean nothing) and a measurement on a device.

use std::time::Instant;

use crate::backend::Backend;
use crate::error::GpuError;
use crate::host::Host;
use crate::kernels;
use crate::pinned::PinnedHostBuf;

/// One way of copying, timed.
#[derive(Debug, Clone)]
pub struct CopyTimed {
    /// The way (`"up: pinned, copy stream"`).
    pub what: &'static str,
    /// Bytes each copy moves.
    pub bytes: usize,
    /// Median wall time of one copy, start to finish on the host, microseconds.
    pub micros: f64,
    /// For a copy from or into pinned memory, whether the backend used it directly
    /// (false: the driver did not register it, and the copy was staged); None for the
    /// others.
    pub pinned_direct: Option<bool>,
}

/// A copy up on the copy stream beside a run of kernels on the compute stream.
#[derive(Debug, Clone, Copy)]
pub struct Overlap {
    /// The kernels alone, microseconds (median).
    pub compute_us: f64,
    /// The copy alone, microseconds (median).
    pub copy_us: f64,
    /// Both, started together, until both are done, microseconds (median).
    pub both_us: f64,
    /// Whether the copy read its pinned memory directly (else it was staged).
    pub pinned_direct: bool,
}

/// Offload's work on the host, timed on one thread and on rayon's pool.
#[derive(Debug, Clone, Copy)]
pub struct HostWork {
    /// On a pool of one thread, microseconds (median).
    pub one_thread_us: f64,
    /// On rayon's pool, microseconds (median).
    pub pool_us: f64,
    /// Threads in rayon's pool.
    pub pool_threads: usize,
}

impl Overlap {
    /// The share of the shorter of the two that ran beside the other: 1 where `both`
    /// took as long as the longer alone, 0 where it took their sum. (Clamped to 0..=1:
    /// timing noise can put it a little outside.)
    pub fn hidden(&self) -> f64 {
        let shorter = self.compute_us.min(self.copy_us);
        if shorter <= 0.0 {
            return 0.0;
        }
        ((self.compute_us + self.copy_us - self.both_us) / shorter).clamp(0.0, 1.0)
    }
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// One untimed run of `f` (first allocations: staging, pinned read buffers, pages), then
/// `reps` (at least 1) runs, each timed on the host; the median in microseconds.
fn timed(reps: usize, mut f: impl FnMut() -> Result<(), GpuError>) -> Result<f64, GpuError> {
    f()?;
    let mut us = Vec::with_capacity(reps.max(1));
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        f()?;
        us.push(t.elapsed().as_secs_f64() * 1e6);
    }
    Ok(median(us))
}

/// `what` landed `want` on the backend, or an error saying where it did not.
fn check_landed(what: &str, got: &[f32], want: &[f32]) -> Result<(), GpuError> {
    match got
        .iter()
        .zip(want)
        .position(|(a, b)| a.to_bits() != b.to_bits())
    {
        None if got.len() == want.len() => Ok(()),
        at => Err(GpuError::Order {
            what: format!(
                "copy bench, {what}: element {} differs from its source",
                at.unwrap_or(got.len().min(want.len()))
            ),
        }),
    }
}

/// Every way of copying `elems` f32s between the host and `be`, `reps` times each,
/// checked: up from pageable memory (`write_at`), up staged on the copy stream
/// (`start_write`), up from pinned memory on the copy stream (`start_write_from_pin`),
/// down into pageable memory (`read_into`), down on the copy stream (`start_read`), down
/// on the copy stream into pinned memory (`start_read_to_pin`).
pub fn time_copies<B: Backend>(
    be: &B,
    elems: usize,
    reps: usize,
) -> Result<Vec<CopyTimed>, GpuError> {
    let source: Vec<f32> = (0..elems).map(|i| (i % 1021) as f32 - 510.5).collect();
    let bytes = elems * std::mem::size_of::<f32>();
    let dst = be.zeros::<f32>(elems)?;
    let pinned = PinnedHostBuf::<B, f32>::zeros(be, elems)?;
    Host.write_at(pinned.settled(be)?, &source)?;
    let mut out = vec![0.0f32; elems];
    let mut rows = Vec::new();
    let direct = pinned.is_direct(be);
    let mut row = |what: &'static str, micros: f64, pinned_direct: Option<bool>| {
        rows.push(CopyTimed {
            what,
            bytes,
            micros,
            pinned_direct,
        })
    };

    let up = timed(reps, || be.write_at(be.all(&dst), &source))?;
    check_landed("up, pageable", &be.download(&dst)?, &source)?;
    row("up: pageable, in the stream's order", up, None);

    be.zero(be.all(&dst))?;
    let staged = timed(reps, || {
        // SAFETY: nothing touches `dst` until the wait, two lines down; it outlives it.
        let w = unsafe { be.start_write(be.all(&dst), &source)? };
        be.wait_write(w)?;
        be.read(be.view(&dst, 0..elems.min(1))?).map(|_| ())
    })?;
    check_landed("up, staged", &be.download(&dst)?, &source)?;
    row("up: staged, copy stream", staged, None);

    be.zero(be.all(&dst))?;
    let direct_up = timed(reps, || {
        // SAFETY: as above.
        let w = unsafe { pinned.start_copy_to(be, 0..elems, be.all(&dst))? };
        be.wait_write(w)?;
        be.read(be.view(&dst, 0..elems.min(1))?).map(|_| ())
    })?;
    check_landed("up, pinned", &be.download(&dst)?, &source)?;
    row("up: pinned, copy stream", direct_up, Some(direct));

    let down = timed(reps, || be.read_into(be.all(&dst), &mut out))?;
    check_landed("down, pageable", &out, &source)?;
    row("down: pageable, in the stream's order", down, None);

    out.fill(0.0);
    let streamed = timed(reps, || {
        // SAFETY: nothing writes `dst` until the finish, just below; it outlives it.
        let r = unsafe { be.start_read(be.all(&dst))? };
        be.finish_read(r, be.all(&dst), &mut out)
    })?;
    check_landed("down, copy stream", &out, &source)?;
    row("down: copy stream", streamed, None);

    let landing = PinnedHostBuf::<B, f32>::zeros(be, elems)?;
    let into_pin = timed(reps, || {
        // SAFETY: nothing writes `dst`, and nothing touches `landing`, until the finish,
        // just below; both outlive it.
        let r = unsafe { landing.start_read_into(be, be.all(&dst), 0..elems)? };
        landing.finish_read_into(be, r, be.all(&dst), 0..elems)
    })?;
    check_landed(
        "down, into pinned memory",
        &Host.read(landing.all()?)?,
        &source,
    )?;
    row(
        "down: into pinned, copy stream",
        into_pin,
        Some(landing.is_direct(be)),
    );
    Ok(rows)
}

/// How much of a copy up of `copy_elems` f32s from pinned memory on the copy stream runs
/// beside `passes` additions over `compute_elems` f32s on the compute stream (each
/// `reps` times, medians); the copy's landed bytes and the additions' result checked.
pub fn time_overlap<B: Backend>(
    be: &B,
    copy_elems: usize,
    (compute_elems, passes): (usize, usize),
    reps: usize,
) -> Result<Overlap, GpuError> {
    let source: Vec<f32> = (0..copy_elems).map(|i| (i % 509) as f32).collect();
    let pinned = PinnedHostBuf::<B, f32>::zeros(be, copy_elems)?;
    Host.write_at(pinned.settled(be)?, &source)?;
    let dst = be.zeros::<f32>(copy_elems)?;
    let acc = be.zeros::<f32>(compute_elems)?;
    let ones = be.upload(&vec![1.0f32; compute_elems])?;
    let sync = || be.read(be.view(&acc, 0..compute_elems.min(1))?).map(|_| ());
    let compute = || -> Result<(), GpuError> {
        for _ in 0..passes {
            kernels::add_into(be, be.all(&acc), be.all(&ones))?;
        }
        Ok(())
    };
    let copy = || -> Result<B::PendingWrite, GpuError> {
        // SAFETY: nothing touches `dst` until the caller's wait, which follows at once
        // (after the compute launches, which do not touch it); it outlives it.
        unsafe { pinned.start_copy_to(be, 0..copy_elems, be.all(&dst)) }
    };
    let compute_us = timed(reps, || {
        compute()?;
        sync()
    })?;
    let copy_us = timed(reps, || {
        be.wait_write(copy()?)?;
        sync()
    })?;
    let both_us = timed(reps, || {
        let w = copy()?;
        compute()?;
        be.wait_write(w)?;
        sync()
    })?;
    check_landed("overlap's copy", &be.download(&dst)?, &source)?;
    // Every pass added 1 to every element: two timings' worth of passes, each with its
    // untimed first run, exactly (small integers in f32).
    let want = vec![(2 * (reps.max(1) + 1) * passes) as f32; compute_elems];
    check_landed("overlap's additions", &be.download(&acc)?, &want)?;
    Ok(Overlap {
        compute_us,
        copy_us,
        both_us,
        pinned_direct: pinned.is_direct(be),
    })
}

/// The host's side of parameter offload's backward, per block: `elems` f32 gradients
/// added into the host's sum (what runs while the device goes on) by `add_into`'s host
/// build, on a pool of one thread and on rayon's pool, whose threads the host backend
/// runs long pack kernels over (`host_threads`): median microseconds of `reps` each; the
/// sums checked.
pub fn time_host_add(elems: usize, reps: usize) -> Result<HostWork, GpuError> {
    // With the untimed first run.
    let want = vec![0.5 * (reps.max(1) + 1) as f32; elems];
    // Made inside: a host buffer stays on the thread that made it.
    let add = || -> Result<f64, GpuError> {
        let grads = Host.upload(&vec![0.5f32; elems])?;
        let sum = Host.zeros::<f32>(elems)?;
        let us = timed(reps, || {
            kernels::add_into(&Host, Host.all(&sum), Host.all(&grads))
        })?;
        check_landed("host add", &Host.download(&sum)?, &want)?;
        Ok(us)
    };
    let one_thread = one_thread_pool()?;
    let one = one_thread.install(add)?;
    Ok(HostWork {
        one_thread_us: one,
        pool_us: add()?,
        pool_threads: rayon::current_num_threads(),
    })
}

/// The offloaded optimizer's step on the host: one AdamW update of `elems` parameters
/// with a bf16 compute copy (the host build over two segments), on a pool of one thread
/// and on rayon's pool: median microseconds of `reps` each; the two results' bits
/// checked against each other.
pub fn time_host_adamw(elems: usize, reps: usize) -> Result<HostWork, GpuError> {
    use crate::step::optimizer::{apply, Optimizer, OptimizerState, Scalars};
    // Made inside: a host buffer stays on the thread that made it.
    let update = || -> Result<(f64, Vec<f32>), GpuError> {
        let master: Vec<f32> = (0..elems).map(|i| (i % 997) as f32 * 1e-3).collect();
        let segments = [(0..elems / 2, true), (elems / 2..elems, false)];
        let opt = OptimizerState::new(&Host, Optimizer::AdamW, &master, &segments)?;
        let grads = Host.upload(&vec![1e-2f32; elems])?;
        let copy = Host.zeros::<half::bf16>(elems)?;
        let s = Scalars::AdamW(stoker_kernels::AdamWStep::new(
            3e-4, 0.9, 0.95, 1e-8, 0.1, 1,
        ));
        let us = timed(reps, || {
            apply(&Host, &opt, Host.all(&copy), Host.all(&grads), &s, 1.0)
        })?;
        Ok((us, opt.master(&Host)?))
    };
    let one_thread = one_thread_pool()?;
    let (one, alone) = one_thread.install(update)?;
    let (threads, pooled) = update()?;
    check_landed("host adamw over threads", &pooled, &alone)?;
    Ok(HostWork {
        one_thread_us: one,
        pool_us: threads,
        pool_threads: rayon::current_num_threads(),
    })
}

/// A rayon pool of one thread: the host build's launches installed on it run whole on
/// that thread, the baseline the pool's pieces are measured against.
fn one_thread_pool() -> Result<rayon::ThreadPool, GpuError> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .map_err(|e| GpuError::Driver {
            what: "making a pool of one thread".into(),
            error: e.to_string(),
        })
}
