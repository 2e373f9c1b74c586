//! NCCL on device memory (feature `cuda`): the collectives of [`Collectives`] on the
//! device backend's own buffers, ordered on its compute stream (or, for those started
//! beside the backward, on NCCL's own stream after an event), with no copy through the host
//! (the chapter's NCCL all-reduce, and ZeRO's reduce-scatter and all-gather). Ranks join
//! as llm.c's do: rank 0 makes NCCL's unique id, any host [`Communicator`] (MPI in a job,
//! or a one-rank `NullComm`) carries it to the others, each calls `ncclCommInitRank` on
//! its own GPU. NCCL's reduce-scatter and all-gather need equal pieces; uneven pieces
//! (ZeRO's last shard) run as one group of per-rank reduces or broadcasts instead, in
//! place. Compiled by the cuda check; run only where a GPU is lent.

use std::cell::{Cell, RefCell};

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr};
use cudarc::nccl::{result, sys};
use stoker_comm::{CommExt, Communicator};

use super::Device;
use crate::backend::View;
use crate::collectives::{check_scalars, piece, Collectives, Mark, MAX_SCALARS};
use crate::elem::{Act, Dtype};
use crate::error::GpuError;

/// One rank's NCCL communicator on a [`Device`]: it holds the device's compute stream
/// (shared, not borrowed: a training loop owns the device and its communicator side by
/// side), and orders every collective on it.
pub struct DeviceNccl {
    /// The compute stream of the device it joined on.
    compute: Arc<CudaStream>,
    comm: sys::ncclComm_t,
    rank: usize,
    world: usize,
    /// [`MAX_SCALARS`] f64 on the device: the scalar sums' buffer, made once.
    scalar: RefCell<CudaSlice<f64>>,
    /// The stream DDP's buckets reduce on, beside the compute stream (both non-blocking:
    /// neither waits for the other but through the events below).
    comm_stream: Arc<CudaStream>,
    /// Recorded on the compute stream before a bucket starts; the comm stream waits it.
    ready: CudaEvent,
    /// Recorded on the comm stream at `finish`; the compute stream waits it.
    done: CudaEvent,
    /// [`Collectives::mark`]'s events, used in turn: mark `k` is recorded on event
    /// `k % MARKS` (a wait for an older mark, whose event was recorded again since, waits
    /// for more than it needs: safe).
    marks: Vec<CudaEvent>,
    /// Marks made so far.
    marked: Cell<u64>,
}

/// Marks a rank keeps apart ([`DeviceNccl::marks`]): ZeRO's windows hold two at a time.
const MARKS: usize = 4;

fn nccl_err(what: impl Into<String>) -> impl FnOnce(result::NcclError) -> GpuError {
    let what = what.into();
    // NcclError's Debug prints only its name; the result code is in `.0`.
    move |e| GpuError::Driver {
        what,
        error: format!("{:?}", e.0),
    }
}

fn nccl_type(d: Dtype) -> sys::ncclDataType_t {
    match d {
        Dtype::F32 => sys::ncclDataType_t::ncclFloat32,
        Dtype::Bf16 => sys::ncclDataType_t::ncclBfloat16,
        Dtype::F16 => sys::ncclDataType_t::ncclFloat16,
    }
}

/// `x` as a raw device pointer NCCL takes.
/// What an in-place all-reduce of an f32 view computes.
#[derive(Debug, Clone, Copy)]
enum InPlace {
    /// The sum (gradients).
    Sum,
    /// The largest of amaxes, over their bits as u32.
    MaxOfAmaxes,
}

fn ptr<E>(v: &View<E>, at: usize) -> *mut std::ffi::c_void {
    (v.addr() + (at * std::mem::size_of::<E>()) as u64) as usize as *mut std::ffi::c_void
}

