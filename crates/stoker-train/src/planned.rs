//! The joint between `stoker plan` and `stoker train`, so that the two share one config
//! schema (this crate's [`TrainConfig`]):
//! - [`plan_input`]: a training config (plus command-line flags on top) as the planner's
//!   input: the model's architecture, the batch, precision, optimizer, strategy, and the
//!   `[plan]` table's hardware;
//! - [`emit`]: a plan's choice written into a training config, keeping every key the plan
//!   does not decide from the config it started from, so `stoker train` runs the file as
//!   is;
//! - [`predicted`]: the planner's bytes held and sent per rank for a config at its
//!   parallel degrees, which the run's end and the dry run hold the trainer to;
//! - [`forecast`]: the planner's peak memory and step time for a run as configured.
//!
//! Keys only one side reads are listed in docs/plan.md; the planner's own live in
//! `[plan]` ([`PlanSection`]), which the trainer accepts and does not act on.

use std::path::PathBuf;

use stoker_plan::emit::PlanSection;
use stoker_plan::hardware::Hardware;
use stoker_plan::input::PlanInput;
use stoker_plan::model::{Architecture, Family};
use stoker_plan::setup::Precision as PlanPrecision;
use stoker_plan::strategy::Stage;
use stoker_plan::trainer::{GroupSpans, TrainerPrediction, TrainerRun};
use stoker_plan::Plan;

use crate::config::{OptimizerKind, StepKind, StrategyKind, TrainConfig};
use crate::error::{config_err, Result};
use crate::layout::FlatLayout;
use crate::models::ModelConfig;
use crate::models::{GptConfig, LlamaConfig};
use crate::parallel::ParallelDims;
use crate::precision::{Kernels, Precision};

/// The planner's name of a trainer precision.
pub(crate) fn plan_precision(p: Precision) -> &'static str {
    match p {
        Precision::Fp32 => "fp32",
        Precision::Bf16 => "bf16",
        Precision::Fp16 => "fp16",
        Precision::Fp8 => "fp8",
        Precision::Fp64 => "fp64",
    }
}

/// The trainer's precision for the planner's; bf16-pure (no FP32 master) is refused,
/// naming `precision`.
pub fn train_precision(p: PlanPrecision) -> Result<Precision> {
    match p {
        PlanPrecision::Fp32 => Ok(Precision::Fp32),
        PlanPrecision::Bf16 => Ok(Precision::Bf16),
        PlanPrecision::Fp16 => Ok(Precision::Fp16),
        PlanPrecision::Fp8 => Ok(Precision::Fp8),
        PlanPrecision::Bf16Pure => Err(config_err(
            "precision",
            "the plan chose bf16-pure (bf16 weights and moments, no FP32 master), which the \
             trainer does not build (it keeps FP32 master weights); plan with --precision bf16",
        )),
    }
}

/// The trainer's strategy for the planner's stage.
fn train_strategy(stage: Stage) -> StrategyKind {
    match stage {
        Stage::Ddp => StrategyKind::Ddp,
        Stage::Zero1 => StrategyKind::Zero1,
        Stage::Zero2 => StrategyKind::Zero2,
        Stage::Zero3 => StrategyKind::Zero3,
    }
}

