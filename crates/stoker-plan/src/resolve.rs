//! Turning raw inputs into a validated model, hardware and setup (the one place defaults live),
//! checking the batch arithmetic up front.

use serde::Serialize;

use crate::deepspeed::DsConfig;
use crate::error::{invalid, positive_f64, positive_int, PlanError, Result};
use crate::hardware::{self, DtypeSupport, Hardware, GB, GIB};
use crate::input::{HardwareInput, ModelInput, PlanInput, TrainingInput};
use crate::model::{self, Architecture, Family, ModelSpec};
use crate::precision::{self, PrecisionChoice};
use crate::setup::{state_bytes, Accounting, Dtype, Optimizer, Precision, Setup};
use crate::strategy::{Stage, Strategy};

/// Default fragmentation allowance: 5% of allocated bytes.
pub const DEFAULT_FRAGMENTATION: f64 = 0.05;
/// Default safety margin: 10% of capacity kept free.
pub const DEFAULT_SAFETY_MARGIN: f64 = 0.10;
/// Default gradient bucket: 25 MiB, PyTorch DDP's bucket_cap_mb.
pub const DEFAULT_BUCKET_MB: f64 = 25.0;

pub use crate::hardware::MIB;

/// Validated inputs, ready to plan.
#[derive(Clone, Debug, Serialize)]
pub struct Resolved {
    /// The model.
    pub model: ModelSpec,
    /// The hardware.
    pub hardware: Hardware,
    /// The training setup (precision already chosen).
    pub setup: Setup,
    /// The precision decision.
    pub precision: PrecisionChoice,
    /// A strategy pinned by `training.strategy` or a DeepSpeed config.
    pub pinned_strategy: Option<Strategy>,
    /// Accumulation steps pinned with the micro-batch.
    pub pinned_accumulation: Option<u64>,
    /// Remarks from reading the inputs (DeepSpeed notes, missing architecture, ...).
    pub notes: Vec<String>,
}

/// Resolves `file` (TOML, lowest precedence), then `ds` (a DeepSpeed config), then `cli`.
pub fn resolve(file: &PlanInput, ds: Option<&DsConfig>, cli: &PlanInput) -> Result<Resolved> {
    let mut input = file.clone();
    input.model.overlay(&cli.model);
    input.hardware.overlay(&cli.hardware);
    let model = resolve_model(&input.model)?;
    let hw = resolve_hardware(&input.hardware)?;
    let mut notes = Vec::new();
    if let Some(ds) = ds {
        let from_ds = ds.to_training(hw.world_size())?;
        input.training.overlay(&from_ds);
        notes.extend(ds.notes.iter().map(|n| format!("{}: {n}", ds.path)));
    }
    input.training.overlay(&cli.training);
    if model.arch.is_none() {
        notes.push(format!(
            "model given by parameter count only ({}): activations and ZeRO-3's gathered layers \
             are not counted; give layers/hidden/heads/vocab for them",
            crate::units::group(model.params)
        ));
    }
    let (setup, precision, pinned_strategy, pinned_accumulation) =
        resolve_training(&input.training, &model, &hw)?;
    if setup.accounting != Accounting::Stoker {
        notes.push(
            "model states follow DeepSpeed's estimator (mixed-precision Adam, GiB); DDP has no \
             DeepSpeed estimator and keeps stoker's accounting"
                .into(),
        );
    }
    Ok(Resolved {
        model,
        hardware: hw,
        setup,
        precision,
        pinned_strategy,
        pinned_accumulation,
        notes,
    })
}

fn opt_pos(field: &str, v: Option<i64>) -> Result<Option<u64>> {
    v.map(|x| positive_int(field, x)).transpose()
}

fn opt_posf(field: &str, v: Option<f64>) -> Result<Option<f64>> {
    v.map(|x| positive_f64(field, x)).transpose()
}

