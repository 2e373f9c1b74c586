//! The host backend: buffers in CPU memory, every [`Call`] run by the host build of the
//! kernels (cuda/host.cpp) over its whole grid, synchronously (the long pack launches in
//! pieces over rayon's pool: `host_threads.rs`). The tests run stoker's GPU
//! code here against stoker-kernels; the device check runs the same calls on both
//! backends and compares the bits.

use std::cell::UnsafeCell;

use crate::backend::{Backend, View};
use crate::call::{Addr, Call, Gemm};
use crate::elem::Elem;
use crate::error::GpuError;
use crate::gemm::host_gemm;

/// The CPU as a backend.
#[derive(Debug, Default, Clone, Copy)]
pub struct Host;

/// A host buffer the kernels may write through shared views: its elements live in
/// `UnsafeCell`s, and no reference to an element outlives a call of this module.
#[derive(Debug)]
pub struct HostBuf<E> {
    cells: Box<[UnsafeCell<E>]>,
}

/// A write from the host on the host build ([`Backend::start_write`]): held until its
/// wait, where it lands, as late as a device's copy may. Meanwhile the destination holds
/// [`POISON`]: a launch that reads it before the wait (on a device, perhaps half old and
/// half new) computes NaNs from floats and reads -1 as an id, and the wait refuses a
/// destination written since the start.
#[derive(Debug)]
#[must_use = "the write lands only at its wait"]
pub struct HostWrite {
    dst: Addr,
    bytes: Vec<u8>,
    /// Where the bytes were taken from, when that is pinned memory
    /// ([`Backend::start_write_from_pin`]): a device's copy reads it until the copy
    /// runs, so the wait refuses a source that changed since.
    pinned_source: Option<Addr>,
}

/// Host memory pinned for the host build ([`Backend::pin_host`]): its address and
/// length, which the pinned copies check their sources against, and what each copy in
/// the stream's order ([`Backend::write_from_pin`]) read, kept until the pin is settled:
/// on a device the copy engine reads the source until then, so every later use of the
/// pin, and the settle, refuses a source written since ([`GpuError::Order`]).
#[derive(Debug)]
pub struct HostPin {
    at: Addr,
    bytes: usize,
    /// Each unsettled copy's source address and the bytes it read (one entry a source).
    in_flight: std::cell::RefCell<Vec<(Addr, Vec<u8>)>>,
}

impl HostPin {
    /// An error where a source of an unsettled copy was written since the copy.
    fn check_in_flight(&self) -> Result<(), GpuError> {
        for (src, read) in self.in_flight.borrow().iter() {
            // SAFETY: the source lies inside the pinned memory (checked when the copy
            // was made), which `pin_host`'s contract keeps alive while the pin lives.
            let now = unsafe { std::slice::from_raw_parts(*src as usize as *const u8, read.len()) };
            if let Some(k) = now.iter().zip(read).position(|(a, b)| a != b) {
                return Err(GpuError::Order {
                    what: format!(
                        "byte {k} of the {} pinned bytes at {src:#x} was written before the \
                         pin was settled (on a device the copy engine reads them until then)",
                        read.len()
                    ),
                });
            }
        }
        Ok(())
    }
}

/// A read back on the host build ([`Backend::start_read`]): the elements are read at its
/// finish, as late as a device's copy may read them.
#[derive(Debug)]
#[must_use = "the read hands its elements over at its finish"]
pub struct HostRead {
    at: Addr,
    bytes: usize,
    /// Where a read into pinned memory lands ([`Backend::start_read_to_pin`]): poisoned
    /// until the finish, which must be given the same memory.
    into: Option<Addr>,
}

/// A read finished on `(at, bytes)` (an address and a length in bytes) is the one
/// `started` on: finishing it for another view would hand over the wrong elements.
pub(crate) fn check_same_read(
    (at, bytes): (Addr, usize),
    started: (Addr, usize),
) -> Result<(), GpuError> {
    if (at, bytes) != started {
        return Err(GpuError::Shape {
            kernel: "finish_read",
            what: format!(
                "{bytes} bytes at {at:#x}, where the read started on {} bytes at {:#x}",
                started.1, started.0
            ),
        });
    }
    Ok(())
}

