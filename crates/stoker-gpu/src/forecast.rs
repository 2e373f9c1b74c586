//! The resident step's time on a GPU, forecast from what the step itself asks of the
//! device: its code runs over [`CountingBackend`], which counts every launch's bytes and every
//! product's FLOPs, and each is timed on a roofline:
//! - a matrix product takes the longer of its FLOPs at a fraction of the dtype's peak (an
//!   FP8 product's at that fraction of FP8's peak) and its bytes at a fraction of the
//!   memory bandwidth (attention's per-head products, with a shared dimension of 64, are
//!   bound by their bytes);
//! - a kernel takes its bytes at that fraction of the bandwidth;
//! - neither takes less than a launch (small models are launch-bound);
//! - the ids come up over the host link, and each value read back waits a round trip.
//!
//! The fractions are assumptions until a device run measures them ([`GpuFigures::assumed`]
//! says which); the device check prints the forecast beside its measured step, so each
//! run checks them.

use stoker_kernels::{GptDims, LlamaDims};

use crate::counting::{CountingBackend, Work};
use crate::elem::{Act, Dtype};
use crate::error::GpuError;
use crate::parallel::Trainable;
use crate::step::buffers::BlockHooks;
use crate::step::optimizer::{OptimizerState, Scalars};
use crate::step::options::StepOptions;
use crate::step::{GptGpuStep, LlamaGpuStep, TokenBatch};

/// What a forecast needs to know of a GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuFigures {
    /// Dense matrix-product peak at the step's dtype, FLOP/s.
    pub peak_flops: f64,
    /// Dense FP8 matrix-product peak, FLOP/s, for the FP8 linear layers' products (0: the
    /// GPU has none, and they are timed at `peak_flops`).
    pub fp8_peak_flops: f64,
    /// Device memory bandwidth, bytes/s.
    pub mem_bw: f64,
    /// Host-to-device link, bytes/s.
    pub link_bw: f64,
    /// The fraction of `peak_flops` a large product reaches.
    pub product_efficiency: f64,
    /// The fraction of `mem_bw` a streaming kernel reaches.
    pub memory_efficiency: f64,
    /// The fraction of `peak_flops` stoker's own tensor-core kernels reach (flash
    /// attention's: warp-level products fed from L2, no shared-memory staging).
    pub tensor_kernel_efficiency: f64,
    /// The least time one launch takes, back to back, s.
    pub launch_s: f64,
    /// A value read back to the host: the round trip, s.
    pub read_s: f64,
}

impl GpuFigures {
    /// A GPU's datasheet figures with the fractions assumed until measured: products at
    /// 70% of peak (cuBLASLt's large bf16 products on an H100 reach 600-750 of 989
    /// TFLOP/s), kernels at 80% of the bandwidth (what a streaming copy reaches), stoker's
    /// tensor-core kernels at 35% of peak (FlashAttention-2 reaches 50-70% on an H100 with
    /// shared-memory tiles and pipelined copies, which these do not have yet), 3 us a
    /// launch and 10 us a read back.
    pub fn assumed(peak_flops: f64, mem_bw: f64, link_bw: f64) -> Self {
        GpuFigures {
            peak_flops,
            fp8_peak_flops: 0.0,
            mem_bw,
            link_bw,
            product_efficiency: Efficiencies::ASSUMED.product,
            memory_efficiency: Efficiencies::ASSUMED.memory,
            tensor_kernel_efficiency: Efficiencies::ASSUMED.tensor_kernel,
            launch_s: 3e-6,
            read_s: 10e-6,
        }
    }

    /// These figures with FP8 products at `fp8_peak_flops` (dense, FLOP/s), at the same
    /// fraction of it as bf16's products reach of theirs: assumed until a device run
    /// times them (the device check's FP8 products print their TFLOP/s).
    pub fn with_fp8_peak(self, fp8_peak_flops: f64) -> Self {
        GpuFigures {
            fp8_peak_flops,
            ..self
        }
    }

    /// These figures with `e`'s fractions (measured ones, [`crate::measured`]).
    pub fn with_efficiencies(self, e: &Efficiencies) -> Self {
        GpuFigures {
            product_efficiency: e.product,
            memory_efficiency: e.memory,
            tensor_kernel_efficiency: e.tensor_kernel,
            ..self
        }
    }

    /// The fractions these figures take.
    pub fn efficiencies(&self) -> Efficiencies {
        Efficiencies {
            product: self.product_efficiency,
            memory: self.memory_efficiency,
            tensor_kernel: self.tensor_kernel_efficiency,
        }
    }
}

/// The fractions of a GPU's peaks the forecast times its parts at: what a device run
/// measures ([`crate::efficiency_fit`]) and the planner then uses ([`crate::measured`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Efficiencies {
    /// Of the dense product peak, by the large products.
    pub product: f64,
    /// Of the memory bandwidth, by the streaming kernels.
    pub memory: f64,
    /// Of the dense product peak, by stoker's own tensor-core kernels.
    pub tensor_kernel: f64,
}

