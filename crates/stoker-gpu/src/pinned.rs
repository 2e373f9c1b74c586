//! Host memory the backend copies from and into directly: what FSDP's and DeepSpeed's
//! offload keep their host copies in (`pin_memory`), so that a block's parameters go up
//! at the bus's speed, read by the copy engine, instead of being copied into staging on
//! the host's thread first. A [`PinnedHostBuf`] is host memory (a [`HostBuf`], whose
//! elements the host build of the kernels reads and writes through views, as an
//! offloaded optimizer does) pinned for one backend: a run of whole pages of its own, so
//! that no two pinned buffers share a page (a driver registers pages, and refuses a page
//! registered twice). Copies from it may read it until the backend says they are done,
//! so a host write to elements a copy may still read goes through
//! [`PinnedHostBuf::settled`], which waits for every copy (elements no copy in flight
//! reads may be written meanwhile: the offloaded optimizer steps one piece while the
//! piece before goes up).

use std::ops::Range;

use crate::backend::{Backend, View};
use crate::call::Addr;
use crate::elem::Elem;
use crate::error::GpuError;
use crate::host::{Host, HostBuf};

/// The page a pinned run starts on and is a whole number of.
const PAGE: usize = 4096;

/// Elements a pinned buffer of `len` elements of `elem` bytes allocates: up to a page
/// before the first page boundary, and the last page rounded up.
fn padded_len(len: usize, elem: usize) -> usize {
    len + 2 * PAGE / elem
}

/// Host bytes a pinned buffer of `len` elements of `elem` bytes holds
/// ([`PinnedHostBuf::bytes`] counts the same): for a plan made before it exists.
pub fn planned_bytes(len: usize, elem: usize) -> usize {
    padded_len(len, elem) * elem
}

/// A host buffer pinned for backend `B`: see the module docs.
pub struct PinnedHostBuf<B: Backend, E> {
    // The pin drops first: its drop waits for the copies using the buffer, and unpins
    // it, before the memory goes.
    pin: B::HostPin,
    /// The elements, with up to a page before and after them: the pinned run is whole
    /// pages from `start`.
    buf: HostBuf<E>,
    /// The first element's index in `buf` (page-aligned).
    start: usize,
    /// Elements.
    len: usize,
}

impl<B: Backend, E: Elem> PinnedHostBuf<B, E> {
    /// `len` zeros in host memory, pinned for `be`.
    pub fn zeros(be: &B, len: usize) -> Result<Self, GpuError> {
        let size = std::mem::size_of::<E>();
        if !PAGE.is_multiple_of(size) {
            return Err(GpuError::Shape {
                kernel: "pinned buffer",
                what: format!("elements of {size} bytes do not tile a page of {PAGE}"),
            });
        }
        let buf = Host.zeros::<E>(padded_len(len, size))?;
        let addr = Host.all(&buf).addr();
        // Elements are aligned to their size, which divides the page.
        let start = (PAGE - (addr % PAGE as Addr) as usize) % PAGE / size;
        let bytes = (len * size).div_ceil(PAGE) * PAGE;
        let run = Host.view(&buf, start..start + bytes / size)?;
        // SAFETY: `run` lies inside `buf` (checked by `view`), which lives in this struct
        // beside the pin and drops after it; the host writes it only through `settled`,
        // which waits for the pin's copies first, and the pin's drop waits for them too.
        let pin = unsafe { be.pin_host(run.addr(), bytes)? };
        Ok(PinnedHostBuf {
            pin,
            buf,
            start,
            len,
        })
    }

    /// Elements in the buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Host bytes it holds, its padding to whole pages included ([`planned_bytes`]).
    pub fn bytes(&self) -> usize {
        Host::len(&self.buf) * std::mem::size_of::<E>()
    }

    /// Whether it has none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The backend's pin of it (on a device: whether the driver registered it, and
    /// why not).
    pub fn pin(&self) -> &B::HostPin {
        &self.pin
    }

    /// Whether the backend copies this memory directly (on a device: the driver
    /// registered it; where not, its copies are staged).
    pub fn is_direct(&self, be: &B) -> bool {
        be.pin_is_direct(&self.pin)
    }

