//! The training config `stoker plan` emits for the trainer: a small TOML file documented in
//! docs/plan.md. Every field is something the trainer acts on; nothing is an estimate.

use serde::{Deserialize, Serialize};

/// `[model]`: what to build and how long its sequences are.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelSection {
    /// Preset name, or "custom".
    pub name: String,
    /// Parameter count the plan assumed.
    pub params: u64,
    /// Tokens per sequence.
    pub seq_len: u64,
    /// Recompute each block's activations in backward.
    pub activation_checkpointing: bool,
}

/// `[data]`: the loader of each device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DataSection {
    /// Loader workers per device.
    pub num_workers: u64,
    /// Batches prefetched per worker.
    pub prefetch_factor: u64,
    /// Page-locked host buffers for host-to-device copies (false on CPU-only hardware).
    pub pin_memory: bool,
    /// Sequences per device per micro-step.
    pub micro_batch: u64,
    /// Samples/s one device's loader must sustain.
    pub required_samples_per_s: f64,
}

/// `[precision]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PrecisionSection {
    /// `fp32`, `fp16`, `bf16`, `bf16-pure` or `fp8`.
    pub precision: String,
    /// `dynamic` for fp16, else `none`.
    pub loss_scaling: String,
}

/// `[accumulation]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AccumulationSection {
    /// Micro-steps per optimizer step.
    pub accumulation_steps: u64,
    /// Sequences per optimizer step over all devices (micro x accumulation x world).
    pub global_batch: u64,
}

/// `[parallel]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParallelSection {
    /// `ddp`, `zero1`, `zero2` or `zero3`.
    pub strategy: String,
    /// Optimizer states on the host, stepped by the CPU.
    pub offload_optimizer: bool,
    /// Parameter shards on the host (zero3 only).
    pub offload_params: bool,
    /// Data-parallel ranks.
    pub world_size: u64,
    /// Ranks per node.
    pub devices_per_node: u64,
}

/// `[optimizer]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OptimizerSection {
    /// `adam` (AdamW) or `sgd` (with momentum).
    pub name: String,
}

/// The emitted training config.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainingConfig {
    /// `[model]`.
    pub model: ModelSection,
    /// `[data]`.
    pub data: DataSection,
    /// `[precision]`.
    pub precision: PrecisionSection,
    /// `[accumulation]`.
    pub accumulation: AccumulationSection,
    /// `[parallel]`.
    pub parallel: ParallelSection,
    /// `[optimizer]`.
    pub optimizer: OptimizerSection,
}

impl TrainingConfig {
    /// The config as TOML, with a header saying where it came from.
    pub fn to_toml(&self) -> String {
        let body = toml::to_string(self).unwrap_or_else(|e| format!("# cannot serialise: {e}\n"));
        format!("# stoker training config, emitted by `stoker plan` (schema: docs/plan.md)\n{body}")
    }
}