impl DeviceNccl {
    /// Joins every rank of `host` (rank 0 makes the id, `host` broadcasts it) in an
    /// NCCL communicator on `dev`.
    pub fn join(dev: &Device, host: &(impl Communicator + ?Sized)) -> Result<Self, GpuError> {
        let (rank, world) = (host.rank(), host.world_size());
        // Words 0..16 carry rank 0's id, word 16 whether it made one: no rank waits for
        // an id that is never coming.
        let mut words = [0u64; 17];
        let mut why = None;
        if rank == 0 {
            match result::get_uniqueid() {
                Ok(id) => {
                    for (w, c) in words.iter_mut().zip(id.internal.chunks(8)) {
                        *w = u64::from_le_bytes(std::array::from_fn(|i| c[i] as u8));
                    }
                    words[16] = 1;
                }
                Err(e) => why = Some(format!("{:?}", e.0)),
            }
        }
        host.broadcast(&mut words, 0)
            .map_err(|e| GpuError::Driver {
                what: format!(
                    "broadcasting NCCL's id over {world} ranks ({})",
                    host.backend()
                ),
                error: e.to_string(),
            })?;
        if words[16] != 1 {
            return Err(GpuError::Driver {
                what: format!("making NCCL's unique id on rank 0 of {world}"),
                error: why.unwrap_or_else(|| "rank 0 could not".into()),
            });
        }
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        for (i, w) in words[..16].iter().enumerate() {
            for (j, b) in w.to_le_bytes().into_iter().enumerate() {
                id.internal[i * 8 + j] = b as std::ffi::c_char;
            }
        }
        // Before the communicator, so that nothing fails between its making and its owner.
        let scalar =
            dev.stream()
                .alloc_zeros::<f64>(MAX_SCALARS)
                .map_err(|e| GpuError::Driver {
                    what: "allocating NCCL's scalar".into(),
                    error: e.to_string(),
                })?;
        let ctx = dev.stream().context().clone();
        let comm_stream = ctx.new_stream().map_err(|e| GpuError::Driver {
            what: "making NCCL's stream".into(),
            error: e.to_string(),
        })?;
        let event = || {
            ctx.new_event(None).map_err(|e| GpuError::Driver {
                what: "making an event".into(),
                error: e.to_string(),
            })
        };
        let (ready, done) = (event()?, event()?);
        let marks = (0..MARKS).map(|_| event()).collect::<Result<Vec<_>, _>>()?;
        dev.bind()?;
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is a valid place for the handle; the id is the one every rank
        // got from rank 0; this thread's context is `dev`'s (bound above).
        unsafe { result::comm_init_rank(&mut comm, world as i32, id, rank as i32) }.map_err(
            nccl_err(format!("ncclCommInitRank, rank {rank} of {world}")),
        )?;
        Ok(DeviceNccl {
            compute: dev.stream().clone(),
            comm,
            rank,
            world,
            scalar: RefCell::new(scalar),
            comm_stream,
            ready,
            done,
            marks,
            marked: Cell::new(0),
        })
    }

    /// `be` is the device this communicator joined on: its stream is the one the
    /// collectives are ordered on.
    fn check_device(&self, be: &Device) -> Result<(), GpuError> {
        match Arc::ptr_eq(be.stream(), &self.compute) {
            true => be.bind(),
            false => Err(GpuError::Shape {
                kernel: "nccl",
                what: "a collective on another device than the communicator's".into(),
            }),
        }
    }

    fn stream(&self) -> sys::cudaStream_t {
        self.compute.cu_stream() as sys::cudaStream_t
    }

    /// The stream the collectives started beside the compute run on.
    fn comm_stream(&self) -> sys::cudaStream_t {
        self.comm_stream.cu_stream() as sys::cudaStream_t
    }

    /// `op(root, at, n)` for every rank's non-empty piece (`n` elements from `at`, rank
    /// order) between NCCL's group calls, so that they run as one operation.
    fn per_piece(
        &self,
        what: &str,
        counts: &[usize],
        mut op: impl FnMut(usize, usize, usize) -> Result<result::NcclStatus, result::NcclError>,
    ) -> Result<(), GpuError> {
        result::group_start().map_err(nccl_err(format!("{what}: ncclGroupStart")))?;
        let mut at = 0;
        let mut r = Ok(());
        for (root, &n) in counts.iter().enumerate() {
            if n > 0 && r.is_ok() {
                r = op(root, at, n)
                    .map(drop)
                    .map_err(nccl_err(format!("{what}: piece {root}")));
            }
            at += n;
        }
        result::group_end().map_err(nccl_err(format!("{what}: ncclGroupEnd")))?;
        r
    }

