//! The optimizer offloaded to the host (DeepSpeed's `offload_optimizer`, FSDP's
//! `CPUOffload`): where the model's variables live on a GPU (`device = "cuda"`), the
//! trainer's FP32 master weights, gradient sum and optimizer states stay in host memory as
//! they are on a CPU run, and the optimizer steps there. What crosses the bus: every
//! gradient down once per micro-batch and every parameter up once per step, both in the
//! variables' dtype (bf16 gradients are widened to f32 on the host, exactly).
//!
//! [`HostStaging`] holds one page-locked (pinned) host buffer per parameter for each
//! direction, so the copies are DMA transfers queued on the model's CUDA stream, each
//! followed by an event of its own buffer that the host waits on before it touches the
//! buffer (cudarc records its own event on pinned memory only when a context has several
//! streams; candle's has one):
//! - down: after the backward every gradient's copy is queued at once, last group first
//!   (the order the backward finishes them); the host then waits for one parameter's copy
//!   at a time and adds it into the gradient sum while the later ones are still in flight;
//! - up: each parameter's new values are written into its pinned buffer and its copy into
//!   the variable's own storage queued (a candle in-place op, so the graph reads the same
//!   variable), as soon as the optimizer is done with that parameter where it updates the
//!   whole buffer ([`HostStaging::upload_segment`]: the copies run while it steps the
//!   next parameters), else after the all-gather ([`HostStaging::upload`]). The host then
//!   fetches the next batches while they run; the next micro-batch's copy queues behind.
//!
//! Every call stays on the trainer's thread: candle's stream is per thread. candle's
//! backward produces every gradient in one call, so copies cannot start while the backward
//! still runs (DeepSpeed's per-bucket hooks do); that overlap is not built. This is a
//! staging helper the trainer holds beside its strategy, not a [`crate::parallel`]
//! strategy: it moves data between the device and the host and leaves the ranks alone.
//!
//! On a CPU device the same code runs with ordinary vectors (the unit tests here hold it to
//! [`FlatLayout::gather_grads`] and [`FlatLayout::unflatten`]); the trainer uses it only
//! for variables that are not in host memory.

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, DType, Device, InplaceOp1, Layout, Tensor};
use half::{bf16, f16};

use crate::error::{Result, TrainError};
use crate::layout::FlatLayout;
use crate::params::ParamSet;

#[cfg(feature = "cuda")]
use candle_core::cuda_backend::cudarc::driver::{CudaEvent, CudaStream, PinnedHostSlice};

/// One parameter's host buffer: a vector for a CPU device, page-locked memory for a GPU.
enum Staged<T> {
    Host(Vec<T>),
    #[cfg(feature = "cuda")]
    Pinned(Pinned<T>),
}

/// Page-locked memory and the event recorded after each copy from or into it.
#[cfg(feature = "cuda")]
struct Pinned<T> {
    buf: PinnedHostSlice<T>,
    done: CudaEvent,
}

/// A staged buffer in its variable's dtype.
enum StagedBuf {
    F32(Staged<f32>),
    Bf16(Staged<bf16>),
    F16(Staged<f16>),
}

/// Runs `$e` with `$s` bound to the typed buffer inside a [`StagedBuf`].
macro_rules! each {
    ($buf:expr, $s:ident => $e:expr) => {
        match $buf {
            StagedBuf::F32($s) => $e,
            StagedBuf::Bf16($s) => $e,
            StagedBuf::F16($s) => $e,
        }
    };
}

/// What the variables are refreshed from: the FP32 master buffer, or the optimizer's bf16
/// copy of it (bf16 variables take it as is, as [`FlatLayout::unflatten_bf16`] does).
#[derive(Clone, Copy)]
pub enum MasterView<'a> {
    /// The FP32 master buffer (the whole flat layout).
    F32(&'a [f32]),
    /// The bf16 copy the optimizer wrote in its pass.
    Bf16(&'a [bf16]),
}

impl<'a> MasterView<'a> {
    /// Elements in view.
    fn len(self) -> usize {
        match self {
            MasterView::F32(m) => m.len(),
            MasterView::Bf16(m) => m.len(),
        }
    }

    /// Elements `r` of the view.
    fn part(self, r: std::ops::Range<usize>) -> MasterView<'a> {
        match self {
            MasterView::F32(m) => MasterView::F32(&m[r]),
            MasterView::Bf16(m) => MasterView::Bf16(&m[r]),
        }
    }
}