impl Efficiencies {
    /// Assumed until measured: see [`GpuFigures::assumed`].
    pub const ASSUMED: Efficiencies = Efficiencies {
        product: 0.7,
        memory: 0.8,
        tensor_kernel: 0.35,
    };
}

/// One kernel's share of a forecast.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelShare {
    /// The kernel's name, without its dtype (`layernorm_forward`).
    pub kernel: &'static str,
    /// Its launches.
    pub launches: usize,
    /// Its bytes, all launches.
    pub bytes: u64,
    /// Its time, s.
    pub seconds: f64,
}

/// Where a step's forecast time goes, s.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StepForecast {
    /// Dense products (the linear layers, the head): FLOP-bound.
    pub products_s: f64,
    /// Batched products (attention's per-head scores and weighted values).
    pub batched_products_s: f64,
    /// Of `products_s`, the FP8 linear layers' products.
    pub fp8_products_s: f64,
    /// Hand-written kernels, by kernel, largest first.
    pub kernels: Vec<KernelShare>,
    /// Copies and zeroing inside device memory.
    pub device_s: f64,
    /// Uploads and reads back.
    pub host_s: f64,
    /// Copies up to the device on their copy stream, beside the kernels.
    pub transfer_up_s: f64,
    /// Copies down from the device on theirs.
    pub transfer_down_s: f64,
    /// Launches of kernels and products.
    pub launches: usize,
    /// FLOPs of every product and tensor-core kernel.
    pub flops: f64,
}

impl StepForecast {
    /// The hand-written kernels' time, s.
    pub fn kernels_s(&self) -> f64 {
        self.kernels.iter().map(|k| k.seconds).sum()
    }

    /// The whole, s: nothing overlaps on the compute stream, and each copy stream's
    /// transfers hide behind it up to its length (a first-order model: it assumes each
    /// transfer has compute beside it to overlap).
    pub fn total_s(&self) -> f64 {
        let stream = self.products_s
            + self.batched_products_s
            + self.kernels_s()
            + self.device_s
            + self.host_s;
        stream.max(self.transfer_up_s).max(self.transfer_down_s)
    }

    /// `model_flops` (as llm.c counts a step: 6N + 6LCT a token) over the peak and the
    /// forecast time.
    pub fn mfu(&self, model_flops: f64, peak_flops: f64) -> f64 {
        model_flops / (peak_flops * self.total_s())
    }
}

/// Times `work` on `gpu`.
pub fn forecast(work: &[Work], gpu: &GpuFigures) -> StepForecast {
    let bw = gpu.mem_bw * gpu.memory_efficiency;
    let streamed = |bytes: u64| (bytes as f64 / bw).max(gpu.launch_s);
    let mut f = StepForecast::default();
    let mut kernels = std::collections::BTreeMap::new();
    for w in work {
        match w {
            Work::Launch {
                kernel,
                bytes,
                flops,
            } => {
                f.launches += 1;
                let k = kernels.entry(*kernel).or_insert(KernelShare {
                    kernel,
                    launches: 0,
                    bytes: 0,
                    seconds: 0.0,
                });
                k.launches += 1;
                k.bytes += bytes;
                // A tensor-core kernel takes the longer of its FLOPs and its bytes.
                f.flops += flops;
                let computed = flops / (gpu.peak_flops * gpu.tensor_kernel_efficiency);
                k.seconds += streamed(*bytes).max(computed);
            }
            Work::Product {
                flops,
                bytes,
                batch,
                fp8,
            } => {
                f.launches += 1;
                f.flops += flops;
                let peak = match *fp8 && gpu.fp8_peak_flops > 0.0 {
                    true => gpu.fp8_peak_flops,
                    false => gpu.peak_flops,
                };
                let s = (flops / (peak * gpu.product_efficiency)).max(streamed(*bytes));
                if *fp8 {
                    f.fp8_products_s += s;
                }
                match batch {
                    1 => f.products_s += s,
                    _ => f.batched_products_s += s,
                }
            }
            Work::Device { bytes } => f.device_s += streamed(*bytes),
            Work::Upload { bytes } => f.host_s += *bytes as f64 / gpu.link_bw,
            Work::Read { .. } => f.host_s += gpu.read_s,
            Work::Transfer { bytes, up } => {
                let s = *bytes as f64 / gpu.link_bw;
                match up {
                    true => f.transfer_up_s += s,
                    false => f.transfer_down_s += s,
                }
            }
        }
    }
    f.kernels = kernels.into_values().collect();
    f.kernels.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
    f
}