    /// [`Collectives::all_reduce`] of `buf` (`InPlace::Sum`) or
    /// [`Collectives::max_of_amaxes`] (`InPlace::MaxOfAmaxes`), in place, enqueued on
    /// `stream`.
    ///
    /// # Safety
    /// `buf` is a view of a live buffer of this communicator's device that nothing
    /// writes until the work on `stream` so far has finished, or a stream waiting for it
    /// says so.
    unsafe fn all_reduce_on(
        &self,
        buf: View<f32>,
        op: InPlace,
        stream: sys::cudaStream_t,
    ) -> Result<(), GpuError> {
        let (dtype, nccl_op, what) = match op {
            InPlace::Sum => (
                sys::ncclDataType_t::ncclFloat32,
                sys::ncclRedOp_t::ncclSum,
                format!("all-reducing {} gradients", buf.len()),
            ),
            // Amaxes are >= 0 or NaN, whose bits order as u32 do (NaN above +inf): NCCL's
            // max over u32 is their max with a NaN kept (its max over floats may drop one).
            InPlace::MaxOfAmaxes => (
                sys::ncclDataType_t::ncclUint32,
                sys::ncclRedOp_t::ncclMax,
                format!("taking the largest of {} amaxes", buf.len()),
            ),
        };
        // SAFETY: the caller's contract; in place, `buf.len()` 32-bit values on this
        // device (f32, or their bits as u32).
        unsafe {
            result::all_reduce(
                ptr(&buf, 0),
                ptr(&buf, 0),
                buf.len(),
                dtype,
                nccl_op,
                self.comm,
                stream,
            )
        }
        .map(drop)
        .map_err(nccl_err(what))
    }

    /// [`Collectives::reduce_scatter`] enqueued on `stream`.
    ///
    /// # Safety
    /// `input` and `out` are views of live buffers of this communicator's device that
    /// nothing writes (`out`: touches) until the work on `stream` so far has finished, or
    /// until a stream waiting for it says so.
    unsafe fn reduce_scatter_on(
        &self,
        input: View<f32>,
        counts: &[usize],
        out: View<f32>,
        stream: sys::cudaStream_t,
    ) -> Result<(), GpuError> {
        let (_, mine) = piece("reduce-scatter", counts, self.world, self.rank, input.len())?;
        crate::error::check_len("reduce-scatter", "out", out.len(), mine)?;
        crate::backend::check_disjoint("reduce-scatter", &input, &out)?;
        let what = format!("reduce-scattering {} gradients", input.len());
        let f32 = sys::ncclDataType_t::ncclFloat32;
        if counts.iter().all(|&c| c == counts[0]) {
            // SAFETY: input holds world x counts[0] elements, out counts[0], both in
            // live buffers of the device, disjoint (checked); ordered on `stream`.
            return unsafe {
                result::reduce_scatter(
                    ptr(&input, 0),
                    ptr(&out, 0),
                    mine,
                    f32,
                    sys::ncclRedOp_t::ncclSum,
                    self.comm,
                    stream,
                )
            }
            .map(drop)
            .map_err(nccl_err(what));
        }
        self.per_piece(&what, counts, |root, at, n| {
            // SAFETY: piece `root` is input[at..at + n] (the counts add up to its length,
            // checked); only the root writes its `out`, which holds n (its `mine`).
            unsafe {
                result::reduce(
                    ptr(&input, at),
                    ptr(&out, 0),
                    n,
                    f32,
                    sys::ncclRedOp_t::ncclSum,
                    root as i32,
                    self.comm,
                    stream,
                )
            }
        })
    }

