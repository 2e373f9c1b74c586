//! Raw inputs as written in a TOML plan file or on the command line: every field optional,
//! merged by precedence (file < DeepSpeed config < command line) before validation.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{PlanError, Result};

/// A count written as an integer, a float (`7.5e9`) or text (`"7.5B"`).
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum Count {
    /// An integer.
    Int(i64),
    /// A float such as 7.5e9.
    Float(f64),
    /// Text such as "7.5B" or "124M".
    Text(String),
}

impl Count {
    /// The count as a positive integer, naming `field` on error.
    pub fn resolve(&self, field: &str) -> Result<u64> {
        match self {
            Count::Int(v) => crate::error::positive_int(field, *v),
            Count::Float(v) => crate::model::parse_count(field, &v.to_string()),
            Count::Text(s) => crate::model::parse_count(field, s),
        }
    }
}

/// `[model]`: a preset, an architecture, or a parameter count.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ModelInput {
    /// Preset name (see `model::MODEL_PRESETS`).
    pub preset: Option<String>,
    /// Parameter count; alone, it plans model states only (no activations).
    pub params: Option<Count>,
    /// `gpt2` or `llama` layout for a custom architecture.
    pub family: Option<String>,
    /// Transformer blocks.
    pub layers: Option<i64>,
    /// Width.
    pub hidden: Option<i64>,
    /// Attention heads.
    pub heads: Option<i64>,
    /// Key/value heads (GQA).
    pub kv_heads: Option<i64>,
    /// MLP inner width.
    pub ffn_hidden: Option<i64>,
    /// Vocabulary size.
    pub vocab: Option<i64>,
    /// Context length of the architecture (learned positions).
    pub context: Option<i64>,
    /// Output head shares the embedding.
    pub tied_embeddings: Option<bool>,
}

/// `[hardware]`: a preset and/or explicit figures.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct HardwareInput {
    /// Preset name (see `hardware::HARDWARE_PRESETS`).
    pub preset: Option<String>,
    /// Nodes.
    pub nodes: Option<i64>,
    /// Devices per node.
    pub devices_per_node: Option<i64>,
    /// Memory per device, GiB.
    pub memory_gib: Option<f64>,
    /// Host memory per node, GiB.
    pub host_memory_gib: Option<f64>,
    /// Host CPU cores per node.
    pub host_cores: Option<i64>,
    /// Peak dense TFLOP/s per dtype, e.g. `{ bf16 = 989, fp8 = 1979 }`.
    pub peak_tflops: Option<BTreeMap<String, f64>>,
    /// Dtypes the device computes without hardware for them, e.g. `["bf16"]` for a CPU
    /// without AMX or AVX512-BF16: planned at their peak when asked for, never picked by
    /// decision (b), and a request for one is warned of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub emulated: Option<Vec<String>>,
    /// Ring bus bandwidth inside a node, GB/s (bytes).
    pub intra_node_gbyte_s: Option<f64>,
    /// Network bandwidth per node, Gbit/s (bits, as NICs are sold).
    pub inter_node_gbit_s: Option<f64>,
    /// What a CPU node's cores can push through its network stack, Gbit/s (TCP is
    /// CPU-bound: measured as the unshaped path's rate); the part of a collective that
    /// costs the cores and cannot hide behind their compute. Default: the intra-node rate.
    pub host_net_gbit_s: Option<f64>,
    /// Host<->device link per device, GB/s.
    pub host_link_gbyte_s: Option<f64>,
    /// Host memory bandwidth per node, GB/s.
    pub host_mem_gbyte_s: Option<f64>,
    /// One device's memory bandwidth, GB/s (an accelerator's HBM).
    pub device_mem_gbyte_s: Option<f64>,
}

