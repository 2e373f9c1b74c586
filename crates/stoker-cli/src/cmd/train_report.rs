//! What `stoker train` prints at a run's end (rank 0): the summary, the bytes held and
//! sent against the plan, the forecast against what the run measured, and, with
//! `--summary-json FILE`, the same results as JSON for scripts.

use std::path::Path;

use anyhow::Context;
use stoker_train::config::TrainConfig;
use stoker_train::run::RunSummary;

/// Prints the run's results, and writes them to `json` where given.
pub fn print(s: &RunSummary, json: Option<&Path>) -> anyhow::Result<()> {
    print_summary(s);
    if let Some(path) = json {
        let text = serde_json::to_string_pretty(&SummaryJson::of(s))?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// A planned figure beside the measured one, and their ratio.
#[derive(serde::Serialize)]
struct Planned {
    planned: f64,
    measured: f64,
    /// measured / planned (null where nothing was planned).
    ratio: Option<f64>,
}

impl Planned {
    fn of(planned: f64, measured: f64) -> Self {
        Planned {
            planned,
            measured,
            ratio: (planned > 0.0).then(|| measured / planned),
        }
    }
}

/// The run's results as `--summary-json` writes them.
#[derive(serde::Serialize)]
struct SummaryJson<'a> {
    steps: u64,
    /// Steps this run took (0: it resumed a finished run; then `last_loss` is null).
    steps_run: usize,
    preempted: bool,
    last_loss: f64,
    eval_loss: Option<f64>,
    eval_accuracy: Option<f64>,
    eval_targets: Option<usize>,
    /// The step the evaluation was made after.
    eval_step: Option<u64>,
    /// The FP32 master weights' CRC-32, eight hex digits (as printed).
    weights_crc32: String,
    params: usize,
    strategy: &'a str,
    world: usize,
    global_batch: usize,
    throughput: f64,
    step_s: f64,
    loader_wait_pct: f64,
    sample: Option<&'a str>,
    /// Model states per rank, bytes: the planner's against the trainer's buffers.
    model_states: Planned,
    /// Bytes each rank sent per step (ring model).
    bytes_sent_per_step: Planned,
    /// Peak memory of the training steps per rank, bytes (the forecast's, and the RSS).
    train_memory: Option<Planned>,
    /// The whole run's peak (evaluation, checkpoints, sampling), bytes.
    run_memory: Option<Planned>,
    /// Seconds per step.
    step_time: Option<Planned>,
}

impl<'a> SummaryJson<'a> {
    fn of(s: &'a RunSummary) -> Self {
        let f = s.forecast.as_ref();
        SummaryJson {
            steps: s.steps,
            steps_run: s.steps_run(),
            preempted: s.preempted,
            last_loss: s.last_loss,
            eval_loss: s.eval.map(|e| e.loss),
            eval_accuracy: s.eval.map(|e| e.accuracy),
            eval_targets: s.eval.map(|e| e.count),
            eval_step: s.eval_step,
            weights_crc32: format!("{:08x}", s.weights_crc32),
            params: s.params,
            strategy: &s.strategy,
            world: s.dims.world,
            global_batch: s.dims.global_batch,
            throughput: s.throughput,
            step_s: s.step_s,
            loader_wait_pct: s.loader_wait_pct,
            sample: s.sample.as_deref(),
            model_states: Planned::of(s.planned.model_states(), s.held.model_states() as f64),
            bytes_sent_per_step: Planned::of(s.planned.bytes_sent_per_step, s.bytes_per_step),
            train_memory: f.map(|f| Planned::of(f.peak_bytes, s.train_rss_bytes as f64)),
            run_memory: f.map(|f| Planned::of(f.peak_bytes, s.peak_rss_bytes as f64)),
            step_time: f.and_then(|f| f.step_s).map(|t| Planned::of(t, s.step_s)),
        }
    }
}

/// Says how a run that a signal stopped can continue.
pub fn print_preempted(s: &RunSummary, config: &TrainConfig) {
    let dir = config
        .run_dir
        .join("checkpoints")
        .join(format!("step_{:08}", s.steps));
    match s.steps_run() {
        // Stopped in the evaluation a resume owed, before any step: nothing was written,
        // and `latest` may name another checkpoint (a resume of an older one).
        0 => println!(
            "stopped by a signal during the evaluation owed at step {}: checkpoint {} still \
             owes it; continue with --resume {}",
            s.steps,
            dir.display(),
            dir.display()
        ),
        _ => println!(
            "stopped by a signal after step {}: checkpoint {} written; continue with \
             --resume latest",
            s.steps,
            dir.display()
        ),
    }
}

/// The resident loop's memory on its backend: planned, counted, and on a GPU measured.
fn print_resident(r: &stoker_train::run::ResidentMemory) {
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    let c = &r.counted;
    let planned = match r.planned {
        Some(p) => format!(
            "planned {:.2} MiB (master and optimizer {:.2} + step {:.2}), ",
            mib(p.total()),
            mib(p.state),
            mib(p.steps)
        ),
        None => String::new(),
    };
    let ratio = |b: usize| match r.planned {
        Some(p) if p.total() > 0 => format!("{:.4}", b as f64 / p.total() as f64),
        _ => "-".into(),
    };
    let measured = match r.measured {
        Some(m) => format!(
            "; taken from the GPU as its driver reports it {:.2} MiB, measured/planned {}",
            mib(m),
            ratio(m)
        ),
        None => "; on the host build (no driver to ask)".into(),
    };
    println!(
        "resident loop per rank: {planned}counted {:.2} MiB (master and optimizer {:.2} + steps {:.2}), counted/planned {}{measured}",
        mib(c.total()),
        mib(c.state),
        mib(c.steps),
        ratio(c.total()),
    );
    if c.host > 0 || r.planned.is_some_and(|p| p.host > 0) {
        // An offload's host memory: on no device, so in none of the figures above.
        let planned = r.planned.map_or(String::new(), |p| {
            format!("planned {:.2} MiB, ", mib(p.host))
        });
        println!(
            "offload's host memory per rank: {planned}counted {:.2} MiB",
            mib(c.host)
        );
    }
}

/// Rank 0's bytes, planned (`stoker_plan::trainer`) vs counted from its buffers and by
/// its communicator.
fn print_states(s: &RunSummary) {
    let mib = |b: f64| b / (1 << 20) as f64;
    let ratio = |held: f64, plan: f64| if plan > 0.0 { held / plan } else { f64::NAN };
    let (p, h) = (&s.planned, &s.held);
    println!(
        "model states per rank ({} x {}): planned {:.2} MiB (params {:.2} + grads {:.2} + optimizer {:.2}), held {:.2} MiB (params {:.2} + grads {:.2} + optimizer {:.2}), held/planned {:.4}; workspace {:.2} MiB",
        s.strategy,
        s.dims.world,
        mib(p.model_states()),
        mib(p.params),
        mib(p.grads),
        mib(p.optimizer),
        mib(h.model_states() as f64),
        mib(h.params as f64),
        mib(h.grads as f64),
        mib(h.optimizer as f64),
        ratio(h.model_states() as f64, p.model_states()),
        mib(h.buffers as f64),
    );
    if let Some(r) = &s.resident {
        print_resident(r);
    }
    if s.dims.world > 1 {
        println!(
            "bytes sent per step per rank: planned {:.3} MiB, counted {:.3} MiB, counted/planned {:.4}",
            mib(p.bytes_sent_per_step),
            mib(s.bytes_per_step),
            ratio(s.bytes_per_step, p.bytes_sent_per_step)
        );
    }
}

/// The planner's forecast for this run (peak memory, step time) beside what it measured.
fn print_forecast(s: &RunSummary) {
    let Some(f) = &s.forecast else {
        return;
    };
    let mib = |b: f64| b / (1 << 20) as f64;
    let rss = s.train_rss_bytes as f64;
    let heap = match (f.heap_bytes, s.train_heap_bytes) {
        (Some(plan), Some(counted)) => format!(
            "heap of training steps planned {:.1} MiB, counted peak {:.1} MiB (counted/planned \
             {:.3}); ",
            mib(plan),
            mib(counted as f64),
            counted as f64 / plan
        ),
        _ => String::new(),
    };
    let time = match f.step_s {
        Some(t) => format!(
            "step time planned {:.1} ms, measured {:.1} ms (measured/planned {:.2})",
            t * 1e3,
            s.step_s * 1e3,
            s.step_s / t
        ),
        None => format!(
            "step time measured {:.1} ms (not planned: {})",
            s.step_s * 1e3,
            f.why_no_step_time()
        ),
    };
    // The plan sizes the loader to sustain the step's need (`stoker tune loader
    // --from-plan`), so it expects the step never to wait for data.
    let loader = match f.required_samples_per_s {
        Some(need) => format!(
            "; loader wait planned 0% (the step needs {need:.0} samples/s), measured {:.2}% \
             of training time",
            s.loader_wait_pct
        ),
        None => format!("; loader wait {:.2}% of training time", s.loader_wait_pct),
    };
    let planner = match f.planner_peak_bytes > 0.0 {
        true => format!(
            " (planner's generic formula {:.1} MiB)",
            mib(f.planner_peak_bytes)
        ),
        false => String::new(),
    };
    println!(
        "planned vs measured per rank ({}): {heap}memory of training steps planned \
         {:.1} MiB{planner}, measured peak RSS {:.1} MiB (measured/planned {:.2}); whole run's peak \
         with evaluation, checkpoints and sampling {:.1} MiB{} (measured/planned {:.2}); {time}{loader}",
        f.basis(),
        mib(f.peak_bytes),
        mib(rss),
        rss / f.peak_bytes,
        mib(s.peak_rss_bytes as f64),
        if s.dims.world > 1 {
            " (rank 0's process)"
        } else {
            ""
        },
        s.peak_rss_bytes as f64 / f.peak_bytes,
    );
    // A preset's figures describe the machine they were measured on: say how to plan this
    // one where the step missed them by more than the plan's 25%.
    if let (Some(t), false) = (f.step_s, f.measured_figures) {
        if !(0.75..=1.25).contains(&(s.step_s / t)) {
            println!(
                "note: the step time was planned from the {}'s figures, measured on another \
                 machine; `stoker plan --calibrate` measures this one into its profile, which \
                 later plans and runs use",
                f.hardware
            );
        }
    }
}

/// The run's last evaluation, where it made one.
fn print_eval(s: &RunSummary) {
    if let Some(e) = s.eval {
        println!(
            "eval loss {:.4}, accuracy {:.2}% ({} targets) after step {}",
            e.loss,
            100.0 * e.accuracy,
            e.count,
            s.eval_step.unwrap_or(s.steps)
        );
    }
}

fn print_summary(s: &RunSummary) {
    println!("parameters: {}", s.params);
    if s.steps_run() == 0 {
        // Stopped in an owed evaluation before any step: print_preempted says so.
        if s.preempted {
            return;
        }
        // A finished job resubmitted (Slurm requeues one after its last step too): it
        // succeeds, and its weights are the checkpoint's.
        println!(
            "steps: {}, nothing to train: the run resumed at step {}, where it ends \
             (train.steps, or --stop-after)",
            s.steps, s.steps
        );
        // The evaluation its checkpoint owed, run now (a signal had stopped it).
        print_eval(s);
        println!("weights crc32: {:08x}", s.weights_crc32);
        return;
    }
    println!("steps: {}, last train loss {:.4}", s.steps, s.last_loss);
    print_eval(s);
    println!(
        "throughput {:.0} targets/s, {:.1} ms per step, loader wait {:.2}% of training time \
         (evaluation {:.2} s and checkpoints {:.2} s not counted)",
        s.throughput,
        1e3 * s.step_s,
        s.loader_wait_pct,
        s.eval_s,
        s.checkpoint_s
    );
    if s.dims.world > 1 {
        println!(
            "ranks: {} ({:?}), {:.1} ms per step, {:.1} ms of it waiting for gradient reductions, {:.2} MiB sent per step by each rank",
            s.dims.world,
            s.dims.strategy,
            1e3 * s.step_s,
            1e3 * s.comm_wait_s,
            s.bytes_per_step / (1 << 20) as f64
        );
    }
    print_states(s);
    print_forecast(s);
    println!("weights crc32: {:08x}", s.weights_crc32);
    if let Some(text) = &s.sample {
        println!("--- sample ---\n{text}\n--------------");
    }
}