    /// [`Collectives::all_gather`] enqueued on `stream`.
    ///
    /// # Safety
    /// `buf` is a view of a live buffer of this communicator's device that nothing
    /// touches until the work on `stream` so far has finished, or until a stream waiting
    /// for it says so.
    unsafe fn all_gather_on<E: Act>(
        &self,
        buf: View<E>,
        counts: &[usize],
        stream: sys::cudaStream_t,
    ) -> Result<(), GpuError> {
        let (at, mine) = piece("all-gather", counts, self.world, self.rank, buf.len())?;
        let what = format!("all-gathering {} parameters", buf.len());
        let ty = nccl_type(E::DTYPE);
        if counts.iter().all(|&c| c == counts[0]) {
            // SAFETY: in place (NCCL's rule: this rank's piece at rank x count of the
            // output); buf holds world x count elements of a live buffer of `be`.
            return unsafe {
                result::all_gather(ptr(&buf, at), ptr(&buf, 0), mine, ty, self.comm, stream)
            }
            .map(drop)
            .map_err(nccl_err(what));
        }
        self.per_piece(&what, counts, |root, at, n| {
            // SAFETY: piece `root` is buf[at..at + n] (the counts add up to its length,
            // checked), broadcast in place from its owner.
            unsafe {
                result::broadcast(
                    ptr(&buf, at),
                    ptr(&buf, at),
                    n,
                    ty,
                    root as i32,
                    self.comm,
                    stream,
                )
            }
        })
    }

    /// Orders the comm stream after every launch on `be`'s compute stream so far.
    fn after_compute(&self, be: &Device) -> Result<(), GpuError> {
        let driver = |what: &'static str| {
            move |e: cudarc::driver::DriverError| GpuError::Driver {
                what: what.into(),
                error: e.to_string(),
            }
        };
        self.ready
            .record(be.stream())
            .map_err(driver("recording a bucket's event"))?;
        self.comm_stream
            .wait(&self.ready)
            .map_err(driver("ordering a bucket after its backward"))
    }
}

impl Drop for DeviceNccl {
    fn drop(&mut self) {
        // SAFETY: the handle came from ncclCommInitRank and is destroyed once, here,
        // after every call on it has finished (both its streams synchronized first).
        let _ = self.compute.context().bind_to_thread();
        let _ = self.compute.synchronize();
        let _ = self.comm_stream.synchronize();
        let _ = unsafe { result::comm_destroy(self.comm) };
    }
}

impl Collectives<Device> for DeviceNccl {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce(&self, be: &Device, buf: View<f32>) -> Result<(), GpuError> {
        self.check_device(be)?;
        // SAFETY: on the compute stream, where every later launch waits for it.
        unsafe { self.all_reduce_on(buf, InPlace::Sum, self.stream()) }
    }

    fn max_of_amaxes(&self, be: &Device, buf: View<f32>) -> Result<(), GpuError> {
        self.check_device(be)?;
        // SAFETY: on the compute stream, where every later launch waits for it.
        unsafe { self.all_reduce_on(buf, InPlace::MaxOfAmaxes, self.stream()) }
    }

    unsafe fn start_all_reduce(&self, be: &Device, buf: View<f32>) -> Result<(), GpuError> {
        self.check_device(be)?;
        self.after_compute(be)?;
        // SAFETY: the caller's contract keeps `buf` alive and unwritten until `finish`
        // orders the compute stream after the comm stream.
        unsafe { self.all_reduce_on(buf, InPlace::Sum, self.comm_stream()) }
    }

    unsafe fn start_reduce_scatter(
        &self,
        be: &Device,
        input: View<f32>,
        counts: &[usize],
        out: View<f32>,
    ) -> Result<(), GpuError> {
        self.check_device(be)?;
        self.after_compute(be)?;
        // SAFETY: the caller's contract keeps `input` unwritten and `out` untouched, both
        // alive, until `finish` orders the compute stream after the comm stream.
        unsafe { self.reduce_scatter_on(input, counts, out, self.comm_stream()) }
    }