/// What one training step of a GPT asks of the device: the gradients zeroed, a
/// micro-batch of `batch` x `t` positions (forward and backward, the loss read back),
/// then the update (the norm read back, clipping, AdamW writing the compute copy), with
/// activations in `A`.
pub fn gpt_step_work<A: Act>(
    dims: GptDims,
    shape: (usize, usize),
    opts: StepOptions,
) -> Result<StepWork, GpuError> {
    let be = CountingBackend::new();
    let (offsets, ranges) = crate::sample::gpt_layout(&dims);
    let step =
        GptGpuStep::<CountingBackend, A>::with_options(&be, dims, offsets, 1e-5, shape, opts)?;
    let segments = crate::sample::segments(&stoker_kernels::gpt_params(&dims), &ranges);
    step_work(&be, &step, &segments, dims.vocab)
}

/// [`gpt_step_work`] for a Llama.
pub fn llama_step_work<A: Act>(
    dims: LlamaDims,
    shape: (usize, usize),
    opts: StepOptions,
) -> Result<StepWork, GpuError> {
    let be = CountingBackend::new();
    let (offsets, ranges) = crate::sample::llama_layout(&dims);
    let step = LlamaGpuStep::<CountingBackend, A>::with_options(
        &be,
        dims,
        offsets,
        (1e-5, 10_000.0),
        shape,
        opts,
    )?;
    let segments = crate::sample::segments(&stoker_kernels::llama_params(&dims), &ranges);
    step_work(&be, &step, &segments, dims.vocab)
}

/// [`gpt_step_work`] with activations of `dtype`.
pub fn gpt_step_work_in(
    dtype: Dtype,
    dims: GptDims,
    shape: (usize, usize),
    opts: StepOptions,
) -> Result<StepWork, GpuError> {
    match dtype {
        Dtype::F32 => gpt_step_work::<f32>(dims, shape, opts),
        Dtype::Bf16 => gpt_step_work::<half::bf16>(dims, shape, opts),
        Dtype::F16 => gpt_step_work::<half::f16>(dims, shape, opts),
    }
}

/// [`llama_step_work`] with activations of `dtype`.
pub fn llama_step_work_in(
    dtype: Dtype,
    dims: LlamaDims,
    shape: (usize, usize),
    opts: StepOptions,
) -> Result<StepWork, GpuError> {
    match dtype {
        Dtype::F32 => llama_step_work::<f32>(dims, shape, opts),
        Dtype::Bf16 => llama_step_work::<half::bf16>(dims, shape, opts),
        Dtype::F16 => llama_step_work::<half::f16>(dims, shape, opts),
    }
}

/// The AdamW step the forecasts update with (its scalars change no count).
fn adamw() -> Scalars {
    Scalars::AdamW(stoker_kernels::AdamWStep::new(
        3e-4, 0.9, 0.95, 1e-8, 0.1, 1,
    ))
}

/// What one training step asks of the device, in its two parts.
#[derive(Debug, Clone, PartialEq)]
pub struct StepWork {
    /// A micro-batch: the gradients zeroed, forward and backward, the loss read back
    /// (the zeroing is once a window; it is counted with each micro-batch here).
    pub micro_batch: Vec<Work>,
    /// The update after a window: the norm read back, clipping, the optimizer.
    pub update: Vec<Work>,
    /// The step's parameters (its flat buffer, laid out contiguously).
    pub params: usize,
}

impl StepWork {
    /// Both parts, in order.
    pub fn all(&self) -> Vec<Work> {
        self.micro_batch
            .iter()
            .chain(&self.update)
            .cloned()
            .collect()
    }
}

/// Makes the optimizer's state over `step`'s parameters, then counts a micro-batch (the
/// gradients zeroed, forward and backward as the resident loop queues it, the loss read
/// back) with tokens as distinct as a vocabulary of `vocab` allows (each a group of its
/// own in the embedding's backward, the most its backward can have), and the update.
fn step_work<S: Trainable<CountingBackend>>(
    be: &CountingBackend,
    step: &S,
    segments: &[(std::ops::Range<usize>, bool)],
    vocab: usize,
) -> Result<StepWork, GpuError> {
    let opt = OptimizerState::adamw_zeros(be, step.flat_len(), segments)?;
    let ids: Vec<i64> = (0..step.rows())
        .map(|i| (i % vocab.max(1)) as i64)
        .collect();
    let batch = TokenBatch {
        tokens: &ids,
        targets: &ids,
        ignore: -1,
    };
    let _ = be.take(); // the setup's uploads are not the step's
    step.zero_grads(be)?;
    let scale = 1.0 / step.rows() as f32;
    step.queue_micro_batch(be, (batch, scale), false, BlockHooks::default())?;
    step.loss_sum(be)?;
    let micro_batch = be.take();
    crate::step::optimizer::update(be, &opt, step.update_views(be)?, &adamw(), 1.0, Some(1.0))?;
    Ok(StepWork {
        micro_batch,
        update: be.take(),
        params: step.flat_len(),
    })
}
