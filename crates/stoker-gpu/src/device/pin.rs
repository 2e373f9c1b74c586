//! Host memory page-locked for the device (`cuMemHostRegister`, what `pin_memory`
//! does), so that copies from it run on the copy engine straight from that memory, and
//! the events of the copies still reading it, which a host write waits for first
//! ([`crate::Backend::settle_pin`]). Where the driver will not register the memory (a
//! page shared with memory registered already, a limit on locked memory) the pin says
//! so and its copies go through the staging's pinned buffers instead: slower, the same
//! bits.

use std::cell::RefCell;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream};

use crate::call::Addr;
use crate::error::GpuError;

fn driver(what: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> GpuError {
    move |e| GpuError::Driver {
        what: what.into(),
        error: e.to_string(),
    }
}

/// Host memory pinned for a device: see the module docs.
pub struct DevicePin {
    ctx: Arc<CudaContext>,
    at: Addr,
    bytes: usize,
    /// Whether the driver page-locked it (else its copies are staged).
    registered: bool,
    /// The events of copies started from it and not yet waited for.
    reads: RefCell<Vec<CudaEvent>>,
}

impl DevicePin {
    /// Pins `bytes` bytes of host memory at `at` for `ctx`, or notes that the driver
    /// would not.
    ///
    /// # Safety
    /// The memory stays alive until the pin is dropped.
    pub(super) unsafe fn new(
        ctx: &Arc<CudaContext>,
        at: Addr,
        bytes: usize,
    ) -> Result<Self, GpuError> {
        ctx.bind_to_thread()
            .map_err(driver("making the context current"))?;
        let registered = bytes > 0 && {
            // SAFETY: `at` starts `bytes` bytes of live host memory (this function's
            // contract), unregistered in drop before it can go.
            let r = unsafe {
                cudarc::driver::sys::cuMemHostRegister_v2(
                    at as usize as *mut std::ffi::c_void,
                    bytes,
                    0,
                )
            };
            r.result().is_ok()
        };
        Ok(DevicePin {
            ctx: ctx.clone(),
            at,
            bytes,
            registered,
            reads: RefCell::new(Vec::new()),
        })
    }

    /// Its address and length in bytes.
    pub(super) fn range(&self) -> (Addr, usize) {
        (self.at, self.bytes)
    }

    /// Whether the driver page-locked it: its copies read it directly.
    pub fn registered(&self) -> bool {
        self.registered
    }

    /// An event for the next copy from it, made before the copy so that nothing but
    /// [`DevicePin::mark_read`] can fail after it.
    pub(super) fn new_read_event(&self) -> Result<CudaEvent, GpuError> {
        self.ctx.new_event(None).map_err(driver("making an event"))
    }

    /// Records `event` on `stream` after a copy from this memory queued there; where
    /// that fails, waits for the stream instead.
    pub(super) fn mark_read(&self, event: CudaEvent, stream: &CudaStream) -> Result<(), GpuError> {
        if let Err(e) = event.record(stream) {
            let _ = stream.synchronize();
            return Err(driver("marking a copy from pinned memory")(e));
        }
        self.reads.borrow_mut().push(event);
        Ok(())
    }

    /// Returns once every copy started from this memory has read it.
    pub(super) fn settle(&self) -> Result<(), GpuError> {
        let mut reads = self.reads.borrow_mut();
        for e in reads.iter() {
            e.synchronize()
                .map_err(driver("waiting for a copy from pinned memory"))?;
        }
        reads.clear();
        Ok(())
    }
}

impl Drop for DevicePin {
    fn drop(&mut self) {
        if self.settle().is_err() {
            // No copy may read the memory after it goes.
            let _ = self.ctx.synchronize();
        }
        if self.registered && self.ctx.bind_to_thread().is_ok() {
            // SAFETY: the memory was registered at `at` by `new`, and no copy reads it
            // any more (settled above).
            let _ = unsafe {
                cudarc::driver::sys::cuMemHostUnregister(self.at as usize as *mut std::ffi::c_void)
            };
        }
    }
}