/// Host-side staging of a model's gradients and parameters: one buffer per parameter in
/// each direction (module doc).
pub struct HostStaging {
    grads: Vec<StagedBuf>,
    params: Vec<StagedBuf>,
    /// (flat offset, parameter index) of every parameter, by offset: which parameter an
    /// optimizer segment is.
    by_offset: Vec<(usize, usize)>,
    /// Parameter uploads queued so far, and how many of them segment by segment.
    uploads: usize,
    segment_uploads: usize,
}

impl HostStaging {
    /// Buffers for every parameter of `params` (laid out by `layout`), pinned where their
    /// variables are on a GPU.
    pub fn for_params(params: &ParamSet, layout: &FlatLayout) -> Result<Self> {
        if layout.slots().len() != params.len() {
            return Err(TrainError::Offload(format!(
                "{} parameters, the layout has {} slots",
                params.len(),
                layout.slots().len()
            )));
        }
        let (mut grads, mut ups) = (Vec::new(), Vec::new());
        for p in params.iter() {
            let (dev, n) = (p.var.device(), p.var.elem_count());
            let buf = || -> Result<StagedBuf> {
                Ok(match p.var.dtype() {
                    DType::F32 => StagedBuf::F32(staged(dev, n)?),
                    DType::BF16 => StagedBuf::Bf16(staged(dev, n)?),
                    DType::F16 => StagedBuf::F16(staged(dev, n)?),
                    other => {
                        return Err(TrainError::Offload(format!(
                        "parameter `{}` is {other:?}: offload stages f32, bf16 and f16 variables",
                        p.name
                    )))
                    }
                })
            };
            grads.push(buf()?);
            ups.push(buf()?);
        }
        // Empty parameters share their offset with the next one and have nothing to upload.
        let mut by_offset: Vec<(usize, usize)> = layout
            .slots()
            .iter()
            .enumerate()
            .filter(|(_, s)| s.len > 0)
            .map(|(i, s)| (s.offset, i))
            .collect();
        by_offset.sort_unstable();
        Ok(HostStaging {
            grads,
            params: ups,
            by_offset,
            uploads: 0,
            segment_uploads: 0,
        })
    }

    /// The parameters with at least one element: how many segment uploads refresh them all.
    pub fn nonempty(&self) -> usize {
        self.by_offset.len()
    }

    /// Parameter uploads queued so far, and how many of them as an optimizer's segments:
    /// what tests count (each parameter once per step, by segment where the optimizer
    /// updates the whole buffer).
    pub fn upload_counts(&self) -> (usize, usize) {
        (self.uploads, self.segment_uploads)
    }

    /// Bytes of host memory the buffers hold.
    pub fn bytes(&self) -> usize {
        let bytes = |b: &StagedBuf| each!(b, s => s.len() * std::mem::size_of_val(&s.zero()));
        self.grads.iter().chain(&self.params).map(bytes).sum()
    }

    /// Adds each parameter's gradient from `store` (widened to f32) into `out`, laid out by
    /// `layout`: what [`FlatLayout::gather_grads`] does, with every copy queued before the
    /// first is waited for. A parameter without a gradient is an error naming it.
    pub fn download_grads(
        &mut self,
        store: &GradStore,
        params: &ParamSet,
        layout: &FlatLayout,
        out: &mut [f32],
    ) -> Result<()> {
        layout.check_len(out.len())?;
        self.check_count(params)?;
        // Last group first, as the backward finishes them.
        let order = (0..params.len()).rev();
        // The gradients stay alive until every copy from them has been read.
        let mut sources = Vec::with_capacity(params.len());
        for i in order.clone() {
            let p = params.at(i).expect("counted above");
            let g = store
                .get(p.var.as_tensor())
                .ok_or_else(|| TrainError::NoGradient {
                    name: p.name.clone(),
                })?
                .contiguous()?;
            each!(&mut self.grads[i], s => s.start_download(&g, &p.name))?;
            sources.push(g);
        }
        for i in order {
            let s = &layout.slots()[i];
            let out = &mut out[s.offset..s.offset + s.len];
            each!(&self.grads[i], b => add_widened(out, b.read()?));
        }
        drop(sources);
        Ok(())
    }