/// `[training]`: batch, sequence, precision, optimizer and the model's knobs.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TrainingInput {
    /// Sequences per optimizer step over all devices.
    pub global_batch: Option<i64>,
    /// Tokens per sequence.
    pub seq_len: Option<i64>,
    /// Sequences per device per micro-step (pins the search).
    pub micro_batch: Option<i64>,
    /// Micro-steps per optimizer step (pins the search).
    pub accumulation_steps: Option<i64>,
    /// `fp32`, `fp16`, `bf16`, `bf16-pure`, `fp8`; unset lets the planner choose.
    pub precision: Option<String>,
    /// `adam` (default) or `sgd`.
    pub optimizer: Option<String>,
    /// Full activation checkpointing (default off).
    pub activation_checkpointing: Option<bool>,
    /// ZeRO-3 over more than one device keeps only each unit's input through the
    /// forward and runs the unit's forward again in its backward (default off; stoker's
    /// candle-graph path, FSDP with a checkpoint per wrapped unit).
    pub zero3_checkpoints_units: Option<bool>,
    /// Fused attention without the s x s score matrix (default: the hardware's).
    pub flash_attention: Option<bool>,
    /// Assumed model FLOP utilization, 0..1 (default from the hardware).
    pub mfu: Option<f64>,
    /// The step's own forecast of its MFU, 0..1, used where `mfu` is not given (before
    /// the hardware's): stoker's trainer sets it for the GPU-resident step from what the
    /// step asks of the device (`stoker_gpu::forecast`).
    pub forecast_mfu: Option<f64>,
    /// Times each activation of a micro-batch crosses host memory at f32 width beyond
    /// what the FLOP rate covers (default 0): a framework of unfused ops, each writing a
    /// fresh output, pays it; stoker's trainer sets it for candle's graph path.
    pub activation_passes: Option<f64>,
    /// Fragmentation allowance, fraction (default 0.05).
    pub fragmentation: Option<f64>,
    /// Safety margin, fraction of capacity kept free (default 0.10).
    pub safety_margin: Option<f64>,
    /// Gradient bucket, MiB (default 25, PyTorch DDP's `bucket_cap_mb`, also MiB).
    pub bucket_mb: Option<f64>,
    /// `stoker` (default), `deepspeed`, `deepspeed-legacy`.
    pub accounting: Option<String>,
    /// Evaluate only what this strategy needs: `ddp`, `zero1`, `zero2`, `zero3`.
    pub strategy: Option<String>,
    /// With `strategy`: optimizer offloaded.
    pub offload_optimizer: Option<bool>,
    /// With `strategy`: parameters offloaded (ZeRO-3).
    pub offload_params: Option<bool>,
    /// dtype of the gradient collectives (`fp32`, `bf16`, `fp16`; default: the
    /// precision's gradients), FSDP's `reduce_dtype`.
    pub reduce_dtype: Option<String>,
    /// dtype of the parameter all-gathers (default: the precision's weights), FSDP's
    /// `param_dtype`.
    pub gather_dtype: Option<String>,
}

/// A whole plan input, as a TOML file holds it.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PlanInput {
    /// `[model]`.
    #[serde(default)]
    pub model: ModelInput,
    /// `[hardware]`.
    #[serde(default)]
    pub hardware: HardwareInput,
    /// `[training]`.
    #[serde(default)]
    pub training: TrainingInput,
}

macro_rules! overlay_fields {
    ($base:expr, $top:expr, $($f:ident),*) => {
        $( if $top.$f.is_some() { $base.$f = $top.$f.clone(); } )*
    };
}

impl ModelInput {
    /// Fields set in `top` replace ours.
    pub fn overlay(&mut self, top: &ModelInput) {
        overlay_fields!(
            self,
            top,
            preset,
            params,
            family,
            layers,
            hidden,
            heads,
            kv_heads,
            ffn_hidden,
            vocab,
            context,
            tied_embeddings
        );
    }

    /// Whether any architecture field is set.
    pub fn has_arch_fields(&self) -> bool {
        self.family.is_some()
            || self.layers.is_some()
            || self.hidden.is_some()
            || self.heads.is_some()
            || self.kv_heads.is_some()
            || self.ffn_hidden.is_some()
            || self.vocab.is_some()
            || self.context.is_some()
            || self.tied_embeddings.is_some()
    }
}

