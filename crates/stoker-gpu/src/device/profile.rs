//! Where a step's time goes on the device, measured the way the forecast splits it
//! (`crate::forecast`): with a profile started, `Device` records a pair of CUDA events
//! around each launch, product, zeroing, copy and graph replay, and the profile sums
//! their times by part: each kernel by name, the dense products, the batched (attention's
//! per-head) products, copies and zeroings, graphs. A kernel's start event is recorded
//! just before its launch; where the GPU is idle, waiting on the host, the interval
//! still holds the driver's own launch call (a few microseconds), so on launch-bound
//! steps the parts overstate the kernels and the gaps between them (what the parts' sum
//! leaves of the step's wall time) understate the waiting. Products' intervals hold the
//! library's host-side planning too. The events are pooled across profiles.

use std::cell::{Cell, RefCell};
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream};

use crate::error::GpuError;

/// What a timed piece of device work counts toward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Part {
    /// A kernel, by its name (`Call::name`).
    Kernel(&'static str),
    /// Products of one matrix pair (the linear layers, the classifier).
    Products,
    /// Batched products (attention's per-head ones).
    BatchedProducts,
    /// Copies and zeroings inside device memory.
    Device,
    /// A captured graph, replayed whole.
    Graph,
}

/// A part's measured time over the profile.
#[derive(Debug, Clone, PartialEq)]
pub struct MeasuredShare {
    /// The part.
    pub part: Part,
    /// Pieces of work timed.
    pub launches: usize,
    /// Their summed GPU time, in milliseconds.
    pub ms: f64,
}

/// The events of a profile under way.
#[derive(Default)]
pub(super) struct Profiler {
    marks: RefCell<Option<Vec<(Part, CudaEvent, CudaEvent)>>>,
    /// Events of earlier profiles, to record again.
    pool: RefCell<Vec<CudaEvent>>,
    /// Whether a timed piece of work is running (a product's bias kernel is the
    /// product's, not timed again).
    inside: Cell<bool>,
}

fn driver(what: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> GpuError {
    move |e| GpuError::Driver {
        what: what.into(),
        error: e.to_string(),
    }
}

impl Profiler {
    /// Starts a profile (forgetting any under way).
    pub(super) fn start(&self) {
        *self.marks.borrow_mut() = Some(Vec::new());
    }

    /// Runs `work`, timed as `part` on `stream` where a profile is under way and `work`
    /// is not inside another timed piece.
    pub(super) fn timed<R>(
        &self,
        (ctx, stream): (&Arc<CudaContext>, &Arc<CudaStream>),
        part: Part,
        work: impl FnOnce() -> Result<R, GpuError>,
    ) -> Result<R, GpuError> {
        if self.inside.get() || self.marks.borrow().is_none() {
            return work();
        }
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let event = || match self.pool.borrow_mut().pop() {
            Some(e) => Ok(e),
            None => ctx
                .new_event(flags)
                .map_err(driver("making a profile event")),
        };
        let (start, end) = (event()?, event()?);
        start
            .record(stream)
            .map_err(driver("recording a profile event"))?;
        self.inside.set(true);
        let done = work();
        self.inside.set(false);
        let done = done?;
        end.record(stream)
            .map_err(driver("recording a profile event"))?;
        if let Some(marks) = self.marks.borrow_mut().as_mut() {
            marks.push((part, start, end));
        }
        Ok(done)
    }

    /// Ends the profile: each part's launches and summed time, the longest first (waits
    /// for every piece timed). Empty where no profile was under way.
    pub(super) fn take(&self) -> Result<Vec<MeasuredShare>, GpuError> {
        let marks = self.marks.borrow_mut().take().unwrap_or_default();
        let mut shares: Vec<MeasuredShare> = Vec::new();
        let mut pool = self.pool.borrow_mut();
        for (part, start, end) in marks {
            let ms = start
                .elapsed_ms(&end)
                .map_err(driver("reading a profile event"))? as f64;
            pool.extend([start, end]);
            match shares.iter_mut().find(|s| s.part == part) {
                Some(s) => {
                    s.launches += 1;
                    s.ms += ms;
                }
                None => shares.push(MeasuredShare {
                    part,
                    launches: 1,
                    ms,
                }),
            }
        }
        shares.sort_by(|a, b| b.ms.total_cmp(&a.ms));
        Ok(shares)
    }
}
