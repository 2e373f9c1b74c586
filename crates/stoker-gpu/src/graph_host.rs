//! The host backend that also captures graphs: [`Host`]'s buffers and kernels, and
//! between [`Backend::begin_capture`] and [`Backend::end_capture`] every launch, product,
//! zeroing and copy recorded with its arguments as they are then, to be replayed later
//! as a CUDA graph replays. What a graph cannot hold (a read back, a write from the
//! host, an allocation) is refused while capturing, as the device refuses it. So a step
//! that replays its captured micro-batch here reproduces the eager run's bits only if
//! nothing it launches depends on the host's state at launch time: the tests check
//! exactly that on the CPU.

use std::cell::RefCell;

use crate::backend::{Backend, View};
use crate::call::{Addr, Call, Gemm};
use crate::elem::Elem;
use crate::error::{not_while_capturing, GpuError};
use crate::host::{Host, HostBuf, HostPin, HostRead, HostWrite};

/// One recorded piece of work: raw addresses and byte counts, so a graph holds no
/// borrow of the buffers it touches (the device's graphs hold device pointers alike).
#[derive(Debug, Clone, Copy)]
enum HostOp {
    Launch(Call),
    Gemm(Gemm),
    Zero { at: Addr, bytes: usize },
    Copy { dst: Addr, src: Addr, bytes: usize },
}

/// A captured graph of the host backend.
#[derive(Debug, Default)]
pub struct HostGraph {
    ops: Vec<HostOp>,
}

impl HostGraph {
    /// Pieces of work recorded.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }
}

/// [`Host`] with a recorder.
#[derive(Debug, Default)]
pub struct GraphHost {
    recording: RefCell<Option<Vec<HostOp>>>,
}

impl GraphHost {
    /// A backend capturing nothing yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// An error where a capture is under way: `op` cannot be part of a graph.
    fn live(&self, op: &str) -> Result<(), GpuError> {
        match self.recording.borrow().is_some() {
            true => Err(not_while_capturing(op)),
            false => Ok(()),
        }
    }

    /// Records `op` and returns true where a capture is under way.
    fn recorded(&self, op: HostOp) -> bool {
        match self.recording.borrow_mut().as_mut() {
            Some(ops) => {
                ops.push(op);
                true
            }
            None => false,
        }
    }

    /// Runs one recorded piece of work.
    ///
    /// # Safety
    /// Every address in `op` lies in a live host buffer with the elements (or bytes) it
    /// names.
    unsafe fn run(op: &HostOp) -> Result<(), GpuError> {
        match *op {
            // SAFETY: the caller's contract, as Host::launch and Host::gemm state it.
            HostOp::Launch(call) => unsafe { Host.launch(&call) },
            // SAFETY: likewise.
            HostOp::Gemm(g) => unsafe { Host.gemm(&g) },
            HostOp::Zero { at, bytes } => {
                // SAFETY: the caller's contract: `at` starts `bytes` bytes of a live host
                // buffer (a view's, checked when it was recorded), whose cells may be
                // written; all-zero bits are zero for every element type.
                unsafe { std::ptr::write_bytes(at as usize as *mut u8, 0, bytes) };
                Ok(())
            }
            HostOp::Copy { dst, src, bytes } => {
                // SAFETY: the caller's contract: both start `bytes` bytes of live host
                // buffers, which do not overlap (checked when it was recorded).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        src as usize as *const u8,
                        dst as usize as *mut u8,
                        bytes,
                    )
                };
                Ok(())
            }
        }
    }
}

impl Backend for GraphHost {
    type Buf<E: Elem> = HostBuf<E>;
    type Graph = HostGraph;
    type PendingWrite = HostWrite;
    type PendingRead = HostRead;
    type HostPin = HostPin;

    unsafe fn pin_host(&self, at: Addr, bytes: usize) -> Result<HostPin, GpuError> {
        // SAFETY: the caller's contract, passed on.
        unsafe { Host.pin_host(at, bytes) }
    }

    fn settle_pin(&self, pin: &HostPin) -> Result<(), GpuError> {
        Host.settle_pin(pin)
    }

    fn pin_is_direct(&self, pin: &HostPin) -> bool {
        Host.pin_is_direct(pin)
    }

    unsafe fn start_write_from_pin<E: Elem>(
        &self,
        v: View<E>,
        pin: &HostPin,
        data: &[E],
    ) -> Result<HostWrite, GpuError> {
        self.live("a write from the host")?;
        // SAFETY: the caller's contract, passed on.
        unsafe { Host.start_write_from_pin(v, pin, data) }
    }

    unsafe fn write_from_pin<E: Elem>(
        &self,
        v: View<E>,
        pin: &HostPin,
        data: &[E],
    ) -> Result<(), GpuError> {
        self.live("a write from the host")?;
        // SAFETY: the caller's contract, passed on.
        unsafe { Host.write_from_pin(v, pin, data) }
    }