    /// Refreshes every variable of `params` from `src` (laid out by `layout`), converting
    /// to each variable's dtype on the host and queueing the copy; returns once every copy
    /// is queued.
    pub fn upload(
        &mut self,
        src: MasterView<'_>,
        layout: &FlatLayout,
        params: &ParamSet,
    ) -> Result<()> {
        layout.check_len(src.len())?;
        self.check_count(params)?;
        for (i, (p, s)) in params.iter().zip(layout.slots()).enumerate() {
            self.upload_param(i, src.part(s.offset..s.offset + s.len), p)?;
        }
        Ok(())
    }

    /// Refreshes the parameter at flat offset `offset` from `values` (its new FP32 values)
    /// or, where given, `bf16` (their bf16 copy, for bf16 variables): what an optimizer's
    /// segment hands over as soon as it is updated ([`crate::optim::Optimizer::step_each`]).
    /// An offset where no parameter starts is an error.
    pub fn upload_segment(
        &mut self,
        offset: usize,
        values: &[f32],
        bf16: Option<&[bf16]>,
        params: &ParamSet,
    ) -> Result<()> {
        self.check_count(params)?;
        let i = match self.by_offset.binary_search_by_key(&offset, |&(o, _)| o) {
            Ok(k) => self.by_offset[k].1,
            Err(_) => {
                return Err(TrainError::Offload(format!(
                    "offload: no parameter starts at flat offset {offset}"
                )))
            }
        };
        let p = params.at(i).expect("counted above");
        // As the whole upload: a bf16 copy refreshes bf16 variables, the only kind it exists
        // for (a variable of another dtype beside one is an error).
        let src = match bf16 {
            Some(b) => MasterView::Bf16(b),
            None => MasterView::F32(values),
        };
        self.upload_param(i, src, p)?;
        self.segment_uploads += 1;
        Ok(())
    }

    /// Writes parameter `i`'s new values `src` (exactly its elements) into its staging
    /// buffer, converted to its variable's dtype, and queues the copy into the variable.
    fn upload_param(
        &mut self,
        i: usize,
        src: MasterView<'_>,
        p: &crate::params::Param,
    ) -> Result<()> {
        let staged = &mut self.params[i];
        let n = src.len();
        if n != p.var.elem_count() {
            return Err(TrainError::Offload(format!(
                "offload: {n} values for parameter `{}` of {} elements",
                p.name,
                p.var.elem_count()
            )));
        }
        match (&mut *staged, src) {
            (StagedBuf::Bf16(b), MasterView::Bf16(m)) => b.write()?.copy_from_slice(m),
            (b, MasterView::F32(m)) => each!(b, b => narrow_into(b.write()?, m)),
            (_, MasterView::Bf16(_)) => {
                return Err(TrainError::Offload(format!(
                    "parameter `{}` is {:?}: a bf16 copy refreshes bf16 variables only",
                    p.name,
                    p.var.dtype()
                )))
            }
        }
        p.var.as_tensor().inplace_op1(&CopyIn(staged))?;
        self.uploads += 1;
        Ok(())
    }

    /// Fails unless `params` has as many parameters as the buffers were made for.
    fn check_count(&self, params: &ParamSet) -> Result<()> {
        let n = params.len();
        if n != self.grads.len() {
            return Err(TrainError::Offload(format!(
                "{n} parameters, the staging holds {}",
                self.grads.len()
            )));
        }
        Ok(())
    }
}

/// Adds `src`, widened to f32 (exactly), into `out`.
fn add_widened<T: Element>(out: &mut [f32], src: &[T]) {
    for (o, x) in out.iter_mut().zip(src) {
        *o += x.to_f64() as f32;
    }
}

/// Writes `src` rounded to `T` into `dst` (round to nearest even, as candle's cast does).
fn narrow_into<T: Element>(dst: &mut [T], src: &[f32]) {
    for (d, x) in dst.iter_mut().zip(src) {
        *d = T::from_f64(*x as f64);
    }
}

/// A zeroed buffer of `n` elements for a variable on `dev`: pinned for a GPU.
fn staged<T: Element>(dev: &Device, n: usize) -> Result<Staged<T>> {
    match dev {
        Device::Cpu => Ok(Staged::Host(vec![T::zero(); n])),
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => Ok(Staged::Pinned(Pinned::zeroed(
            d.cuda_stream().context(),
            n,
        )?)),
        #[allow(unreachable_patterns)]
        other => Err(TrainError::Offload(format!(
            "offload stages variables on a CPU or CUDA device, not {other:?}"
        ))),
    }
}

