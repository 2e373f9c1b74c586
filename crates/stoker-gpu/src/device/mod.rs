//! The GPU backend (`cuda` feature): buffers in device memory (cudarc), every [`Call`]
//! launched on one stream from the fatbin build.rs compiled with nvcc, embedded in the
//! binary and loaded once. Launch shapes: 256 threads a block; element kernels one
//! thread per element (grid-stride past 2^20 blocks), row kernels one warp per row,
//! warp kernels exactly their warp count. Products go through cuBLASLt (`lt`, the bias in
//! the epilogue), or cuBLAS where cuBLASLt has no algorithm for a shape or the caller
//! asks for it ([`GemmLibrary`]). Beside it: `staging` (writes through pinned
//! memory that do not wait for the stream), `transfers` (copies on copy streams of their
//! own, beside the kernels), `nccl` (the resident path's collectives on
//! device memory), `check`, `flash_check`, `gemm_check` and `replica_check` (the device check:
//! kernels, flash attention within its tolerance, the two product libraries, steps and
//! the training loop against the host build), `profile` (each launch's time).

pub mod check;
pub mod flash_check;
pub mod fp8_check;
pub mod gemm_check;
mod lt;
pub mod nccl;
mod pin;
pub mod profile;
pub mod replica_check;
mod staging;
mod transfers;

pub use pin::DevicePin;
pub use transfers::{DeviceRead, DeviceWrite};

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cublas::{sys as blas, CudaBlas};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, LaunchConfig,
    PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use crate::backend::{Backend, View};
use crate::call::{AbTypes, Addr, Arg, Call, Gemm, Grid};
use crate::elem::{Dtype, Elem};
use crate::error::GpuError;

/// kernels.cu as nvcc compiled it (SASS for sm_90, PTX for later GPUs).
static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/kernels.fatbin"));

/// Threads per block.
const BLOCK: u32 = 256;
/// Warps per block.
const WARPS_PER_BLOCK: i64 = BLOCK as i64 / 32;
/// The most blocks a grid-stride kernel gets.
const MAX_BLOCKS: i64 = 1 << 20;

fn driver(what: impl Into<String>) -> impl FnOnce(cudarc::driver::DriverError) -> GpuError {
    let what = what.into();
    move |e| GpuError::Driver {
        what,
        error: e.to_string(),
    }
}

/// Which library runs the matrix products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmLibrary {
    /// cuBLASLt, a linear layer's bias in the epilogue (llm.c's way; the default).
    CublasLt,
    /// cuBLAS's strided-batched product, the bias added by the `add_bias` kernel (the
    /// first version's way, kept to compare against).
    Cublas,
}

/// One GPU: its compute stream, where every launch goes, two copy streams beside it, and
/// stoker's kernels loaded.
pub struct Device {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    module: Arc<CudaModule>,
    functions: RefCell<HashMap<String, CudaFunction>>,
    blas: CudaBlas,
    lt: lt::Lt,
    gemm_library: Cell<GemmLibrary>,
    staging: staging::Staging,
    /// The copy streams: writes and reads that overlap the kernels.
    transfers: transfers::Transfers,
    /// Whether the stream is being captured into a graph.
    capturing: Cell<bool>,
    /// cuBLAS's workspace of its own, set before the first capture (cuBLAS would
    /// otherwise use memory of its default pool inside a graph).
    blas_workspace: std::cell::OnceCell<CudaSlice<u8>>,
    /// Events around each launch, while a profile is under way.
    profiler: profile::Profiler,
}

/// A captured graph on the device, instantiated (cudarc's, on the device's stream).
pub struct DeviceGraph(cudarc::driver::CudaGraph);

// SAFETY: CUDA allows a graph to be used from any thread as long as no two threads use it
// at once (its objects are not internally synchronized). A DeviceGraph is reached only
// through `&mut` or through a step's RefCell (`step::graphs`), which is not Sync, so a
// step moved to another thread takes its graphs along and uses them there alone; cudarc
// binds the context to the calling thread before each launch.
unsafe impl Send for DeviceGraph {}