/// A training config as the planner's input, with `flags` (the command line) on top:
/// the GPT's or Llama's architecture, its context as the sequence length, the batch (micro-batch and
/// accumulation pinned when the config gives them), precision, optimizer, strategy, and
/// `[plan]`'s hardware and knobs. Only transformers (GPT, Llama) can be planned: the planner models
/// transformers (`stoker train --dry-run` counts any model's bytes).
pub fn plan_input(cfg: &TrainConfig, flags: &PlanInput) -> Result<PlanInput> {
    // (family, layers, width, heads, kv heads, MLP width, vocab, context, tied head)
    let arch = match &cfg.model {
        ModelConfig::Gpt(g) => (
            "gpt2",
            g.n_layer,
            g.d_model,
            g.n_head,
            g.n_head,
            4 * g.d_model,
            g.vocab,
            g.context,
            true,
        ),
        ModelConfig::Llama(l) => {
            let d = l.dims();
            (
                "llama",
                d.n_layer,
                d.d_model,
                d.n_head,
                d.n_kv_head,
                d.ffn_hidden,
                d.vocab,
                d.context,
                false,
            )
        }
        ModelConfig::Cnn(_) | ModelConfig::Mlp(_) => {
            return Err(config_err(
                "model.kind",
                "the planner models transformers (GPT, Llama); for a CNN or MLP, `stoker \
                 train --dry-run CONFIG` prints the bytes the run will hold",
            ))
        }
    };
    let (family, layers, hidden, heads, kv_heads, ffn, vocab, context, tied) = arch;
    let mut input = PlanInput::default();
    if let Some(section) = &cfg.plan {
        section.apply_to(&mut input);
        input.model.preset = section.model_preset.clone();
    }
    let m = &mut input.model;
    m.family = Some(family.into());
    m.layers = Some(layers as i64);
    m.hidden = Some(hidden as i64);
    m.heads = Some(heads as i64);
    m.kv_heads = Some(kv_heads as i64);
    m.ffn_hidden = Some(ffn as i64);
    m.vocab = Some(vocab as i64);
    m.context = Some(context as i64);
    m.tied_embeddings = Some(tied);
    let t = &mut input.training;
    t.seq_len = Some(context as i64);
    t.micro_batch = Some(cfg.batch.micro_batch as i64);
    t.accumulation_steps = cfg.batch.accumulation_steps.map(|k| k as i64);
    t.global_batch = cfg.batch.global_batch.map(|b| b as i64);
    t.precision = Some(plan_precision(cfg.precision).into());
    t.optimizer = Some(
        match cfg.optimizer.kind {
            OptimizerKind::Adamw => "adam",
            OptimizerKind::Sgd => "sgd",
        }
        .into(),
    );
    t.strategy = Some(cfg.parallel.strategy.stage().name().into());
    t.offload_optimizer = Some(cfg.parallel.offload_optimizer);
    // The trainer's collectives move its FP32 gradients and FP32 parameter buffer.
    t.reduce_dtype = Some("fp32".into());
    t.gather_dtype = Some("fp32".into());
    t.bucket_mb = Some(cfg.parallel.bucket_cap_mb);
    if let Some(w) = cfg.batch.world_size {
        let h = &mut input.hardware;
        if h.nodes.is_none() && h.devices_per_node.is_none() {
            h.nodes = Some(1);
            h.devices_per_node = Some(w as i64);
        }
    }
    input.model.overlay(&flags.model);
    input.hardware.overlay(&flags.hardware);
    input.training.overlay(&flags.training);
    pin_world(cfg, &mut input)?;
    // The path the run will take at the precision planned (a `--precision` flag may
    // change it: fp16 and fp8 run on candle's graph; `auto` has been settled into the
    // config by then, and a bad name is the resolver's to refuse).
    let precision =
        PlanPrecision::requested("training.precision", input.training.precision.as_deref())
            .ok()
            .flatten()
            .and_then(|p| train_precision(p).ok())
            .unwrap_or(cfg.precision);
    if input.training.mfu.is_none() {
        input.training.forecast_mfu = resident_forecast_mfu(cfg, &input, precision)?;
    }
    if !cfg.direct_step_at(precision) {
        // Candle's graph path: ZeRO-3 over several ranks runs each unit's forward again
        // in the backward (docs/zero.md), and unfused ops move the activations through
        // memory beyond the direct step's rate, which the preset's MFU is. A given MFU
        // (a calibration of this config's own step) covers the traffic already.
        let t = &mut input.training;
        t.zero3_checkpoints_units.get_or_insert(true);
        if t.mfu.is_none() {
            t.activation_passes.get_or_insert(GRAPH_ACTIVATION_PASSES);
        }
    }
    Ok(input)
}

/// The planner's MFU of `cfg`'s GPU-resident step forecast on `input`'s hardware
/// ([`crate::resident_forecast`]): the planner's FLOPs of a micro-batch (PaLM's count)
/// over the peak and the forecast time, so its compute time is the forecast's. None off
/// the resident step or off an accelerator.
fn resident_forecast_mfu(
    cfg: &TrainConfig,
    input: &PlanInput,
    precision: Precision,
) -> Result<Option<f64>> {
    let plan_err = |e: stoker_plan::error::PlanError| config_err("plan", e.to_string());
    let hw = stoker_plan::resolve::resolve_hardware(&input.hardware).map_err(plan_err)?;
    let Some(f) = crate::resident_forecast::resident_forecast(cfg, &hw, precision)? else {
        return Ok(None);
    };
    let model = stoker_plan::resolve::resolve_model(&input.model).map_err(plan_err)?;
    let (b, t) = f.shape;
    let flops = (b * t) as f64 * model.train_flops_per_token(t as u64);
    let mfu = flops / (f.figures.peak_flops * f.micro_batch_s());
    Ok((mfu.is_finite() && mfu > 0.0).then_some(mfu.min(1.0)))
}

/// `stoker plan`'s line for a config on the resident step and an accelerator: the
/// forecast of one micro-batch's step on one device of `hw` (where the time goes) and,
/// where something is kept per block, what recomputing attention and the MLP's
/// activation would cost (the memory it saves is the resident loop's line). None where
/// there is no forecast.
pub fn resident_forecast_line(cfg: &TrainConfig, hw: &Hardware) -> Result<Option<String>> {
    use crate::resident_forecast::resident_forecast;
    let Some(f) = resident_forecast(cfg, hw, cfg.precision)? else {
        return Ok(None);
    };
    let mut line = f.line();
    let most = crate::config::Recompute::most(cfg.flash_attention);
    if cfg.recompute != most {
        let mut c = cfg.clone();
        c.recompute = most;
        if let Some(r) = resident_forecast(&c, hw, cfg.precision)? {
            let (now, then) = (f.micro_batch_s(), r.micro_batch_s());
            line.push_str(&format!(
                "; with recompute = \"{}\": {:.2} ms (+{:.1}%)",
                most.name(),
                then * 1e3,
                100.0 * (then / now - 1.0)
            ));
        }
    }
    Ok(Some(line))
}

