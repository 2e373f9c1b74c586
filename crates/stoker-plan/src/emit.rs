//! What a plan hands to the trainer. There is one config schema, the trainer's
//! (`stoker_train::TrainConfig`, docs/training.md); this module holds the two pieces of it
//! the planner owns:
//! - [`PlanChoice`]: the settings the plan chose (strategy, batch split, precision, loader),
//!   which `stoker plan --emit-config` writes into a training config through the trainer's
//!   own type (stoker-train depends on this crate, not the other way round);
//! - [`PlanSection`]: the `[plan]` table of a training config, the keys only the planner
//!   reads (hardware, utilization) and the predictions it wrote there (the loader's need,
//!   the step time, the peak memory). The trainer accepts the table and does not act on it.

use serde::{Deserialize, Serialize};

use crate::input::{HardwareInput, PlanInput};

/// `[model]` of a choice: what the plan assumed.
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

/// The loader of each device.
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

/// Precision.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PrecisionSection {
    /// `fp32`, `fp16`, `bf16`, `bf16-pure` or `fp8`.
    pub precision: crate::setup::Precision,
    /// `dynamic` for fp16, else `none`.
    pub loss_scaling: String,
}

/// Batch split.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AccumulationSection {
    /// Micro-steps per optimizer step.
    pub accumulation_steps: u64,
    /// Sequences per optimizer step over all devices (micro x accumulation x world).
    pub global_batch: u64,
}

/// Distribution.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParallelSection {
    /// `ddp`, `zero1`, `zero2` or `zero3`.
    pub strategy: crate::strategy::Stage,
    /// Optimizer states on the host, stepped by the CPU.
    pub offload_optimizer: bool,
    /// Parameter shards on the host (zero3 only).
    pub offload_params: bool,
    /// Data-parallel ranks.
    pub world_size: u64,
    /// Ranks per node.
    pub devices_per_node: u64,
}

/// Optimizer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OptimizerSection {
    /// `adam` (AdamW) or `sgd` (with momentum).
    pub name: String,
}

/// What the plan predicts for its choice.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PredictionSection {
    /// Seconds per optimizer step.
    pub step_s: f64,
    /// Peak bytes per device.
    pub peak_bytes: f64,
}

/// The settings a plan chose, in the planner's own terms (`config` of `--json`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanChoice {
    /// The model the plan assumed.
    pub model: ModelSection,
    /// The loader per device.
    pub data: DataSection,
    /// Precision.
    pub precision: PrecisionSection,
    /// Batch split.
    pub accumulation: AccumulationSection,
    /// Distribution.
    pub parallel: ParallelSection,
    /// Optimizer.
    pub optimizer: OptimizerSection,
    /// Predicted step time and peak memory of this choice.
    pub predicted: PredictionSection,
}

impl PlanChoice {
    /// One line for people: strategy, batch split, precision, loader.
    pub fn summary(&self) -> String {
        let p = &self.parallel;
        let a = &self.accumulation;
        let d = &self.data;
        format!(
            "{}{} on {} device(s): micro-batch {} x accumulation {} x {} = global batch {}; \
             {}{}, {}; loader {} worker(s) x prefetch {} for {:.1} samples/s \
             per device",
            p.strategy.name(),
            match (p.offload_optimizer, p.offload_params) {
                (false, false) => "",
                (true, false) => "+offload-opt",
                _ => "+offload-opt+params",
            },
            p.world_size,
            d.micro_batch,
            a.accumulation_steps,
            p.world_size,
            a.global_batch,
            self.precision.precision.name(),
            if self.precision.loss_scaling == "dynamic" {
                " with dynamic loss scaling"
            } else {
                ""
            },
            self.optimizer.name,
            d.num_workers,
            d.prefetch_factor,
            d.required_samples_per_s,
        )
    }

    /// The `[plan]` table that records this choice's predictions in a training config,
    /// keeping the hardware and knobs it was planned with so the file plans again alike.
    pub fn plan_section(&self, planned_with: &PlanInput) -> PlanSection {
        let t = &planned_with.training;
        PlanSection {
            hardware: planned_with.hardware.clone(),
            mfu: t.mfu,
            fragmentation: t.fragmentation,
            safety_margin: t.safety_margin,
            flash_attention: t.flash_attention,
            accounting: t.accounting.clone(),
            model_preset: planned_with.model.preset.clone(),
            required_samples_per_s: Some(self.data.required_samples_per_s),
            step_s: Some(self.predicted.step_s),
            peak_bytes: Some(self.predicted.peak_bytes),
            pin_memory: Some(self.data.pin_memory),
            figures_from: None,
        }
    }
}

/// `[plan]` of a training config: the keys only `stoker plan` (and `stoker tune loader
/// --from-plan`) read. Inputs: the hardware and the planner's knobs. Outputs, written by
/// `stoker plan --emit-config`: its predictions, which a later plan overwrites.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanSection {
    /// `[plan.hardware]`: the hardware to plan for (a preset and/or figures).
    #[serde(default, skip_serializing_if = "is_default")]
    pub hardware: HardwareInput,
    /// Assumed model FLOP utilization, 0..1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mfu: Option<f64>,
    /// Fragmentation allowance, fraction.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fragmentation: Option<f64>,
    /// Safety margin, fraction of capacity kept free.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub safety_margin: Option<f64>,
    /// Fused attention without the s x s score matrix.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flash_attention: Option<bool>,
    /// `stoker`, `deepspeed` or `deepspeed-legacy`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accounting: Option<String>,
    /// The model preset the config was planned from (the architecture itself is the
    /// trainer's `[model]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_preset: Option<String>,
    /// Written by the planner: samples/s one rank's loader must sustain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub required_samples_per_s: Option<f64>,
    /// Written by the planner: seconds per optimizer step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_s: Option<f64>,
    /// Written by the planner: peak bytes per device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_bytes: Option<f64>,
    /// Written by the planner: page-locked loader buffers (true only with an
    /// accelerator; the CPU trainer has no host-to-device copy to pin for).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pin_memory: Option<bool>,
    /// Where the figures above came from when a run filled them in rather than the file
    /// (this machine's profile), for the plan's lines; never written.
    #[serde(skip)]
    pub figures_from: Option<String>,
}

fn is_default<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}

impl PlanSection {
    /// Puts the planner's inputs of this table into `input` (hardware, knobs); the
    /// predictions are outputs and are not read back.
    pub fn apply_to(&self, input: &mut PlanInput) {
        input.hardware.overlay(&self.hardware);
        let t = &mut input.training;
        t.mfu = self.mfu.or(t.mfu);
        t.fragmentation = self.fragmentation.or(t.fragmentation);
        t.safety_margin = self.safety_margin.or(t.safety_margin);
        t.flash_attention = self.flash_attention.or(t.flash_attention);
        if self.accounting.is_some() {
            t.accounting = self.accounting.clone();
        }
    }
}
