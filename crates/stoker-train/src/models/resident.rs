//! The GPU-resident steps' host build as a direct step (`step = "resident"`): stoker-gpu's
//! GPT and Llama steps on its host backend, behind stoker-kernels' `TokenStep` (the
//! adapter gathers parameters and adds gradients through the same group protocol as the
//! CPU step), so the whole training loop (loader, accumulation, strategies, optimizer,
//! checkpoints, evaluation) runs the GPU step's code on a CPU; and the same steps as the
//! resident loops ([`super::resident_run`]) on the host or a GPU.

use half::{bf16, f16};
use stoker_gpu::step::options::StepOptions;
use stoker_gpu::step::token_step::{AsTokenStep, MakeStep, ResidentStep};
use stoker_gpu::step::{GptGpuStep, LlamaGpuStep};
use stoker_gpu::{Act, Dtype, Host};
use stoker_kernels::{GptDims, GptOffsets, LlamaDims, LlamaOffsets};

use stoker_gpu::parallel::ThroughHost;

use super::resident_run::{ResidentLoop, ResidentOn, ResidentRun, RunSetup};
use super::token_direct::TokenDirect;
use super::DirectStep;
use crate::error::Result;

fn boxed<S: ResidentStep<Host> + 'static>(
    make: MakeStep<Host, S>,
    groups: Vec<std::ops::Range<usize>>,
    end: usize,
) -> Box<dyn DirectStep> {
    Box::new(TokenDirect {
        step: AsTokenStep::new(Host, make, groups, end),
    })
}

fn gpt_as<T: Act>(
    dims: GptDims,
    offsets: GptOffsets,
    eps: f64,
    opts: StepOptions,
) -> Box<dyn DirectStep>
where
    GptGpuStep<Host, T>: ResidentStep<Host>,
{
    let (groups, end) = (offsets.group_ranges().to_vec(), offsets.end());
    let make: MakeStep<Host, GptGpuStep<Host, T>> = Box::new(move |be, b, t| {
        GptGpuStep::with_options(be, dims, offsets.clone(), eps, (b, t), opts)
    });
    boxed(make, groups, end)
}

/// The GPT's GPU step on the host backend, its activations `act`, made with `opts`.
pub(crate) fn gpt(
    dims: GptDims,
    offsets: GptOffsets,
    eps: f64,
    (act, opts): (Dtype, StepOptions),
) -> Box<dyn DirectStep> {
    match act {
        Dtype::F32 => gpt_as::<f32>(dims, offsets, eps, opts),
        Dtype::Bf16 => gpt_as::<bf16>(dims, offsets, eps, opts),
        Dtype::F16 => gpt_as::<f16>(dims, offsets, eps, opts),
    }
}

fn llama_as<T: Act>(
    dims: LlamaDims,
    offsets: LlamaOffsets,
    (eps, theta): (f64, f64),
    opts: StepOptions,
) -> Box<dyn DirectStep>
where
    LlamaGpuStep<Host, T>: ResidentStep<Host>,
{
    let (groups, end) = (offsets.group_ranges().to_vec(), offsets.end());
    let make: MakeStep<Host, LlamaGpuStep<Host, T>> = Box::new(move |be, b, t| {
        LlamaGpuStep::with_options(be, dims, offsets.clone(), (eps, theta), (b, t), opts)
    });
    boxed(make, groups, end)
}

/// The Llama's GPU step on the host backend, its activations `act`, made with `opts`.
pub(crate) fn llama(
    dims: LlamaDims,
    offsets: LlamaOffsets,
    (eps, theta): (f64, f64),
    (act, opts): (Dtype, StepOptions),
) -> Box<dyn DirectStep> {
    match act {
        Dtype::F32 => llama_as::<f32>(dims, offsets, (eps, theta), opts),
        Dtype::Bf16 => llama_as::<bf16>(dims, offsets, (eps, theta), opts),
        Dtype::F16 => llama_as::<f16>(dims, offsets, (eps, theta), opts),
    }
}

