//! The machine calibration's probes: GPTs and Llamas of several widths and micro-batches whose
//! training steps a machine profile keeps, for plans to interpolate between.

use super::figures::MachineFigures;
use super::loader::{probe_loader, LOADER_PROBE_CONTEXT};
use super::step_mfu;
use super::timing::{concurrent_step_times, step_time, Runs};
use crate::config::TrainConfig;
use crate::error::{config_err, Result};
use crate::machine::profile::{LoaderProbe, MachineProfile, StepAt, StepPoint};

/// Widths of the GPTs a machine calibration times (2 blocks, 32-wide heads, context 128,
/// [`PROBE_MICRO_BATCHES`], vocabulary 256): the direct step's MFU grows with the width, and plans
/// interpolate between these (profile::pick_mfu). 64 to 512 spans the models a 2-core
/// machine trains (the demo's is 128 wide).
pub const PROBE_WIDTHS: [usize; 4] = [64, 128, 256, 512];

/// Micro-batches of the probe GPTs (at context 128: 512 and 2048 tokens per micro-batch,
/// the M of their GEMMs): the MFU grows with it too, and plans interpolate between them.
pub const PROBE_MICRO_BATCHES: [usize; 2] = [4, 16];

/// Timed steps of each probe in each pass (after one warm-up step): as many as fill a
/// fifth of a second, 2 to 30.
const PROBE_RUNS: Runs = Runs::Budget {
    seconds: 0.2,
    min: 2,
    max: 30,
};

/// Passes over all the probes, their timings pooled: a busy spell of a shared machine
/// lasts seconds, long enough to cover every run of a 15 ms probe in one pass, and a
/// third of the pooled timings does not move their median (one pass let two calibrations
/// minutes apart disagree: docs/benchmarks.md, "Measurements behind code constants").
const PROBE_PASSES: usize = 3;

/// Tokens per sequence of the probe GPTs (and of the loader probe's windows).
pub(super) const PROBE_CONTEXT: usize = 128;

/// A probe's training config: a `family` model (`gpt` or `llama`) `d_model` wide, 2
/// blocks of 32-wide heads (one head where the width is not a multiple of 32; the
/// Llama's key/value heads half its query heads where they divide, with Llama's default
/// SwiGLU width), `micro_batch` sequences of [`PROBE_CONTEXT`] tokens, in `precision`, on
/// `kernels`; its data file is a placeholder (the step runs on synthetic tokens; the
/// loader probe sets its own).
pub(super) fn probe_config(
    family: &str,
    d_model: usize,
    micro_batch: usize,
    precision: &str,
    kernels: &str,
) -> Result<TrainConfig> {
    let heads = match d_model % 32 {
        0 => d_model / 32,
        _ => 1,
    };
    let kv = match heads % 2 {
        0 => format!("n_kv_head = {}\n", heads / 2),
        _ => String::new(),
    };
    let text = format!(
        "run_dir = \"runs/probe\"\nprecision = \"{precision}\"\nkernels = \"{kernels}\"\n\
         [data]\ntrain = \"probe.bin\"\n\
         [model]\nkind = \"{family}\"\nvocab = 256\ncontext = {PROBE_CONTEXT}\nd_model = {d_model}\n\
         n_layer = 2\nn_head = {heads}\n{}\
         [batch]\nmicro_batch = {micro_batch}\n\
         [optimizer]\nkind = \"adamw\"\nlr = 1e-3\n\
         [train]\nsteps = 1\n",
        match family {
            "llama" => kv,
            _ => String::new(),
        }
    );
    TrainConfig::parse(&text, std::path::Path::new("(machine calibration probe)"))
}

/// Measures this machine for its profile: its figures, its loader on a synthetic token
/// shard ([`probe_loader`]), then the training step of the
/// probe GPTs `widths` wide ([`PROBE_WIDTHS`] by default; 32-wide heads where the width is
/// a multiple of 32, else one head) in fp32
/// and bf16 on the direct step and on candle's
/// fused graph, and of probe Llamas as wide on their direct step, by one rank on all `threads` cores and, with two cores or more, by two
/// ranks at once on half each (as `mpirun -n 2` runs them). `progress` hears each step
/// measured. [`PROBE_PASSES`] passes over them, about 110 s on 2 cores. The profile is to
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
    profile.loader = Some(LoaderProbe {
        context: LOADER_PROBE_CONTEXT,
        bench: probe_loader(machine.cores)?,
    });
    let mut layouts = vec![(1, threads)];
    if threads >= 2 {
        layouts.push((2, threads / 2));
    }
    // Every (config, ranks, threads per rank) the probes run.
    let mut probes = Vec::new();
    // The GPT on both paths; the Llama on its direct step (its graph path plans from the
    // GPT's graph steps: runs on it are rarer).
    for (family, paths) in [
        ("gpt", &["direct", "fused"][..]),
        ("llama", &["direct"][..]),
    ] {
        for precision in ["fp32", "bf16"] {
            for &kernels in paths {
                for &d in widths {
                    for mb in PROBE_MICRO_BATCHES {
                        let cfg = probe_config(family, d, mb, precision, kernels)?;
                        match kernels {
                            // bf16 without bf16 hardware runs on the graph: measured there.
                            "direct" if !cfg.direct_step() => {}
                            "direct" => probes.extend(layouts.iter().map(|&l| (cfg.clone(), l))),
                            // The graph's step is timed by one rank only.
                            _ => probes.push((cfg, layouts[0])),
                        }
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
        let at = StepAt::of(cfg, *ranks, *rank_threads)
            .ok_or_else(|| config_err("model.kind", "a probe is a transformer"))?;
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