/// The element types staged: f32, bf16 and f16 (candle's, and on a GPU cudarc's).
#[cfg(feature = "cuda")]
trait Element:
    candle_core::WithDType
    + candle_core::cuda_backend::CudaDType
    + candle_core::cuda_backend::cudarc::driver::DeviceRepr
    + candle_core::cuda_backend::cudarc::driver::ValidAsZeroBits
{
}
#[cfg(feature = "cuda")]
impl<T> Element for T where
    T: candle_core::WithDType
        + candle_core::cuda_backend::CudaDType
        + candle_core::cuda_backend::cudarc::driver::DeviceRepr
        + candle_core::cuda_backend::cudarc::driver::ValidAsZeroBits
{
}
/// The element types staged: f32, bf16 and f16 (candle's).
#[cfg(not(feature = "cuda"))]
trait Element: candle_core::WithDType {}
#[cfg(not(feature = "cuda"))]
impl<T: candle_core::WithDType> Element for T {}

#[cfg(feature = "cuda")]
impl<T: Element> Pinned<T> {
    /// `n` zeroed elements of plain page-locked memory (flags 0: the host reads gradients
    /// back, which cudarc's default, write-combined memory makes slow).
    fn zeroed(
        ctx: &std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaContext>,
        n: usize,
    ) -> Result<Self> {
        let err = |what: &str, e: &dyn std::fmt::Debug| {
            TrainError::Offload(format!("{what} ({n} pinned host elements): {e:?}"))
        };
        // SAFETY: the allocation is uninitialized until the `write_bytes` below, and nothing
        // reads it before then: it is not returned or referenced before the fill.
        let mut buf =
            unsafe { ctx.alloc_pinned_with_flags::<T>(n, 0) }.map_err(|e| err("allocating", &e))?;
        let ptr = buf.as_mut_ptr().map_err(|e| err("addressing", &e))?;
        // SAFETY: `ptr` is the start of `buf`'s `n` elements (cudarc allocated exactly that
        // many, aligned for T); all-zero bytes are a valid T (`ValidAsZeroBits`).
        unsafe { std::ptr::write_bytes(ptr, 0, n) };
        let done = ctx
            .new_event(None)
            .map_err(|e| err("creating its event", &e))?;
        Ok(Pinned { buf, done })
    }

    /// Marks the end of the copy just queued on `stream` from or into this buffer.
    fn copied_on(&self, stream: &CudaStream) -> candle_core::Result<()> {
        self.done
            .record(stream)
            .map_err(|e| candle_core::Error::Msg(format!("offload: recording a copy: {e:?}")))
    }

    /// Waits for the last copy from or into this buffer.
    fn wait(&self) -> Result<()> {
        self.done
            .synchronize()
            .map_err(|e| TrainError::Offload(format!("offload: waiting for a copy: {e:?}")))
    }

    /// The memory, once the last copy from or into it has finished.
    fn slice(&self) -> Result<&[T]> {
        self.wait()?;
        self.buf.as_slice().map_err(pinned_err)
    }

    /// The memory to overwrite, once the last copy from or into it has finished.
    fn slice_mut(&mut self) -> Result<&mut [T]> {
        self.wait()?;
        self.buf.as_mut_slice().map_err(pinned_err)
    }
}

/// A failure to address a pinned buffer.
#[cfg(feature = "cuda")]
fn pinned_err(e: candle_core::cuda_backend::cudarc::driver::DriverError) -> TrainError {
    TrainError::Offload(format!("offload: a pinned buffer: {e:?}"))
}

#[cfg(feature = "cuda")]
impl<T> Drop for Pinned<T> {
    fn drop(&mut self) {
        // A copy may still be writing or reading the memory cudarc frees next.
        let _ = self.done.synchronize();
    }
}

impl<T: Element> Staged<T> {
    /// A zero of the element type (for its size).
    fn zero(&self) -> T {
        T::zero()
    }

    /// Elements held.
    fn len(&self) -> usize {
        match self {
            Staged::Host(v) => v.len(),
            #[cfg(feature = "cuda")]
            Staged::Pinned(p) => p.buf.len(),
        }
    }

