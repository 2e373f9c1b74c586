//! This machine, measured: `stoker plan --calibrate` measures it instead of trusting a preset's typed-in
//! constants, and turns the figures into planner inputs (`[plan.hardware]` and `[plan]
//! mfu` of a training config), so later plans and every run's forecast use them. Alone
//! ([`probe_machine`]) it measures the training step of GPTs and Llamas of several widths into the
//! machine's profile ([`profile`]), which plans every config on this machine; with a
//! config ([`calibrate`]), that config's own step.
//!
//! What it measures, each with stoker's own code on this machine:
//! - the GEMM rate of each dtype the trainer runs (`stoker_kernels::linear_with` on a
//!   2048 x 1024 x 1024 product, f32 and bf16 operands): the preset's "peak";
//! - the training step of the config itself (its model, micro-batch and precision, on
//!   synthetic tokens), run at once by as many ranks as the run plans on this host, each
//!   with its share of the cores: its rate over the planner's FLOP count at one rank's
//!   share of the GEMM rate is the MFU. Two one-thread ranks can run a small step's GEMMs
//!   and candle's ops better than one rank of two threads (the graph path of an 8-block GPT
//!   at micro-batch 4: 89 ms per micro-batch and rank, 105 ms on one rank of two threads),
//!   and worse than one thread alone (they share caches and memory bandwidth), so only
//!   the step as the run will run it plans it;
//! - the host memory bandwidth (a 256 MiB copy);
//! - the all-reduce bus bandwidth between two ranks of the in-process backend (16 MiB of
//!   f32), standing in for the intra-node link;
//! - the loader's rate on the config's own training set at its `[data]` settings and
//!   micro-batch (as fast as the consumer takes batches, 0.5 s after a warm-up batch):
//!   one point of a loader benchmark, which the plan checks its consumption against
//!   (`stoker tune loader` searches the settings; this measures the ones configured).

mod figures;
mod loader;
mod probe;
pub mod profile;
mod timing;

pub use figures::MachineFigures;
pub use loader::{bench_point, probe_loader, LOADER_PROBE_CONTEXT};
pub use probe::{probe_machine, PROBE_MICRO_BATCHES, PROBE_WIDTHS};

use stoker_plan::input::{HardwareInput, PlanInput};

use crate::config::TrainConfig;
use crate::error::Result;
use crate::machine::profile::{StepAt, StepPoint};
use crate::planned::{plan_input, planner_row};
use loader::loader_rate;
use timing::{concurrent_step_s, one_micro_batch, STEP_RUNS};

/// What `--calibrate` measured.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Calibration {
    /// The machine's figures.
    pub machine: MachineFigures,
    /// Ranks planned on each host (`--devices-per-node`, else the config's), whose share of
    /// the GEMM rate the MFU is planned at.
    pub ranks_per_host: usize,
    /// Ranks that ran the step at once on this machine (`--calibrate-ranks-at-once`, else
    /// `ranks_per_host`), each on its share of the cores: more than `ranks_per_host` where
    /// several planned hosts share this machine (scripts/cluster.sh's namespaces).
    pub ranks_at_once: usize,
    /// Compute threads the step ran on: each rank's (`RAYON_NUM_THREADS`, else
    /// `parallel.threads_per_rank`, else the cores over `ranks_at_once`).
    pub threads_per_rank: usize,
    /// Seconds of the config's training step on `threads_per_rank` threads (the slowest
    /// rank's median, see `step_time`).
    pub step_s: f64,
    /// The planner's compute time for that step at MFU 1, at one rank's share of the GEMM
    /// rate (the host's over `ranks_per_host`), over the measured step.
    pub mfu: f64,
    /// The precision the step ran in.
    pub precision: String,
    /// The config's loader on its training set; None where the data cannot be opened
    /// (the reason is in `loader_note`).
    pub loader: Option<stoker_data::measure::Trial>,
    /// Bytes of one training sample (all fields), where the data opened.
    pub sample_bytes: Option<u64>,
    /// Where the loader was measured, or why it was not.
    pub loader_note: String,
}

impl Calibration {
    /// The measured figures as planner inputs ([`MachineFigures::apply`]); the MFU is
    /// returned for `[plan] mfu`.
    pub fn apply(&self, hardware: &mut HardwareInput) -> f64 {
        self.machine.apply(hardware);
        self.mfu
    }

    /// The config's step as a machine profile keeps it; None for a model that is not a
    /// GPT (which [`calibrate`] refuses anyway).
    pub fn step_point(&self, cfg: &TrainConfig, source: &str) -> Option<StepPoint> {
        let mut at = StepAt::of(cfg, self.ranks_per_host, self.threads_per_rank)?;
        at.ranks_at_once = self.ranks_at_once;
        Some(StepPoint {
            step_s: self.step_s,
            mfu: self.mfu,
            source: source.into(),
            at,
        })
    }

    /// The loader measurement as the planner's loader benchmark (one point: the
    /// configured setting).
    pub fn loader_bench(&self) -> Option<stoker_plan::loader::LoaderBench> {
        let t = self.loader.as_ref()?;
        Some(stoker_plan::loader::LoaderBench {
            dataset: Some(self.loader_note.clone()),
            sample_bytes: self.sample_bytes,
            points: vec![bench_point(t)],
        })
    }

