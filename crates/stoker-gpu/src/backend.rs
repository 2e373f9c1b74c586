//! Where kernels run: a [`Backend`] owns flat buffers and runs [`Call`]s on them. The
//! host backend ([`crate::host::Host`]) runs the host build on the CPU; the device
//! backend (`device::Device`, with the `cuda` feature) launches the GPU kernels. Code
//! above this line ([`crate::kernels`], the step) is written once for both.

use std::marker::PhantomData;
use std::ops::Range;

use crate::call::{Addr, Call, Gemm};
use crate::elem::Elem;
use crate::error::GpuError;

/// Flat buffers and kernel launches.
pub trait Backend {
    /// A flat buffer of `E`.
    type Buf<E: Elem>;
    /// Launches captured once and replayed as one (a CUDA graph): see
    /// [`Backend::begin_capture`].
    type Graph;
    /// A write from the host still landing ([`Backend::start_write`]).
    type PendingWrite;
    /// A read back to the host still under way ([`Backend::start_read`]).
    type PendingRead;
    /// Host memory the backend copies from directly ([`Backend::pin_host`]: on a
    /// device, page-locked), and the copies still reading it.
    type HostPin;

    /// A buffer of `len` zeros.
    fn zeros<E: Elem>(&self, len: usize) -> Result<Self::Buf<E>, GpuError>;
    /// A buffer holding `data`.
    fn upload<E: Elem>(&self, data: &[E]) -> Result<Self::Buf<E>, GpuError>;
    /// Overwrites the elements of `v` with `data` (as many), after every launch so far.
    fn write_at<E: Elem>(&self, v: View<E>, data: &[E]) -> Result<(), GpuError>;
    /// Overwrites `buf[offset..offset + data.len()]` with `data`.
    fn write<E: Elem>(
        &self,
        buf: &Self::Buf<E>,
        offset: usize,
        data: &[E],
    ) -> Result<(), GpuError> {
        self.write_at(self.view(buf, offset..offset + data.len())?, data)
    }
    /// Overwrites `v` with `data` as [`Backend::write_at`] does, ordered after every
    /// launch so far, without waiting for them: the data is staged first (the device
    /// copies it from pinned host memory while earlier launches run). The host's is
    /// `write_at`.
    fn write_staged<E: Elem>(&self, v: View<E>, data: &[E]) -> Result<(), GpuError> {
        self.write_at(v, data)
    }
    /// Starts overwriting `v` with `data` after every launch so far, without holding back
    /// the launches queued after it: on a device the copy runs on a copy stream of its
    /// own, from pinned memory, beside the kernels (a block's parameters going up while
    /// the block before runs: the chapter's `non_blocking=True` copy). `data` is taken at
    /// once. [`Backend::wait_write`] orders the launches that read `v` after it.
    ///
    /// # Safety
    /// Until [`Backend::wait_write`] of what this returns, nothing may touch `v`, and its
    /// buffer must stay alive: the copy may land at any moment in between (on the host
    /// build it lands at the wait, so a missing wait shows in the bits).
    unsafe fn start_write<E: Elem>(
        &self,
        v: View<E>,
        data: &[E],
    ) -> Result<Self::PendingWrite, GpuError>;
    /// Orders every later launch after `write`'s copy.
    fn wait_write(&self, write: Self::PendingWrite) -> Result<(), GpuError>;
    /// Makes `bytes` bytes of host memory at `at` a source the backend copies from with
    /// no staging in between (on a device, `cuMemHostRegister`: the copy engine reads it
    /// at the bus's speed, where [`Backend::start_write`] first copies its data into
    /// pinned memory on the host's thread). [`crate::PinnedHostBuf`] is its safe owner.
    ///
    /// # Safety
    /// The memory stays alive, and is written only after [`Backend::settle_pin`], until
    /// what this returns is dropped (its drop waits for the copies reading it).
    unsafe fn pin_host(&self, at: Addr, bytes: usize) -> Result<Self::HostPin, GpuError>;
    /// Returns once no copy started from or into `pin`'s memory still uses it: what a
    /// host write to that memory waits for.
    fn settle_pin(&self, pin: &Self::HostPin) -> Result<(), GpuError>;
    /// Whether copies from and into `pin`'s memory use it directly (on a device: the
    /// driver registered it), rather than through staging.
    fn pin_is_direct(&self, pin: &Self::HostPin) -> bool;
    /// [`Backend::start_write`] from `data`, which lies in `pin`'s memory (checked),
    /// read by the copy itself, as late as the copy runs.
    ///
    /// # Safety
    /// [`Backend::start_write`]'s for `v`; nothing writes `data` until
    /// [`Backend::settle_pin`] of `pin` (on the host build, the wait refuses a source
    /// written since the start); and `data`'s memory stays alive until the wait.
    unsafe fn start_write_from_pin<E: Elem>(
        &self,
        v: View<E>,
        pin: &Self::HostPin,
        data: &[E],
    ) -> Result<Self::PendingWrite, GpuError>;
    /// [`Backend::write_staged`] from `data`, which lies in `pin`'s memory (checked):
    /// ordered after every launch so far and before every later one, read by the copy
    /// itself.
    ///
    /// # Safety
    /// Nothing writes `data` until [`Backend::settle_pin`] of `pin` (on the host build,
    /// the settle refuses a source written since).
    unsafe fn write_from_pin<E: Elem>(
        &self,
        v: View<E>,
        pin: &Self::HostPin,
        data: &[E],
    ) -> Result<(), GpuError>;
    /// Starts reading `v` back after every launch so far, without holding back the
    /// launches queued after it (on a device: on the copy stream, into pinned memory):
    /// a block's gradients going down while the block before it runs its backward.
    /// [`Backend::finish_read`] hands the elements over.
    ///
    /// # Safety
    /// Until [`Backend::finish_read`] of what this returns, nothing may write `v`, and
    /// its buffer must stay alive (on the host build the read happens at the finish, so
    /// a write in between shows in the bits).
    unsafe fn start_read<E: Elem>(&self, v: View<E>) -> Result<Self::PendingRead, GpuError>;
    /// [`Backend::start_read`] straight into `out` (as many elements as `v`), which lies
    /// in `pin`'s memory (checked): on a device the copy engine writes it, with no copy
    /// out of the read's own memory at the finish. [`Backend::finish_read`] with the same
    /// `out` ends it.
    ///
    /// # Safety
    /// [`Backend::start_read`]'s for `v`; and nothing reads or writes `out`, which stays
    /// alive, until the finish (on the host build `out` holds [`crate::host::POISON`]
    /// until then, and the finish refuses an `out` written since the start).
    unsafe fn start_read_to_pin<E: Elem>(
        &self,
        v: View<E>,
        pin: &Self::HostPin,
        out: &mut [E],
    ) -> Result<Self::PendingRead, GpuError>;
    /// The elements `read` (started on `v`) read, into `out` (as many), once it is done.
    fn finish_read<E: Elem>(
        &self,
        read: Self::PendingRead,
        v: View<E>,
        out: &mut [E],
    ) -> Result<(), GpuError>;
    /// A buffer's elements, after every launch so far has finished.
    fn download<E: Elem>(&self, buf: &Self::Buf<E>) -> Result<Vec<E>, GpuError>;
    /// A buffer's length in elements.
    fn len<E: Elem>(buf: &Self::Buf<E>) -> usize;
    /// The address of a buffer's first element.
    fn addr<E: Elem>(&self, buf: &Self::Buf<E>) -> Addr;
    /// Sets the elements of `v` to zero (enqueued after every launch so far).
    fn zero<E: Elem>(&self, v: View<E>) -> Result<(), GpuError>;
    /// Copies `src` into `dst` (enqueued after every launch so far); the lengths must
    /// match and the views must not overlap.
    fn copy<E: Elem>(&self, dst: View<E>, src: View<E>) -> Result<(), GpuError>;
    /// The elements of `v`, after every launch so far has finished.
    fn read<E: Elem>(&self, v: View<E>) -> Result<Vec<E>, GpuError>;
    /// [`Backend::read`] into `out` (as many elements as `v`), reusing the caller's
    /// memory.
    fn read_into<E: Elem>(&self, v: View<E>, out: &mut [E]) -> Result<(), GpuError> {
        crate::error::check_len("read", "out", out.len(), v.len())?;
        out.copy_from_slice(&self.read(v)?);
        Ok(())
    }
    /// Free memory as the device's driver reports it, for a run's measured side of its
    /// device memory; None where the backend is host memory.
    fn free_memory(&self) -> Option<usize> {
        None
    }
    /// Starts capturing: until [`Backend::end_capture`], launches, products, zeroings
    /// and copies inside device memory are recorded into a graph instead of run, with
    /// their arguments as they are now. Reads back and writes from the host are errors
    /// meanwhile ([`GpuError::Capture`]): a replay could not repeat them. An error where
    /// the backend cannot capture ([`crate::Host`]; [`crate::GraphHost`] can).
    fn begin_capture(&self) -> Result<(), GpuError>;
    /// Ends the capture [`Backend::begin_capture`] started: what it recorded, not yet
    /// run.
    fn end_capture(&self) -> Result<Self::Graph, GpuError>;
    /// Runs (or enqueues) every launch of `graph` in its captured order, with its
    /// captured arguments.
    ///
    /// # Safety
    /// Every buffer the captured launches touched is still alive (the graph holds their
    /// addresses, not borrows).
    unsafe fn replay(&self, graph: &Self::Graph) -> Result<(), GpuError>;
    /// Runs (or enqueues) `call`.
    ///
    /// # Safety
    /// Every address in `call` points into a live buffer of this backend with as many
    /// elements as the call's shapes imply ([`crate::kernels`] checks this before each
    /// call).
    unsafe fn launch(&self, call: &Call) -> Result<(), GpuError>;
    /// Runs (or enqueues) the matrix product `g`.
    ///
    /// # Safety
    /// Every operand's extent lies inside a live buffer of this backend
    /// ([`crate::gemm::matmul`] checks this before each product).
    unsafe fn gemm(&self, g: &Gemm) -> Result<(), GpuError>;