    /// The values, once the copy into them has finished.
    fn read(&self) -> Result<&[T]> {
        match self {
            Staged::Host(v) => Ok(v),
            #[cfg(feature = "cuda")]
            Staged::Pinned(p) => p.slice(),
        }
    }

    /// The values to overwrite, once the copy out of them has finished.
    fn write(&mut self) -> Result<&mut [T]> {
        match self {
            Staged::Host(v) => Ok(v),
            #[cfg(feature = "cuda")]
            Staged::Pinned(p) => p.slice_mut(),
        }
    }

    /// Copies `g` (contiguous, of this buffer's dtype and length) in: at once into a host
    /// vector; queued on the tensor's stream into pinned memory ([`Staged::read`] waits).
    fn start_download(&mut self, g: &Tensor, name: &str) -> Result<()> {
        if g.elem_count() != self.len() || g.dtype() != T::DTYPE {
            return Err(TrainError::Offload(format!(
                "gradient of `{name}`: {} {:?} elements, its staging {} {:?}",
                g.elem_count(),
                g.dtype(),
                self.len(),
                T::DTYPE
            )));
        }
        match self {
            Staged::Host(v) => {
                v.copy_from_slice(&g.flatten_all()?.to_vec1::<T>()?);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Staged::Pinned(p) => {
                let (storage, layout) = g.storage_and_layout();
                let (a, b) = layout.contiguous_offsets().ok_or_else(|| {
                    TrainError::Offload(format!("gradient of `{name}` is not contiguous"))
                })?;
                let candle_core::Storage::Cuda(cs) = &*storage else {
                    return Err(TrainError::Offload(format!(
                        "gradient of `{name}` is not on the GPU its staging is pinned for"
                    )));
                };
                let stream = cs.device.cuda_stream();
                let slice = cs.as_cuda_slice::<T>()?;
                p.wait()?;
                stream
                    .memcpy_dtoh(&slice.slice(a..b), &mut p.buf)
                    .map_err(|e| {
                        TrainError::Offload(format!("copying `{name}`'s gradient: {e:?}"))
                    })?;
                Ok(p.copied_on(&stream)?)
            }
        }
    }
}

/// The in-place op that writes a staged buffer into a variable's storage: a plain copy
/// on a CPU, a queued host-to-device copy from pinned memory on a GPU.
struct CopyIn<'a>(&'a StagedBuf);

impl InplaceOp1 for CopyIn<'_> {
    fn name(&self) -> &'static str {
        "stoker-offload-copy-in"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let (a, b) = contiguous(layout)?;
        match (storage, self.0) {
            (CpuStorage::F32(v), StagedBuf::F32(Staged::Host(s))) => copy_host(&mut v[a..b], s),
            (CpuStorage::BF16(v), StagedBuf::Bf16(Staged::Host(s))) => copy_host(&mut v[a..b], s),
            (CpuStorage::F16(v), StagedBuf::F16(Staged::Host(s))) => copy_host(&mut v[a..b], s),
            _ => Err(candle_core::Error::Msg(
                "offload: a CPU variable and its staging disagree in dtype or kind".into(),
            )),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &mut candle_core::CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<()> {
        let (a, b) = contiguous(layout)?;
        let stream = storage.device.cuda_stream();
        match self.0 {
            StagedBuf::F32(Staged::Pinned(p)) => copy_up(&stream, p, storage, a, b),
            StagedBuf::Bf16(Staged::Pinned(p)) => copy_up(&stream, p, storage, a, b),
            StagedBuf::F16(Staged::Pinned(p)) => copy_up(&stream, p, storage, a, b),
            _ => Err(candle_core::Error::Msg(
                "offload: a GPU variable whose staging is not pinned".into(),
            )),
        }
    }
}

/// The element range of a contiguous layout.
fn contiguous(layout: &Layout) -> candle_core::Result<(usize, usize)> {
    layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("offload: a variable is not contiguous".into()))
}

/// Copies `src` into `dst`, which must be as long.
fn copy_host<T: Copy>(dst: &mut [T], src: &[T]) -> candle_core::Result<()> {
    if dst.len() != src.len() {
        return Err(candle_core::Error::Msg(format!(
            "offload: a variable of {} elements, its staging {}",
            dst.len(),
            src.len()
        )));
    }
    dst.copy_from_slice(src);
    Ok(())
}