/// Each byte of a destination while a write to it is in flight on the host build: all
/// ones, a NaN in f32, bf16 and f16, -1 in i32.
pub const POISON: u8 = 0xff;

impl Host {
    /// Copies `src`, a view of backend `be` (a device's buffer), into `dst`, a view of a
    /// host buffer, as many elements: the gradients down for an optimizer on the host,
    /// with no copy in between. The views must not overlap (checked).
    pub fn copy_from<B: Backend, E: Elem>(
        &self,
        dst: View<E>,
        be: &B,
        src: View<E>,
    ) -> Result<(), GpuError> {
        be.read_into(src, self.writable(dst, &src)?)
    }

    /// Copies `src`, a view of a host buffer, into `dst`, a view of backend `be` (a
    /// device's buffer), as many elements: the compute copy up after an optimizer on the
    /// host. The views must not overlap (checked).
    pub fn copy_to<B: Backend, E: Elem>(
        &self,
        src: View<E>,
        be: &B,
        dst: View<E>,
    ) -> Result<(), GpuError> {
        be.write_at(dst, self.readable(src, &dst)?)
    }

    /// `dst`, a view of a host buffer, as a slice to fill from `src` (as long, not
    /// overlapping it: checked).
    fn writable<'a, E: Elem>(
        &self,
        dst: View<'a, E>,
        src: &View<E>,
    ) -> Result<&'a mut [E], GpuError> {
        crate::error::check_len("copy", "dst", dst.len(), src.len())?;
        crate::backend::check_disjoint("copy", &dst, src)?;
        // SAFETY: a View is made only inside a live HostBuf of this backend (its borrow,
        // 'a, keeps the buffer alive), whose cells may be written; host kernels run
        // synchronously, so none touches them now; `src` does not overlap them (checked
        // above), so this slice is the only access to those elements while the caller
        // fills it.
        Ok(unsafe { std::slice::from_raw_parts_mut(dst.addr() as usize as *mut E, dst.len()) })
    }

    /// `src`, a view of a host buffer, as a slice to copy into `dst` (as long, not
    /// overlapping it: checked).
    fn readable<'a, E: Elem>(&self, src: View<'a, E>, dst: &View<E>) -> Result<&'a [E], GpuError> {
        crate::error::check_len("copy", "dst", dst.len(), src.len())?;
        crate::backend::check_disjoint("copy", dst, &src)?;
        // SAFETY: as in `copy_from`: `src` lies inside a live HostBuf (its borrow, 'a,
        // keeps the buffer alive) that no kernel touches now, and `dst`, which the caller
        // writes, does not overlap it (checked).
        Ok(unsafe { std::slice::from_raw_parts(src.addr() as usize as *const E, src.len()) })
    }
}

fn refuses_capture() -> GpuError {
    GpuError::Capture {
        what: "the host backend runs each call as it comes; \
               stoker_gpu::GraphHost captures"
            .into(),
    }
}

impl Host {
    /// Runs the packs of `call` that start in `range` (a pack kernel that runs in pieces:
    /// the optimizers, the gradients' sum), over rayon's pool: a piece of one launch, for
    /// a caller that does something between the pieces (the offloaded optimizer's copies).
    /// An error for any other call, or a range that is not inside its grid or does not
    /// start on a multiple of eight.
    ///
    /// # Safety
    /// [`Backend::launch`]'s for `call`; and no other piece of it runs meanwhile.
    pub(crate) unsafe fn launch_packs(
        &self,
        call: &Call,
        range: std::ops::Range<usize>,
    ) -> Result<(), GpuError> {
        let bad = |what: String| GpuError::Shape {
            kernel: "launch in pieces",
            what,
        };
        let n =
            crate::ffi::pack_extent(call).ok_or_else(|| bad(format!("{call:?} has no pieces")))?;
        if range.start > range.end || range.end as i64 > n || !range.start.is_multiple_of(8) {
            return Err(bad(format!("elements {range:?} of a grid of {n}")));
        }
        // SAFETY: the caller's contract; the range lies inside the grid and starts on a
        // pack (checked above).
        unsafe { crate::host_threads::run_pieces(call, range.start as i64..range.end as i64) };
        Ok(())
    }
}

