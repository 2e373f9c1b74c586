//! The training setup: batch, sequence, precision, optimizer, and the model's own knobs
//! (utilization, margins). Also the bytes-per-parameter table of each precision/optimizer.

use serde::{Deserialize, Serialize};

use crate::error::{PlanError, Result};

/// A matmul dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// IEEE binary32.
    Fp32,
    /// IEEE binary16.
    Fp16,
    /// bfloat16.
    Bf16,
    /// FP8 (E4M3 forward / E5M2 backward).
    Fp8,
}

impl Dtype {
    /// Parses `fp32`, `fp16`, `bf16` or `fp8` (also `f32`, `float16`, ...).
    pub fn parse(field: &str, s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "fp32" | "f32" | "float32" => Ok(Dtype::Fp32),
            "fp16" | "f16" | "float16" | "half" => Ok(Dtype::Fp16),
            "bf16" | "bfloat16" => Ok(Dtype::Bf16),
            "fp8" | "f8" => Ok(Dtype::Fp8),
            _ => Err(PlanError::UnknownOption {
                field: field.into(),
                got: s.into(),
                expected: "fp32, fp16, bf16, fp8".into(),
            }),
        }
    }
}

/// How weights, gradients and optimizer states are stored, and which dtype the matmuls use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Precision {
    /// Everything in fp32.
    Fp32,
    /// fp16 compute with fp32 master weights and dynamic loss scaling.
    Fp16,
    /// bf16 compute with fp32 master weights.
    Bf16,
    /// bf16 weights, gradients and optimizer moments; no fp32 master (llm.c-style without
    /// stochastic rounding is lossy: the planner only counts its bytes).
    Bf16Pure,
    /// fp8 matmuls (Transformer Engine style) on top of bf16 mixed precision.
    Fp8,
}

impl Precision {
    /// The precision a `training.precision` value asks for: None where it is unset or
    /// `auto` (any case), which leave decision (b) to choose; the one place `auto` is read.
    pub fn requested(field: &str, value: Option<&str>) -> Result<Option<Self>> {
        value
            .filter(|p| !p.eq_ignore_ascii_case("auto"))
            .map(|p| Self::parse(field, p))
            .transpose()
    }

    /// Parses a precision name.
    pub fn parse(field: &str, s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "fp32" | "f32" => Ok(Precision::Fp32),
            "fp16" | "f16" => Ok(Precision::Fp16),
            "bf16" => Ok(Precision::Bf16),
            "bf16-pure" | "pure-bf16" => Ok(Precision::Bf16Pure),
            "fp8" => Ok(Precision::Fp8),
            _ => Err(PlanError::UnknownOption {
                field: field.into(),
                got: s.into(),
                expected: "fp32, fp16, bf16, bf16-pure, fp8, or auto (the planner's choice)".into(),
            }),
        }
    }

    /// The name used in configs.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Fp16 => "fp16",
            Precision::Bf16 => "bf16",
            Precision::Bf16Pure => "bf16-pure",
            Precision::Fp8 => "fp8",
        }
    }

    /// The dtype the matmuls run in.
    pub fn compute_dtype(self) -> Dtype {
        match self {
            Precision::Fp32 => Dtype::Fp32,
            Precision::Fp16 => Dtype::Fp16,
            Precision::Bf16 | Precision::Bf16Pure => Dtype::Bf16,
            Precision::Fp8 => Dtype::Fp8,
        }
    }

    /// Bytes of one stored activation element (16-bit for every reduced precision; fp8
    /// recipes keep activations for the backward pass in 16 bits).
    pub fn activation_bytes(self) -> f64 {
        match self {
            Precision::Fp32 => 4.0,
            _ => 2.0,
        }
    }
}

/// The optimizer, which decides the bytes of optimizer state per parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Optimizer {
    /// Adam / AdamW: two moments per parameter.
    Adam,
    /// SGD with momentum: one buffer per parameter.
    Sgd,
}