    fn finish(&self, be: &Device) -> Result<(), GpuError> {
        self.check_device(be)?;
        let err = |e: cudarc::driver::DriverError| GpuError::Driver {
            what: "ordering the compute stream after the buckets".into(),
            error: e.to_string(),
        };
        self.done.record(&self.comm_stream).map_err(err)?;
        be.stream().wait(&self.done).map_err(err)
    }

    fn reduce_scatter(
        &self,
        be: &Device,
        input: View<f32>,
        counts: &[usize],
        out: View<f32>,
    ) -> Result<(), GpuError> {
        self.check_device(be)?;
        // SAFETY: on the compute stream, where every later launch waits for it.
        unsafe { self.reduce_scatter_on(input, counts, out, self.stream()) }
    }

    fn all_gather<E: Act>(
        &self,
        be: &Device,
        buf: View<E>,
        counts: &[usize],
    ) -> Result<(), GpuError> {
        self.check_device(be)?;
        // SAFETY: on the compute stream, where every later launch waits for it.
        unsafe { self.all_gather_on(buf, counts, self.stream()) }
    }

    unsafe fn start_all_gather<E: Act>(
        &self,
        be: &Device,
        buf: View<E>,
        counts: &[usize],
    ) -> Result<(), GpuError> {
        self.check_device(be)?;
        self.after_compute(be)?;
        // SAFETY: the caller's contract keeps `buf` untouched and alive until a wait
        // orders the compute stream after the comm stream.
        unsafe { self.all_gather_on(buf, counts, self.comm_stream()) }
    }

    fn mark(&self, be: &Device) -> Result<Mark, GpuError> {
        self.check_device(be)?;
        let k = self.marked.get();
        self.marks[k as usize % MARKS]
            .record(&self.comm_stream)
            .map_err(|e| GpuError::Driver {
                what: "marking the collectives started".into(),
                error: e.to_string(),
            })?;
        self.marked.set(k + 1);
        Ok(Mark(k))
    }

    fn wait(&self, be: &Device, mark: Mark) -> Result<(), GpuError> {
        self.check_device(be)?;
        if mark.0 >= self.marked.get() {
            return Err(GpuError::Shape {
                kernel: "nccl",
                what: format!("a wait for mark {} of {} made", mark.0, self.marked.get()),
            });
        }
        be.stream()
            .wait(&self.marks[mark.0 as usize % MARKS])
            .map_err(|e| GpuError::Driver {
                what: "ordering the compute stream after a mark".into(),
                error: e.to_string(),
            })
    }

    fn sum(&self, be: &Device, xs: &[f64]) -> Result<Vec<f64>, GpuError> {
        check_scalars(xs)?;
        if xs.is_empty() {
            return Ok(Vec::new());
        }
        self.check_device(be)?;
        let stream = be.stream();
        let copy = |what: &'static str| {
            move |e: cudarc::driver::DriverError| GpuError::Driver {
                what: what.into(),
                error: e.to_string(),
            }
        };
        let mut scalars = self.scalar.borrow_mut();
        stream
            .memcpy_htod(xs, &mut *scalars)
            .map_err(copy("copying scalars up"))?;
        let (p, _sync) = (*scalars).device_ptr(stream);
        // SAFETY: the buffer holds MAX_SCALARS >= xs.len() f64 of `be`'s context (checked
        // above); ordered on its stream.
        unsafe {
            result::all_reduce(
                p as usize as *const std::ffi::c_void,
                p as usize as *mut std::ffi::c_void,
                xs.len(),
                sys::ncclDataType_t::ncclFloat64,
                sys::ncclRedOp_t::ncclSum,
                self.comm,
                self.stream(),
            )
        }
        .map_err(nccl_err(format!("summing {} scalars", xs.len())))?;
        let mut out = [0f64; MAX_SCALARS];
        stream
            .memcpy_dtoh(&*scalars, &mut out)
            .map_err(copy("copying scalars down"))?;
        stream.synchronize().map_err(copy("synchronizing"))?;
        Ok(out[..xs.len()].to_vec())
    }
}