impl Backend for Host {
    type Buf<E: Elem> = HostBuf<E>;
    /// The host backend runs each call as it comes and captures nothing.
    type Graph = std::convert::Infallible;
    type PendingWrite = HostWrite;
    type PendingRead = HostRead;
    type HostPin = HostPin;

    unsafe fn pin_host(&self, at: Addr, bytes: usize) -> Result<HostPin, GpuError> {
        Ok(HostPin {
            at,
            bytes,
            in_flight: std::cell::RefCell::new(Vec::new()),
        })
    }

    fn settle_pin(&self, pin: &HostPin) -> Result<(), GpuError> {
        // The copies on the copy stream are checked at their waits.
        pin.check_in_flight()?;
        pin.in_flight.borrow_mut().clear();
        Ok(())
    }

    fn pin_is_direct(&self, _pin: &HostPin) -> bool {
        true
    }

    unsafe fn start_write_from_pin<E: Elem>(
        &self,
        v: View<E>,
        pin: &HostPin,
        data: &[E],
    ) -> Result<HostWrite, GpuError> {
        crate::backend::check_inside_pin((pin.at, pin.bytes), data)?;
        pin.check_in_flight()?;
        // SAFETY: the caller's contract, passed on.
        let mut write = unsafe { self.start_write(v, data)? };
        write.pinned_source = Some(data.as_ptr() as usize as Addr);
        Ok(write)
    }

    unsafe fn write_from_pin<E: Elem>(
        &self,
        v: View<E>,
        pin: &HostPin,
        data: &[E],
    ) -> Result<(), GpuError> {
        crate::backend::check_inside_pin((pin.at, pin.bytes), data)?;
        pin.check_in_flight()?;
        self.write_at(v, data)?;
        let src = data.as_ptr() as usize as Addr;
        let read = crate::elem::as_bytes(data).to_vec();
        let mut in_flight = pin.in_flight.borrow_mut();
        match in_flight
            .iter_mut()
            .find(|(a, r)| *a == src && r.len() == read.len())
        {
            Some(entry) => entry.1 = read,
            None => in_flight.push((src, read)),
        }
        Ok(())
    }

    unsafe fn start_write<E: Elem>(&self, v: View<E>, data: &[E]) -> Result<HostWrite, GpuError> {
        crate::error::check_len("write", "data", data.len(), v.len())?;
        // Taken before the destination is poisoned: `data` may be host memory that
        // overlaps it.
        let bytes = crate::elem::as_bytes(data).to_vec();
        // SAFETY: a View lies inside a live HostBuf of this backend (checked when it was
        // made), whose cells may be written, of bytes.len() bytes (checked above); host
        // kernels run synchronously, and `data` is no longer borrowed, so nothing else
        // touches them now.
        unsafe { std::ptr::write_bytes(v.addr() as usize as *mut u8, POISON, bytes.len()) };
        Ok(HostWrite {
            dst: v.addr(),
            bytes,
            pinned_source: None,
        })
    }

