//! Host-to-device writes that do not wait for the stream (the chapter's `pin_memory=True`
//! with `non_blocking=True`): each destination (a step's id buffers, rewritten every
//! micro-batch) gets two pinned host buffers used in turn, each with the event of its last
//! copy. A write waits only for the copy two writes back from the same buffer, never for
//! the kernels queued before it, so the host checks and groups micro-batch k + 1's ids
//! while the GPU runs micro-batch k.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, PinnedHostSlice};

use crate::call::Addr;
use crate::error::GpuError;

/// One destination's two pinned buffers and their copies' events.
struct Slots {
    bufs: [PinnedHostSlice<u8>; 2],
    events: [CudaEvent; 2],
    next: usize,
}

/// Every destination's slots.
#[derive(Default)]
pub(super) struct Staging {
    slots: RefCell<HashMap<Addr, Slots>>,
}

fn driver(what: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> GpuError {
    move |e| GpuError::Driver {
        what: what.into(),
        error: e.to_string(),
    }
}

impl Staging {
    /// Copies `bytes` to device address `dst` on `stream`, through the next of `dst`'s
    /// pinned buffers (made, or grown, on first need).
    ///
    /// # Safety
    /// `dst` must hold `bytes.len()` bytes of a live buffer of `ctx` (the caller's
    /// view, checked against its buffer when it was made), which nothing else writes
    /// until the copy, ordered on `stream`, is done.
    pub(super) unsafe fn write(
        &self,
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        dst: Addr,
        bytes: &[u8],
    ) -> Result<(), GpuError> {
        if bytes.is_empty() {
            return Ok(());
        }
        let mut all = self.slots.borrow_mut();
        if all.get(&dst).is_some_and(|s| s.bufs[0].len() < bytes.len()) {
            if let Some(old) = all.remove(&dst) {
                // Their copies finish before their memory goes.
                for e in &old.events {
                    e.synchronize()
                        .map_err(driver("waiting for a staged copy"))?;
                }
            }
        }
        let slots = match all.entry(dst) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                let pinned = || -> Result<PinnedHostSlice<u8>, GpuError> {
                    // SAFETY: the memory comes uninitialized, and is zeroed below before
                    // any slice of it exists.
                    let mut p = unsafe { ctx.alloc_pinned::<u8>(bytes.len()) }
                        .map_err(driver("allocating pinned staging"))?;
                    let at = p.as_mut_ptr().map_err(driver("reading pinned staging"))?;
                    // SAFETY: `at` points at the p.len() bytes just allocated, which
                    // nothing else refers to.
                    unsafe { std::ptr::write_bytes(at, 0, p.len()) };
                    Ok(p)
                };
                let event = || ctx.new_event(None).map_err(driver("making an event"));
                v.insert(Slots {
                    bufs: [pinned()?, pinned()?],
                    events: [event()?, event()?],
                    next: 0,
                })
            }
        };
        let k = slots.next;
        slots.next = 1 - k;
        // Its previous copy has read it.
        slots.events[k]
            .synchronize()
            .map_err(driver("waiting for a staged copy"))?;
        let host = slots.bufs[k]
            .as_mut_slice()
            .map_err(driver("reading pinned staging"))?;
        let host = &mut host[..bytes.len()];
        host.copy_from_slice(bytes);
        // SAFETY: `dst` holds bytes.len() bytes of a live buffer of this context (this
        // function's contract); `host` is pinned memory that stays alive and unwritten
        // until the event recorded just after the copy completes (waited above before
        // any rewrite, and before the slots are dropped or replaced).
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, host, stream.cu_stream()) }
            .map_err(driver("copying staged data up"))?;
        if let Err(e) = slots.events[k].record(stream) {
            // No event guards the pinned buffer now: the copy ends before it is reused.
            let _ = stream.synchronize();
            return Err(driver("recording a staged copy")(e));
        }
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        for s in self.slots.get_mut().values() {
            for e in &s.events {
                let _ = e.synchronize();
            }
        }
    }
}