    /// Elements `range` of `buf`, checked against its length.
    fn view<'a, E: Elem>(
        &self,
        buf: &'a Self::Buf<E>,
        range: Range<usize>,
    ) -> Result<View<'a, E>, GpuError> {
        let len = Self::len(buf);
        if range.start > range.end || range.end > len {
            return Err(GpuError::Shape {
                kernel: "view",
                what: format!("elements {range:?} of a buffer of {len}"),
            });
        }
        Ok(View {
            addr: self.addr(buf) + (range.start * std::mem::size_of::<E>()) as Addr,
            len: range.len(),
            _buf: PhantomData,
        })
    }

    /// The whole of `buf`.
    fn all<'a, E: Elem>(&self, buf: &'a Self::Buf<E>) -> View<'a, E> {
        View {
            addr: self.addr(buf),
            len: Self::len(buf),
            _buf: PhantomData,
        }
    }
}

/// Waits for every write of `writes` ([`Backend::wait_write`]), all of them even where
/// one fails (a write dropped unwaited never lands on the host build); the first error.
pub(crate) fn wait_writes<B: Backend>(
    be: &B,
    writes: impl IntoIterator<Item = B::PendingWrite>,
) -> Result<(), GpuError> {
    let mut first = Ok(());
    for w in writes {
        let waited = be.wait_write(w);
        if first.is_ok() {
            first = waited;
        }
    }
    first
}

