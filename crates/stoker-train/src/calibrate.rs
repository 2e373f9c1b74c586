//! `stoker plan --calibrate`: measures this machine instead of trusting a preset's typed-in
//! constants, and turns the figures into planner inputs (`[plan.hardware]` and `[plan]
//! mfu` of a training config), so later plans and every run's forecast use them. Alone
//! ([`probe_machine`]) it measures the training step of GPTs of several widths into the
//! machine's profile (crate::profile), which plans every config on this machine; with a
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

use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use stoker_comm::communicator::{CommExt, Communicator};
use stoker_plan::input::{HardwareInput, PlanInput};

use crate::accumulate::MicroBatch;
use crate::config::{ModelConfig, TrainConfig};
use crate::error::{config_err, Result};
use crate::planned::{plan_input, planner_row};
use crate::profile::{MachineProfile, StepAt, StepPoint};
use crate::trainer::Trainer;

/// The machine's own figures, measured whatever the config: what a machine profile
/// keeps, and what a plan puts in place of a preset's constants.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MachineFigures {
    /// Logical CPUs this process may use.
    pub cores: usize,
    /// f32 GEMM rate, TFLOP/s.
    pub fp32_tflops: f64,
    /// bf16-operand GEMM rate (f32 accumulation), TFLOP/s.
    pub bf16_tflops: f64,
    /// Host memory bandwidth of a large copy, GB/s (read + write counted once, as
    /// memcpy benchmarks report it).
    pub host_mem_gbyte_s: f64,
    /// All-reduce bus bandwidth of the in-process backend between 2 ranks, GB/s.
    pub allreduce_gbyte_s: f64,
}

impl MachineFigures {
    /// Measures them (GEMMs, a copy, an all-reduce: about a second).
    pub fn measure() -> Result<Self> {
        Ok(MachineFigures {
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            fp32_tflops: gemm_tflops(false)?,
            bf16_tflops: gemm_tflops(true)?,
            host_mem_gbyte_s: host_mem_gbyte_s()?,
            allreduce_gbyte_s: allreduce_gbyte_s()?,
        })
    }

    /// The figures as planner inputs: `hardware` gets the peaks, links and cores (on top
    /// of the `cpu` preset unless it names another).
    pub fn apply(&self, hardware: &mut HardwareInput) {
        if hardware.preset.is_none() {
            hardware.preset = Some("cpu".into());
        }
        let peaks = hardware.peak_tflops.get_or_insert_with(Default::default);
        peaks.insert("fp32".into(), self.fp32_tflops);
        peaks.insert("bf16".into(), self.bf16_tflops);
        hardware.host_cores = Some(self.cores as i64);
        hardware.host_mem_gbyte_s = Some(self.host_mem_gbyte_s);
        hardware.host_link_gbyte_s = Some(self.host_mem_gbyte_s);
        hardware.intra_node_gbyte_s = Some(self.allreduce_gbyte_s);
    }

    /// A table for people.
    pub fn to_text(&self) -> String {
        format!(
            "calibration of this machine ({} cores):\n\
             \x20 GEMM fp32          {:>8.3} TFLOP/s  (2048 x 1024 x 1024, stoker's kernels)\n\
             \x20 GEMM bf16 operands {:>8.3} TFLOP/s\n\
             \x20 host memory        {:>8.2} GB/s     (256 MiB copy)\n\
             \x20 all-reduce         {:>8.2} GB/s     (bus bandwidth, 2 in-process ranks, 16 MiB)\n",
            self.cores,
            self.fp32_tflops,
            self.bf16_tflops,
            self.host_mem_gbyte_s,
            self.allreduce_gbyte_s,
        )
    }
}

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
    /// rank's lower quartile, see `step_time`).
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