/// Host-memory passes over each micro-batch's activation bytes that candle's graph path
/// makes beyond the direct step's rate (each unfused op writes a fresh output): fitted on
/// the demo's GPT (d 128, 4 layers, context 128, batch 16, fp32) as the graph step's time
/// over the direct step's, four alternating runs each (161 vs 94 ms), over the planner's
/// activation bytes (74.2 MB) at the `cpu` preset's 8 GB/s (docs/plan.md, "The graph
/// path's step").
pub const GRAPH_ACTIVATION_PASSES: f64 = 7.0;

/// Checks `batch.world_size` against the hardware's device count, and fills the global
/// batch when the config gives only the micro-batch (and accumulation): DeepSpeed's rule
/// `global = micro x accumulation x world` at the hardware's world size.
fn pin_world(cfg: &TrainConfig, input: &mut PlanInput) -> Result<()> {
    let hw = stoker_plan::resolve::resolve_hardware(&input.hardware)
        .map_err(|e| config_err("plan.hardware", e.to_string()))?;
    let world = hw.world_size();
    if let Some(w) = cfg.batch.world_size {
        if w as u64 != world {
            return Err(config_err(
                "batch.world_size",
                format!(
                    "{w}, but the hardware planned for ([plan.hardware] or --nodes x \
                     --devices-per-node) has {world} devices"
                ),
            ));
        }
    }
    let t = &mut input.training;
    if t.global_batch.is_none() {
        let micro = t.micro_batch.unwrap_or(1);
        let k = t.accumulation_steps.unwrap_or(1);
        t.global_batch = micro
            .checked_mul(k)
            .and_then(|v| v.checked_mul(world as i64));
    }
    Ok(())
}

/// Where a config emitted without a training config to start from puts its run and reads
/// its data.
#[derive(Clone, Debug)]
pub struct EmitPlace {
    /// `run_dir`.
    pub run_dir: PathBuf,
    /// `data.train`.
    pub train_data: PathBuf,
}

/// The trainer's model for the plan's architecture: a GPT for GPT-2's layout (learned
/// positions, tied head, 4h MLP, one key/value head per head), a Llama for the Llama
/// family (rotary positions, grouped-query attention, SwiGLU of the plan's width, untied
/// head). What the trainer cannot build is refused naming the key.
fn model_for(arch: &Architecture) -> Result<ModelConfig> {
    let dim = |v: u64| usize::try_from(v).map_err(|_| config_err("model", "too large"));
    let unsupported = |key: &str, what: String, layout: &str| {
        Err(config_err(
            format!("model.{key}"),
            format!("{what}: the trainer builds {layout}, so no training config is emitted"),
        ))
    };
    if arch.family == Family::Llama {
        if arch.tied_embeddings {
            return unsupported(
                "tied_embeddings",
                "true".into(),
                "the Llama with an untied head",
            );
        }
        return Ok(ModelConfig::Llama(LlamaConfig {
            vocab: dim(arch.vocab)?,
            context: dim(arch.context)?,
            d_model: dim(arch.hidden)?,
            n_layer: dim(arch.layers)?,
            n_head: dim(arch.heads)?,
            n_kv_head: Some(dim(arch.kv_heads)?),
            ffn_hidden: Some(dim(arch.ffn_hidden)?),
            rope_theta: 10_000.0,
            norm_eps: 1e-5,
            init_from: None,
        }));
    }
    let gpt2 =
        "GPT-2's layout (learned positions, LayerNorm, GELU, 4h MLP, tied head) or the Llama";
    if arch.family != Family::Gpt2 {
        return unsupported("family", format!("{:?}", arch.family).to_lowercase(), gpt2);
    }
    if arch.ffn_hidden != 4 * arch.hidden {
        return unsupported(
            "ffn_hidden",
            format!("{} (not 4 x {})", arch.ffn_hidden, arch.hidden),
            gpt2,
        );
    }
    if arch.kv_heads != arch.heads {
        return unsupported(
            "kv_heads",
            format!("{} (grouped-query attention)", arch.kv_heads),
            gpt2,
        );
    }
    if !arch.tied_embeddings {
        return unsupported("tied_embeddings", "false".into(), gpt2);
    }
    Ok(ModelConfig::Gpt(GptConfig {
        vocab: dim(arch.vocab)?,
        context: dim(arch.context)?,
        d_model: dim(arch.hidden)?,
        n_layer: dim(arch.layers)?,
        n_head: dim(arch.heads)?,
        init_from: None,
    }))
}

/// A fresh training config for `model`: nanoGPT's GPT-2 hyper-parameters (AdamW, lr 6e-4
/// decaying to 6e-5 after 100 warmup steps, betas 0.9 / 0.95, weight decay 0.1, clipping
/// at 1.0), 1000 steps. Parsed from TOML so that every other default stays the one the
/// config types declare.
fn fresh(model: &ModelConfig, place: &EmitPlace) -> Result<TrainConfig> {
    let quoted = |p: &PathBuf| toml::Value::String(p.display().to_string()).to_string();
    let model = toml::to_string(model).map_err(|e| config_err("model", e.to_string()))?;
    let text = format!(
        "run_dir = {run_dir}\n\
         [data]\ntrain = {train}\n\
         [model]\n{model}\
         [batch]\nmicro_batch = 1\n\
         [optimizer]\nkind = \"adamw\"\nlr = 6e-4\nmin_lr = 6e-5\nwarmup_steps = 100\n\
         beta2 = 0.95\nweight_decay = 0.1\ngrad_clip = 1.0\n\
         [train]\nsteps = 1000\neval_every = 100\ncheckpoint_every = 500\n",
        run_dir = quoted(&place.run_dir),
        train = quoted(&place.train_data),
    );
    toml::from_str(&text).map_err(|e| config_err("plan", format!("fresh config: {e}")))
}