    fn wait_write(&self, write: HostWrite) -> Result<(), GpuError> {
        // SAFETY: `start_write`'s contract keeps the view's buffer (a live HostBuf) alive
        // until this wait; the view held bytes.len() bytes at `dst` (checked there).
        let now = unsafe {
            std::slice::from_raw_parts(write.dst as usize as *const u8, write.bytes.len())
        };
        if let Some(k) = now.iter().position(|&b| b != POISON) {
            return Err(GpuError::Order {
                what: format!(
                    "wait_write: byte {k} of the {} at {:#x} was written between the write's \
                     start and its wait (on a device the copy lands at any moment in between)",
                    write.bytes.len(),
                    write.dst
                ),
            });
        }
        if let Some(src) = write.pinned_source {
            // SAFETY: `start_write_from_pin`'s contract keeps the source (pinned host
            // memory of a live buffer, bytes.len() bytes at `src`, checked inside its pin
            // there) alive until the pin is settled, which is after this wait.
            let source =
                unsafe { std::slice::from_raw_parts(src as usize as *const u8, write.bytes.len()) };
            if let Some(k) = source.iter().zip(&write.bytes).position(|(a, b)| a != b) {
                return Err(GpuError::Order {
                    what: format!(
                        "wait_write: byte {k} of the {} pinned bytes at {src:#x} was written \
                         between the copy's start and its wait (on a device the copy engine \
                         reads them at any moment in between)",
                        write.bytes.len()
                    ),
                });
            }
        }
        // SAFETY: `start_write`'s contract keeps the view's buffer (a live HostBuf, whose
        // cells may be written) alive and untouched until this wait; the view held
        // bytes.len() bytes at `dst` (checked there), and `bytes` is Rust memory outside
        // any HostBuf.
        unsafe {
            std::ptr::copy_nonoverlapping(
                write.bytes.as_ptr(),
                write.dst as usize as *mut u8,
                write.bytes.len(),
            )
        };
        Ok(())
    }

    unsafe fn start_read<E: Elem>(&self, v: View<E>) -> Result<HostRead, GpuError> {
        Ok(HostRead {
            at: v.addr(),
            bytes: v.len() * std::mem::size_of::<E>(),
            into: None,
        })
    }

    unsafe fn start_read_to_pin<E: Elem>(
        &self,
        v: View<E>,
        pin: &HostPin,
        out: &mut [E],
    ) -> Result<HostRead, GpuError> {
        crate::error::check_len("read", "out", out.len(), v.len())?;
        crate::backend::check_inside_pin((pin.at, pin.bytes), out)?;
        let into = out.as_ptr() as usize as Addr;
        // SAFETY: `out` is a live, exclusive slice of an Elem type (plain numbers, no
        // padding), so its bytes may be written.
        unsafe { std::ptr::write_bytes(out.as_mut_ptr().cast::<u8>(), POISON, size_of_val(out)) };
        // SAFETY: the caller's contract, passed on.
        let mut read = unsafe { self.start_read(v)? };
        read.into = Some(into);
        Ok(read)
    }

    fn finish_read<E: Elem>(
        &self,
        read: HostRead,
        v: View<E>,
        out: &mut [E],
    ) -> Result<(), GpuError> {
        let bytes = v.len() * std::mem::size_of::<E>();
        check_same_read((v.addr(), bytes), (read.at, read.bytes))?;
        if let Some(into) = read.into {
            check_same_read((out.as_ptr() as usize as Addr, bytes), (into, read.bytes))?;
            // SAFETY: `out` is a live slice of an Elem type: plain numbers, whose bytes
            // may be read.
            let now = unsafe { std::slice::from_raw_parts(out.as_ptr().cast::<u8>(), bytes) };
            if let Some(k) = now.iter().position(|&b| b != POISON) {
                return Err(GpuError::Order {
                    what: format!(
                        "finish_read: byte {k} of the {bytes} pinned bytes at {into:#x} was \
                         written between the read's start and its finish (on a device the \
                         copy engine writes them at any moment in between)"
                    ),
                });
            }
        }
        self.read_into(v, out)
    }

    fn begin_capture(&self) -> Result<(), GpuError> {
        Err(refuses_capture())
    }

    fn end_capture(&self) -> Result<Self::Graph, GpuError> {
        Err(refuses_capture())
    }

    unsafe fn replay(&self, graph: &Self::Graph) -> Result<(), GpuError> {
        match *graph {}
    }