/// Builds the model from a preset, an architecture, or a parameter count.
pub fn resolve_model(m: &ModelInput) -> Result<ModelSpec> {
    let params = m
        .params
        .as_ref()
        .map(|c| c.resolve("model.params"))
        .transpose()?;
    let base = m.preset.as_deref().map(model::preset).transpose()?;
    // A count beside a preset or an architecture would size the model states while the
    // activations and FLOPs followed the architecture (a "7B" gpt2-124m): one or the other.
    if let (Some(p), true) = (params, base.is_some() || m.has_arch_fields()) {
        let other = match (&m.preset, m.has_arch_fields()) {
            (Some(name), false) => format!("model.preset {name:?}"),
            (Some(name), true) => format!("model.preset {name:?} and its architecture keys"),
            (None, _) => "the architecture keys (layers, hidden, ...)".to_string(),
        };
        return Err(PlanError::Unsupported(format!(
            "model.params ({p}) and {other} both give the model: the count alone plans model \
             states only; the preset or architecture counts its own parameters and also plans \
             activations and FLOPs. Give one"
        )));
    }
    if !m.has_arch_fields() {
        return match (base, params) {
            (Some(spec), _) => Ok(spec),
            (None, Some(p)) => Ok(ModelSpec::from_params(p)),
            (None, None) => {
                Err(PlanError::Missing {
                    field: "model".into(),
                    hint: format!(
                    "give a preset (--model; known: {}), a parameter count (--params 7.5e9) or \
                     an architecture (--layers --hidden --heads --vocab)",
                    model::MODEL_PRESETS.iter().map(|p| p.0).collect::<Vec<_>>().join(", ")
                ),
                })
            }
        };
    }
    let family = match m.family.as_deref() {
        None => base
            .as_ref()
            .and_then(|b| b.arch.as_ref())
            .map_or(Family::Gpt2, |a| a.family),
        Some(f) => match f.to_ascii_lowercase().as_str() {
            "gpt2" | "gpt" => Family::Gpt2,
            "llama" => Family::Llama,
            _ => {
                return Err(PlanError::UnknownOption {
                    field: "model.family".into(),
                    got: f.into(),
                    expected: "gpt2, llama".into(),
                })
            }
        },
    };
    let b = base.as_ref().and_then(|s| s.arch.clone());
    // Upper bounds far beyond any model (GPT-4-class models have ~10^2 layers and ~10^4
    // width) that keep the parameter and activation arithmetic inside 64 bits.
    let max = |field: &str| -> u64 {
        match field {
            "layers" => 100_000,
            "hidden" | "heads" | "kv_heads" => 1 << 20,
            "ffn_hidden" => 1 << 22,
            "vocab" => 1 << 26,
            _ => 1 << 24, // context
        }
    };
    let need = |field: &str, v: Option<i64>, from_base: Option<u64>| -> Result<u64> {
        match (v, from_base) {
            (Some(x), _) if x > 0 && x as u64 > max(field) => Err(invalid(
                &format!("model.{field}"),
                &format!("a positive integer up to {}", max(field)),
                x,
            )),
            (Some(x), _) => positive_int(&format!("model.{field}"), x),
            (None, Some(x)) => Ok(x),
            (None, None) => Err(PlanError::Missing {
                field: format!("model.{field}"),
                hint: "a custom architecture needs layers, hidden, heads and vocab".into(),
            }),
        }
    };
    let layers = need("layers", m.layers, b.as_ref().map(|a| a.layers))?;
    let hidden = need("hidden", m.hidden, b.as_ref().map(|a| a.hidden))?;
    let heads = need("heads", m.heads, b.as_ref().map(|a| a.heads))?;
    let vocab = need("vocab", m.vocab, b.as_ref().map(|a| a.vocab))?;
    let kv_heads = need(
        "kv_heads",
        m.kv_heads,
        Some(b.as_ref().map_or(heads, |a| a.kv_heads)),
    )?;
    let ffn_hidden = need(
        "ffn_hidden",
        m.ffn_hidden,
        Some(
            b.as_ref()
                .map_or(family.default_ffn_hidden(hidden), |a| a.ffn_hidden),
        ),
    )?;
    let context = need(
        "context",
        m.context,
        Some(b.as_ref().map_or(1024, |a| a.context)),
    )?;
    let arch = Architecture {
        family,
        layers,
        hidden,
        heads,
        kv_heads,
        ffn_hidden,
        vocab,
        context,
        tied_embeddings: m
            .tied_embeddings
            .or(b.as_ref().map(|a| a.tied_embeddings))
            .unwrap_or(family == Family::Gpt2),
    };
    let name = match &base {
        Some(s) => format!("{} (modified)", s.name),
        None => "custom".into(),
    };
    let mut spec = ModelSpec::from_arch(name, arch)?;
    spec.default_global_batch = base.and_then(|b| b.default_global_batch);
    Ok(spec)
}

