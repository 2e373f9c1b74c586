//! The machine profile: what `stoker plan --calibrate` measured on this machine (its
//! GEMM rates, memory and all-reduce bandwidth, and the MFU of GPT training steps of
//! several sizes), kept in one file that every later plan of a training config on this
//! machine reads, as `accelerate config` keeps its answers for every later launch. A
//! preset's constants describe the machine they were measured on; the profile, this one.
//!
//! A plan uses it ([`MachineProfile::apply`]) where the config plans for this CPU
//! (`[plan.hardware]` without a preset, or the `cpu` preset), names no figures of its own
//! (`[plan]`'s peaks or MFU, which win), and runs on the machine that wrote it (the same
//! CPU model and core count). The MFU for the config's step comes from the steps the
//! profile measured ([`pick_mfu`]). Where to find the file is the binary's business (the
//! library reads no environment); `stoker` documents it in docs/plan.md.

mod pick;

use std::path::Path;

use serde::{Deserialize, Serialize};

pub use pick::{pick_mfu, MfuPick};

use stoker_plan::loader::LoaderBench;

use crate::config::TrainConfig;
use crate::error::{Result, TrainError};
use crate::machine::MachineFigures;
use crate::models::ModelConfig;

/// This machine's measured figures, kept between runs (see the module docs).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MachineProfile {
    /// The CPU model that measured it ([`this_cpu`]).
    pub cpu: String,
    /// When it was last measured, seconds since the Unix epoch.
    pub measured_unix_s: u64,
    /// The machine's figures (cores, GEMM rates, bandwidths).
    pub figures: MachineFigures,
    /// The loader's rates on a synthetic token shard (`[loader]`), for plans of GPT
    /// configs; absent in a profile written before it was measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loader: Option<LoaderProbe>,
    /// Training steps measured, each with its MFU (`[[step]]` tables).
    #[serde(default, rename = "step")]
    pub steps: Vec<StepPoint>,
    /// The file it was read from or is written to (not in the file): plans name it.
    #[serde(skip)]
    pub path: std::path::PathBuf,
}

/// Where and how a training step ran: what a measured step's MFU holds for, and what a
/// plan asks the profile about.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepAt {
    /// The model family: `gpt` or `llama` (absent in a profile written before Llamas
    /// were measured: `gpt`).
    #[serde(default = "gpt_family")]
    pub model: String,
    /// The planner's precision name (`fp32`, `bf16`, ...).
    pub precision: String,
    /// `direct` (the model's own step), or `fused` / `composed` (candle's graph).
    pub path: String,
    /// Ranks per host the MFU is planned at (each has the host's peak over these).
    pub ranks_per_host: usize,
    /// Ranks that ran the step at once on this machine.
    pub ranks_at_once: usize,
    /// Compute threads of each rank.
    pub threads_per_rank: usize,
    /// The model's width.
    pub d_model: usize,
    /// Its blocks.
    pub n_layer: usize,
    /// Its attention heads.
    pub n_head: usize,
    /// Tokens per sequence.
    pub context: usize,
    /// Its vocabulary.
    pub vocab: usize,
    /// Sequences per micro-batch.
    pub micro_batch: usize,
}

impl StepAt {
    /// `cfg`'s step as `ranks_per_host` ranks of `threads_per_rank` threads run it at once
    /// on one host; None for a model that is not a transformer (the planner models
    /// transformers: the GPT and the Llama).
    pub fn of(cfg: &TrainConfig, ranks_per_host: usize, threads_per_rank: usize) -> Option<Self> {
        let (model, d_model, n_layer, n_head, context, vocab) = match &cfg.model {
            ModelConfig::Gpt(g) => ("gpt", g.d_model, g.n_layer, g.n_head, g.context, g.vocab),
            ModelConfig::Llama(l) => ("llama", l.d_model, l.n_layer, l.n_head, l.context, l.vocab),
            ModelConfig::Cnn(_) | ModelConfig::Mlp(_) => return None,
        };
        Some(StepAt {
            model: model.into(),
            precision: crate::planned::plan_precision(cfg.precision).into(),
            // Where `direct` cannot run the step (fp16, fp8), candle's graph runs it fused.
            path: match (cfg.direct_step(), cfg.kernels) {
                (true, _) => "direct",
                (false, crate::precision::Kernels::Direct) => "fused",
                (false, k) => k.name(),
            }
            .into(),
            ranks_per_host: ranks_per_host.max(1),
            ranks_at_once: ranks_per_host.max(1),
            threads_per_rank: threads_per_rank.max(1),
            d_model,
            n_layer,
            n_head,
            context,
            vocab,
            micro_batch: cfg.batch.micro_batch,
        })
    }