/// The training config a plan chose: `base` (the config planned from, if any; else a
/// fresh one at `place`) with the plan's decisions written in: `[batch]` (micro-batch,
/// accumulation, world size, global batch), `precision`, `[parallel] strategy` and
/// `offload_optimizer`, `[data]` workers and prefetch, the optimizer kind, the model's
/// sizes (its context cut to the planned sequence length), `device` (`cuda` on an accelerator), and `[plan]` with the predictions.
/// `planned_with` is the merged planner input, kept in `[plan]` so the file plans again
/// alike.
pub fn emit(
    plan: &Plan,
    planned_with: &PlanInput,
    base: Option<&TrainConfig>,
    place: &EmitPlace,
) -> Result<TrainConfig> {
    let choice = plan.choice.as_ref().ok_or_else(|| {
        config_err(
            "parallel.strategy",
            "no strategy fits, so there is no training config to emit",
        )
    })?;
    let arch = plan.inputs.model.arch.as_ref().ok_or_else(|| {
        config_err(
            "model",
            "the plan knows only a parameter count; the trainer needs an architecture \
             (a preset, or --layers --hidden --heads --vocab --context)",
        )
    })?;
    if choice.model.activation_checkpointing {
        return Err(config_err(
            "model.activation_checkpointing",
            "the plan recomputes activations, which the trainer does not do; plan without \
             --activation-checkpointing",
        ));
    }
    if choice.parallel.offload_params {
        return Err(config_err(
            "parallel.offload_params",
            "the plan offloads parameters, which the trainer does not build",
        ));
    }
    let mut model = model_for(arch)?;
    // The trainer's windows are `context` tokens long: a plan for shorter sequences than
    // the architecture's context trains that many (and a position table that size).
    let seq = usize::try_from(plan.inputs.setup.seq_len).unwrap_or(usize::MAX);
    match &mut model {
        ModelConfig::Gpt(g) => g.context = g.context.min(seq),
        ModelConfig::Llama(l) => l.context = l.context.min(seq),
        ModelConfig::Cnn(_) | ModelConfig::Mlp(_) => {}
    }
    let mut cfg = match base {
        Some(b) => b.clone(),
        None => fresh(&model, place)?,
    };
    // What the plan's architecture does not say stays the base config's.
    match (&mut model, &cfg.model) {
        (ModelConfig::Gpt(new), ModelConfig::Gpt(old)) => new.init_from = old.init_from.clone(),
        (ModelConfig::Llama(new), ModelConfig::Llama(old)) => {
            new.init_from = old.init_from.clone();
            new.rope_theta = old.rope_theta;
            new.norm_eps = old.norm_eps;
        }
        _ => {}
    }
    cfg.model = model;
    let usize_of = |key: &str, v: u64| {
        usize::try_from(v).map_err(|_| config_err(key, format!("{v} does not fit this machine")))
    };
    cfg.batch.micro_batch = usize_of("batch.micro_batch", choice.data.micro_batch)?;
    cfg.batch.accumulation_steps = Some(usize_of(
        "batch.accumulation_steps",
        choice.accumulation.accumulation_steps,
    )?);
    cfg.batch.world_size = Some(usize_of("batch.world_size", choice.parallel.world_size)?);
    cfg.batch.global_batch = Some(usize_of(
        "batch.global_batch",
        choice.accumulation.global_batch,
    )?);
    cfg.precision = train_precision(choice.precision.precision)?;
    if !cfg.precision.needs_loss_scaling() {
        // The fp16 scaler's settings, where the plan chose another precision (which
        // refuses them).
        cfg.loss_scale = None;
    }
    cfg.parallel.strategy = train_strategy(choice.parallel.strategy);
    cfg.parallel.offload_optimizer = choice.parallel.offload_optimizer;
    cfg.optimizer.kind = match choice.optimizer.name.as_str() {
        "sgd" => OptimizerKind::Sgd,
        _ => OptimizerKind::Adamw,
    };
    cfg.data.num_workers = usize_of("data.num_workers", choice.data.num_workers)?;
    cfg.data.prefetch_factor = usize_of("data.prefetch_factor", choice.data.prefetch_factor)?;
    if cfg.data.num_workers == 0 {
        // Workers kept between epochs need workers (as torch's DataLoader says).
        cfg.data.persistent_workers = false;
    }
    if plan.inputs.hardware.accelerator {
        cfg.device = "cuda".into();
        // A GPU runs candle's CUDA ops, or the resident step a config already chose; the
        // handwritten step and the fused ops are CPU kernels.
        if cfg.step != Some(StepKind::Resident) {
            (cfg.step, cfg.kernels) = (Some(StepKind::Graph), Kernels::Composed);
        }
    }
    // The step by its own key, settled by the parser's rule (before: a preset's config
    // said `kernels = "direct"`, its older name, and every run of it warned so).
    cfg.resolve_step(false)?;
    let section: PlanSection = choice.plan_section(planned_with);
    cfg.plan = Some(section);
    Ok(cfg)
}

