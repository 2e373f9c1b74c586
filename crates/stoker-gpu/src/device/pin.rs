//! Host memory page-locked for the device (`cuMemHostRegister`, what `pin_memory`
//! does), so that copies from and into it run on the copy engine straight from that
//! memory, and the last event of the copies still using it on each stream, which a host
//! write waits for first ([`crate::Backend::settle_pin`]; copies on one stream end in
//! their order). Where the driver will not register the memory (a limit on locked
//! memory; a page registered already, which [`crate::PinnedHostBuf`]'s whole pages of
//! its own avoid) the pin keeps the driver's error and its copies go through the
//! staging's pinned buffers instead: slower, the same bits.

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
    /// The driver's answer to the registration: Ok where it page-locked the memory
    /// (else its copies are staged).
    registered: Result<(), cudarc::driver::DriverError>,
    /// For each stream (by its handle's address) with copies from or into it not yet
    /// waited for, the event after the last of them.
    uses: RefCell<Vec<(usize, CudaEvent)>>,
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
        let registered = match bytes {
            0 => Err(cudarc::driver::DriverError(
                cudarc::driver::sys::CUresult::CUDA_ERROR_INVALID_VALUE,
            )),
            // SAFETY: `at` starts `bytes` bytes of live host memory (this function's
            // contract), unregistered in drop before it can go.
            _ => unsafe {
                cudarc::driver::sys::cuMemHostRegister_v2(
                    at as usize as *mut std::ffi::c_void,
                    bytes,
                    0,
                )
            }
            .result(),
        };
        Ok(DevicePin {
            ctx: ctx.clone(),
            at,
            bytes,
            registered,
            uses: RefCell::new(Vec::new()),
        })
    }

    /// Its address and length in bytes.
    pub(super) fn range(&self) -> (Addr, usize) {
        (self.at, self.bytes)
    }

    /// Whether the driver page-locked it: its copies use it directly.
    pub fn registered(&self) -> bool {
        self.registered.is_ok()
    }

    /// Why the driver did not page-lock it, if it did not.
    pub fn registration_error(&self) -> Option<String> {
        self.registered.as_ref().err().map(|e| e.to_string())
    }

    /// An event for the next copy from or into it, made before the copy so that
    /// nothing but [`DevicePin::mark_use`] can fail after it.
    pub(super) fn new_use_event(&self) -> Result<CudaEvent, GpuError> {
        self.ctx.new_event(None).map_err(driver("making an event"))
    }

    /// Records `event` on `stream` after a copy from or into this memory queued there,
    /// in place of that stream's last (copies on one stream end in their order); where
    /// recording fails, waits for the stream instead.
    pub(super) fn mark_use(&self, event: CudaEvent, stream: &CudaStream) -> Result<(), GpuError> {
        if let Err(e) = event.record(stream) {
            let _ = stream.synchronize();
            return Err(driver("marking a copy with pinned memory")(e));
        }
        let mut uses = self.uses.borrow_mut();
        let s = stream.cu_stream() as usize;
        match uses.iter_mut().find(|(t, _)| *t == s) {
            // The old event, recorded before, completes no later: dropping it is safe
            // (the driver frees it once it completes).
            Some(last) => last.1 = event,
            None => uses.push((s, event)),
        }
        Ok(())
    }

    /// Returns once every copy started from or into this memory has ended.
    pub(super) fn settle(&self) -> Result<(), GpuError> {
        let mut uses = self.uses.borrow_mut();
        for (_, e) in uses.iter() {
            e.synchronize()
                .map_err(driver("waiting for a copy with pinned memory"))?;
        }
        uses.clear();
        Ok(())
    }
}

impl Drop for DevicePin {
    fn drop(&mut self) {
        if self.settle().is_err() {
            // No copy may read the memory after it goes.
            let _ = self.ctx.synchronize();
        }
        if self.registered() && self.ctx.bind_to_thread().is_ok() {
            // SAFETY: the memory was registered at `at` by `new`, and no copy reads it
            // any more (settled above).
            let _ = unsafe {
                cudarc::driver::sys::cuMemHostUnregister(self.at as usize as *mut std::ffi::c_void)
            };
        }
    }
}