/// Builds the hardware from a preset and/or explicit figures.
pub fn resolve_hardware(h: &HardwareInput) -> Result<Hardware> {
    let mut hw = match h.preset.as_deref() {
        Some(name) => hardware::preset(name)?,
        None => {
            let mem = h.memory_gib.ok_or_else(|| PlanError::Missing {
                field: "hardware.memory_gib".into(),
                hint: format!(
                    "give a hardware preset (--hardware; known: {}) or the memory per device",
                    hardware::HARDWARE_PRESETS
                        .iter()
                        .map(|p| p.0)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            })?;
            Hardware {
                name: "custom".into(),
                devices_per_node: 1,
                nodes: 1,
                device_memory: positive_f64("hardware.memory_gib", mem)? * GIB,
                host_memory: 0.0,
                host_cores: 0,
                dtypes: Default::default(),
                intra_node_bw: 0.0,
                inter_node_bw: 0.0,
                host_net_bw: 0.0,
                host_link_bw: 25.0 * GB,
                host_mem_bw: 100.0 * GB,
                device_mem_bw: 0.0,
                runtime_reserve: GIB,
                default_mfu: 0.4,
                fused_attention: false,
                accelerator: true,
            }
        }
    };
    for (field, v) in [
        ("hardware.nodes", h.nodes),
        ("hardware.devices_per_node", h.devices_per_node),
    ] {
        if v.is_some_and(|x| x > 1_000_000) {
            return Err(invalid(
                field,
                "a positive integer up to 10^6",
                v.unwrap_or(0),
            ));
        }
    }
    if let Some(v) = opt_pos("hardware.nodes", h.nodes)? {
        hw.nodes = v;
    }
    if let Some(v) = opt_pos("hardware.devices_per_node", h.devices_per_node)? {
        hw.devices_per_node = v;
    }
    if let Some(v) = opt_posf("hardware.memory_gib", h.memory_gib)? {
        hw.device_memory = v * GIB;
        // On CPUs the device's memory is the host's, shared by its ranks (docs/plan.md):
        // one figure, unless the host's is given too.
        if !hw.accelerator && h.host_memory_gib.is_none() {
            hw.host_memory = hw.device_memory;
        }
    }
    if let Some(v) = h.host_memory_gib {
        if !v.is_finite() || v < 0.0 {
            return Err(invalid(
                "hardware.host_memory_gib",
                "a non-negative number",
                v,
            ));
        }
        hw.host_memory = v * GIB;
    }
    if let Some(v) = opt_pos("hardware.host_cores", h.host_cores)? {
        hw.host_cores = v;
    }
    if let Some(v) = opt_posf("hardware.intra_node_gbyte_s", h.intra_node_gbyte_s)? {
        hw.intra_node_bw = v * GB;
    }
    if let Some(v) = opt_posf("hardware.inter_node_gbit_s", h.inter_node_gbit_s)? {
        hw.inter_node_bw = v * 1e9 / 8.0;
    }
    if let Some(v) = opt_posf("hardware.host_net_gbit_s", h.host_net_gbit_s)? {
        hw.host_net_bw = v * 1e9 / 8.0;
    }
    if let Some(v) = opt_posf("hardware.host_link_gbyte_s", h.host_link_gbyte_s)? {
        hw.host_link_bw = v * GB;
    }
    if let Some(v) = opt_posf("hardware.host_mem_gbyte_s", h.host_mem_gbyte_s)? {
        hw.host_mem_bw = v * GB;
    }
    if let Some(v) = opt_posf("hardware.device_mem_gbyte_s", h.device_mem_gbyte_s)? {
        hw.device_mem_bw = v * GB;
    }
    if let Some(peaks) = &h.peak_tflops {
        for (k, v) in peaks {
            let field = format!("hardware.peak_tflops.{k}");
            let d = Dtype::parse(&field, k)?;
            let v = positive_f64(&field, *v)?;
            hw.dtypes.insert(
                d,
                DtypeSupport {
                    peak_flops: v * 1e12,
                    native: true,
                    mfu: None,
                },
            );
        }
    }
    for name in h.emulated.iter().flatten() {
        let field = format!("hardware.emulated.{name}");
        let d = Dtype::parse(&field, name)?;
        if d == Dtype::Fp32 {
            return Err(PlanError::UnknownOption {
                field,
                got: name.clone(),
                expected: "bf16, fp16 or fp8 (fp32 is what the others are weighed against)".into(),
            });
        }
        match hw.dtypes.get_mut(&d) {
            Some(s) => s.native = false,
            None => {
                return Err(PlanError::Missing {
                    field: format!("hardware.peak_tflops.{name}"),
                    hint: format!(
                        "hardware.emulated names {name}, which the hardware has no peak for"
                    ),
                })
            }
        }
    }
    if hw.devices_per_node > 1 && hw.intra_node_bw <= 0.0 {
        return Err(PlanError::Missing {
            field: "hardware.intra_node_gbyte_s".into(),
            hint: "more than one device per node needs the intra-node bus bandwidth".into(),
        });
    }
    if hw.nodes > 1 && hw.inter_node_bw <= 0.0 {
        return Err(PlanError::Missing {
            field: "hardware.inter_node_gbit_s".into(),
            hint: "more than one node needs the inter-node bandwidth".into(),
        });
    }
    if hw.dtypes.is_empty() {
        return Err(PlanError::Missing {
            field: "hardware.peak_tflops".into(),
            hint: "give the peak dense TFLOP/s of at least one dtype, e.g. --peak-tflops bf16=312"
                .into(),
        });
    }
    Ok(hw)
}

type Training = (Setup, PrecisionChoice, Option<Strategy>, Option<u64>);

fn fraction(field: &str, v: Option<f64>, default: f64, allow_zero: bool) -> Result<f64> {
    let v = v.unwrap_or(default);
    let ok = v.is_finite() && v < 1.0 && (v > 0.0 || (allow_zero && v == 0.0));
    if !ok {
        let expected = if allow_zero {
            "a fraction in [0, 1)"
        } else {
            "a fraction in (0, 1)"
        };
        return Err(invalid(field, expected, v));
    }
    Ok(v)
}

fn resolve_training(t: &TrainingInput, model: &ModelSpec, hw: &Hardware) -> Result<Training> {
    let world = hw.world_size();
    for (field, v) in [
        ("training.global_batch", t.global_batch),
        ("training.seq_len", t.seq_len),
        ("training.micro_batch", t.micro_batch),
        ("training.accumulation_steps", t.accumulation_steps),
    ] {
        if let Some(x) = v.filter(|x| *x > 1_000_000_000) {
            return Err(invalid(field, "a positive integer up to 10^9", x));
        }
    }
    let global = match opt_pos("training.global_batch", t.global_batch)? {
        Some(g) => g,
        None => model
            .default_global_batch
            .ok_or_else(|| PlanError::Missing {
                field: "training.global_batch".into(),
                hint: "give --global-batch (sequences per optimizer step over all devices)".into(),
            })?,
    };
    let seq_len = match opt_pos("training.seq_len", t.seq_len)? {
        Some(s) => s,
        None => model
            .arch
            .as_ref()
            .map(|a| a.context)
            .ok_or_else(|| PlanError::Missing {
                field: "training.seq_len".into(),
                hint: "give --seq-len (tokens per sequence) when the model has no architecture"
                    .into(),
            })?,
    };
    // A sequence longer than the model's position table cannot be trained: the plan
    // would count tokens the run (and an emitted config) cannot give it.
    if let Some(a) = model.arch.as_ref().filter(|a| seq_len > a.context) {
        return Err(PlanError::InvalidValue {
            field: "training.seq_len".into(),
            expected: format!(
                "at most the model's context {} (its positions), or a model with a longer one",
                a.context
            ),
            got: seq_len.to_string(),
        });
    }
    if global % world != 0 {
        return Err(PlanError::Batch(format!(
            "training.global_batch {global} is not divisible by the world size {world} (hardware.nodes {} x hardware.devices_per_node {})",
            hw.nodes, hw.devices_per_node
        )));
    }
    let per_rank = global / world;
    let micro = opt_pos("training.micro_batch", t.micro_batch)?;
    let accum = opt_pos("training.accumulation_steps", t.accumulation_steps)?;
    let (micro, accum) = match (micro, accum) {
        (Some(m), Some(a)) => {
            if m.checked_mul(a).and_then(|x| x.checked_mul(world)) != Some(global) {
                return Err(PlanError::Batch(format!(
                    "micro_batch {m} x accumulation_steps {a} x world size {world} = {} != \
                     global_batch {global}",
                    m as u128 * a as u128 * world as u128
                )));
            }
            (Some(m), Some(a))
        }
        (Some(m), None) => {
            if !per_rank.is_multiple_of(m) {
                return Err(PlanError::Batch(format!(
                    "micro_batch {m} does not divide the {per_rank} sequences per device \
                     (global_batch {global} / world size {world})"
                )));
            }
            (Some(m), Some(per_rank / m))
        }
        (None, Some(a)) => {
            if !per_rank.is_multiple_of(a) {
                return Err(PlanError::Batch(format!(
                    "accumulation_steps {a} does not divide the {per_rank} sequences per device \
                     (global_batch {global} / world size {world})"
                )));
            }
            (Some(per_rank / a), Some(a))
        }
        (None, None) => (None, None),
    };
    let requested = Precision::requested("training.precision", t.precision.as_deref())?;
    let precision = precision::choose(hw, requested);
    if hw.dtype(precision.precision.compute_dtype()).is_none() {
        return Err(PlanError::Missing {
            field: format!("hardware.peak_tflops.{}", precision.precision.name()),
            hint: "the planner needs the peak FLOP/s of the dtype it computes in".into(),
        });
    }
    let optimizer = Optimizer::from_key(t.optimizer.as_deref())?;
    let accounting = Accounting::from_key(t.accounting.as_deref())?;
    let mfu = match t.mfu {
        Some(v) if v.is_finite() && v > 0.0 && v <= 1.0 => v,
        Some(v) => return Err(invalid("training.mfu", "a fraction in (0, 1]", v)),
        // The step's own forecast, then the compute dtype's measured MFU where the preset
        // has one, else its default.
        None => match t.forecast_mfu {
            Some(v) if v.is_finite() && v > 0.0 && v <= 1.0 => v,
            Some(v) => return Err(invalid("training.forecast_mfu", "a fraction in (0, 1]", v)),
            None => hw
                .dtype(precision.precision.compute_dtype())
                .and_then(|d| d.mfu)
                .unwrap_or(hw.default_mfu),
        },
    };
    let activation_passes = match t.activation_passes {
        None => 0.0,
        Some(v) if v.is_finite() && v >= 0.0 => v,
        Some(v) => {
            return Err(invalid(
                "training.activation_passes",
                "a number of passes >= 0",
                v,
            ))
        }
    };
    let bucket_mb = opt_posf("training.bucket_mb", t.bucket_mb)?.unwrap_or(DEFAULT_BUCKET_MB);
    let pinned = match t.strategy.as_deref() {
        // Offload is a strategy's option: without one, every strategy is planned with and
        // without it, and the flag would be ignored (it was, silently).
        None if t.offload_optimizer == Some(true) || t.offload_params == Some(true) => {
            let key = match t.offload_optimizer == Some(true) {
                true => "training.offload_optimizer",
                false => "training.offload_params",
            };
            return Err(PlanError::Unsupported(format!(
                "{key}: offload is an option of the strategy asked for: give training.strategy \
                 (--strategy) too; without one the plan weighs every strategy with and without \
                 offload"
            )));
        }
        None => None,
        Some(s) => {
            let stage = match s.to_ascii_lowercase().as_str() {
                "ddp" | "zero0" => Stage::Ddp,
                "zero1" => Stage::Zero1,
                "zero2" => Stage::Zero2,
                "zero3" => Stage::Zero3,
                _ => {
                    return Err(PlanError::UnknownOption {
                        field: "training.strategy".into(),
                        got: s.into(),
                        expected: "ddp, zero1, zero2, zero3".into(),
                    })
                }
            };
            Some(Strategy::new(
                stage,
                t.offload_optimizer.unwrap_or(false),
                t.offload_params.unwrap_or(false),
            )?)
        }
    };
    let setup = Setup {
        global_batch: global,
        seq_len,
        precision: precision.precision,
        precision_requested: requested.is_some(),
        optimizer,
        activation_checkpointing: t.activation_checkpointing.unwrap_or(false),
        zero3_checkpoints_units: t.zero3_checkpoints_units.unwrap_or(false),
        flash_attention: t.flash_attention.unwrap_or(hw.fused_attention),
        mfu,
        activation_passes,
        micro_batch: micro,
        fragmentation: fraction(
            "training.fragmentation",
            t.fragmentation,
            DEFAULT_FRAGMENTATION,
            true,
        )?,
        safety_margin: fraction(
            "training.safety_margin",
            t.safety_margin,
            DEFAULT_SAFETY_MARGIN,
            true,
        )?,
        bucket_bytes: bucket_mb * MIB,
        accounting,
        reduce_bytes: match &t.reduce_dtype {
            Some(d) => crate::setup::collective_bytes("training.reduce_dtype", d)?,
            None => state_bytes(precision.precision, optimizer).grad,
        },
        gather_bytes: match &t.gather_dtype {
            Some(d) => crate::setup::collective_bytes("training.gather_dtype", d)?,
            None => state_bytes(precision.precision, optimizer).weight,
        },
    };
    Ok((setup, precision, pinned, accum))
}