/// The emitted file: a header naming the plan, then the config in the trainer's schema.
pub fn to_toml(cfg: &TrainConfig, summary: &str) -> Result<String> {
    let body = toml::to_string(cfg).map_err(|e| config_err("plan", e.to_string()))?;
    Ok(format!(
        "# stoker training config emitted by `stoker plan` (the trainer's schema: \
         docs/training.md;\n# [plan] is read by the planner only: docs/plan.md)\n\
         # chosen: {summary}\n{body}"
    ))
}

/// What a run of stoker's own trainer holds per rank, from the trainer's count of its
/// buffers rather than the planner's formulas for any model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OwnBytes {
    /// The process before the run allocated anything (code, libraries, communicator),
    /// measured at its start, and the code its step first runs after that (resident as it
    /// runs; measured across the setup and the scratch micro-batch): the CPU's counterpart
    /// of an accelerator's runtime reserve.
    pub baseline: f64,
    /// Parameters, gradients and optimizer states ([`stoker_plan::trainer`], exact).
    pub model_states: f64,
    /// The strategy's communication buffers (buckets, shards, gathered groups) and the
    /// accumulation's extra gradient buffers, as the trainer sized them
    /// (`HeldBytes::buffers`).
    pub buffers: f64,
    /// The direct step's activation buffers and bf16 GEMM packing buffers
    /// (`stoker_kernels::activation_floats`, `gemm_pack_bytes`), or what a scratch
    /// micro-batch counted on the graph path; None where nothing counted them (ranks as
    /// threads, no heap counter, a model too large to try), where the planner's formula
    /// stands in.
    pub activations: Option<f64>,
    /// The kernels' scratch beyond the activation buffers (the f32 gemm crate's per-call
    /// packs; its per-thread slabs are made before the start probes), measured by one
    /// scratch micro-batch; 0 where not.
    pub workspace: f64,
    /// The resident loop's own FP32 master, optimizer state and offload buffers on the
    /// host build, whose backend is this process's heap (`ResidentBytes::state` +
    /// `host`, planned; its steps' buffers are `activations`); 0 elsewhere.
    pub backend: f64,
    /// The loader's batch buffers: one per batch in flight plus the one being used.
    pub loader: f64,
    /// The data files the run maps (`Datasets::mapped_bytes`): resident as file-backed
    /// pages once read, and an epoch reads every page. Not heap.
    pub mapped: f64,
    /// Heap bytes live before the run allocated anything, where the binary counts them.
    pub baseline_heap: Option<f64>,
}

/// The planner's forecast for one run as configured (its own strategy and batch split, not
/// the planner's recommendation), which the run's end sets beside what it measured.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RunForecast {
    /// The hardware planned for: `[plan.hardware]`'s preset (default `cpu`), "with
    /// [plan]'s figures" where the config gives peaks or an MFU (a calibration's), "with
    /// this machine's profile PATH" where the run planned on it; `none`
    /// where the planner cannot model the run and only the trainer's count stands.
    pub hardware: String,
    /// Peak bytes per rank of training steps: with the trainer's own count, baseline +
    /// model states + communication buffers + activations + the kernels' scratch + loader
    /// buffers + mapped data files; else the planner's formula.
    pub peak_bytes: f64,
    /// The planner's formula for the same (model states, activations, buckets, runtime,
    /// fragmentation), for comparison; 0 where the planner cannot model the run.
    #[serde(default)]
    pub planner_peak_bytes: f64,
    /// Activations within `peak_bytes`.
    pub activation_bytes: f64,
    /// The kernels' scratch within `peak_bytes` (the trainer's count; 0 without it).
    #[serde(default)]
    pub workspace_bytes: f64,
    /// Mapped data files within `peak_bytes` (the trainer's count; 0 without it).
    #[serde(default)]
    pub mapped_bytes: f64,
    /// Communication and accumulation buffers within `peak_bytes` (the trainer's count;
    /// 0 without it).
    #[serde(default)]
    pub buffer_bytes: f64,
    /// Live heap bytes of training steps: the heap before the run + model states +
    /// communication buffers + activations + the kernels' scratch + loader buffers (the
    /// trainer's own count; None without it).
    #[serde(default)]
    pub heap_bytes: Option<f64>,
    /// Seconds per optimizer step; None where the planner cannot model the run (it models
    /// transformers).
    pub step_s: Option<f64>,
    /// Samples/s one rank's loader must sustain at that step time.
    pub required_samples_per_s: Option<f64>,
    /// Whether the step time rests on figures measured on this machine or typed into the
    /// config (`[plan]`'s: `stoker plan --calibrate` writes them), not the preset's alone.
    #[serde(default)]
    pub measured_figures: bool,
    /// Why the planner gave no row (then there is no step time), e.g. a CNN, which the
    /// planner does not model, or a `[plan.hardware]` that cannot hold the run's ranks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_planner_row: Option<String>,
}