impl Device {
    /// GPU `ordinal`, its default stream, and the kernels loaded.
    pub fn new(ordinal: usize) -> Result<Self, GpuError> {
        let ctx = CudaContext::new(ordinal).map_err(driver(format!("opening GPU {ordinal}")))?;
        // One stream and no buffer shared across streams: cudarc's per-buffer events
        // would only add work to every launch.
        // SAFETY: the flag belongs to this `CudaContext` object (other `Device`s on the same
        // primary context hold their own), and no buffer of this object exists yet.
        unsafe { ctx.disable_event_tracking() };
        // A stream of its own, not the legacy default one: CUDA captures no graph on the
        // legacy stream, and a non-blocking stream does not wait for other work on the
        // GPU (another rank's thread, candle's) through its implicit synchronization.
        let stream = ctx
            .new_stream()
            .map_err(driver(format!("making a stream on GPU {ordinal}")))?;
        let module = ctx
            .load_module(Ptx::from_binary(FATBIN.to_vec()))
            .map_err(driver("loading stoker's kernels"))?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| GpuError::Driver {
            what: "creating a cuBLAS handle".into(),
            error: e.to_string(),
        })?;
        let lt = lt::Lt::new(stream.clone())?;
        let transfers = transfers::Transfers::new(&ctx)?;
        Ok(Device {
            ctx,
            stream,
            module,
            functions: RefCell::new(HashMap::new()),
            blas,
            lt,
            gemm_library: Cell::new(GemmLibrary::CublasLt),
            staging: staging::Staging::default(),
            transfers,
            capturing: Cell::new(false),
            blas_workspace: std::cell::OnceCell::new(),
            profiler: profile::Profiler::default(),
        })
    }

    /// Runs the products through `library` from now on (the device check times both).
    pub fn set_gemm_library(&self, library: GemmLibrary) {
        self.gemm_library.set(library);
    }

    /// The library that runs the products.
    pub fn gemm_library(&self) -> GemmLibrary {
        self.gemm_library.get()
    }

    /// Product shapes cuBLASLt has planned so far, how many of them run through cuBLAS
    /// (no algorithm, or refused by cuBLASLt), and cuBLASLt's first refusal.
    pub fn gemm_plans(&self) -> (usize, usize, Option<String>) {
        self.lt.planned()
    }

    /// The GPU's name, as the driver reports it.
    pub fn name(&self) -> String {
        self.ctx
            .name()
            .unwrap_or_else(|e| format!("unknown GPU ({e})"))
    }

    /// Free device memory, as the driver reports it.
    pub fn free_bytes(&self) -> Result<usize, GpuError> {
        self.ctx
            .mem_get_info()
            .map(|(free, _)| free)
            .map_err(driver("reading free memory"))
    }

    /// Waits for every launch so far.
    pub fn synchronize(&self) -> Result<(), GpuError> {
        self.live("a synchronization")?;
        self.stream.synchronize().map_err(driver("synchronizing"))
    }

    /// The stream every launch goes to (for events and timings).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn function(&self, symbol: &str) -> Result<CudaFunction, GpuError> {
        if let Some(f) = self.functions.borrow().get(symbol) {
            return Ok(f.clone());
        }
        let f = self
            .module
            .load_function(symbol)
            .map_err(driver(format!("finding kernel {symbol}")))?;
        self.functions
            .borrow_mut()
            .insert(symbol.to_string(), f.clone());
        Ok(f)
    }
}

