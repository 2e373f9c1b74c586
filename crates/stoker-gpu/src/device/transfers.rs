//! Copies between host and device on copy streams of their own, beside the kernels (the
//! chapter's `pin_memory=True` with `non_blocking=True`, and what FSDP's and DeepSpeed's
//! parameter offload overlap): a write or read starts after every launch so far on the
//! compute stream (an event its copy stream waits for), runs on its copy stream from or
//! into pinned memory, and records an event of its own. A write's launches wait for that
//! event on the GPU ([`Transfers::wait_write`]); a read's host waits for it when it takes
//! the elements ([`Transfers::finish_read`]). Meanwhile the compute stream goes on with
//! the launches queued after the copy started. Writes and reads have a stream each, so a
//! block's gradients going down and the next block's parameters going up do not queue
//! behind each other (PCIe carries both directions at once).

use std::cell::RefCell;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, PinnedHostSlice};

use super::pin::DevicePin;
use super::staging::Staging;
use crate::call::Addr;
use crate::error::GpuError;

fn driver(what: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> GpuError {
    move |e| GpuError::Driver {
        what: what.into(),
        error: e.to_string(),
    }
}

/// A write from the host landing on the write stream.
pub struct DeviceWrite {
    done: CudaEvent,
    /// The compute stream waits for it ([`Transfers::wait_write`]).
    ordered: bool,
}

impl Drop for DeviceWrite {
    fn drop(&mut self) {
        // Dropped unwaited (an error on the way, or its owner dropped): the copy ends
        // before whatever frees its destination next.
        if !self.ordered {
            let _ = self.done.synchronize();
        }
    }
}

/// A read back under way on the read stream, into pinned memory it holds until the read
/// is finished (or, dropped unfinished, until the copy is done).
pub struct DeviceRead {
    done: CudaEvent,
    pinned: Option<PinnedHostSlice<u8>>,
    /// Where the copy lands when it writes the caller's pinned memory directly
    /// ([`Transfers::start_read_to_pin`]); None when it lands in `pinned`.
    into: Option<Addr>,
    at: Addr,
    bytes: usize,
}

impl Drop for DeviceRead {
    fn drop(&mut self) {
        // The copy ends before its pinned memory goes (the fields drop after this).
        let _ = self.done.synchronize();
    }
}

/// The copy streams and the pinned buffers reads land in.
pub(super) struct Transfers {
    up: Arc<CudaStream>,
    down: Arc<CudaStream>,
    /// Pinned buffers of finished reads, for the next ones (cached host memory: the host
    /// reads them, which write-combined memory makes slow).
    free: RefCell<Vec<PinnedHostSlice<u8>>>,
}

/// Records `done` on `stream` after a copy was queued there; where that fails, waits for
/// the stream instead, so that no copy outlives the memory it uses unguarded.
fn record_after_copy(done: &CudaEvent, stream: &CudaStream) -> Result<(), GpuError> {
    if let Err(e) = done.record(stream) {
        let _ = stream.synchronize();
        return Err(driver("marking a copy")(e));
    }
    Ok(())
}

impl Transfers {
    /// The two copy streams on `ctx`.
    pub(super) fn new(ctx: &Arc<CudaContext>) -> Result<Self, GpuError> {
        let stream = || ctx.new_stream().map_err(driver("making a copy stream"));
        Ok(Transfers {
            up: stream()?,
            down: stream()?,
            free: RefCell::new(Vec::new()),
        })
    }

    /// Orders `copy`'s next work after every launch so far on `compute`.
    fn after(copy: &CudaStream, compute: &CudaStream) -> Result<(), GpuError> {
        let so_far = compute
            .record_event(None)
            .map_err(driver("marking the launches so far"))?;
        copy.wait(&so_far)
            .map_err(driver("ordering a copy stream after the launches"))
    }

    /// Starts writing `bytes` to device address `dst` after every launch so far on
    /// `compute`, through `staging`'s pinned buffers, on the write stream.
    ///
    /// # Safety
    /// `dst` must hold `bytes.len()` bytes of a live buffer of `ctx`, which nothing
    /// touches until [`Transfers::wait_write`] of what this returns (or its drop).
    pub(super) unsafe fn start_write(
        &self,
        ctx: &Arc<CudaContext>,
        compute: &CudaStream,
        staging: &Staging,
        dst: Addr,
        bytes: &[u8],
    ) -> Result<DeviceWrite, GpuError> {
        // Made before the copy, so that nothing can fail between the copy and its mark
        // but the mark itself (`record_after_copy`).
        let done = ctx.new_event(None).map_err(driver("making an event"))?;
        Self::after(&self.up, compute)?;
        // SAFETY: this function's contract: `dst` holds bytes.len() bytes of a live buffer
        // of `ctx`, untouched until the wait, which orders every later launch after the
        // copy on the write stream.
        unsafe { staging.write(ctx, &self.up, dst, bytes)? };
        record_after_copy(&done, &self.up)?;
        Ok(DeviceWrite {
            done,
            ordered: false,
        })
    }

    /// [`Transfers::start_write`] from `bytes` in `pin`'s memory (checked), which the
    /// write stream's copy reads directly; through `staging` where the driver did not
    /// page-lock it.
    ///
    /// # Safety
    /// [`Transfers::start_write`]'s for `dst`; and nothing writes `bytes` until `pin` is
    /// settled.
    pub(super) unsafe fn start_write_from_pin(
        &self,
        ctx: &Arc<CudaContext>,
        compute: &CudaStream,
        (staging, pin): (&Staging, &DevicePin),
        dst: Addr,
        bytes: &[u8],
    ) -> Result<DeviceWrite, GpuError> {
        crate::backend::check_inside_pin(pin.range(), bytes)?;
        if !pin.registered() || bytes.is_empty() {
            // SAFETY: this function's contract, for `dst`.
            return unsafe { self.start_write(ctx, compute, staging, dst, bytes) };
        }
        // Made before the copy (`record_after_copy`).
        let done = ctx.new_event(None).map_err(driver("making an event"))?;
        let used = pin.new_use_event()?;
        Self::after(&self.up, compute)?;
        // SAFETY: `dst` holds bytes.len() bytes of a live buffer of `ctx`, untouched until
        // the wait (this function's contract); `bytes` lies in page-locked memory
        // (checked above) that nothing writes or frees until the pin is settled, which
        // waits for the event `mark_read` records after this copy (or, where recording
        // fails, for the stream).
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, bytes, self.up.cu_stream()) }
            .map_err(driver("copying up from pinned memory"))?;
        record_after_copy(&done, &self.up)?;
        pin.mark_use(used, &self.up)?;
        Ok(DeviceWrite {
            done,
            ordered: false,
        })
    }

    /// Orders every later launch on `compute` after `write`'s copy.
    pub(super) fn wait_write(
        &self,
        compute: &CudaStream,
        mut write: DeviceWrite,
    ) -> Result<(), GpuError> {
        compute
            .wait(&write.done)
            .map_err(driver("ordering the launches after a write"))?;
        write.ordered = true;
        Ok(())
    }

    /// Starts reading `bytes` bytes at device address `at` after every launch so far on
    /// `compute`, on the read stream, into pinned memory of the read's own.
    ///
    /// # Safety
    /// `at` must start `bytes` bytes of a live buffer of `ctx`, which nothing writes
    /// until the read is finished or dropped.
    pub(super) unsafe fn start_read(
        &self,
        ctx: &Arc<CudaContext>,
        compute: &CudaStream,
        at: Addr,
        bytes: usize,
    ) -> Result<DeviceRead, GpuError> {
        let reuse = {
            let mut free = self.free.borrow_mut();
            let k = free.iter().position(|p| p.len() >= bytes);
            k.map(|k| free.swap_remove(k))
        };
        let mut pinned = match reuse {
            Some(p) => p,
            // SAFETY: the memory comes uninitialized; the copy below writes the `bytes`
            // bytes that `finish_read` hands over before any of them is read.
            None => unsafe { ctx.alloc_pinned_with_flags::<u8>(bytes.max(1), 0) }
                .map_err(driver("allocating pinned memory for a read"))?,
        };
        let done = ctx.new_event(None).map_err(driver("making an event"))?;
        Self::after(&self.down, compute)?;
        let host = pinned
            .as_mut_slice()
            .map_err(driver("reading pinned memory"))?;
        // SAFETY: `host` is pinned memory of at least `bytes` bytes (taken from the free
        // list by length, or made so), which the DeviceRead returned below keeps, handing
        // none of it out until `done` has completed; where marking the copy fails,
        // `record_after_copy` waits for the stream before `pinned` can drop. `at` starts
        // `bytes` bytes of a live device buffer of `ctx`, unwritten until then (this
        // function's contract).
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(&mut host[..bytes], at, self.down.cu_stream())
        }
        .map_err(driver("copying down on the read stream"))?;
        record_after_copy(&done, &self.down)?;
        Ok(DeviceRead {
            done,
            pinned: Some(pinned),
            into: None,
            at,
            bytes,
        })
    }

    /// [`Transfers::start_read`] straight into `out`, which lies in `pin`'s memory
    /// (checked): the copy engine writes it where the driver registered it; otherwise
    /// the read lands in pinned memory of its own and the finish copies it over.
    ///
    /// # Safety
    /// [`Transfers::start_read`]'s for `at`; and nothing reads or writes `out`, which
    /// stays alive, until the read is finished or dropped.
    pub(super) unsafe fn start_read_to_pin(
        &self,
        ctx: &Arc<CudaContext>,
        compute: &CudaStream,
        pin: &DevicePin,
        at: Addr,
        out: &mut [u8],
    ) -> Result<DeviceRead, GpuError> {
        crate::backend::check_inside_pin(pin.range(), out)?;
        if !pin.registered() || out.is_empty() {
            // SAFETY: this function's contract, for `at`.
            return unsafe { self.start_read(ctx, compute, at, out.len()) };
        }
        let done = ctx.new_event(None).map_err(driver("making an event"))?;
        let used = pin.new_use_event()?;
        Self::after(&self.down, compute)?;
        let bytes = out.len();
        let into = out.as_ptr() as usize as Addr;
        // SAFETY: `out` lies in page-locked memory (checked above) that nothing reads,
        // writes or frees until the read is finished or dropped, both of which wait for
        // `done` first (where marking the copy fails, `record_after_copy` waits for the
        // stream); `at` starts `bytes` bytes of a live device buffer of `ctx`, unwritten
        // until then (this function's contract).
        unsafe { cudarc::driver::result::memcpy_dtoh_async(out, at, self.down.cu_stream()) }
            .map_err(driver("copying down into pinned memory"))?;
        record_after_copy(&done, &self.down)?;
        // The pin's settle and drop wait for it too, so its memory outlives the copy.
        pin.mark_use(used, &self.down)?;
        Ok(DeviceRead {
            done,
            pinned: None,
            into: Some(into),
            at,
            bytes,
        })
    }

    /// `read`'s bytes into `out` (as many), after its copy is done; `at` the device
    /// address the caller finishes it for (checked against where it started).
    pub(super) fn finish_read(
        &self,
        mut read: DeviceRead,
        at: Addr,
        out: &mut [u8],
    ) -> Result<(), GpuError> {
        crate::host::check_same_read((at, out.len()), (read.at, read.bytes))?;
        read.done
            .synchronize()
            .map_err(driver("waiting for a read's copy"))?;
        if let Some(into) = read.into {
            // Landed in `out` itself, if `out` is where it started.
            return crate::host::check_same_read(
                (out.as_ptr() as usize as Addr, out.len()),
                (into, read.bytes),
            );
        }
        let pinned = read.pinned.take().ok_or_else(|| GpuError::Driver {
            what: "finishing a read".into(),
            error: "its pinned memory is gone".into(),
        })?;
        let host = pinned.as_slice().map_err(driver("reading pinned memory"))?;
        out.copy_from_slice(&host[..out.len()]);
        self.free.borrow_mut().push(pinned);
        Ok(())
    }
}