/// A loader trial as a point of the planner's loader benchmark.
pub fn bench_point(t: &stoker_data::measure::Trial) -> stoker_plan::loader::BenchPoint {
    stoker_plan::loader::BenchPoint {
        num_workers: t.num_workers as u64,
        prefetch_factor: t.prefetch_factor as u64,
        batch_size: Some(t.batch_size as u64),
        samples_per_s: t.samples_per_s,
        mb_per_s: Some(t.mb_per_s),
        consumer_wait_pct: Some(t.consumer_wait_pct),
        peak_rss_bytes: Some(t.peak_rss_bytes),
    }
}

/// Seconds of each of `runs` calls of `f`.
fn time_runs(runs: usize, mut f: impl FnMut() -> Result<()>) -> Result<Vec<f64>> {
    let mut t = Vec::with_capacity(runs);
    for _ in 0..runs {
        let t0 = Instant::now();
        f()?;
        t.push(t0.elapsed().as_secs_f64());
    }
    Ok(t)
}

/// Seconds of `runs` calls of `f` after one warm-up call.
fn timings(runs: usize, mut f: impl FnMut() -> Result<()>) -> Result<Vec<f64>> {
    f()?;
    time_runs(runs, f)
}

/// How many timed steps a step's measurement takes.
#[derive(Clone, Copy, Debug)]
enum Runs {
    /// This many.
    Fixed(usize),
    /// As many as fill `seconds` at the warm-up step's time (rank 0's, which every rank
    /// then runs), within `min..=max`: a short step is timed often enough to outlast a
    /// busy moment of the machine, a long one no more than `min` times.
    Budget {
        seconds: f64,
        min: usize,
        max: usize,
    },
}

/// The median of `t` (not empty).
fn median(mut t: Vec<f64>) -> f64 {
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

/// Median of `runs` timings of `f` after one warm-up call.
fn median_s(runs: usize, f: impl FnMut() -> Result<()>) -> Result<f64> {
    Ok(median(timings(runs.max(1), f)?))
}

/// TFLOP/s of stoker's linear layer on a 2048 x 1024 x 1024 product: the best of 11
/// runs, as a peak is what the machine can do. (A median of 5 drew 0.104 TFLOP/s in fp32
/// in a busy spell of this shared 2-core machine, where other calibrations drew
/// 0.18-0.20, 2026-12-04; every MFU planned on it would have been off by the same factor.)
fn gemm_tflops(bf16_operands: bool) -> Result<f64> {
    let (m, k, n) = (2048usize, 1024usize, 1024usize);
    let x = Tensor::rand(-1f32, 1f32, (m, k), &Device::Cpu)?;
    let w = Tensor::rand(-1f32, 1f32, (n, k), &Device::Cpu)?;
    let b = Tensor::zeros(n, candle_core::DType::F32, &Device::Cpu)?;
    stoker_kernels::linear_with(&x, &w, &b, bf16_operands)?;
    let mut best = f64::INFINITY;
    for _ in 0..11 {
        let t0 = Instant::now();
        stoker_kernels::linear_with(&x, &w, &b, bf16_operands)?;
        best = best.min(t0.elapsed().as_secs_f64());
    }
    Ok(2.0 * (m * k * n) as f64 / best / 1e12)
}

/// GB/s of a 256 MiB copy.
fn host_mem_gbyte_s() -> Result<f64> {
    let len = 256 << 20;
    let src = vec![1u8; len];
    let mut dst = vec![0u8; len];
    let s = median_s(3, || {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&dst);
        Ok(())
    })?;
    Ok(len as f64 / s / 1e9)
}

/// Bus bandwidth (2 (n-1)/n x bytes / time) of a 16 MiB f32 all-reduce between two
/// ranks of the in-process backend.
fn allreduce_gbyte_s() -> Result<f64> {
    let elems = 4 << 20;
    let times = stoker_comm::local::run_local(2, Duration::from_secs(60), |c| {
        let mut buf = vec![1f32; elems];
        median_s(5, || {
            c.all_reduce(&mut buf)
                .map_err(|e| config_err("calibrate", e.to_string()))
        })
    });
    let mut worst = 0f64;
    for t in times {
        worst = worst.max(t?);
    }
    Ok((4 * elems) as f64 / worst / 1e9)
}