impl RunForecast {
    /// What the forecast rests on, for its lines: `cpu preset` (with `[plan]`'s figures),
    /// or the trainer's count alone where the planner cannot model the run.
    pub fn basis(&self) -> String {
        match self.step_s {
            Some(_) => self.hardware.clone(),
            None => "the trainer's count; no planner row".into(),
        }
    }

    /// Why there is no planned step time (the planner's error), for the lines that
    /// would show it.
    pub fn why_no_step_time(&self) -> &str {
        self.no_planner_row
            .as_deref()
            .unwrap_or("the planner gave no row")
    }
}

/// What the planner says of one run's step: its hardware, peak memory formula,
/// activations, and time.
pub(crate) struct PlannerRow {
    hardware: String,
    /// Planned from `[plan]`'s figures, not the preset's alone.
    measured: bool,
    peak_bytes: f64,
    pub(crate) activation_bytes: f64,
    /// Seconds per optimizer step.
    pub(crate) step_s: f64,
    samples: f64,
}

/// The forecast of `cfg` launched on `world` ranks, `per_host` of them on each machine, on
/// `[plan.hardware]` or else the `cpu` preset with one device per rank (`world / per_host`
/// nodes where that divides, else one). Memory comes from the trainer's own
/// count (`own`; the planner's activations where it has none of its own) or else the
/// planner's formula; time from the planner. An error says why neither can forecast the
/// run; the run goes on without.
/// (On a CPU the ranks of one host share its cores: the planner gives each rank the
/// host's peak over the ranks on it, `Hardware::device_peak_flops`.)
pub fn forecast(
    cfg: &TrainConfig,
    world: usize,
    per_host: usize,
    own: Option<&OwnBytes>,
) -> Result<RunForecast> {
    if crate::device::TrainDevice::parse(&cfg.device)?.is_cuda() {
        // The trainer's count is of host memory and the planner's row of device memory:
        // checking either against a GPU run needs a GPU, which no session has had yet.
        return Err(config_err(
            "device",
            format!(
                "`{}`: a run on a GPU is not forecast yet (its device memory and step time have \
                 never been measured against the plan; docs/zero.md, Offload)",
                cfg.device
            ),
        ));
    }
    // Memory from the trainer's own count where it has one: with its activations (then
    // the planner's row is optional: a CNN has none), or with the planner's activations
    // where nothing counted them (ranks as threads; a model too large to try here).
    // Without a count, the planner's row alone. (Until 2026-12-07 an
    // uncounted run took the row alone, dropping the process, its buffers and its
    // mapped data: an fp8 GPT forecast 1.0 MiB for 34.7 MiB measured.)
    let with_own = |o: &OwnBytes, a: f64| {
        let held = o.model_states + o.buffers + a + o.workspace + o.backend + o.loader;
        (
            o.baseline + held + o.mapped,
            a,
            o.baseline_heap.map(|h| h + held),
        )
    };
    let (row, (peak_bytes, activation_bytes, heap_bytes)) = match own {
        Some(o) => match o.activations {
            Some(a) => (planner_row(cfg, world, per_host), with_own(o, a)),
            None => {
                let r = planner_row(cfg, world, per_host)?;
                let memory = with_own(o, r.activation_bytes);
                (Ok(r), memory)
            }
        },
        None => {
            let r = planner_row(cfg, world, per_host)?;
            let memory = (r.peak_bytes, r.activation_bytes, None);
            (Ok(r), memory)
        }
    };
    let (row, no_planner_row) = match row {
        Ok(r) => (Some(r), None),
        Err(e) => (None, Some(e.to_string())),
    };
    Ok(RunForecast {
        hardware: row.as_ref().map_or("none".into(), |r| r.hardware.clone()),
        peak_bytes,
        planner_peak_bytes: row.as_ref().map_or(0.0, |r| r.peak_bytes),
        activation_bytes,
        buffer_bytes: own.map_or(0.0, |o| o.buffers),
        workspace_bytes: own.map_or(0.0, |o| o.workspace),
        mapped_bytes: own.map_or(0.0, |o| o.mapped),
        heap_bytes,
        step_s: row.as_ref().map(|r| r.step_s),
        required_samples_per_s: row.as_ref().map(|r| r.samples / r.step_s),
        measured_figures: row.as_ref().is_some_and(|r| r.measured),
        no_planner_row,
    })
}