/// Queues the copy of pinned `src` into elements `a..b` of `dst` (a variable's storage of
/// `src`'s dtype) on `stream`, and marks its end on `src`'s event.
#[cfg(feature = "cuda")]
fn copy_up<T: Element>(
    stream: &std::sync::Arc<CudaStream>,
    src: &Pinned<T>,
    dst: &mut candle_core::CudaStorage,
    a: usize,
    b: usize,
) -> candle_core::Result<()> {
    let dst = dst.as_cuda_slice_mut::<T>()?;
    if b - a != src.buf.len() || b > dst.len() {
        return Err(candle_core::Error::Msg(format!(
            "offload: a variable of {} elements at {a}, its staging {}",
            b - a,
            src.buf.len()
        )));
    }
    stream
        .memcpy_htod(&src.buf, &mut dst.slice_mut(a..b))
        .map_err(|e| {
            candle_core::Error::Msg(format!("offload: queueing a parameter copy: {e:?}"))
        })?;
    src.copied_on(stream)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::{Init, ParamBuilder};
    use candle_core::Var;

    fn params(dt: DType) -> ParamSet {
        let mut b = ParamBuilder::new(Device::Cpu, dt, 7);
        b.param("fc.weight", &[5, 3], Init::Normal(0.5)).unwrap();
        b.param("fc.bias", &[5], Init::Normal(0.5)).unwrap();
        b.param("out.weight", &[2, 5], Init::Normal(0.5)).unwrap();
        b.finish()
    }

    fn values(p: &ParamSet) -> Vec<Vec<f32>> {
        p.iter()
            .map(|p| {
                let t = p.var.as_tensor().to_dtype(DType::F32).unwrap();
                t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
            })
            .collect()
    }

    /// Gradients of a loss that touches every parameter differently.
    fn grads(p: &ParamSet) -> GradStore {
        let mut loss: Option<Tensor> = None;
        for (i, p) in p.iter().enumerate() {
            let t = p.var.as_tensor().to_dtype(DType::F32).unwrap();
            let term = (t.sqr().unwrap().sum_all().unwrap() * (i as f64 + 1.5)).unwrap();
            loss = Some(match loss {
                None => term,
                Some(l) => (l + term).unwrap(),
            });
        }
        loss.unwrap().backward().unwrap()
    }

    #[test]
    fn downloads_add_what_gather_grads_adds() {
        for dt in [DType::F32, DType::BF16, DType::F16] {
            let p = params(dt);
            let layout = FlatLayout::of(&p).unwrap();
            let g = grads(&p);
            let start: Vec<f32> = (0..layout.total_len()).map(|i| i as f32 * 0.25).collect();
            let (mut want, mut got) = (start.clone(), start);
            layout.gather_grads(&g, &p, &mut want).unwrap();
            let mut s = HostStaging::for_params(&p, &FlatLayout::of(&p).unwrap()).unwrap();
            s.download_grads(&g, &p, &layout, &mut got).unwrap();
            // Twice: the buffers are reused.
            s.download_grads(&g, &p, &layout, &mut got).unwrap();
            layout.gather_grads(&g, &p, &mut want).unwrap();
            assert_eq!(
                got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "{dt:?}"
            );
        }
    }

    #[test]
    fn a_missing_gradient_is_named() {
        let p = params(DType::F32);
        let layout = FlatLayout::of(&p).unwrap();
        let only_first = p.iter().next().unwrap().var.as_tensor().sum_all().unwrap();
        let g = only_first.backward().unwrap();
        let mut out = vec![0f32; layout.total_len()];
        let mut s = HostStaging::for_params(&p, &layout).unwrap();
        let e = s.download_grads(&g, &p, &layout, &mut out).unwrap_err();
        assert!(e.to_string().contains("out.weight"), "{e}");
    }

    #[test]
    fn uploads_set_what_unflatten_sets() {
        for dt in [DType::F32, DType::BF16, DType::F16] {
            let (a, b) = (params(dt), params(dt));
            let layout = FlatLayout::of(&a).unwrap();
            let master: Vec<f32> = (0..layout.total_len())
                .map(|i| (i as f32 * 0.37).sin() * 3.0 + 1e-3)
                .collect();
            layout.unflatten(&master, &a).unwrap();
            let mut s = HostStaging::for_params(&b, &layout).unwrap();
            s.upload(MasterView::F32(&master), &layout, &b).unwrap();
            assert_eq!(values(&a), values(&b), "{dt:?}");
            if dt == DType::BF16 {
                let copy: Vec<bf16> = master.iter().map(|x| bf16::from_f32(*x + 1.0)).collect();
                layout.unflatten_bf16(&copy, &a).unwrap();
                s.upload(MasterView::Bf16(&copy), &layout, &b).unwrap();
                assert_eq!(values(&a), values(&b));
            }
        }
        let p = params(DType::F32);
        let layout = FlatLayout::of(&p).unwrap();
        let mut s = HostStaging::for_params(&p, &layout).unwrap();
        let copy = vec![bf16::ZERO; layout.total_len()];
        let e = s.upload(MasterView::Bf16(&copy), &layout, &p).unwrap_err();
        assert!(e.to_string().contains("bf16 variables only"), "{e}");
        // 30 elements: f32 gradients and f32 parameters.
        assert_eq!(s.bytes(), 2 * 4 * 30);
    }

    #[test]
    fn segment_uploads_in_reverse_order_set_what_a_whole_upload_sets() {
        for dt in [DType::F32, DType::BF16, DType::F16] {
            let (a, b) = (params(dt), params(dt));
            let layout = FlatLayout::of(&a).unwrap();
            let master: Vec<f32> = (0..layout.total_len())
                .map(|i| i as f32 * 0.013 - 0.2)
                .collect();
            // Not the master rounded: an upload that rounds instead of taking the copy differs.
            let copy: Vec<bf16> = master.iter().map(|x| bf16::from_f32(*x + 1.0)).collect();
            let whole = match dt {
                DType::BF16 => MasterView::Bf16(&copy),
                _ => MasterView::F32(&master),
            };
            HostStaging::for_params(&a, &layout)
                .unwrap()
                .upload(whole, &layout, &a)
                .unwrap();
            let mut s = HostStaging::for_params(&b, &layout).unwrap();
            for slot in layout.slots().iter().rev() {
                let r = slot.offset..slot.offset + slot.len;
                let c = (dt == DType::BF16).then(|| &copy[r.clone()]);
                s.upload_segment(slot.offset, &master[r], c, &b).unwrap();
            }
            assert_eq!(values(&a), values(&b), "{dt:?}");
            let first = &layout.slots()[0];
            let e = s
                .upload_segment(first.offset + 1, &master[..1], None, &b)
                .unwrap_err();
            assert!(e.to_string().contains("no parameter starts"), "{e}");
            let e = s
                .upload_segment(first.offset, &master[..1], None, &b)
                .unwrap_err();
            assert!(e.to_string().contains(&first.name), "{e}");
        }
    }

    #[test]
    fn an_empty_parameter_sharing_an_offset_is_not_a_segment() {
        let mut b = ParamBuilder::new(Device::Cpu, DType::F32, 7);
        b.param("empty.weight", &[0, 3], Init::Normal(0.5)).unwrap();
        b.param("fc.weight", &[5, 3], Init::Normal(0.5)).unwrap();
        let p = b.finish();
        let layout = FlatLayout::of(&p).unwrap();
        let mut s = HostStaging::for_params(&p, &layout).unwrap();
        assert_eq!(s.nonempty(), 1);
        let full = &layout.slots()[1];
        let new = vec![1.5f32; full.len];
        s.upload_segment(full.offset, &new, None, &p).unwrap();
        assert_eq!(values(&p)[1], vec![1.5f32; 15]);
        assert_eq!(s.upload_counts(), (1, 1));
    }

    #[test]
    fn an_upload_writes_the_variable_the_graph_reads() {
        // The copy goes into the variable's own storage: a tensor computed from it after
        // the upload sees the new values (the in-place op does not make a new tensor).
        let p = params(DType::F32);
        let layout = FlatLayout::of(&p).unwrap();
        let var: &Var = &p.iter().next().unwrap().var;
        let before = var.as_tensor().clone();
        let master = vec![2.0f32; layout.total_len()];
        HostStaging::for_params(&p, &layout)
            .unwrap()
            .upload(MasterView::F32(&master), &layout, &p)
            .unwrap();
        let sum = before.sum_all().unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(sum, 2.0 * var.elem_count() as f32);
    }
}