    /// Whether `other` is the same model and micro-batch (layout aside).
    pub fn same_shape(&self, other: &StepAt) -> bool {
        self.model == other.model
            && (
                self.d_model,
                self.n_layer,
                self.n_head,
                self.context,
                self.vocab,
                self.micro_batch,
            ) == (
                other.d_model,
                other.n_layer,
                other.n_head,
                other.context,
                other.vocab,
                other.micro_batch,
            )
    }
}

fn gpt_family() -> String {
    "gpt".into()
}

/// The loader measured on token windows of `context` tokens ([`crate::machine::probe_loader`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoaderProbe {
    /// Tokens per window.
    pub context: usize,
    /// Samples/s per setting.
    pub bench: LoaderBench,
}

/// One measured training step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepPoint {
    /// Seconds of one micro-batch's step on each rank (the slowest rank's median).
    pub step_s: f64,
    /// The planner's compute time at MFU 1 (at the host's peak over `at.ranks_per_host`)
    /// over `step_s`.
    pub mfu: f64,
    /// `probe` (the machine calibration's own GPTs) or the config that was calibrated.
    pub source: String,
    /// Where and how it ran.
    pub at: StepAt,
}

impl StepPoint {
    /// The step with its MFU moved from GEMM rates `from` to `to`: an MFU is the planner's
    /// time at the peak over the step, so it scales as one over the peak (a dtype the
    /// figures do not measure is planned at the preset's peak either way).
    pub fn moved(&self, from: &MachineFigures, to: &MachineFigures) -> StepPoint {
        let mut p = self.clone();
        let precision = p.at.precision.as_str();
        if let (Some(was), Some(now)) = (from.peak_tflops(precision), to.peak_tflops(precision)) {
            p.mfu = (p.mfu * was / now).clamp(1e-6, 1.0);
        }
        p
    }
}

/// This machine's CPU model: `/proc/cpuinfo`'s first `model name` (x86) or `CPU part`
/// (Arm), else `unknown`. With the core count it tells a profile measured here from one
/// copied from elsewhere.
pub fn this_cpu() -> String {
    let text = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    text.lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| matches!(k.trim(), "model name" | "CPU part"))
        .map(|(_, v)| v.trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}