/// `cfg` as one rank stepping one micro-batch at a time: what the calibration times and
/// plans.
fn one_micro_batch(cfg: &TrainConfig) -> TrainConfig {
    let mut one = cfg.clone();
    one.batch.world_size = Some(1);
    one.batch.accumulation_steps = Some(1);
    one.batch.global_batch = Some(one.batch.micro_batch);
    one
}

/// Timed training steps per rank (after one warm-up step). Four calibrations of the same
/// step by two one-thread ranks at once gave 62-97 ms with 5 runs and no meeting of the
/// ranks before them, 68-74 ms with 11 runs after the meeting (2026-12-04).
const STEP_RUNS: usize = 11;

/// A trainer for `cfg` on one rank and one micro-batch of synthetic tokens, for
/// [`concurrent_step_times`].
fn step_trainer(cfg: &TrainConfig) -> Result<(Trainer, Vec<MicroBatch>)> {
    let ModelConfig::Gpt(g) = &cfg.model else {
        return Err(config_err(
            "model.kind",
            "calibration times the GPT's training step (the planner models transformers)",
        ));
    };
    let one = one_micro_batch(cfg);
    let trainer = Trainer::new(&one)?;
    let (b, t) = (one.batch.micro_batch, g.context);
    let ids = |salt: u64| -> Vec<i64> {
        (0..(b * t) as u64)
            .map(|i| (crate::params::mix64(i ^ salt) % g.vocab as u64) as i64)
            .collect()
    };
    let window = vec![MicroBatch {
        input: Tensor::from_vec(ids(1), (b, t), &Device::Cpu)?,
        targets: ids(2),
    }];
    Ok((trainer, window))
}

/// `cfg`'s step as `ranks` ranks of `threads` compute threads each run it on this host at
/// once (the ranks of an in-process group, each with its own pool and trainer, as
/// `parallel.backend = "local"` runs them): the ranks share the cores' caches and memory
/// bandwidth as the run's processes will. Each rank's `runs` timings after a warm-up
/// step, in rank order. The ranks build their trainers, then meet (a barrier) so that
/// their timed steps overlap: a rank stepping while another still builds runs alone,
/// faster. A rank that fails leaves the group, and the others' barrier ends with an error.
fn concurrent_step_times(
    cfg: &TrainConfig,
    ranks: usize,
    threads: usize,
    runs: Runs,
) -> Result<Vec<Vec<f64>>> {
    let times = stoker_comm::run_local(ranks, stoker_comm::DEFAULT_TIMEOUT, |comm| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .map_err(|e| config_err("calibrate", format!("a pool of {threads} threads: {e}")))?;
        // The trainer stays on the pool's thread (it is not `Send`).
        pool.install(move || {
            let (mut trainer, window) = step_trainer(cfg)?;
            let comm_err = |e: stoker_comm::CommError| config_err("calibrate", e.to_string());
            comm.barrier().map_err(comm_err)?;
            let mut step = || trainer.train_step(&window).map(|_| ());
            let t0 = Instant::now();
            step()?;
            let warm = t0.elapsed().as_secs_f64();
            let n = match runs {
                Runs::Fixed(n) => n,
                Runs::Budget { seconds, min, max } => {
                    let mut n = [(seconds / warm).ceil().clamp(min as f64, max as f64)];
                    comm.broadcast(&mut n, 0).map_err(comm_err)?;
                    n[0] as usize
                }
            };
            time_runs(n.max(1), step)
        })
    });
    times.into_iter().collect()
}

/// The step time of [`concurrent_step_times`] (see [`step_time`]).
fn concurrent_step_s(cfg: &TrainConfig, ranks: usize, threads: usize, runs: usize) -> Result<f64> {
    Ok(step_time(concurrent_step_times(
        cfg,
        ranks,
        threads,
        Runs::Fixed(runs),
    )?))
}

