//! DeepSpeed's model-state estimator, reproduced for `--accounting deepspeed[-legacy]`.
//!
//! DeepSpeed documents `estimate_zero2_model_states_mem_needs` (stage_1_and_2.py) and
//! `estimate_zero3_model_states_mem_needs` (stage3.py). They count model states only, per GPU
//! and per node ("per CPU"), assume mixed-precision Adam and pad host figures by a 1.5 buffer
//! factor. Stage 1/2 without offload: `4P + 16P/G` before DeepSpeed PR #5099 (which its docs'
//! t5-3b example shows: 15.93 GiB), `2P + 18P/G` since (the 16-bit gradients counted as
//! partitioned, plus an fp32 gradient partition).

use serde::Serialize;

use crate::strategy::{Stage, Strategy};

/// DeepSpeed's host-side buffer factor (its `additional_buffer_factor` default).
pub const BUFFER_FACTOR: f64 = 1.5;

/// Which version of DeepSpeed's stage 1/2 formula.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Formula {
    /// `4P + 16P/G` (before PR #5099).
    Legacy,
    /// `2P + 18P/G` (current).
    Current,
}

/// One estimate, split the way DeepSpeed's code comments split it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct DsEstimate {
    /// 16-bit parameters on the GPU, bytes (plus ZeRO-3's 4 x largest layer).
    pub gpu_params: f64,
    /// Gradients on the GPU (16-bit, and the fp32 partition in the current formula), bytes.
    pub gpu_grads: f64,
    /// fp32 master + moments on the GPU, bytes.
    pub gpu_optimizer: f64,
    /// GPU total, bytes.
    pub gpu: f64,
    /// Host memory per node, bytes.
    pub cpu_per_node: f64,
}

/// DeepSpeed's estimate for `params` on `nodes` x `gpus_per_node`, for one strategy.
/// `largest_layer` is needed for ZeRO-3; DDP has no DeepSpeed estimator (returns `None`).
/// ZeRO-3 assumes `zero_init` (DeepSpeed's default in its tables' first rows).
pub fn estimate(
    params: f64,
    largest_layer: f64,
    gpus_per_node: u64,
    nodes: u64,
    strategy: Strategy,
    formula: Formula,
) -> Option<DsEstimate> {
    let g = (gpus_per_node * nodes) as f64;
    let p = params;
    let est = match strategy.stage {
        Stage::Ddp => return None,
        Stage::Zero1 | Stage::Zero2 => {
            if strategy.offload_optimizer {
                DsEstimate {
                    gpu_params: 2.0 * p,
                    gpu_grads: 0.0,
                    gpu_optimizer: 0.0,
                    gpu: 2.0 * p,
                    cpu_per_node: p * (4.0 * g).max(16.0) * BUFFER_FACTOR,
                }
            } else {
                let (params_b, grads) = match formula {
                    Formula::Legacy => (2.0 * p, 2.0 * p + 4.0 * p / g),
                    Formula::Current => (2.0 * p, 6.0 * p / g),
                };
                let opt = 12.0 * p / g;
                DsEstimate {
                    gpu_params: params_b,
                    gpu_grads: grads,
                    gpu_optimizer: opt,
                    gpu: params_b + grads + opt,
                    cpu_per_node: p * 4.0 * gpus_per_node as f64 * BUFFER_FACTOR,
                }
            }
        }
        Stage::Zero3 => {
            let layer = 4.0 * largest_layer;
            let per_node = 1.0 / nodes as f64;
            if strategy.offload_params {
                DsEstimate {
                    gpu_params: layer,
                    gpu_grads: 0.0,
                    gpu_optimizer: 0.0,
                    gpu: layer,
                    cpu_per_node: p * 18.0 * per_node * BUFFER_FACTOR,
                }
            } else if strategy.offload_optimizer {
                let params_b = layer + (2.0 * p / g).trunc();
                DsEstimate {
                    gpu_params: params_b,
                    gpu_grads: 0.0,
                    gpu_optimizer: 0.0,
                    gpu: params_b,
                    cpu_per_node: p * 16.0 * per_node * BUFFER_FACTOR,
                }
            } else {
                // 18P/G in all; DeepSpeed does not split it, this split is stoker's reading.
                let params_b = layer + 2.0 * p / g;
                let grads = 4.0 * p / g;
                let opt = 12.0 * p / g;
                DsEstimate {
                    gpu_params: params_b,
                    gpu_grads: grads,
                    gpu_optimizer: opt,
                    gpu: params_b + grads + opt,
                    cpu_per_node: largest_layer * 4.0 * gpus_per_node as f64 * BUFFER_FACTOR,
                }
            }
        }
    };
    Some(est)
}