/// `a` and `b` share no element: what a copy between them needs.
pub(crate) fn check_disjoint<E>(
    kernel: &'static str,
    a: &View<E>,
    b: &View<E>,
) -> Result<(), GpuError> {
    let size = std::mem::size_of::<E>() as Addr;
    let (a0, a1) = (a.addr(), a.addr() + a.len() as Addr * size);
    let (b0, b1) = (b.addr(), b.addr() + b.len() as Addr * size);
    if a0 < b1 && b0 < a1 {
        return Err(GpuError::Shape {
            kernel,
            what: format!("the views overlap ({} and {} elements)", a.len(), b.len()),
        });
    }
    Ok(())
}

/// `data` lies inside the pinned region of `bytes` bytes at `at`: a copy from the pin's
/// memory must read nothing else.
pub(crate) fn check_inside_pin<E>((at, bytes): (Addr, usize), data: &[E]) -> Result<(), GpuError> {
    let start = data.as_ptr() as usize as Addr;
    let end = start + std::mem::size_of_val(data) as Addr;
    if start < at || end > at + bytes as Addr {
        return Err(GpuError::Shape {
            kernel: "pinned copy",
            what: format!(
                "{} bytes at {start:#x}, outside the {bytes} pinned bytes at {at:#x}",
                end - start
            ),
        });
    }
    Ok(())
}

/// Elements of a live buffer: an address and a length, borrowed from the buffer so the
/// buffer outlives it. Kernels read and write through views (device memory, or host
/// buffers made for it); which views a kernel may alias is the kernel's contract.
#[derive(Debug, Clone, Copy)]
pub struct View<'a, E> {
    addr: Addr,
    len: usize,
    _buf: PhantomData<&'a E>,
}

impl<'a, E: crate::elem::Act> View<'a, E> {
    /// The same elements as `U`, which must be the same element type (`E` itself: the
    /// step's generic activations seen as the concrete type a kernel takes).
    pub fn cast<U: crate::elem::Act>(self) -> Result<View<'a, U>, GpuError> {
        if E::DTYPE != U::DTYPE {
            return Err(GpuError::Shape {
                kernel: "view",
                what: format!("{:?} elements seen as {:?}", E::DTYPE, U::DTYPE),
            });
        }
        Ok(View {
            addr: self.addr,
            len: self.len,
            _buf: PhantomData,
        })
    }
}

impl<E> View<'_, E> {
    /// Elements in the view.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Its first element's address.
    pub fn addr(&self) -> Addr {
        self.addr
    }

    /// Elements `range` of this view, checked.
    pub fn slice(&self, range: Range<usize>) -> Result<Self, GpuError> {
        if range.start > range.end || range.end > self.len {
            return Err(GpuError::Shape {
                kernel: "view",
                what: format!("elements {range:?} of a view of {}", self.len),
            });
        }
        Ok(View {
            addr: self.addr + (range.start * std::mem::size_of::<E>()) as Addr,
            len: range.len(),
            _buf: PhantomData,
        })
    }
}