/// A step's time from each rank's timings: the slowest rank's (a synchronous step waits
/// for it) lower quartile, the step on a quiet machine. A busy spell of a shared machine
/// only slows steps down, and lasts seconds: it moved the median of a probe's 5 steps by
/// up to 35% between two calibrations minutes apart (bf16 at d_model 128: MFU 0.60 and
/// 0.44, 2026-12-04); the lower quartile stands unless it covers three quarters of the
/// steps, and a single lucky step does not set it. A run's mean step includes whatever
/// else the machine runs then (a run of 60 steps here: lower quartile 54.1 ms, median
/// 55.0, mean 60.3 with two spells of 74 ms steps).
fn step_time(per_rank: Vec<Vec<f64>>) -> f64 {
    per_rank
        .into_iter()
        .map(lower_quartile)
        .fold(0f64, f64::max)
}

/// The lower quartile of `t` (not empty).
fn lower_quartile(mut t: Vec<f64>) -> f64 {
    t.sort_by(f64::total_cmp);
    t[(t.len() - 1) / 4]
}

/// `cfg`'s loader on its training set at its `[data]` settings and micro-batch, as fast as
/// the consumer takes batches; Err with the reason where the data cannot be opened.
fn loader_rate(cfg: &TrainConfig) -> Result<(stoker_data::measure::Trial, u64)> {
    use stoker_data::{Dataset, Sampler, SamplerConfig};
    // The data is checked against the model's input shapes, which a shell knows without
    // drawing any weights.
    let shell = crate::models::Shell::new(cfg.model.clone());
    let data = crate::data::open_datasets(cfg, &shell)?;
    let d = &cfg.data;
    let lc = d.train_loader(cfg.batch.micro_batch);
    let sampler = Sampler::new(
        data.train.len(),
        SamplerConfig {
            shuffle: d.shuffle,
            seed: cfg.seed,
            ..SamplerConfig::default()
        },
    )?;
    let budget = stoker_data::measure::TrialBudget {
        min_time: Duration::from_millis(500),
        max_batches: 100_000,
        step: None,
    };
    let bytes: usize = data.train.fields().iter().map(|f| f.sample_bytes()).sum();
    let trial = stoker_data::measure::measure_loader(data.train.clone(), sampler, lc, budget)?;
    Ok((trial, bytes as u64))
}