impl HardwareInput {
    /// Fields set in `top` replace ours; peak FLOP/s merge per dtype. A preset in `top`
    /// other than ours is another device: our figures of its dtypes (peaks, `emulated`)
    /// go with ours.
    pub fn overlay(&mut self, top: &HardwareInput) {
        // Compared as the presets they stand for (`h100` is `h100-80gb`, `CPU` is `cpu`).
        let device = |p: &Option<String>| {
            p.as_deref().map(|n| {
                crate::hardware::canonical_preset(n).map_or(n.to_ascii_lowercase(), Into::into)
            })
        };
        if top.preset.is_some() && device(&top.preset) != device(&self.preset) {
            self.peak_tflops = None;
            self.emulated = None;
        }
        overlay_fields!(
            self,
            top,
            preset,
            nodes,
            devices_per_node,
            memory_gib,
            host_memory_gib,
            host_cores,
            intra_node_gbyte_s,
            inter_node_gbit_s,
            host_net_gbit_s,
            host_link_gbyte_s,
            host_mem_gbyte_s,
            device_mem_gbyte_s,
            emulated
        );
        if let Some(top_peaks) = &top.peak_tflops {
            let peaks = self.peak_tflops.get_or_insert_with(BTreeMap::new);
            for (k, v) in top_peaks {
                peaks.insert(k.clone(), *v);
            }
        }
    }
}

impl TrainingInput {
    /// Fields set in `top` replace ours.
    pub fn overlay(&mut self, top: &TrainingInput) {
        overlay_fields!(
            self,
            top,
            global_batch,
            seq_len,
            micro_batch,
            accumulation_steps,
            precision,
            optimizer,
            activation_checkpointing,
            zero3_checkpoints_units,
            flash_attention,
            mfu,
            forecast_mfu,
            activation_passes,
            fragmentation,
            safety_margin,
            bucket_mb,
            accounting,
            strategy,
            offload_optimizer,
            offload_params,
            reduce_dtype,
            gather_dtype
        );
    }
}

impl PlanInput {
    /// Fields set in `top` replace ours.
    pub fn overlay(&mut self, top: &PlanInput) {
        self.model.overlay(&top.model);
        self.hardware.overlay(&top.hardware);
        self.training.overlay(&top.training);
    }

    /// The parameter count where it is the only model input and nothing asks for a full
    /// plan: besides `model.params`, only what the model-states table reads (precision,
    /// optimizer, accounting, nodes, devices per node) may be set. Such an input plans
    /// model states only, as DeepSpeed's estimators do from a count.
    pub fn states_only_count(&self) -> Option<&Count> {
        let mut rest = self.clone();
        rest.model.params = None;
        rest.training.precision = None;
        rest.training.optimizer = None;
        rest.training.accounting = None;
        rest.hardware.nodes = None;
        rest.hardware.devices_per_node = None;
        match rest == PlanInput::default() {
            true => self.model.params.as_ref(),
            false => None,
        }
    }

    /// Parses a TOML plan file's text; `path` names it in errors.
    pub fn from_toml_str(path: &str, text: &str) -> Result<Self> {
        toml::from_str(text).map_err(|e| PlanError::Toml {
            path: path.to_string(),
            message: crate::error::toml_error_line(text, &e),
        })
    }

    /// Reads a TOML plan file.
    pub fn from_toml_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| PlanError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_toml_str(&path.display().to_string(), &text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A count with only what the model-states table reads plans states only; anything a
    /// full plan needs (an architecture, a hardware, a batch) asks for the full plan.
    #[test]
    fn a_count_alone_plans_model_states_only() {
        let text = |t: &str| PlanInput::from_toml_str("p.toml", t).unwrap();
        let alone = text("[model]\nparams = \"7B\"");
        assert_eq!(alone.states_only_count(), Some(&Count::Text("7B".into())));
        let with_table_keys = text(
            "[model]\nparams = 7000000000\n[hardware]\nnodes = 8\ndevices_per_node = 8\n\
             [training]\nprecision = \"fp16\"\noptimizer = \"adam\"\naccounting = \"deepspeed\"",
        );
        assert_eq!(
            with_table_keys.states_only_count(),
            Some(&Count::Int(7_000_000_000))
        );
        for full in [
            "[model]\nparams = \"7B\"\nheads = 32",
            "[model]\nparams = \"7B\"\n[hardware]\npreset = \"h100-80gb\"",
            "[model]\nparams = \"7B\"\n[training]\nglobal_batch = 64",
            "[model]\npreset = \"llama-7b\"",
            "[hardware]\nnodes = 2",
        ] {
            assert_eq!(text(full).states_only_count(), None, "{full}");
        }
    }
}