/// The planner's row for `cfg` as configured (see [`forecast`]).
pub(crate) fn planner_row(cfg: &TrainConfig, world: usize, per_host: usize) -> Result<PlannerRow> {
    let mut cfg = cfg.clone();
    let section = cfg.plan.get_or_insert_with(PlanSection::default);
    let h = &mut section.hardware;
    if *h == stoker_plan::input::HardwareInput::default() {
        // One device per rank.
        h.preset = Some("cpu".into());
    }
    // On CPUs the ranks of one host share its cores (and its peak): plan the hosts the
    // ranks really run on, over what a config emitted elsewhere says (`nodes = 1`).
    // (All ranks on one host are one node of `world` devices, also where the config was
    // emitted for another count.)
    let cpu = h
        .preset
        .as_deref()
        .is_some_and(stoker_plan::hardware::is_cpu_preset);
    if cpu && per_host >= 1 && per_host <= world && world.is_multiple_of(per_host) {
        h.nodes = Some((world / per_host) as i64);
        h.devices_per_node = Some(per_host as i64);
    }
    // Figures measured on this machine (`stoker plan --calibrate`) or typed into the
    // config replace the preset's, and the forecast's lines say so.
    let measured = h.peak_tflops.is_some() || section.mfu.is_some();
    let figures = section
        .figures_from
        .clone()
        .unwrap_or_else(|| "[plan]'s figures".into());
    cfg.batch.world_size = Some(world);
    let input = plan_input(&cfg, &PlanInput::default())?;
    let resolved = stoker_plan::resolve::resolve(&PlanInput::default(), None, &input)
        .map_err(|e| config_err("plan", e.to_string()))?;
    let plan = stoker_plan::plan(resolved, None);
    let row = plan
        .strategies
        .iter()
        .find(|r| Some(r.strategy) == plan.inputs.pinned_strategy)
        .ok_or_else(|| config_err("parallel.strategy", "the planner has no row for it"))?;
    Ok(PlannerRow {
        measured,
        hardware: match measured {
            true => format!("{} preset with {figures}", plan.inputs.hardware.name),
            false => format!("{} preset", plan.inputs.hardware.name),
        },
        peak_bytes: row.memory.device.total,
        activation_bytes: row.memory.device.activations,
        step_s: row.time.step_s,
        samples: (row.micro_batch * row.accumulation_steps) as f64,
    })
}

/// The planner's prediction of one rank's bytes for `config` at `dims`.
pub fn predicted(
    config: &TrainConfig,
    dims: &ParallelDims,
    layout: &FlatLayout,
) -> TrainerPrediction {
    let p = &config.parallel;
    // ZeRO-3 on the resident loop keeps ZeRO-2's bookkeeping on the host (the whole
    // master mirror, the model's variables, a shard of the moments): its backend holds
    // what it shards (`planned_resident_bytes`).
    let stage = match (dims.strategy.stage(), config.resident_loop()) {
        (Stage::Zero3, true) => Stage::Zero2,
        (stage, _) => stage,
    };
    let dtype = config.kernels.param_dtype(config.precision);
    let bf16_copy = if dtype == candle_core::DType::BF16 {
        2
    } else {
        0
    };
    // ZeRO-3 gathers by group: the root groups (first and last) once per micro-batch,
    // the blocks between them once or twice.
    let spans: Vec<u64> = layout
        .group_ranges()
        .iter()
        .map(|(_, r)| r.len() as u64)
        .collect();
    let root = spans.first().copied().unwrap_or(0) + spans.last().copied().unwrap_or(0);
    let direct = config.direct_step();
    let groups = match direct {
        true => GroupSpans {
            root: if spans.len() > 1 { root } else { root / 2 },
            blocks: spans.iter().sum::<u64>().saturating_sub(root),
            reshard_after_forward: p.reshard_after_forward,
        },
        // The graph path gathers unit by unit (parallel::units): the groups its schedule
        // gathers once count as root, those gathered twice as blocks.
        false => {
            let plan = crate::parallel::units::UnitPlan::for_model(
                &config.model,
                config.precision,
                config.kernels,
                layout,
                p.reshard_after_forward,
            );
            let (mut once, mut twice) = (0u64, 0u64);
            match plan {
                Ok(plan) => {
                    for (n, s) in plan.gathers().into_iter().zip(&plan.spans) {
                        match n {
                            1 => once += s.len() as u64,
                            _ => twice += s.len() as u64,
                        }
                    }
                }
                // A model whose units cannot be planned fails the trainer's build first;
                // here it counts as one unit.
                Err(_) => once = layout.total_len() as u64,
            }
            GroupSpans {
                root: once,
                blocks: twice,
                reshard_after_forward: true,
            }
        }
    };
    let mut prediction = stoker_plan::trainer::predict(&TrainerRun {
        flat_len: layout.total_len() as u64,
        world: dims.world as u64,
        stage,
        moments: match config.optimizer.kind {
            OptimizerKind::Adamw => 2,
            OptimizerKind::Sgd => 1,
        },
        // Under ZeRO-3 the model's candle variables give way to a shell.
        copy_bytes: match stage {
            Stage::Zero3 if dims.world > 1 => bf16_copy as u64,
            _ => (dtype.size_in_bytes() + bf16_copy) as u64,
        },
        accumulation: dims.accumulation_steps as u64,
        reduce_every_micro_batch: match stage {
            Stage::Zero1 => false,
            Stage::Zero2 => p.sync_every_micro_batch.unwrap_or(true),
            _ => p.sync_every_micro_batch.unwrap_or(false),
        },
        deterministic: p.deterministic,
        groups,
        direct,
        resident: resident_schedule(config),
    });
    // The resident loop's gradients stay on its backend: the trainer keeps none beside
    // ZeRO-2's shard (ZeRO-3 on the loop is ZeRO-2's bookkeeping; one rank shards
    // nothing).
    if config.resident_loop() && (stage != Stage::Zero2 || dims.world == 1) {
        prediction.grads = 0.0;
    }
    prediction
}