/// Compute threads of each of `ranks` ranks run at once on this machine, as the run gives
/// them: `RAYON_NUM_THREADS` where set (an MPI rank then builds no pool of its own), else
/// `parallel.threads_per_rank`, else the cores over the ranks.
pub fn rank_threads(cfg: &TrainConfig, ranks: usize) -> usize {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .filter(|&n: &usize| n > 0)
        .unwrap_or_else(|| crate::run::threads_per_rank(cfg.parallel.threads_per_rank, ranks))
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

/// Widths of the GPTs a machine calibration times (2 blocks, 32-wide heads, context 128,
/// [`PROBE_MICRO_BATCHES`], vocabulary 256): the direct step's MFU grows with the width, and plans
/// interpolate between these (profile::pick_mfu). 64 to 512 spans the models a 2-core
/// machine trains (the demo's is 128 wide).
pub const PROBE_WIDTHS: [usize; 4] = [64, 128, 256, 512];

/// Micro-batches of the probe GPTs (at context 128: 512 and 2048 tokens per micro-batch,
/// the M of their GEMMs): the MFU grows with it too, and plans interpolate between them.
pub const PROBE_MICRO_BATCHES: [usize; 2] = [4, 16];

/// Timed steps of each probe in each pass (after one warm-up step): as many as fill a
/// quarter of a second, 3 to 30.
const PROBE_RUNS: Runs = Runs::Budget {
    seconds: 0.25,
    min: 3,
    max: 30,
};

/// Passes over all the probes, their timings pooled: a busy spell of a shared machine
/// lasts seconds, long enough to cover every run of a 15 ms probe. With one pass of 5
/// runs, two calibrations 3 minutes apart put the bf16 direct step at d_model 128 at MFU
/// 0.60 and 0.44 (2026-12-04).
const PROBE_PASSES: usize = 2;

/// A probe GPT's training config: `d_model` wide, `micro_batch` sequences of 128 tokens,
/// in `precision`, on `kernels`.
fn probe_config(
    d_model: usize,
    micro_batch: usize,
    precision: &str,
    kernels: &str,
) -> Result<TrainConfig> {
    let text = format!(
        "run_dir = \"runs/probe\"\nprecision = \"{precision}\"\nkernels = \"{kernels}\"\n\
         [data]\ntrain = \"probe.bin\"\n\
         [model]\nkind = \"gpt\"\nvocab = 256\ncontext = 128\nd_model = {d_model}\n\
         n_layer = 2\nn_head = {}\n\
         [batch]\nmicro_batch = {micro_batch}\n\
         [optimizer]\nkind = \"adamw\"\nlr = 1e-3\n\
         [train]\nsteps = 1\n",
        match d_model % 32 {
            0 => d_model / 32,
            _ => 1,
        }
    );
    TrainConfig::parse(&text, std::path::Path::new("(machine calibration probe)"))
}

/// Measures this machine for its profile: its figures, then the training step of the
/// probe GPTs `widths` wide ([`PROBE_WIDTHS`] by default; 32-wide heads where the width is
/// a multiple of 32, else one head) in fp32
/// and bf16 on the direct step and on candle's
/// fused graph, by one rank on all `threads` cores and, with two cores or more, by two
/// ranks at once on half each (as `mpirun -n 2` runs them). `progress` hears each step
/// measured. [`PROBE_PASSES`] passes over them, about 40 s on 2 cores. The profile is to
/// be kept at `path`.
pub fn probe_machine(
    threads: usize,
    widths: &[usize],
    path: &std::path::Path,
    mut progress: impl FnMut(&StepPoint),
) -> Result<MachineProfile> {
    let machine = MachineFigures::measure()?;
    let mut profile = MachineProfile::new(machine.clone(), path);
    let threads = threads.max(1);
    let mut layouts = vec![(1, threads)];
    if threads >= 2 {
        layouts.push((2, threads / 2));
    }
    // Every (config, ranks, threads per rank) the probes run.
    let mut probes = Vec::new();
    for precision in ["fp32", "bf16"] {
        for kernels in ["direct", "fused"] {
            for &d in widths {
                for mb in PROBE_MICRO_BATCHES {
                    let cfg = probe_config(d, mb, precision, kernels)?;
                    match kernels {
                        // bf16 without bf16 hardware runs on the graph: measured there.
                        "direct" if !cfg.direct_step() => {}
                        "direct" => probes.extend(layouts.iter().map(|&l| (cfg.clone(), l))),
                        // The graph's step is timed by one rank only: runs on it are rarer.
                        _ => probes.push((cfg, layouts[0])),
                    }
                }
            }
        }
    }
    let mut times: Vec<Vec<Vec<f64>>> = probes.iter().map(|_| Vec::new()).collect();
    for _ in 0..PROBE_PASSES {
        for ((cfg, (ranks, rank_threads)), pooled) in probes.iter().zip(&mut times) {
            let pass = concurrent_step_times(cfg, *ranks, *rank_threads, PROBE_RUNS)?;
            pooled.resize(pass.len(), Vec::new());
            for (all, these) in pooled.iter_mut().zip(pass) {
                all.extend(these);
            }
        }
    }
    for ((cfg, (ranks, rank_threads)), pooled) in probes.iter().zip(times) {
        let step = step_time(pooled);
        let mut at = StepAt::of(cfg, *ranks, *rank_threads)
            .ok_or_else(|| config_err("model.kind", "a probe is a GPT"))?;
        at.ranks_at_once = *ranks;
        let point = StepPoint {
            step_s: step,
            mfu: step_mfu(cfg, &machine, *ranks, step)?,
            source: "probe".into(),
            at,
        };
        progress(&point);
        profile.record(point);
    }
    Ok(profile)
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