/// The launch shape of a grid.
fn config(grid: Grid) -> LaunchConfig {
    let blocks = match grid {
        Grid::Elements(n) => (n.max(1) + BLOCK as i64 - 1) / BLOCK as i64,
        Grid::Packs(n) => {
            let packs = (n.max(1) + crate::call::PACK - 1) / crate::call::PACK;
            (packs + BLOCK as i64 - 1) / BLOCK as i64
        }
        Grid::Rows(n) | Grid::Warps(n) => (n.max(1) + WARPS_PER_BLOCK - 1) / WARPS_PER_BLOCK,
    };
    // Warp kernels need every warp (a partial sum per warp); the others stride.
    let blocks = match grid {
        Grid::Warps(_) => blocks,
        _ => blocks.min(MAX_BLOCKS),
    };
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A device buffer and the length asked for (CUDA refuses empty allocations: an empty
/// buffer holds one unused element, and says it holds none, as the host's does).
pub struct DeviceBuf<E> {
    slice: CudaSlice<E>,
    len: usize,
}

impl Device {
    /// Starts timing each launch, product, zeroing, copy and graph replay from now on
    /// (CUDA events around each; [`profile`]).
    pub fn start_profile(&self) {
        self.profiler.start();
    }

    /// Ends the profile [`Device::start_profile`] started: each part's summed GPU time,
    /// the longest first (waits for the stream).
    pub fn take_profile(&self) -> Result<Vec<profile::MeasuredShare>, GpuError> {
        self.live("a profile's end")?;
        self.profiler.take()
    }

    /// Runs `work` timed as `part` where a profile is under way (and no capture: a
    /// graph's launches are timed as its replay).
    fn timed<R>(
        &self,
        part: profile::Part,
        work: impl FnOnce() -> Result<R, GpuError>,
    ) -> Result<R, GpuError> {
        match self.capturing.get() {
            true => work(),
            false => self.profiler.timed((&self.ctx, &self.stream), part, work),
        }
    }

    /// cuBLAS's own workspace (as large as cuBLASLt's), made and set once.
    fn ensure_blas_workspace(&self) -> Result<(), GpuError> {
        if self.blas_workspace.get().is_some() {
            return Ok(());
        }
        let bytes = lt::WORKSPACE_BYTES;
        // SAFETY: cuBLAS writes its workspace before it reads it; nothing else does.
        let buf = unsafe { self.stream.alloc::<u8>(bytes) }.map_err(driver(format!(
            "allocating cuBLAS's {bytes}-byte workspace"
        )))?;
        let ptr = {
            let (ptr, _record) = buf.device_ptr(&self.stream);
            ptr
        };
        self.bind()?;
        // SAFETY: the handle is this device's; `ptr` starts `bytes` bytes of device memory
        // that `blas_workspace` keeps alive as long as the device (and so the handle).
        let status = unsafe {
            blas::cublasSetWorkspace_v2(
                *self.blas.handle(),
                ptr as usize as *mut std::ffi::c_void,
                bytes,
            )
        };
        if status != blas::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(GpuError::Driver {
                what: "setting cuBLAS's workspace".into(),
                error: format!("{status:?}"),
            });
        }
        let _ = self.blas_workspace.set(buf);
        Ok(())
    }

    /// An error where the stream is being captured: `op` waits for the stream, copies
    /// from the host or allocates, which a graph cannot replay.
    fn live(&self, op: &str) -> Result<(), GpuError> {
        match self.capturing.get() {
            true => Err(crate::error::not_while_capturing(op)),
            false => Ok(()),
        }
    }

    /// Makes this device's context current on the calling thread (a `Device` may move
    /// between threads; cudarc's own calls do this, the raw ones below need it).
    pub(crate) fn bind(&self) -> Result<(), GpuError> {
        self.ctx
            .bind_to_thread()
            .map_err(driver("making the context current"))
    }
}

impl Backend for Device {
    type Buf<E: Elem> = DeviceBuf<E>;
    type Graph = DeviceGraph;
    type PendingWrite = DeviceWrite;
    type PendingRead = DeviceRead;
    type HostPin = DevicePin;

    unsafe fn pin_host(&self, at: Addr, bytes: usize) -> Result<DevicePin, GpuError> {
        self.live("pinning host memory")?;
        // SAFETY: the caller's contract, passed on.
        unsafe { DevicePin::new(&self.ctx, at, bytes) }
    }

    fn settle_pin(&self, pin: &DevicePin) -> Result<(), GpuError> {
        self.live("waiting for copies from pinned memory")?;
        pin.settle()
    }

    fn pin_is_direct(&self, pin: &DevicePin) -> bool {
        pin.registered()
    }

    unsafe fn start_write_from_pin<E: Elem>(
        &self,
        v: View<E>,
        pin: &DevicePin,
        data: &[E],
    ) -> Result<DeviceWrite, GpuError> {
        self.live("a write from the host")?;
        crate::error::check_len("write", "data", data.len(), v.len())?;
        self.bind()?;
        let bytes = crate::elem::as_bytes(data);
        // SAFETY: a View lies inside a live device buffer of this context and holds
        // data.len() elements (checked when it was made, and above); this function's
        // contract keeps it untouched and alive until the wait, and `data` unwritten
        // until the pin is settled.
        unsafe {
            self.transfers.start_write_from_pin(
                &self.ctx,
                &self.stream,
                (&self.staging, pin),
                v.addr(),
                bytes,
            )
        }
    }

    unsafe fn write_from_pin<E: Elem>(
        &self,
        v: View<E>,
        pin: &DevicePin,
        data: &[E],
    ) -> Result<(), GpuError> {
        self.live("a write from the host")?;
        crate::error::check_len("write", "data", data.len(), v.len())?;
        let bytes = crate::elem::as_bytes(data);
        crate::backend::check_inside_pin(pin.range(), bytes)?;
        if !pin.registered() || bytes.is_empty() {
            return self.write_staged(v, data);
        }
        self.bind()?;
        let used = pin.new_use_event()?;
        // SAFETY: a View lies inside a live device buffer of this context and holds
        // data.len() elements (checked when it was made, and above); the copy is ordered
        // on the compute stream, before every later launch that might touch the view.
        // `bytes` lies in page-locked memory (checked above) that nothing writes or frees
        // until the pin is settled, which waits for the event marked after this copy.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(v.addr(), bytes, self.stream.cu_stream())
        }
        .map_err(driver("copying up from pinned memory"))?;
        pin.mark_use(used, &self.stream)
    }

    unsafe fn start_write<E: Elem>(&self, v: View<E>, data: &[E]) -> Result<DeviceWrite, GpuError> {
        self.live("a write from the host")?;
        crate::error::check_len("write", "data", data.len(), v.len())?;
        self.bind()?;
        let bytes = crate::elem::as_bytes(data);
        // SAFETY: a View lies inside a live device buffer of this context and holds
        // data.len() elements (checked when it was made, and above); this function's
        // contract keeps it untouched and alive until the wait.
        unsafe {
            self.transfers
                .start_write(&self.ctx, &self.stream, &self.staging, v.addr(), bytes)
        }
    }

    fn wait_write(&self, write: DeviceWrite) -> Result<(), GpuError> {
        self.live("a write from the host")?;
        self.transfers.wait_write(&self.stream, write)
    }

    unsafe fn start_read<E: Elem>(&self, v: View<E>) -> Result<DeviceRead, GpuError> {
        self.live("a read back")?;
        self.bind()?;
        // SAFETY: a View lies inside a live device buffer of this context and holds
        // v.len() elements (checked when it was made); this function's contract keeps it
        // unwritten and alive until the read is finished.
        unsafe {
            self.transfers.start_read(
                &self.ctx,
                &self.stream,
                v.addr(),
                v.len() * std::mem::size_of::<E>(),
            )
        }
    }

    unsafe fn start_read_to_pin<E: Elem>(
        &self,
        v: View<E>,
        pin: &DevicePin,
        out: &mut [E],
    ) -> Result<DeviceRead, GpuError> {
        self.live("a read back")?;
        crate::error::check_len("read", "out", out.len(), v.len())?;
        self.bind()?;
        // SAFETY: `out` is a live, exclusive slice of an Elem type: plain numbers with no
        // padding, for which every bit pattern is a value, so it may be written as
        // size_of_val(out) bytes.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<u8>(), size_of_val(out))
        };
        // SAFETY: a View lies inside a live device buffer of this context and holds
        // v.len() elements (checked when it was made); this function's contract keeps it
        // unwritten and alive, and `out` untouched and alive, until the read is finished.
        unsafe {
            self.transfers
                .start_read_to_pin(&self.ctx, &self.stream, pin, v.addr(), bytes)
        }
    }

    fn finish_read<E: Elem>(
        &self,
        read: DeviceRead,
        v: View<E>,
        out: &mut [E],
    ) -> Result<(), GpuError> {
        crate::error::check_len("read", "out", out.len(), v.len())?;
        // SAFETY: `out` is a live, exclusive slice of an Elem type: plain numbers with no
        // padding, for which every bit pattern is a value, so it may be written as
        // size_of_val(out) bytes.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(
                out.as_mut_ptr().cast::<u8>(),
                std::mem::size_of_val(out),
            )
        };
        self.transfers.finish_read(read, v.addr(), bytes)
    }

    fn begin_capture(&self) -> Result<(), GpuError> {
        self.live("a capture inside a capture")?;
        // What the products allocate lazily exists before the capture: an allocation
        // inside it would become the graph's own memory.
        self.lt.ensure_workspace()?;
        self.ensure_blas_workspace()?;
        // Relaxed: the step's own checks (`live`) keep what a graph cannot hold out of
        // the capture; cuBLASLt's plans and workspace were made by an eager run before.
        self.stream
            .begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(driver("starting a graph capture"))?;
        self.capturing.set(true);
        Ok(())
    }

    fn end_capture(&self) -> Result<DeviceGraph, GpuError> {
        if !self.capturing.replace(false) {
            return Err(GpuError::Capture {
                what: "end_capture with no capture under way".into(),
            });
        }
        let graph = self
            .stream
            .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
            .map_err(driver("ending a graph capture"))?;
        graph.map(DeviceGraph).ok_or_else(|| GpuError::Capture {
            what: "the capture recorded nothing".into(),
        })
    }

    unsafe fn replay(&self, graph: &DeviceGraph) -> Result<(), GpuError> {
        self.live("a replay inside a capture")?;
        // The caller's contract keeps every captured buffer alive until the launch ends
        // (the graph is ordered on the stream like any launch).
        self.timed(profile::Part::Graph, || {
            graph.0.launch().map_err(driver("launching a graph"))
        })
    }

    fn free_memory(&self) -> Option<usize> {
        self.free_bytes().ok()
    }

    fn zeros<E: Elem>(&self, len: usize) -> Result<DeviceBuf<E>, GpuError> {
        self.live("an allocation")?;
        let slice = self
            .stream
            .alloc_zeros::<E>(len.max(1))
            .map_err(driver(format!("allocating {len} elements")))?;
        Ok(DeviceBuf { slice, len })
    }

    fn upload<E: Elem>(&self, data: &[E]) -> Result<DeviceBuf<E>, GpuError> {
        self.live("an upload")?;
        if data.is_empty() {
            return self.zeros(0);
        }
        let slice = self
            .stream
            .clone_htod(data)
            .map_err(driver(format!("copying {} elements up", data.len())))?;
        Ok(DeviceBuf {
            slice,
            len: data.len(),
        })
    }

    fn write_at<E: Elem>(&self, v: View<E>, data: &[E]) -> Result<(), GpuError> {
        self.live("a write from the host")?;
        crate::error::check_len("write", "data", data.len(), v.len())?;
        self.bind()?;
        // SAFETY: a View lies inside a live device buffer of this context (checked when
        // it was made) and holds data.len() elements; the copy is ordered on the stream
        // after every launch, and `data` outlives it (the synchronization below).
        unsafe {
            cudarc::driver::result::memcpy_htod_async(v.addr(), data, self.stream.cu_stream())
        }
        .map_err(driver(format!("copying {} elements up", data.len())))?;
        self.synchronize()
    }

    fn write_staged<E: Elem>(&self, v: View<E>, data: &[E]) -> Result<(), GpuError> {
        self.live("a staged write")?;
        crate::error::check_len("write", "data", data.len(), v.len())?;
        self.bind()?;
        let bytes = crate::elem::as_bytes(data);
        // SAFETY: a View lies inside a live device buffer of this context and holds
        // data.len() elements (checked when it was made, and above); the copy is ordered
        // on the compute stream, before every later launch that might write the view.
        unsafe { self.staging.write(&self.ctx, &self.stream, v.addr(), bytes) }
    }

    fn download<E: Elem>(&self, buf: &DeviceBuf<E>) -> Result<Vec<E>, GpuError> {
        self.live("a download")?;
        let mut all = self
            .stream
            .clone_dtoh(&buf.slice)
            .map_err(driver("copying a buffer down"))?;
        all.truncate(buf.len);
        Ok(all)
    }

    fn zero<E: Elem>(&self, v: View<E>) -> Result<(), GpuError> {
        // Nothing to enqueue (and nothing for a capture to hold: some drivers have refused
        // empty memsets inside one).
        if v.is_empty() {
            return Ok(());
        }
        self.timed(profile::Part::Device, || {
            self.bind()?;
            // SAFETY: a View lies inside a live device buffer of this context (checked when
            // it was made); the memset is ordered on the stream.
            unsafe {
                cudarc::driver::result::memset_d8_async(
                    v.addr(),
                    0,
                    v.len() * std::mem::size_of::<E>(),
                    self.stream.cu_stream(),
                )
            }
            .map_err(driver(format!("zeroing {} elements", v.len())))
        })
    }

    fn copy<E: Elem>(&self, dst: View<E>, src: View<E>) -> Result<(), GpuError> {
        crate::error::check_len("copy", "dst", dst.len(), src.len())?;
        crate::backend::check_disjoint("copy", &dst, &src)?;
        if src.is_empty() {
            return Ok(());
        }
        self.timed(profile::Part::Device, || {
            self.bind()?;
            // SAFETY: both views lie inside live device buffers of this context and hold
            // src.len() elements; the copy is ordered on the stream.
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    dst.addr(),
                    src.addr(),
                    src.len() * std::mem::size_of::<E>(),
                    self.stream.cu_stream(),
                )
            }
            .map_err(driver(format!(
                "copying {} elements on the device",
                src.len()
            )))
        })
    }

    fn read<E: Elem>(&self, v: View<E>) -> Result<Vec<E>, GpuError> {
        self.live("a read back")?;
        self.bind()?;
        let mut out = vec![E::default(); v.len()];
        // SAFETY: as in `zero`; `out` holds v.len() elements and lives until the
        // synchronization below.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(&mut out, v.addr(), self.stream.cu_stream())
        }
        .map_err(driver(format!("copying {} elements down", v.len())))?;
        self.synchronize()?;
        Ok(out)
    }

    fn read_into<E: Elem>(&self, v: View<E>, out: &mut [E]) -> Result<(), GpuError> {
        self.live("a read back")?;
        crate::error::check_len("read", "out", out.len(), v.len())?;
        self.bind()?;
        // SAFETY: as in `read`; `out` holds v.len() elements (checked) and lives until the
        // synchronization below.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(out, v.addr(), self.stream.cu_stream())
        }
        .map_err(driver(format!("copying {} elements down", v.len())))?;
        self.synchronize()
    }

    fn len<E: Elem>(buf: &DeviceBuf<E>) -> usize {
        buf.len
    }

    fn addr<E: Elem>(&self, buf: &DeviceBuf<E>) -> Addr {
        let (ptr, _sync) = buf.slice.device_ptr(&self.stream);
        ptr
    }

    unsafe fn launch(&self, call: &Call) -> Result<(), GpuError> {
        let symbol = call.symbol();
        let f = self.function(&symbol)?;
        let args = call.args();
        let mut launch = self.stream.launch_builder(&f);
        for a in &args {
            match a {
                Arg::Addr(v) => launch.arg(v),
                Arg::I64(v) => launch.arg(v),
                Arg::I32(v) => launch.arg(v),
                Arg::F32(v) => launch.arg(v),
                Arg::Heads(v) => launch.arg(v),
                Arg::AdamW(v) => launch.arg(v),
                Arg::Sgd(v) => launch.arg(v),
            };
        }
        // Timed from just before the launch: the host's lookups and arguments above are
        // not the kernel's time.
        self.timed(profile::Part::Kernel(call.name()), || {
            // SAFETY: the caller's contract (every address inside a live buffer, as the
            // shapes imply); the arguments are the kernel's parameters in order, with the
            // types kernels.inc declares (tests/kernel_list.rs holds the counts in step).
            unsafe { launch.launch(config(call.grid())) }
                .map_err(driver(format!("launching {symbol}")))?;
            Ok(())
        })
    }

    unsafe fn gemm(&self, g: &Gemm) -> Result<(), GpuError> {
        self.timed(
            match g.batch {
                1 => profile::Part::Products,
                _ => profile::Part::BatchedProducts,
            },
            || {
                self.bind()?;
                let epilogue = lt::epilogue_bias(g);
                // cuBLAS has no FP8 product: those run through cuBLASLt whatever the library.
                let fp8 = matches!(g.ab, AbTypes::Fp8 { .. });
                let done = match (self.gemm_library.get(), fp8) {
                    // SAFETY: the caller's contract; the context is current (bound above), and
                    // an epilogue bias is aligned (epilogue_bias).
                    (GemmLibrary::CublasLt, _) | (_, true) => unsafe { self.lt.gemm(g, epilogue)? },
                    (GemmLibrary::Cublas, false) => false,
                };
                if !done && fp8 {
                    let (_, _, refused) = self.lt.planned();
                    return Err(GpuError::Driver {
                        what: format!("an FP8 product {}x{}x{}", g.m, g.n, g.k),
                        error: format!(
                            "cuBLASLt has no algorithm for it or refused it, and cuBLAS has no \
                             FP8 product (the first refusal of any product so far: {})",
                            refused.as_deref().unwrap_or("none")
                        ),
                    });
                }
                if !done {
                    // SAFETY: the caller's contract.
                    unsafe { self.cublas_gemm(g)? };
                }
                match g.bias {
                    Some(bias) if !(done && epilogue.is_some()) => {
                        let call = Call::AddBias {
                            dtype: g.c_type,
                            out: g.c,
                            bias,
                            n: (g.m * g.n) as i64,
                            cols: crate::error::dim("matmul", "n", g.n)?,
                        };
                        // SAFETY: the caller's contract: with a bias, C is m dense rows of n in
                        // the bias's type, and the bias holds n elements.
                        unsafe { self.launch(&call) }
                    }
                    _ => Ok(()),
                }
            },
        )
    }
}