fn profile_err(path: &Path, message: impl Into<String>) -> TrainError {
    TrainError::Profile {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

impl MachineProfile {
    /// A profile of `figures`, measured now on this CPU, with no steps yet, to be kept at
    /// `path`.
    pub fn new(figures: MachineFigures, path: &Path) -> Self {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        MachineProfile {
            cpu: this_cpu(),
            measured_unix_s: now,
            figures,
            loader: None,
            steps: Vec::new(),
            path: path.to_path_buf(),
        }
    }

    /// Reads the profile at `path`; None where there is no file. A file that does not
    /// parse is an error naming it and the field.
    pub fn load(path: &Path) -> Result<Option<Self>> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(profile_err(path, e.to_string())),
        };
        let mut profile: Self = toml::from_str(&text).map_err(|e| {
            profile_err(
                path,
                format!(
                    "{} (`stoker plan --calibrate` writes it anew)",
                    stoker_plan::error::toml_error_line(&text, &e)
                ),
            )
        })?;
        profile.path = path.to_path_buf();
        profile.check().map_err(|m| {
            profile_err(
                path,
                format!("{m} (`stoker plan --calibrate` writes it anew)"),
            )
        })?;
        Ok(Some(profile))
    }

    /// The figures a plan divides by are positive and finite, each MFU a fraction in
    /// (0, 1], each count at least 1: Err names the field.
    fn check(&self) -> std::result::Result<(), String> {
        let f = &self.figures;
        let positive = |name: &str, v: f64| match v.is_finite() && v > 0.0 {
            true => Ok(()),
            false => Err(format!("{name} = {v}: expected a positive number")),
        };
        if f.cores == 0 {
            return Err("figures.cores = 0: expected at least 1".into());
        }
        positive("figures.fp32_tflops", f.fp32_tflops)?;
        positive("figures.bf16_tflops", f.bf16_tflops)?;
        positive("figures.host_mem_gbyte_s", f.host_mem_gbyte_s)?;
        positive("figures.allreduce_gbyte_s", f.allreduce_gbyte_s)?;
        if let Some(l) = &self.loader {
            if l.context == 0 {
                return Err("loader.context = 0: expected at least 1".into());
            }
            for (i, p) in l.bench.points.iter().enumerate() {
                positive(
                    &format!("loader.bench.points[{i}].samples_per_s"),
                    p.samples_per_s,
                )?;
            }
        }
        for (i, p) in self.steps.iter().enumerate() {
            positive(&format!("step[{i}].step_s"), p.step_s)?;
            if !(p.mfu > 0.0 && p.mfu <= 1.0) {
                return Err(format!(
                    "step[{i}].mfu = {}: expected a fraction in (0, 1]",
                    p.mfu
                ));
            }
            let a = &p.at;
            let counts = [
                ("ranks_per_host", a.ranks_per_host),
                ("ranks_at_once", a.ranks_at_once),
                ("threads_per_rank", a.threads_per_rank),
                ("d_model", a.d_model),
                ("n_layer", a.n_layer),
                ("n_head", a.n_head),
                ("context", a.context),
                ("vocab", a.vocab),
                ("micro_batch", a.micro_batch),
            ];
            if let Some((name, _)) = counts.iter().find(|(_, v)| *v == 0) {
                return Err(format!("step[{i}].at.{name} = 0: expected at least 1"));
            }
        }
        Ok(())
    }

    /// Writes the profile to its `path` (its directory made), through a temporary file
    /// renamed over it, so that a reader never sees half of it.
    pub fn save(&self) -> Result<()> {
        let path = self.path.as_path();
        let body = toml::to_string(self).map_err(|e| profile_err(path, e.to_string()))?;
        let text = format!(
            "# This machine's figures, measured by `stoker plan --calibrate`: every later plan\n\
             # of a training config on this machine uses them (docs/plan.md, \"Machine profile\").\n\
             {body}"
        );
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| profile_err(dir, e.to_string()))?;
        }
        let tmp = path.with_extension("toml.tmp");
        std::fs::write(&tmp, text).map_err(|e| profile_err(&tmp, e.to_string()))?;
        std::fs::rename(&tmp, path).map_err(|e| profile_err(path, e.to_string()))
    }

    /// Keeps `point`, replacing a step measured at the same place and shape.
    pub fn record(&mut self, point: StepPoint) {
        match self.steps.iter_mut().find(|p| p.at == point.at) {
            Some(p) => *p = point,
            None => self.steps.push(point),
        }
    }

    /// The profile's loader rates as the loader benchmark of `cfg`'s plan: a token model
    /// (GPT or Llama) reads token windows, and each point's samples/s is scaled from the
    /// probe's window to the config's by their bytes (the rate per byte held; where
    /// per-sample costs dominate, longer windows come out slower than they are, on the
    /// safe side). None where the profile measured no loader or `cfg` reads no token
    /// windows. (Until 2026-12-07 a Llama got none, and its plan took the chapter's
    /// starting point of workers where the GPT's took 0.)
    pub fn loader_for(&self, cfg: &TrainConfig) -> Option<LoaderBench> {
        let context = cfg.model.context()?;
        let probe = self.loader.as_ref()?;
        let scale = probe.context.max(1) as f64 / context.max(1) as f64;
        let mut bench = probe.bench.clone();
        for p in &mut bench.points {
            p.samples_per_s *= scale;
        }
        bench.sample_bytes = bench
            .sample_bytes
            .map(|b| (b as f64 / scale).round() as u64);
        bench.dataset = Some(format!(
            "{}, scaled to windows of {} tokens (this machine's profile {})",
            probe.bench.dataset.as_deref().unwrap_or("token windows"),
            context,
            self.path.display()
        ));
        Some(bench)
    }

    /// Keeps the steps `old` recorded from configs' own calibrations (not its probes),
    /// moved to this profile's GEMM rates ([`StepPoint::moved`]). Returns how many it kept.
    pub fn keep_config_steps(&mut self, old: &MachineProfile) -> usize {
        let mut kept = 0;
        for p in old.steps.iter().filter(|p| p.source != "probe") {
            self.record(p.moved(&old.figures, &self.figures));
            kept += 1;
        }
        kept
    }

    /// Why the profile does not describe this machine (another CPU model or core count),
    /// or None where it does.
    pub fn other_machine(&self, cpu: &str, cores: usize) -> Option<String> {
        (self.cpu != cpu || self.figures.cores != cores).then(|| {
            format!(
                "it was measured on another machine ({}, {} cores; this one: {cpu}, {cores} \
                 cores)",
                self.cpu, self.figures.cores
            )
        })
    }

    /// The line a plan or run prints of `outcome` ([`MachineProfile::apply`]'s): what
    /// the plan rests on, or why the profile is not used.
    pub fn line(&self, outcome: &std::result::Result<String, String>) -> String {
        match outcome {
            Ok(basis) => format!("machine profile {}: {basis}", self.path.display()),
            Err(why) => format!("machine profile {} not used: {why}", self.path.display()),
        }
    }

    /// Plans `cfg` with the profile's figures: writes them and the MFU of its step (run by
    /// `ranks_per_host` ranks of `threads_per_rank` threads) into its `[plan]`, marked as
    /// coming from this profile's file. Ok says what the MFU rests on; Err why the profile
    /// does not apply (see the module docs), and `cfg` is left as it was.
    pub fn apply(
        &self,
        cfg: &mut TrainConfig,
        ranks_per_host: usize,
        threads_per_rank: usize,
    ) -> std::result::Result<String, String> {
        if crate::device::TrainDevice::parse(&cfg.device).map_or(true, |d| d.is_cuda()) {
            return Err(format!("the config runs on `{}`, not this CPU", cfg.device));
        }
        let section = cfg.plan.as_ref();
        let hardware = section.map(|s| &s.hardware);
        if let Some(p) = hardware
            .and_then(|h| h.preset.as_deref())
            .filter(|p| !stoker_plan::hardware::is_cpu_preset(p))
        {
            return Err(format!("the config plans for the `{p}` preset"));
        }
        if hardware.is_some_and(|h| h.peak_tflops.is_some())
            || section.is_some_and(|s| s.mfu.is_some())
        {
            return Err("the config's [plan] gives its own figures (peaks or MFU)".into());
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        if let Some(why) = self.other_machine(&this_cpu(), cores) {
            return Err(why);
        }
        let want = StepAt::of(cfg, ranks_per_host, threads_per_rank)
            .ok_or("its steps are GPTs' and the planner models transformers")?;
        let pick = pick_mfu(&self.steps, &want)?;
        let section = cfg.plan.get_or_insert_with(Default::default);
        // The profile's figures under the config's own (its links, nodes, memory).
        let mut hardware = stoker_plan::input::HardwareInput::default();
        self.figures.apply(&mut hardware);
        hardware.overlay(&section.hardware);
        section.hardware = hardware;
        section.mfu = Some(pick.mfu);
        section.figures_from = Some(format!("this machine's profile {}", self.path.display()));
        Ok(format!("MFU {:.3} from the {}", pick.mfu, pick.basis))
    }
}

