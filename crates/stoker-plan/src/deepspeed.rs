//! Importing an existing DeepSpeed `ds_config.json`: batch keys (checked against the world
//! size), ZeRO stage, offload, fp16/bf16 blocks, optimizer type, bucket size.
//!
//! DeepSpeed's rule: `train_batch_size = train_micro_batch_size_per_gpu x
//! gradient_accumulation_steps x world size`; any two determine the third. Hugging Face's
//! integration writes `"auto"` for values it fills in; the planner treats those as unset.

use std::path::Path;

use serde_json::Value;

use crate::error::{PlanError, Result};
use crate::input::TrainingInput;

/// The parts of a DeepSpeed config the planner reads.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DsConfig {
    /// The file name, for messages.
    pub path: String,
    /// `train_batch_size`.
    pub train_batch_size: Option<u64>,
    /// `train_micro_batch_size_per_gpu`.
    pub micro_batch: Option<u64>,
    /// `gradient_accumulation_steps`.
    pub accumulation_steps: Option<u64>,
    /// `zero_optimization.stage` (0..=3).
    pub stage: Option<u64>,
    /// `zero_optimization.offload_optimizer.device` is cpu or nvme.
    pub offload_optimizer: bool,
    /// `zero_optimization.offload_param.device` is cpu or nvme.
    pub offload_params: bool,
    /// `"fp16"` or `"bf16"` from the enabled block, if any.
    pub precision: Option<&'static str>,
    /// The enabled `fp16` block's loss-scaler keys (fp16 only).
    pub fp16_scaler: Option<crate::deepspeed_fp16::DsLossScale>,
    /// `optimizer.type`.
    pub optimizer: Option<String>,
    /// `optimizer.params.torch_adam`: DeepSpeed runs torch's Adam instead of its fused one.
    pub torch_adam: bool,
    /// `zero_optimization.reduce_bucket_size`, elements.
    pub reduce_bucket_elems: Option<f64>,
    /// Remarks on what was read or assumed.
    pub notes: Vec<String>,
}