/// The resident loop's schedule of collectives under ZeRO-2 and ZeRO-3 for `config` (its
/// blocks as the loop's step sizes them); None off the loop or under another strategy.
fn resident_schedule(config: &TrainConfig) -> Option<stoker_plan::trainer::ResidentLoop> {
    let zero3 = match config.parallel.strategy {
        StrategyKind::Zero2 => false,
        StrategyKind::Zero3 => true,
        _ => return None,
    };
    if !config.resident_loop() {
        return None;
    }
    let (blocks, block_len) = crate::trainer::resident_blocks(&config.model)?;
    Some(stoker_plan::trainer::ResidentLoop {
        blocks: blocks as u64,
        block_len: block_len as u64,
        gathers_blocks: zero3,
    })
}

/// `stoker plan`'s line for a config on the resident loop: what the loop holds on its
/// backend at rank 0 of `world`, planned from the sizes its buffers are made with
/// ([`crate::trainer::planned_resident_bytes`]), and its share of `device` (the plan's
/// hardware: name and bytes per device) where there is one. None off the resident loop.
pub fn resident_plan_line(
    cfg: &TrainConfig,
    world: usize,
    device: Option<(&str, f64)>,
) -> Result<Option<String>> {
    if !cfg.resident_loop() {
        return Ok(None);
    }
    let meta = crate::models::build_meta_model_on(
        &cfg.model,
        cfg.precision,
        cfg.kernels,
        cfg.seed,
        &candle_core::Device::Cpu,
    )?;
    let len = FlatLayout::of(meta.params())?.total_len();
    let Some(b) = crate::trainer::planned_resident_bytes(cfg, len, (0, world.max(1))) else {
        return Ok(None);
    };
    let mib = |x: usize| x as f64 / (1 << 20) as f64;
    let share = match device {
        Some((name, bytes)) if bytes > 0.0 => {
            let largest =
                |c: &TrainConfig| largest_resident_micro_batch(c, len, world.max(1), 0.9 * bytes);
            // Where some activation is kept per block, what recomputing attention's
            // probabilities and the MLP's activation would allow (the step's largest
            // activations).
            let most = crate::config::Recompute::most(cfg.flash_attention);
            let recomputed = match cfg.recompute == most {
                true => String::new(),
                false => {
                    let mut c = cfg.clone();
                    c.recompute = most;
                    format!(" ({} with recompute = \"{}\")", largest(&c), most.name())
                }
            };
            format!(
                ", {:.1}% of the {name}'s {:.1} GiB; the largest micro-batch within 90% of \
                 it: {}{recomputed}",
                100.0 * b.total() as f64 / bytes,
                bytes / (1u64 << 30) as f64,
                largest(cfg)
            )
        }
        _ => String::new(),
    };
    // An offload's host memory, beside the planner's host row (bytes a parameter).
    let host = match b.host {
        0 => String::new(),
        h => format!(
            "; offload's host memory {:.2} MiB ({:.2} bytes a parameter)",
            mib(h),
            h as f64 / len.max(1) as f64
        ),
    };
    Ok(Some(format!(
        "resident loop per rank ({} on {world} rank(s), micro-batch {} x {}): {:.2} MiB \
         planned from its buffers (master and optimizer {:.2} + step {:.2}){share}{host}",
        cfg.parallel.strategy.name(),
        cfg.batch.micro_batch,
        cfg.model.context().unwrap_or(1),
        mib(b.total()),
        mib(b.state),
        mib(b.steps),
    )))
}

/// The largest micro-batch whose resident loop (planned, rank 0 of `world`, over a flat
/// layout of `len` elements) stays within `budget` bytes (for fp8, with rows that are a
/// multiple of 16): 0 where none does, not even one sequence, or for fp8 not the fewest
/// sequences whose rows are a multiple of 16. The step's buffers grow with the
/// micro-batch; the state does not.
fn largest_resident_micro_batch(cfg: &TrainConfig, len: usize, world: usize, budget: f64) -> usize {
    let fits = |b: usize| {
        let mut c = cfg.clone();
        c.batch.micro_batch = b;
        crate::trainer::planned_resident_bytes(&c, len, (0, world))
            .is_some_and(|p| p.total() as f64 <= budget)
    };
    if !fits(1) {
        return 0;
    }
    // Doubling to a bound, then bisection: `fits` is monotone in the micro-batch.
    let mut hi = 2;
    while fits(hi) && hi < 1 << 20 {
        hi *= 2;
    }
    let mut lo = hi / 2;
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        match fits(mid) {
            true => lo = mid,
            false => hi = mid,
        }
    }
    // fp8's products take micro-batch rows (sequences x positions) that are multiples of
    // 16: the largest such micro-batch at or below.
    let unit = match (cfg.precision, cfg.model.context()) {
        (crate::precision::Precision::Fp8, Some(t)) if t > 0 => 16 / gcd(t, 16),
        _ => 1,
    };
    lo - lo % unit
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}
