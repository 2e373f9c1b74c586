//! Host memory the backend copies from directly: what FSDP's and DeepSpeed's parameter
//! offload keep their host copy in (`pin_memory`), so that a block's parameters go up at
//! the bus's speed, read by the copy engine, instead of being copied into staging on the
//! host's thread first. A [`PinnedHostBuf`] is a host buffer ([`HostBuf`], which the
//! host build of the kernels reads and writes through views, as an offloaded optimizer
//! does) pinned for one backend. Copies from it may read it until the backend says they
//! are done, so every host write to it goes through [`PinnedHostBuf::settled`], which
//! waits for them.

use std::ops::Range;

use crate::backend::{Backend, View};
use crate::elem::Elem;
use crate::error::GpuError;
use crate::host::{Host, HostBuf};

/// A host buffer pinned for backend `B`: see the module docs.
pub struct PinnedHostBuf<B: Backend, E> {
    // The pin drops first: its drop waits for the copies reading the buffer, and
    // unpins it, before the memory goes.
    pin: B::HostPin,
    buf: HostBuf<E>,
}

impl<B: Backend, E: Elem> PinnedHostBuf<B, E> {
    /// `len` zeros in host memory, pinned for `be`.
    pub fn zeros(be: &B, len: usize) -> Result<Self, GpuError> {
        let buf = Host.zeros::<E>(len)?;
        let all = Host.all(&buf);
        // SAFETY: `buf` owns the len elements at its address, lives in this struct beside
        // the pin, and drops after it; it is written only through `settled`, which waits
        // for the pin's copies first.
        let pin = unsafe { be.pin_host(all.addr(), len * std::mem::size_of::<E>())? };
        Ok(PinnedHostBuf { pin, buf })
    }

    /// Elements in the buffer.
    pub fn len(&self) -> usize {
        Host::len(&self.buf)
    }

    /// Whether it has none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The backend's pin of it (on a device, whether the driver registered it).
    pub fn pin(&self) -> &B::HostPin {
        &self.pin
    }

    /// The buffer, for reads: copies to the backend may be reading it too.
    pub fn readable(&self) -> &HostBuf<E> {
        &self.buf
    }

    /// The buffer, once no copy reads it any more: what the host writes it through
    /// (an update, a load).
    pub fn settled(&self, be: &B) -> Result<&HostBuf<E>, GpuError> {
        be.settle_pin(&self.pin)?;
        Ok(&self.buf)
    }

    /// Starts copying elements `src` of this buffer into `dst` (as many) beside the
    /// backend's launches ([`Backend::start_write_from_pin`]).
    ///
    /// # Safety
    /// [`Backend::start_write`]'s for `dst`: nothing touches it, and its buffer stays
    /// alive, until [`Backend::wait_write`] of what this returns.
    pub unsafe fn start_copy_to(
        &self,
        be: &B,
        src: Range<usize>,
        dst: View<E>,
    ) -> Result<B::PendingWrite, GpuError> {
        let data = self.slice(src)?;
        // SAFETY: the caller's contract for `dst`; `data` is written only through
        // `settled`, which waits for this copy first.
        unsafe { be.start_write_from_pin(dst, &self.pin, data) }
    }

    /// Copies elements `src` of this buffer into `dst` (as many), ordered after every
    /// launch so far and before every later one ([`Backend::write_from_pin`]).
    pub fn copy_to(&self, be: &B, src: Range<usize>, dst: View<E>) -> Result<(), GpuError> {
        let data = self.slice(src)?;
        // SAFETY: `data` is written only through `settled`, which waits for this copy
        // first.
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
        let out = writable(Host.view(&self.buf, dst)?);
        // SAFETY: the caller's contract, passed on.
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
        let out = writable(Host.view(&self.buf, dst)?);
        be.finish_read(read, src, out)
    }

    /// Elements `range`, as a slice for a copy to read.
    fn slice(&self, range: Range<usize>) -> Result<&[E], GpuError> {
        let v = Host.view(&self.buf, range)?;
        // SAFETY: a View lies inside the live HostBuf it was made from (checked by
        // `Host::view`), which `&self` keeps alive. The slice is private to this module
        // and lives only through one backend call above, in which nothing writes the
        // buffer: host kernels run on the calling thread, and a HostBuf (cells) is not
        // shared between threads.
        Ok(unsafe { std::slice::from_raw_parts(v.addr() as usize as *const E, v.len()) })
    }
}

/// The elements of `v`, a view of a pinned buffer's host memory, as a slice for a read to
/// write.
fn writable<E: Elem>(v: View<'_, E>) -> &mut [E] {
    // SAFETY: a View lies inside the live HostBuf it was made from (checked by
    // `Host::view`), whose cells may be written, and which its borrow keeps alive. This
    // is private to this module, whose callers hold the slice only through one backend
    // call, in which nothing else touches those elements: host kernels run on the
    // calling thread, and a HostBuf (cells) is not shared between threads.
    unsafe { std::slice::from_raw_parts_mut(v.addr() as usize as *mut E, v.len()) }
}