    /// Elements `range`, for reads: copies to the backend may be reading them too.
    pub fn view(&self, range: Range<usize>) -> Result<View<'_, E>, GpuError> {
        Host.view(&self.buf, self.start..self.start + self.len)?
            .slice(range)
    }

    /// Every element, for reads.
    pub fn all(&self) -> Result<View<'_, E>, GpuError> {
        self.view(0..self.len)
    }

    /// Every element, once no copy uses them any more: what the host writes the buffer
    /// through (an update, a load).
    pub fn settled(&self, be: &B) -> Result<View<'_, E>, GpuError> {
        be.settle_pin(&self.pin)?;
        self.all()
    }

    /// Starts copying elements `src` of this buffer into `dst` (as many) beside the
    /// backend's launches ([`Backend::start_write_from_pin`]).
    ///
    /// # Safety
    /// [`Backend::start_write`]'s for `dst`: nothing touches it, and its buffer stays
    /// alive, until [`Backend::wait_write`] of what this returns; and this buffer stays
    /// alive until then too.
    pub unsafe fn start_copy_to(
        &self,
        be: &B,
        src: Range<usize>,
        dst: View<E>,
    ) -> Result<B::PendingWrite, GpuError> {
        let data = readable(self.view(src)?);
        // SAFETY: the caller's contract for `dst` and for this buffer's life; `data` is
        // written only through `settled`, which waits for this copy first.
        unsafe { be.start_write_from_pin(dst, &self.pin, data) }
    }

    /// Copies elements `src` of this buffer into `dst` (as many), ordered after every
    /// launch so far and before every later one ([`Backend::write_from_pin`]).
    pub fn copy_to(&self, be: &B, src: Range<usize>, dst: View<E>) -> Result<(), GpuError> {
        let data = readable(self.view(src)?);
        // SAFETY: `data` is written only through `settled`, which waits for this copy
        // first, and the pin's drop waits for it before the memory goes.
        unsafe { be.write_from_pin(dst, &self.pin, data) }
    }

    /// Starts reading `src` (a view of the backend) into elements `dst` of this buffer
    /// (as many) beside the backend's launches ([`Backend::start_read_to_pin`]: on a
    /// device the copy engine writes them directly).
    ///
    /// # Safety
    /// [`Backend::start_read`]'s for `src`: nothing writes it, and its buffer stays
    /// alive, until [`PinnedHostBuf::finish_read_into`]; and nothing reads or writes
    /// elements `dst` of this buffer until then.
    pub unsafe fn start_read_into(
        &self,
        be: &B,
        src: View<E>,
        dst: Range<usize>,
    ) -> Result<B::PendingRead, GpuError> {
        let out = writable(self.view(dst)?);
        // SAFETY: the caller's contract, passed on; the pin's drop waits for the read
        // before the memory goes.
        unsafe { be.start_read_to_pin(src, &self.pin, out) }
    }

    /// Ends `read`, which [`PinnedHostBuf::start_read_into`] started from `src` into
    /// elements `dst`: they hold `src`'s elements when this returns.
    pub fn finish_read_into(
        &self,
        be: &B,
        read: B::PendingRead,
        src: View<E>,
        dst: Range<usize>,
    ) -> Result<(), GpuError> {
        let out = writable(self.view(dst)?);
        be.finish_read(read, src, out)
    }
}

/// The elements of `v`, a view of a pinned buffer's host memory, as a slice for a copy to
/// read.
fn readable<E: Elem>(v: View<'_, E>) -> &[E] {
    // SAFETY: a View lies inside the live HostBuf it was made from (checked by
    // `Host::view`), which its borrow keeps alive. This is private to this module, whose
    // callers hold the slice only through one backend call, which returns before the host
    // runs anything else on this buffer (host kernels, even those run in pieces on
    // rayon's pool, end before their launch returns), and a HostBuf (cells) is not shared
    // between threads.
    unsafe { std::slice::from_raw_parts(v.addr() as usize as *const E, v.len()) }
}

/// The elements of `v`, a view of a pinned buffer's host memory, as a slice for a read to
/// write.
fn writable<E: Elem>(v: View<'_, E>) -> &mut [E] {
    // SAFETY: as in `readable`, and the cells of a HostBuf may be written: nothing else
    // touches those elements while the one backend call holds the slice.
    unsafe { std::slice::from_raw_parts_mut(v.addr() as usize as *mut E, v.len()) }
}