/// A [`ResidentLoop`] of steps made by `make` on the backend `setup` names, as a
/// [`ResidentRun`]: the host build through the ranks' communicator, or a GPU, whose
/// collectives are NCCL's on device memory where the ranks are processes on GPUs of their
/// own (`mpirun`, `srun` with `device = "cuda"`) and go through host memory otherwise
/// (one rank; ranks as threads of one process; a GPU every rank names, `cuda:N`). `make` is generic over the backend:
/// one closure for the host build and the device.
macro_rules! loop_on {
    ($setup:expr, $make:expr) => {{
        let setup: &RunSetup<'_> = $setup;
        let through_host = ThroughHost(setup.comm.clone());
        match setup.on {
            // Micro-batches replayed as graphs: the host build that records and replays.
            ResidentOn::Host if setup.step_options().graph_micro_batches => {
                let be = stoker_gpu::GraphHost::new();
                let run = ResidentLoop::new(be, through_host, Box::new($make), setup, None)?;
                Ok(Box::new(run) as Box<dyn ResidentRun>)
            }
            ResidentOn::Host => {
                let run = ResidentLoop::new(Host, through_host, Box::new($make), setup, None)?;
                Ok(Box::new(run) as Box<dyn ResidentRun>)
            }
            #[cfg(feature = "cuda")]
            ResidentOn::Cuda { gpu: n, own } => {
                let dev = stoker_gpu::device::Device::new(n).map_err(|e| {
                    crate::error::config_err("device", format!("opening CUDA GPU {n}: {e}"))
                })?;
                let free = stoker_gpu::Backend::free_memory(&dev);
                let nccl = own && setup.rank_world.1 > 1 && setup.comm.backend() != "local";
                match nccl {
                    true => {
                        let coll = stoker_gpu::device::nccl::DeviceNccl::join(&dev, &*setup.comm)
                            .map_err(|e| {
                            crate::error::TrainError::Strategy(format!(
                                "the resident step's NCCL communicator: {e}"
                            ))
                        })?;
                        let run = ResidentLoop::new(dev, coll, Box::new($make), setup, free)?;
                        Ok(Box::new(run) as Box<dyn ResidentRun>)
                    }
                    false => {
                        let run =
                            ResidentLoop::new(dev, through_host, Box::new($make), setup, free)?;
                        Ok(Box::new(run) as Box<dyn ResidentRun>)
                    }
                }
            }
            #[cfg(not(feature = "cuda"))]
            ResidentOn::Cuda { .. } => Err(crate::device::not_compiled()),
        }
    }};
}

fn gpt_run_as<T: Act>(
    dims: GptDims,
    offsets: GptOffsets,
    eps: f64,
    setup: &RunSetup<'_>,
) -> Result<Box<dyn ResidentRun>> {
    let opts = setup.step_options();
    loop_on!(setup, move |be: &_, b, t| GptGpuStep::<_, T>::with_options(
        be,
        dims,
        offsets.clone(),
        eps,
        (b, t),
        opts
    ))
}

/// The GPT's resident loop of `setup`, its activations `act`.
pub(crate) fn gpt_run(
    dims: GptDims,
    offsets: GptOffsets,
    eps: f64,
    act: Dtype,
    setup: &RunSetup<'_>,
) -> Result<Box<dyn ResidentRun>> {
    match act {
        Dtype::F32 => gpt_run_as::<f32>(dims, offsets, eps, setup),
        Dtype::Bf16 => gpt_run_as::<bf16>(dims, offsets, eps, setup),
        Dtype::F16 => gpt_run_as::<f16>(dims, offsets, eps, setup),
    }
}

fn llama_run_as<T: Act>(
    dims: LlamaDims,
    offsets: LlamaOffsets,
    (eps, theta): (f64, f64),
    setup: &RunSetup<'_>,
) -> Result<Box<dyn ResidentRun>> {
    let opts = setup.step_options();
    loop_on!(setup, move |be: &_, b, t| {
        LlamaGpuStep::<_, T>::with_options(be, dims, offsets.clone(), (eps, theta), (b, t), opts)
    })
}

/// The Llama's resident loop of `setup`, its activations `act`.
pub(crate) fn llama_run(
    dims: LlamaDims,
    offsets: LlamaOffsets,
    (eps, theta): (f64, f64),
    act: Dtype,
    setup: &RunSetup<'_>,
) -> Result<Box<dyn ResidentRun>> {
    match act {
        Dtype::F32 => llama_run_as::<f32>(dims, offsets, (eps, theta), setup),
        Dtype::Bf16 => llama_run_as::<bf16>(dims, offsets, (eps, theta), setup),
        Dtype::F16 => llama_run_as::<f16>(dims, offsets, (eps, theta), setup),
    }
}