impl Device {
    /// The product through cuBLAS's strided-batched GEMM (no bias).
    ///
    /// # Safety
    /// As [`Backend::gemm`].
    unsafe fn cublas_gemm(&self, g: &Gemm) -> Result<(), GpuError> {
        use blas::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        let ty = |d: Dtype| match d {
            Dtype::F32 => blas::cudaDataType::CUDA_R_32F,
            Dtype::Bf16 => blas::cudaDataType::CUDA_R_16BF,
            Dtype::F16 => blas::cudaDataType::CUDA_R_16F,
        };
        let op = |t: bool| if t { CUBLAS_OP_T } else { CUBLAS_OP_N };
        let AbTypes::Act(ab) = g.ab else {
            return Err(GpuError::Shape {
                kernel: "matmul",
                what: "cuBLAS has no FP8 product".into(),
            });
        };
        let int = |x: usize| {
            i32::try_from(x).map_err(|_| GpuError::Shape {
                kernel: "matmul",
                what: format!("{x} exceeds cuBLAS's 32-bit sizes"),
            })
        };
        let (alpha, beta) = (1f32, if g.accumulate { 1f32 } else { 0f32 });
        self.bind()?;
        let stride = |s: usize| s as i64;
        // Row-major C = A B is column-major C^T = B^T A^T: cuBLAS gets B's storage first,
        // with the sizes swapped. f32 accumulation (no TF32) for every input type.
        // SAFETY: the caller's contract: every operand's extent lies in a live buffer of
        // this context; alpha and beta outlive the (stream-ordered) call's launch.
        let status = unsafe {
            blas::cublasGemmStridedBatchedEx(
                *self.blas.handle(),
                op(g.b.trans),
                op(g.a.trans),
                int(g.n)?,
                int(g.m)?,
                int(g.k)?,
                (&alpha as *const f32).cast(),
                g.b.addr as usize as *const std::ffi::c_void,
                ty(ab),
                int(g.b.ld)?,
                stride(g.strides[1]),
                g.a.addr as usize as *const std::ffi::c_void,
                ty(ab),
                int(g.a.ld)?,
                stride(g.strides[0]),
                (&beta as *const f32).cast(),
                g.c as usize as *mut std::ffi::c_void,
                ty(g.c_type),
                int(g.ldc)?,
                stride(g.strides[2]),
                int(g.batch)?,
                blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        if status != blas::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(GpuError::Driver {
                what: format!("cuBLAS product {}x{}x{} (batch {})", g.m, g.n, g.k, g.batch),
                error: format!("{status:?}"),
            });
        }
        Ok(())
    }
}