    unsafe fn start_write<E: Elem>(&self, v: View<E>, data: &[E]) -> Result<HostWrite, GpuError> {
        self.live("a write from the host")?;
        // SAFETY: the caller's contract, passed on.
        unsafe { Host.start_write(v, data) }
    }

    fn wait_write(&self, write: HostWrite) -> Result<(), GpuError> {
        self.live("a write from the host")?;
        Host.wait_write(write)
    }

    unsafe fn start_read<E: Elem>(&self, v: View<E>) -> Result<HostRead, GpuError> {
        self.live("a read back")?;
        // SAFETY: the caller's contract, passed on.
        unsafe { Host.start_read(v) }
    }

    unsafe fn start_read_to_pin<E: Elem>(
        &self,
        v: View<E>,
        pin: &HostPin,
        out: &mut [E],
    ) -> Result<HostRead, GpuError> {
        self.live("a read back")?;
        // SAFETY: the caller's contract, passed on.
        unsafe { Host.start_read_to_pin(v, pin, out) }
    }

    fn finish_read<E: Elem>(
        &self,
        read: HostRead,
        v: View<E>,
        out: &mut [E],
    ) -> Result<(), GpuError> {
        self.live("a read back")?;
        Host.finish_read(read, v, out)
    }

    fn zeros<E: Elem>(&self, len: usize) -> Result<HostBuf<E>, GpuError> {
        self.live("an allocation")?;
        Host.zeros(len)
    }

    fn upload<E: Elem>(&self, data: &[E]) -> Result<HostBuf<E>, GpuError> {
        self.live("an upload")?;
        Host.upload(data)
    }

    fn write_at<E: Elem>(&self, v: View<E>, data: &[E]) -> Result<(), GpuError> {
        self.live("a write from the host")?;
        Host.write_at(v, data)
    }

    fn download<E: Elem>(&self, buf: &HostBuf<E>) -> Result<Vec<E>, GpuError> {
        self.live("a download")?;
        Host.download(buf)
    }

    fn len<E: Elem>(buf: &HostBuf<E>) -> usize {
        Host::len(buf)
    }

    fn addr<E: Elem>(&self, buf: &HostBuf<E>) -> Addr {
        Host.addr(buf)
    }

    fn zero<E: Elem>(&self, v: View<E>) -> Result<(), GpuError> {
        let op = HostOp::Zero {
            at: v.addr(),
            bytes: v.len() * std::mem::size_of::<E>(),
        };
        match self.recorded(op) {
            true => Ok(()),
            false => Host.zero(v),
        }
    }

    fn copy<E: Elem>(&self, dst: View<E>, src: View<E>) -> Result<(), GpuError> {
        crate::error::check_len("copy", "dst", dst.len(), src.len())?;
        crate::backend::check_disjoint("copy", &dst, &src)?;
        let op = HostOp::Copy {
            dst: dst.addr(),
            src: src.addr(),
            bytes: src.len() * std::mem::size_of::<E>(),
        };
        match self.recorded(op) {
            true => Ok(()),
            false => Host.copy(dst, src),
        }
    }

    fn read<E: Elem>(&self, v: View<E>) -> Result<Vec<E>, GpuError> {
        self.live("a read back")?;
        Host.read(v)
    }

    fn read_into<E: Elem>(&self, v: View<E>, out: &mut [E]) -> Result<(), GpuError> {
        self.live("a read back")?;
        Host.read_into(v, out)
    }

    fn begin_capture(&self) -> Result<(), GpuError> {
        self.live("a capture inside a capture")?;
        *self.recording.borrow_mut() = Some(Vec::new());
        Ok(())
    }

    fn end_capture(&self) -> Result<HostGraph, GpuError> {
        let ops = self.recording.borrow_mut().take();
        let ops = ops.ok_or_else(|| GpuError::Capture {
            what: "end_capture with no capture under way".into(),
        })?;
        Ok(HostGraph { ops })
    }

    unsafe fn replay(&self, graph: &HostGraph) -> Result<(), GpuError> {
        self.live("a replay inside a capture")?;
        for op in &graph.ops {
            // SAFETY: the caller's contract: every buffer the capture touched is alive,
            // and each op's addresses were checked against its views when recorded.
            unsafe { Self::run(op)? };
        }
        Ok(())
    }

    unsafe fn launch(&self, call: &Call) -> Result<(), GpuError> {
        match self.recorded(HostOp::Launch(*call)) {
            true => Ok(()),
            // SAFETY: the caller's contract.
            false => unsafe { Host.launch(call) },
        }
    }

    unsafe fn gemm(&self, g: &Gemm) -> Result<(), GpuError> {
        match self.recorded(HostOp::Gemm(*g)) {
            true => Ok(()),
            // SAFETY: the caller's contract.
            false => unsafe { Host.gemm(g) },
        }
    }
}
