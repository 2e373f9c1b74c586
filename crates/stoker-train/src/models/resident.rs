//! The GPU-resident steps' host build as a direct step (`step = "resident"`): stoker-gpu's
//! GPT and Llama steps on its host backend, behind stoker-kernels' `TokenStep` (the
//! adapter gathers parameters and adds gradients through the same group protocol as the
//! CPU step), so the whole training loop (loader, accumulation, strategies, optimizer,
//! checkpoints, evaluation) runs the GPU step's code on a CPU.

use half::bf16;
use stoker_gpu::step::token_step::{AsTokenStep, MakeStep, ResidentStep};
use stoker_gpu::step::{GptGpuStep, LlamaGpuStep};
use stoker_gpu::{Act, Host};
use stoker_kernels::{GptDims, GptOffsets, LlamaDims, LlamaOffsets};

use super::token_direct::TokenDirect;
use super::DirectStep;

fn boxed<S: ResidentStep<Host> + 'static>(
    make: MakeStep<Host, S>,
    groups: Vec<std::ops::Range<usize>>,
    end: usize,
) -> Box<dyn DirectStep> {
    Box::new(TokenDirect {
        step: AsTokenStep::new(Host, make, groups, end),
    })
}

fn gpt_as<T: Act>(dims: GptDims, offsets: GptOffsets, eps: f64) -> Box<dyn DirectStep>
where
    GptGpuStep<Host, T>: ResidentStep<Host>,
{
    let (groups, end) = (offsets.group_ranges().to_vec(), offsets.end());
    let make: MakeStep<Host, GptGpuStep<Host, T>> =
        Box::new(move |be, b, t| GptGpuStep::new(be, dims, offsets.clone(), eps, b, t));
    boxed(make, groups, end)
}

/// The GPT's GPU step on the host backend, bf16 activations when `bf16`.
pub(crate) fn gpt(dims: GptDims, offsets: GptOffsets, eps: f64, bf16: bool) -> Box<dyn DirectStep> {
    match bf16 {
        true => gpt_as::<bf16>(dims, offsets, eps),
        false => gpt_as::<f32>(dims, offsets, eps),
    }
}

fn llama_as<T: Act>(
    dims: LlamaDims,
    offsets: LlamaOffsets,
    eps: f64,
    theta: f64,
) -> Box<dyn DirectStep>
where
    LlamaGpuStep<Host, T>: ResidentStep<Host>,
{
    let (groups, end) = (offsets.group_ranges().to_vec(), offsets.end());
    let make: MakeStep<Host, LlamaGpuStep<Host, T>> =
        Box::new(move |be, b, t| LlamaGpuStep::new(be, dims, offsets.clone(), eps, theta, b, t));
    boxed(make, groups, end)
}

/// The Llama's GPU step on the host backend, bf16 activations when `bf16`.
pub(crate) fn llama(
    dims: LlamaDims,
    offsets: LlamaOffsets,
    eps: f64,
    theta: f64,
    bf16: bool,
) -> Box<dyn DirectStep> {
    match bf16 {
        true => llama_as::<bf16>(dims, offsets, eps, theta),
        false => llama_as::<f32>(dims, offsets, eps, theta),
    }
}