impl DsConfig {
    /// Reads and parses a DeepSpeed config file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| PlanError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json_str(&path.display().to_string(), &text)
    }

    /// Parses a DeepSpeed config's text; `path` names it in errors.
    pub fn from_json_str(path: &str, text: &str) -> Result<Self> {
        let v: Value = serde_json::from_str(text).map_err(|source| PlanError::Json {
            path: path.to_string(),
            source,
        })?;
        let err = |message: String| PlanError::DeepSpeed {
            path: path.to_string(),
            message,
        };
        if !v.is_object() {
            return Err(err("expected a JSON object at the top level".into()));
        }
        let mut cfg = DsConfig {
            path: path.to_string(),
            ..Default::default()
        };
        cfg.train_batch_size = count(&v, "train_batch_size").map_err(err)?;
        cfg.micro_batch = count(&v, "train_micro_batch_size_per_gpu").map_err(err)?;
        cfg.accumulation_steps = count(&v, "gradient_accumulation_steps").map_err(err)?;

        let fp16 = enabled(&v, "fp16").map_err(err)?;
        let bf16 = enabled(&v, "bf16").map_err(err)? || enabled(&v, "bfloat16").map_err(err)?;
        cfg.precision = match (fp16, bf16) {
            (true, true) => {
                return Err(err(
                    "both fp16.enabled and bf16.enabled are true; enable one".into(),
                ))
            }
            (true, false) => {
                cfg.fp16_scaler = Some(crate::deepspeed_fp16::read(&v["fp16"]).map_err(err)?);
                Some("fp16")
            }
            (false, true) => Some("bf16"),
            (false, false) => {
                cfg.notes.push(
                    "no enabled fp16/bf16 block: DeepSpeed would train in fp32; \
                     the planner chooses the precision"
                        .into(),
                );
                None
            }
        };

        if let Some(z) = v.get("zero_optimization") {
            if !z.is_object() {
                return Err(err("zero_optimization must be an object".into()));
            }
            cfg.stage = count_or_zero(z, "stage", "zero_optimization.stage").map_err(err)?;
            if let Some(s) = cfg.stage {
                if s > 3 {
                    return Err(err(format!(
                        "zero_optimization.stage must be 0..=3, got {s}"
                    )));
                }
            }
            cfg.offload_optimizer = offload(z, "offload_optimizer", &mut cfg.notes).map_err(err)?
                || z.get("cpu_offload")
                    .and_then(Value::as_bool)
                    .unwrap_or(false);
            cfg.offload_params = offload(z, "offload_param", &mut cfg.notes).map_err(err)?;
            if let Some(b) = z.get("reduce_bucket_size") {
                if !is_auto(b) {
                    let e = b.as_f64().filter(|x| *x > 0.0).ok_or_else(|| {
                        err(format!(
                            "zero_optimization.reduce_bucket_size must be a positive number, got {b}"
                        ))
                    })?;
                    cfg.reduce_bucket_elems = Some(e);
                }
            }
            let stage = cfg.stage.unwrap_or(0);
            if cfg.offload_params && stage != 3 {
                return Err(err(format!(
                    "zero_optimization.offload_param needs zero_optimization.stage 3, got {stage}"
                )));
            }
            if cfg.offload_optimizer && stage == 0 {
                return Err(err(
                    "zero_optimization.offload_optimizer needs zero_optimization.stage 1, 2 or 3, got 0"
                        .into(),
                ));
            }
        }
        if let Some(t) = v.pointer("/optimizer/type") {
            let t = t
                .as_str()
                .ok_or_else(|| err(format!("optimizer.type must be a string, got {t}")))?;
            cfg.optimizer = Some(t.to_string());
        }
        // DeepSpeed tests the raw value (`if torch_adam:`): Python's truth.
        cfg.torch_adam = v
            .pointer("/optimizer/params/torch_adam")
            .is_some_and(|t| match t {
                serde_json::Value::Null => false,
                serde_json::Value::Bool(b) => *b,
                serde_json::Value::Number(n) => n.as_f64() != Some(0.0),
                serde_json::Value::String(s) => !s.is_empty(),
                serde_json::Value::Array(a) => !a.is_empty(),
                serde_json::Value::Object(o) => !o.is_empty(),
            });
        Ok(cfg)
    }

    /// Whether DeepSpeed would run this file's optimizer as one of its fused ones (Adam,
    /// AdamW: `FusedAdam`, unless `torch_adam`), which decides its stage-0 fp16 wrapper:
    /// `FP16_Optimizer` for a fused one, `FP16_UnfusedOptimizer` otherwise (torch's
    /// optimizers, and a client's optimizer where the file names none, as Hugging Face's
    /// Trainer passes one).
    pub fn fused_optimizer(&self) -> bool {
        let adam = self
            .optimizer
            .as_deref()
            .is_some_and(|t| t.eq_ignore_ascii_case("adam") || t.eq_ignore_ascii_case("adamw"));
        adam && !self.torch_adam
    }

    /// Training inputs from this config, after checking the batch keys against `world`.
    pub fn to_training(&self, world: u64) -> Result<TrainingInput> {
        let err = |message: String| PlanError::DeepSpeed {
            path: self.path.clone(),
            message,
        };
        let (tbs, mb, gas) = (
            self.train_batch_size,
            self.micro_batch,
            self.accumulation_steps,
        );
        let (global, micro, accum) = match (tbs, mb, gas) {
            (Some(t), Some(m), Some(g)) => {
                if m.checked_mul(g).and_then(|x| x.checked_mul(world)) != Some(t) {
                    return Err(err(format!(
                        "train_batch_size {t} != train_micro_batch_size_per_gpu {m} x \
                         gradient_accumulation_steps {g} x world size {world} (= {})",
                        product(&[m, g, world])
                    )));
                }
                (Some(t), Some(m), Some(g))
            }
            (Some(t), Some(m), None) => {
                if t % m.saturating_mul(world) != 0 {
                    return Err(err(format!(
                        "train_batch_size {t} is not divisible by train_micro_batch_size_per_gpu \
                         {m} x world size {world} (= {}), so gradient_accumulation_steps is not \
                         a whole number",
                        product(&[m, world])
                    )));
                }
                (Some(t), Some(m), Some(t / m.saturating_mul(world)))
            }
            (Some(t), None, Some(g)) => {
                if t % g.saturating_mul(world) != 0 {
                    return Err(err(format!(
                        "train_batch_size {t} is not divisible by gradient_accumulation_steps {g} \
                         x world size {world} (= {}), so train_micro_batch_size_per_gpu is not a \
                         whole number",
                        product(&[g, world])
                    )));
                }
                (Some(t), Some(t / g.saturating_mul(world)), Some(g))
            }
            (None, Some(m), g) => {
                let g = g.unwrap_or(1);
                let t = m
                    .checked_mul(g)
                    .and_then(|x| x.checked_mul(world))
                    .ok_or_else(|| {
                        err(format!(
                        "train_micro_batch_size_per_gpu {m} x gradient_accumulation_steps {g} x \
                         world size {world} overflows"
                    ))
                    })?;
                (Some(t), Some(m), Some(g))
            }
            (t, None, g) => (t, None, g),
        };
        let stage = self.stage.unwrap_or(0);
        let strategy = match stage {
            0 => "ddp",
            1 => "zero1",
            2 => "zero2",
            _ => "zero3",
        };
        let as_i64 = |v: Option<u64>| v.map(|x| x as i64);
        Ok(TrainingInput {
            global_batch: as_i64(global),
            micro_batch: as_i64(micro),
            accumulation_steps: as_i64(accum),
            precision: self.precision.map(str::to_string),
            optimizer: self.optimizer.clone(),
            strategy: self.stage.map(|_| strategy.to_string()),
            offload_optimizer: Some(self.offload_optimizer),
            offload_params: Some(self.offload_params),
            // DeepSpeed buckets hold 16-bit gradients.
            bucket_mb: self
                .reduce_bucket_elems
                .map(|e| e * 2.0 / crate::hardware::MIB),
            ..Default::default()
        })
    }
}

