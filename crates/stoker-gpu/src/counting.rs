//! A backend that runs nothing and counts what a step asks of a device: each kernel
//! launch with the bytes it must move, each matrix product with its FLOPs and bytes,
//! each copy, zeroing, upload and read. The step's own code runs unchanged over it, so
//! the count is the step's, not a model of it: [`crate::forecast`] turns it into a time
//! on a given GPU.
//!
//! Buffers hold no memory, only an address range of their own (so the kernels' checks
//! of lengths and overlaps run as on a device). Reads return zeros.

use std::cell::{Cell, RefCell};
use std::marker::PhantomData;

use crate::backend::{Backend, View};
use crate::call::{Addr, Call, Gemm};
use crate::elem::Elem;
use crate::error::GpuError;

/// One thing asked of the device.
#[derive(Debug, Clone, PartialEq)]
pub enum Work {
    /// A kernel launch: its name, the bytes it reads and writes at least, and what it
    /// computes on tensor cores.
    Launch {
        /// The kernel's name, whatever its element type (`layernorm_forward`).
        kernel: &'static str,
        /// Bytes read and written, each buffer counted once ([`Call::min_bytes`]).
        bytes: u64,
        /// Multiply-adds times two on tensor cores ([`Call::tensor_flops`]; 0 for a
        /// memory-bound kernel).
        flops: f64,
    },
    /// A matrix product (a batch of them).
    Product {
        /// Multiply-adds times two.
        flops: f64,
        /// Operands read, the result written (and read, where it accumulates).
        bytes: u64,
        /// Products in the batch (attention's per-head products are batches).
        batch: usize,
        /// FP8 operands (the tensor cores' FP8 rate, twice bf16's on Hopper).
        fp8: bool,
    },
    /// A copy, zeroing or write inside device memory.
    Device {
        /// Bytes written (and read, for a copy).
        bytes: u64,
    },
    /// Data from the host (the ids, staged).
    Upload {
        /// Bytes.
        bytes: u64,
    },
    /// Data read back to the host: the step waits for the device there.
    Read {
        /// Bytes.
        bytes: u64,
    },
    /// A copy between host and device on a copy stream, beside the kernels
    /// ([`Backend::start_write`], [`Backend::start_read`]).
    Transfer {
        /// Bytes.
        bytes: u64,
        /// Up to the device (a write), or down from it (a read): each way has its own
        /// stream, and the link carries both at once.
        up: bool,
    },
}

/// The counting backend.
#[derive(Debug)]
pub struct CountingBackend {
    next: Cell<Addr>,
    work: RefCell<Vec<Work>>,
    /// Where the capture under way began in `work`.
    capture_from: Cell<Option<usize>>,
}

/// A buffer's address range, and no memory.
#[derive(Debug)]
pub struct CountedBuf<E> {
    addr: Addr,
    len: usize,
    _elem: PhantomData<E>,
}

/// Where the first buffer's addresses start (nonzero: a zero address means "none" to
/// the kernels).
const FIRST_ADDR: Addr = 1 << 20;

impl Default for CountingBackend {
    fn default() -> Self {
        CountingBackend {
            next: Cell::new(FIRST_ADDR),
            work: RefCell::new(Vec::new()),
            capture_from: Cell::new(None),
        }
    }
}

impl CountingBackend {
    /// A backend with nothing counted.
    pub fn new() -> Self {
        Self::default()
    }

    /// What was asked since the last call (or since it was made), emptied.
    pub fn take(&self) -> Vec<Work> {
        std::mem::take(&mut self.work.borrow_mut())
    }

    fn push(&self, w: Work) {
        self.work.borrow_mut().push(w);
    }

    /// An error where a capture is under way: `op` cannot be part of a graph.
    fn live(&self, op: &str) -> Result<(), GpuError> {
        match self.capture_from.get() {
            Some(_) => Err(crate::error::not_while_capturing(op)),
            None => Ok(()),
        }
    }

    fn alloc<E: Elem>(&self, len: usize) -> CountedBuf<E> {
        let addr = self.next.get();
        let bytes = (len.max(1) * std::mem::size_of::<E>()) as Addr;
        // 256-byte aligned, as cudaMalloc's.
        self.next.set((addr + bytes).div_ceil(256) * 256);
        CountedBuf {
            addr,
            len,
            _elem: PhantomData,
        }
    }
}

fn bytes_of<E>(v: &View<E>) -> u64 {
    (v.len() * std::mem::size_of::<E>()) as u64
}

impl Backend for CountingBackend {
    type Buf<E: Elem> = CountedBuf<E>;
    /// What the capture counted; a replay counts it again.
    type Graph = Vec<Work>;
    /// Counted when it starts.
    type PendingWrite = ();
    /// Counted when it starts; its elements are zeros.
    type PendingRead = ();
    /// Nothing to pin: the counted buffers hold no memory.
    type HostPin = ();

    unsafe fn pin_host(&self, _at: Addr, _bytes: usize) -> Result<(), GpuError> {
        Ok(())
    }

    fn settle_pin(&self, _pin: &()) -> Result<(), GpuError> {
        Ok(())
    }

    fn pin_is_direct(&self, _pin: &()) -> bool {
        true
    }