impl Optimizer {
    /// Parses `adam`, `adamw` or `sgd`.
    pub fn parse(field: &str, s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "adam" | "adamw" | "fusedadam" | "cpuadam" | "deepspeedcpuadam" => Ok(Optimizer::Adam),
            "sgd" => Ok(Optimizer::Sgd),
            _ => Err(PlanError::UnknownOption {
                field: field.into(),
                got: s.into(),
                expected: "adam, adamw, sgd".into(),
            }),
        }
    }

    /// `training.optimizer` as given (a flag or a file), Adam where it is absent: the one
    /// place the key's name and default live.
    pub fn from_key(value: Option<&str>) -> Result<Self> {
        value.map_or(Ok(Optimizer::Adam), |s| {
            Self::parse("training.optimizer", s)
        })
    }

    /// The name used in configs.
    pub fn name(self) -> &'static str {
        match self {
            Optimizer::Adam => "adam",
            Optimizer::Sgd => "sgd",
        }
    }
}

/// Whose memory accounting to use for model states.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Accounting {
    /// stoker's: the ZeRO paper's 2 + 2 + 12 bytes per parameter, sharded per stage.
    Stoker,
    /// DeepSpeed's estimator today: ZeRO-1/2 2P + 18P/G (after its PR #5099).
    Deepspeed,
    /// DeepSpeed's estimator before PR #5099: ZeRO-1/2 4P + 16P/G (its docs' t5-3b example).
    DeepspeedLegacy,
}

impl Accounting {
    /// The flag value: `stoker`, `deepspeed`, `deepspeed-legacy`.
    pub fn name(self) -> &'static str {
        match self {
            Accounting::Stoker => "stoker",
            Accounting::Deepspeed => "deepspeed",
            Accounting::DeepspeedLegacy => "deepspeed-legacy",
        }
    }

    /// `training.accounting` as given (a flag or a file), stoker's where it is absent: the
    /// one place the key's name and default live.
    pub fn from_key(value: Option<&str>) -> Result<Self> {
        value.map_or(Ok(Accounting::Stoker), |s| {
            Self::parse("training.accounting", s)
        })
    }

    /// Parses `stoker`, `deepspeed` or `deepspeed-legacy`.
    pub fn parse(field: &str, s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "stoker" | "zero" => Ok(Accounting::Stoker),
            "deepspeed" => Ok(Accounting::Deepspeed),
            "deepspeed-legacy" => Ok(Accounting::DeepspeedLegacy),
            _ => Err(PlanError::UnknownOption {
                field: field.into(),
                got: s.into(),
                expected: "stoker, deepspeed, deepspeed-legacy".into(),
            }),
        }
    }
}

/// Bytes per parameter of each model state.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct StateBytes {
    /// Working weights (what the forward pass reads).
    pub weight: f64,
    /// Gradients, also the dtype of the gradient reduction.
    pub grad: f64,
    /// Optimizer states, including any fp32 master copy.
    pub optimizer: f64,
    /// What an offloaded optimizer keeps on the host per parameter: its states plus an fp32
    /// (or working-dtype) gradient copy and, without a master copy, the weights it updates.
    pub host_offload: f64,
}

/// Bytes per parameter for a precision and optimizer (ZeRO paper section 3.1 for mixed-precision
/// Adam: 2 + 2 + 12 = 16).
pub fn state_bytes(precision: Precision, optimizer: Optimizer) -> StateBytes {
    let moments = match optimizer {
        Optimizer::Adam => 2.0,
        Optimizer::Sgd => 1.0,
    };
    match precision {
        // 16-bit weights and gradients; fp32 master + fp32 moments.
        Precision::Fp16 | Precision::Bf16 | Precision::Fp8 => StateBytes {
            weight: 2.0,
            grad: 2.0,
            optimizer: 4.0 + 4.0 * moments,
            host_offload: 4.0 + 4.0 * moments + 4.0,
        },
        // fp32 weights and gradients; the weights are the master copy.
        Precision::Fp32 => StateBytes {
            weight: 4.0,
            grad: 4.0,
            optimizer: 4.0 * moments,
            host_offload: 4.0 * moments + 4.0 + 4.0,
        },
        // bf16 everywhere, no master copy.
        Precision::Bf16Pure => StateBytes {
            weight: 2.0,
            grad: 2.0,
            optimizer: 2.0 * moments,
            host_offload: 2.0 * moments + 2.0 + 2.0,
        },
    }
}