    /// A table for people.
    pub fn to_text(&self) -> String {
        let loader = match &self.loader {
            Some(t) => format!(
                "{:>8.0} samples/s ({}: {} workers, prefetch {}, batch {})",
                t.samples_per_s, self.loader_note, t.num_workers, t.prefetch_factor, t.batch_size
            ),
            None => format!("not measured ({})", self.loader_note),
        };
        format!(
            "{}\
             \x20 training step      {:>8.1} ms       ({}, the config's model and micro-batch, {} thread(s) per rank, {} rank(s) at once; planned {} per host)\n\
             \x20 MFU                {:>8.3}          (planner's FLOPs at the rank's share of the GEMM rate / step)\n\
             \x20 loader             {loader}\n",
            self.machine.to_text(),
            self.step_s * 1e3,
            self.precision,
            self.threads_per_rank,
            self.ranks_at_once,
            self.ranks_per_host,
            self.mfu,
        )
    }
}

/// The dtypes this CPU computes without hardware for them, as a plan's
/// `hardware.emulated`: bf16 where it has neither AMX nor AVX512-BF16 (candle's graph
/// then emulates it, slower than fp32), so that the planner's decision (b) does not pick
/// it here; `None` where it has them.
pub fn emulated_dtypes() -> Option<Vec<String>> {
    (!stoker_kernels::bf16_native()).then(|| vec!["bf16".to_string()])
}

/// Compute threads of each of `ranks` ranks run at once on this machine, as the run gives
/// them: `RAYON_NUM_THREADS` where set (an MPI rank then builds no pool of its own), else
/// `parallel.threads_per_rank`, else the cores over the ranks.
/// (An unusable `RAYON_NUM_THREADS` is refused by the binary at start, see
/// [`rayon_threads_env`](crate::device::rayon_threads_env).)
pub fn rank_threads(cfg: &TrainConfig, ranks: usize) -> usize {
    crate::device::rayon_threads_env()
        .ok()
        .flatten()
        .unwrap_or_else(|| crate::device::threads_per_rank(cfg.parallel.threads_per_rank, ranks))
}

/// Measures this machine and `cfg`'s step run by `ranks_at_once` ranks at once, for a plan
/// of `ranks_per_host` ranks on each host (see the module docs). Candle's own elementwise
/// workers are sized once per process (`CANDLE_NUM_THREADS`), so a caller planning several
/// ranks per host sets that to the rank's threads before candle first runs, as `stoker
/// plan --calibrate` does.
pub fn calibrate(
    cfg: &TrainConfig,
    ranks_per_host: usize,
    ranks_at_once: usize,
) -> Result<Calibration> {
    let ranks_per_host = ranks_per_host.max(1);
    let ranks_at_once = ranks_at_once.max(1);
    let threads = rank_threads(cfg, ranks_at_once);
    let machine = MachineFigures::measure()?;
    let step = concurrent_step_s(cfg, ranks_at_once, threads, STEP_RUNS)?;
    let (loader, sample_bytes, loader_note) = match loader_rate(cfg) {
        Ok((t, b)) => (Some(t), Some(b), cfg.data.train.display().to_string()),
        Err(e) => (None, None, e.to_string()),
    };
    Ok(Calibration {
        mfu: step_mfu(cfg, &machine, ranks_per_host, step)?,
        machine,
        ranks_per_host,
        ranks_at_once,
        threads_per_rank: threads,
        step_s: step,
        precision: crate::planned::plan_precision(cfg.precision).into(),
        loader,
        sample_bytes,
        loader_note,
    })
}

/// The MFU of `cfg`'s step measured at `step_s` seconds per micro-batch: the planner's
/// compute time for it at MFU 1, on one rank's share (over `ranks_per_host`) of the
/// measured GEMM rates, over `step_s`.
pub fn step_mfu(
    cfg: &TrainConfig,
    machine: &MachineFigures,
    ranks_per_host: usize,
    step_s: f64,
) -> Result<f64> {
    let mut probe = one_micro_batch(cfg);
    let section = probe.plan.get_or_insert_with(Default::default);
    section.hardware = HardwareInput::default();
    machine.apply(&mut section.hardware);
    // One device with one rank's share of the host's GEMM rate.
    for peak in section
        .hardware
        .peak_tflops
        .iter_mut()
        .flat_map(|p| p.values_mut())
    {
        *peak /= ranks_per_host.max(1) as f64;
    }
    section.mfu = Some(1.0);
    let at_peak = planner_row(&probe, 1, 1)?.step_s;
    Ok((at_peak / step_s).clamp(1e-6, 1.0))
}

/// A training config's planner input with the calibration applied on top of its
/// `[plan]` (the calibrated figures win over a preset's).
pub fn calibrated_input(
    cfg: &TrainConfig,
    c: &Calibration,
    flags: &PlanInput,
) -> Result<PlanInput> {
    let mut cfg = cfg.clone();
    let section = cfg.plan.get_or_insert_with(Default::default);
    section.mfu = Some(c.apply(&mut section.hardware));
    plan_input(&cfg, flags)
}