    fn zeros<E: Elem>(&self, len: usize) -> Result<HostBuf<E>, GpuError> {
        Ok(HostBuf {
            cells: (0..len).map(|_| UnsafeCell::new(E::default())).collect(),
        })
    }

    fn upload<E: Elem>(&self, data: &[E]) -> Result<HostBuf<E>, GpuError> {
        Ok(HostBuf {
            cells: data.iter().map(|&x| UnsafeCell::new(x)).collect(),
        })
    }

    fn write_at<E: Elem>(&self, v: View<E>, data: &[E]) -> Result<(), GpuError> {
        crate::error::check_len("write", "data", data.len(), v.len())?;
        // SAFETY: a View lies inside a live HostBuf of this backend (checked when it was
        // made), whose cells may be written; host kernels run synchronously, so nothing
        // else touches them now, and `data` is Rust memory outside any HostBuf.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), v.addr() as usize as *mut E, data.len())
        };
        Ok(())
    }

    fn download<E: Elem>(&self, buf: &HostBuf<E>) -> Result<Vec<E>, GpuError> {
        // SAFETY: as in `write`: no kernel runs and no other access is live.
        Ok(buf.cells.iter().map(|c| unsafe { *c.get() }).collect())
    }

    fn zero<E: Elem>(&self, v: View<E>) -> Result<(), GpuError> {
        // SAFETY: a View is made only by `view`/`all`/`slice`, inside a live HostBuf of
        // this backend (its borrow keeps the buffer alive), whose cells may be written;
        // all-zero bits are zero for f32, bf16 and i32.
        unsafe { std::ptr::write_bytes(v.addr() as usize as *mut E, 0, v.len()) };
        Ok(())
    }

    fn copy<E: Elem>(&self, dst: View<E>, src: View<E>) -> Result<(), GpuError> {
        crate::error::check_len("copy", "dst", dst.len(), src.len())?;
        crate::backend::check_disjoint("copy", &dst, &src)?;
        // SAFETY: both views lie inside live HostBufs of this backend (cells that may be
        // written), hold src.len() elements and do not overlap (checked above).
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.addr() as usize as *const E,
                dst.addr() as usize as *mut E,
                src.len(),
            )
        };
        Ok(())
    }

    fn read<E: Elem>(&self, v: View<E>) -> Result<Vec<E>, GpuError> {
        // SAFETY: as in `zero`: the view lies inside a live HostBuf, and no kernel runs.
        Ok(unsafe { std::slice::from_raw_parts(v.addr() as usize as *const E, v.len()) }.to_vec())
    }

    fn read_into<E: Elem>(&self, v: View<E>, out: &mut [E]) -> Result<(), GpuError> {
        crate::error::check_len("read", "out", out.len(), v.len())?;
        // SAFETY: as in `zero`: the view lies inside a live HostBuf, and no kernel runs;
        // `out` is Rust memory outside any HostBuf, as long as the view (checked).
        out.copy_from_slice(unsafe {
            std::slice::from_raw_parts(v.addr() as usize as *const E, v.len())
        });
        Ok(())
    }

    fn len<E: Elem>(buf: &HostBuf<E>) -> usize {
        buf.cells.len()
    }

    fn addr<E: Elem>(&self, buf: &HostBuf<E>) -> Addr {
        // UnsafeCell<E> has E's layout: the cells are a plain array of E.
        buf.cells.as_ptr() as usize as Addr
    }

    unsafe fn launch(&self, call: &Call) -> Result<(), GpuError> {
        // SAFETY: the caller's contract: every address points into a live HostBuf with
        // the elements the call's shapes imply, and HostBuf's cells may be written.
        unsafe { crate::host_threads::run(call) };
        Ok(())
    }

    unsafe fn gemm(&self, g: &Gemm) -> Result<(), GpuError> {
        // SAFETY: the caller's contract: every operand's checked extent lies inside a
        // live HostBuf.
        unsafe { host_gemm(g) };
        Ok(())
    }
}