/// The validated training setup.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Setup {
    /// Sequences per optimizer step, over all devices.
    pub global_batch: u64,
    /// Tokens per sequence.
    pub seq_len: u64,
    /// Precision recipe (after the recommendation's fallbacks).
    pub precision: Precision,
    /// Whether the precision was asked for (otherwise the planner picks it).
    pub precision_requested: bool,
    /// Optimizer.
    pub optimizer: Optimizer,
    /// Full activation checkpointing (recompute each block in backward).
    pub activation_checkpointing: bool,
    /// ZeRO-3 over more than one device checkpoints at its units' boundaries
    /// (`training.zero3_checkpoints_units`): see [`Setup::checkpoints`].
    pub zero3_checkpoints_units: bool,
    /// Fused attention that never stores the s x s score matrix (FlashAttention).
    pub flash_attention: bool,
    /// Assumed model FLOP utilization (fraction of peak).
    pub mfu: f64,
    /// Host-memory passes over each micro-batch's activation bytes beyond the FLOP rate
    /// (`training.activation_passes`; 0 unless given).
    pub activation_passes: f64,
    /// Micro-batch per device, when pinned by the user or a DeepSpeed config.
    pub micro_batch: Option<u64>,
    /// Allocator fragmentation allowance, fraction of allocated bytes.
    pub fragmentation: f64,
    /// Headroom kept free on each device and host, fraction of capacity.
    pub safety_margin: f64,
    /// Gradient communication bucket, bytes (PyTorch DDP's bucket_cap_mb default: 25 MB).
    pub bucket_bytes: f64,
    /// Whose model-state accounting to use.
    pub accounting: Accounting,
    /// Bytes per element of the gradient collectives (reduce-scatter, all-reduce):
    /// the precision's gradient bytes unless `training.reduce_dtype` says otherwise
    /// (FSDP's `reduce_dtype`; stoker's trainer reduces FP32).
    pub reduce_bytes: f64,
    /// Bytes per element of the parameter all-gathers: the precision's weight bytes unless
    /// `training.gather_dtype` says otherwise (FSDP's `param_dtype`; stoker's trainer
    /// gathers its FP32 buffer).
    pub gather_bytes: f64,
}

impl Setup {
    /// Whether `stage` on `world` devices stores only checkpoints and runs the forward
    /// again in the backward: with full activation checkpointing, or ZeRO-3 over more
    /// than one device where it checkpoints its units.
    pub fn checkpoints(&self, stage: crate::strategy::Stage, world: u64) -> bool {
        self.activation_checkpointing
            || (self.zero3_checkpoints_units && stage == crate::strategy::Stage::Zero3 && world > 1)
    }
}

/// Bytes per element of a collective's dtype name (`fp32`, `bf16`, `fp16`, as
/// [`Dtype::parse`] reads them); fp8 is not a dtype collectives reduce or gather in.
pub fn collective_bytes(field: &str, name: &str) -> Result<f64> {
    match Dtype::parse(field, name).ok() {
        Some(Dtype::Fp32) => Ok(4.0),
        Some(Dtype::Bf16 | Dtype::Fp16) => Ok(2.0),
        Some(Dtype::Fp8) | None => Err(PlanError::UnknownOption {
            field: field.into(),
            got: name.into(),
            expected: "fp32, bf16, fp16".into(),
        }),
    }
}