/// A training config planned on this machine's profile: its figures applied (unless the
/// command line names the hardware or its figures, which then stand), the profile's line
/// saying which, and the profile's loader rates for the config's windows.
pub struct OnProfile {
    /// `machine profile PATH: ...` or `... not used: why`.
    pub line: String,
    /// The profile's loader benchmark for the config, where its figures apply.
    pub loader: Option<LoaderBench>,
}

impl MachineProfile {
    /// Plans `cfg` (for `ranks` ranks on a host) on this profile, unless the command line's
    /// `cli` names the hardware or its figures: a `stoker plan --config` on this machine.
    pub fn plan_config(
        &self,
        cfg: &mut TrainConfig,
        cli: &stoker_plan::input::PlanInput,
        ranks: usize,
    ) -> OnProfile {
        let flags = &cli.hardware;
        let named = flags
            .preset
            .as_deref()
            .is_some_and(|p| !stoker_plan::hardware::is_cpu_preset(p))
            || flags.peak_tflops.is_some()
            || cli.training.mfu.is_some();
        let outcome = match named {
            true => Err("the command line names the hardware or its figures".into()),
            false => {
                let threads = crate::machine::rank_threads(cfg, ranks);
                self.apply(cfg, ranks, threads)
            }
        };
        OnProfile {
            loader: outcome.is_ok().then(|| self.loader_for(cfg)).flatten(),
            line: self.line(&outcome),
        }
    }
}

/// Where a plan's loader benchmark comes from, most direct first: a benchmark file given
/// (`--loader-bench`), the config's own calibration (one measured point), this machine's
/// profile (its synthetic shard, scaled to the config's windows).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoaderSource {
    /// `stoker bench loader --json`'s file.
    File,
    /// The config's calibration.
    Calibration,
    /// The machine profile.
    Profile,
}

/// The loader benchmark a plan uses, and where it came from: the first of `file`,
/// `calibration`, `profile` that is there.
pub fn pick_loader_bench(
    file: Option<LoaderBench>,
    calibration: Option<LoaderBench>,
    profile: Option<LoaderBench>,
) -> Option<(LoaderBench, LoaderSource)> {
    file.map(|b| (b, LoaderSource::File))
        .or(calibration.map(|b| (b, LoaderSource::Calibration)))
        .or(profile.map(|b| (b, LoaderSource::Profile)))
}