/// The product of `factors` for a message, or "more than 2^64" when it overflows.
fn product(factors: &[u64]) -> String {
    factors
        .iter()
        .try_fold(1u64, |acc, &f| acc.checked_mul(f))
        .map_or_else(|| "more than 2^64".into(), |p| p.to_string())
}

fn is_auto(v: &Value) -> bool {
    v.as_str().is_some_and(|s| s.eq_ignore_ascii_case("auto"))
}

fn count(v: &Value, key: &str) -> std::result::Result<Option<u64>, String> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) if is_auto(x) => Ok(None),
        Some(x) => match x.as_u64() {
            Some(n) if n > 0 && n <= i64::MAX as u64 => Ok(Some(n)),
            _ => Err(format!(
                "{key} must be a positive integer up to 2^63 - 1, got {x}"
            )),
        },
    }
}

fn count_or_zero(v: &Value, key: &str, name: &str) -> std::result::Result<Option<u64>, String> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_u64()
            .map(Some)
            .ok_or_else(|| format!("{name} must be an integer 0..=3, got {x}")),
    }
}

fn enabled(v: &Value, block: &str) -> std::result::Result<bool, String> {
    match v.get(block) {
        None | Some(Value::Null) => Ok(false),
        Some(b) if !b.is_object() => Err(format!("{block} must be an object, got {b}")),
        Some(b) => match b.get("enabled") {
            None => Ok(false), // DeepSpeed: a block without "enabled" is off
            Some(Value::Bool(e)) => Ok(*e),
            Some(x) if is_auto(x) => Ok(false),
            Some(x) => Err(format!("{block}.enabled must be true or false, got {x}")),
        },
    }
}

fn offload(z: &Value, key: &str, notes: &mut Vec<String>) -> std::result::Result<bool, String> {
    let Some(o) = z.get(key) else {
        return Ok(false);
    };
    if o.is_null() {
        return Ok(false);
    }
    match o.get("device").and_then(Value::as_str) {
        None | Some("none") => Ok(false),
        Some("cpu") => Ok(true),
        Some("nvme") => {
            notes.push(format!(
                "zero_optimization.{key}.device is nvme: modelled as host memory (NVMe capacity \
                 and bandwidth are not modelled)"
            ));
            Ok(true)
        }
        Some(d) => Err(format!(
            "zero_optimization.{key}.device must be cpu, nvme or none, got {d:?}"
        )),
    }
}