    unsafe fn start_write_from_pin<E: Elem>(
        &self,
        v: View<E>,
        _pin: &(),
        data: &[E],
    ) -> Result<(), GpuError> {
        // SAFETY: nothing is written; the counted copy is the same as start_write's.
        unsafe { self.start_write(v, data) }
    }

    unsafe fn write_from_pin<E: Elem>(
        &self,
        v: View<E>,
        _pin: &(),
        data: &[E],
    ) -> Result<(), GpuError> {
        self.write_staged(v, data)
    }

    unsafe fn start_write<E: Elem>(&self, v: View<E>, data: &[E]) -> Result<(), GpuError> {
        self.live("a write from the host")?;
        crate::error::check_len("write", "data", data.len(), v.len())?;
        self.push(Work::Transfer {
            bytes: bytes_of(&v),
            up: true,
        });
        Ok(())
    }

    fn wait_write(&self, _write: ()) -> Result<(), GpuError> {
        Ok(())
    }

    unsafe fn start_read<E: Elem>(&self, v: View<E>) -> Result<(), GpuError> {
        self.live("a read back")?;
        self.push(Work::Transfer {
            bytes: bytes_of(&v),
            up: false,
        });
        Ok(())
    }

    unsafe fn start_read_to_pin<E: Elem>(
        &self,
        v: View<E>,
        _pin: &(),
        out: &mut [E],
    ) -> Result<(), GpuError> {
        crate::error::check_len("read", "out", out.len(), v.len())?;
        // SAFETY: nothing is read; the counted copy is the same as start_read's.
        unsafe { self.start_read(v) }
    }

    fn finish_read<E: Elem>(&self, _read: (), v: View<E>, out: &mut [E]) -> Result<(), GpuError> {
        crate::error::check_len("read", "out", out.len(), v.len())?;
        out.fill(E::default());
        Ok(())
    }

    fn begin_capture(&self) -> Result<(), GpuError> {
        self.live("a capture inside a capture")?;
        self.capture_from.set(Some(self.work.borrow().len()));
        Ok(())
    }

    fn end_capture(&self) -> Result<Vec<Work>, GpuError> {
        let from = self.capture_from.take().ok_or_else(|| GpuError::Capture {
            what: "end_capture with no capture under way".into(),
        })?;
        Ok(self.work.borrow_mut().split_off(from))
    }

    unsafe fn replay(&self, graph: &Vec<Work>) -> Result<(), GpuError> {
        self.live("a replay inside a capture")?;
        self.work.borrow_mut().extend_from_slice(graph);
        Ok(())
    }

    fn zeros<E: Elem>(&self, len: usize) -> Result<CountedBuf<E>, GpuError> {
        self.live("an allocation")?;
        Ok(self.alloc(len))
    }

    fn upload<E: Elem>(&self, data: &[E]) -> Result<CountedBuf<E>, GpuError> {
        self.live("an upload")?;
        Ok(self.alloc(data.len()))
    }

    fn write_at<E: Elem>(&self, v: View<E>, data: &[E]) -> Result<(), GpuError> {
        self.live("a write from the host")?;
        crate::error::check_len("write", "data", data.len(), v.len())?;
        self.push(Work::Upload {
            bytes: bytes_of(&v),
        });
        Ok(())
    }

    fn download<E: Elem>(&self, buf: &CountedBuf<E>) -> Result<Vec<E>, GpuError> {
        self.read(self.all(buf))
    }

    fn len<E: Elem>(buf: &CountedBuf<E>) -> usize {
        buf.len
    }

    fn addr<E: Elem>(&self, buf: &CountedBuf<E>) -> Addr {
        buf.addr
    }

    fn zero<E: Elem>(&self, v: View<E>) -> Result<(), GpuError> {
        self.push(Work::Device {
            bytes: bytes_of(&v),
        });
        Ok(())
    }

    fn copy<E: Elem>(&self, dst: View<E>, src: View<E>) -> Result<(), GpuError> {
        crate::error::check_len("copy", "dst", dst.len(), src.len())?;
        crate::backend::check_disjoint("copy", &dst, &src)?;
        self.push(Work::Device {
            bytes: 2 * bytes_of(&src),
        });
        Ok(())
    }

    fn read<E: Elem>(&self, v: View<E>) -> Result<Vec<E>, GpuError> {
        self.live("a read back")?;
        self.push(Work::Read {
            bytes: bytes_of(&v),
        });
        Ok(vec![E::default(); v.len()])
    }

    unsafe fn launch(&self, call: &Call) -> Result<(), GpuError> {
        self.push(Work::Launch {
            kernel: call.name(),
            bytes: call.min_bytes(),
            flops: call.tensor_flops(),
        });
        Ok(())
    }

    unsafe fn gemm(&self, g: &Gemm) -> Result<(), GpuError> {
        let (m, n, k, batch) = (g.m as u64, g.n as u64, g.k as u64, g.batch as u64);
        let [a, b] = g.ab.bytes().map(|x| x as u64);
        let c = g.c_type.bytes() as u64;
        let c_passes = if g.accumulate { 2 } else { 1 };
        let bias = g.bias.map_or(0, |_| n * c);
        self.push(Work::Product {
            flops: 2.0 * (m * n * k * batch) as f64,
            bytes: batch * (m * k * a + k * n * b + c_passes * m * n * c) + bias,
            batch: g.batch,
            fp8: matches!(g.ab, crate::call::AbTypes::Fp8 { .. }),
        });
        Ok(())
    }
}
