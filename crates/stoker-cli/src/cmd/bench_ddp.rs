//! `stoker bench ddp CONFIG` (alone for one rank, under `mpirun -n N` for N): the
//! data-parallel step of the config's strategy on this machine. It trains the config's
//! model on its data for `--steps` steps and reports the median step time and the median
//! wait for communication the step did not hide (DDP and ZeRO-1/2: reductions after the
//! backward; ZeRO-3: gathers and reduce-scatters), then runs the same collectives with
//! nothing else running (the communication's whole time), and prints the overlap
//! achieved, `1 - exposed wait / isolated time`, beside `stoker plan`'s predicted
//! communication time of that strategy for the same model and world size on the `cpu`
//! preset. scripts/bench/ddp.sh runs it at 1 and 2 ranks and prints the step time beyond
//! compute.

use std::path::PathBuf;
use std::rc::Rc;
use std::time::{Duration, Instant};

use anyhow::Context;
use stoker_comm::{Buffer, Communicator, Pending};
use stoker_train::config::{StrategyKind, TrainConfig};
use stoker_train::device::threads_per_rank;
use stoker_train::layout::FlatLayout;
use stoker_train::models::build_model;
use stoker_train::models::ModelConfig;
use stoker_train::parallel::{buckets, GroupShards};
use stoker_train::run::{run_rank, RunOptions};

/// Arguments of `stoker bench ddp`.
#[derive(clap::Args)]
pub struct DdpBenchArgs {
    /// A training config (its model, data, batch and `[parallel]` keys are used).
    config: PathBuf,
    /// Optimizer steps to time.
    #[arg(long, default_value_t = 20)]
    steps: u64,
    /// Leading steps left out of the medians (allocation, first touch).
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Also write the results as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(serde::Serialize)]
struct DdpResult {
    strategy: &'static str,
    ranks: usize,
    threads_per_rank: usize,
    params: usize,
    accumulation_steps: usize,
    sync_every_micro_batch: bool,
    step_ms: f64,
    exposed_wait_ms: f64,
    isolated_comm_ms: f64,
    overlap: f64,
    plan_comm_ms: Option<f64>,
    mib_sent_per_step: f64,
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return f64::NAN;
    }
    v[v.len() / 2]
}

/// `stoker plan`'s communication time per step of `strategy` for a GPT of `config` on
/// `world` ranks of the `cpu` preset, in seconds (None for other models).
fn plan_comm_s(
    config: &TrainConfig,
    strategy: &str,
    world: usize,
    global_batch: usize,
) -> Option<f64> {
    let ModelConfig::Gpt(g) = &config.model else {
        return None;
    };
    let text = format!(
        "[model]\nfamily = \"gpt2\"\nlayers = {}\nhidden = {}\nheads = {}\nvocab = {}\ncontext = {}\n\
         [hardware]\npreset = \"cpu\"\ndevices_per_node = {world}\n\
         [training]\nglobal_batch = {global_batch}\nseq_len = {}\nprecision = \"fp32\"\noptimizer = \"adamw\"\nstrategy = \"{strategy}\"\n",
        g.n_layer, g.d_model, g.n_head, g.vocab, g.context, g.context
    );
    let input = stoker_plan::input::PlanInput::from_toml_str("bench-ddp", &text).ok()?;
    let r = stoker_plan::resolve::resolve(&Default::default(), None, &input).ok()?;
    let p = stoker_plan::plan(r, None);
    p.strategies
        .iter()
        .find(|s| s.label == strategy)
        .map(|s| s.comm.step_s)
}

/// Starts one step's collectives of `config`'s strategy with nothing else running, on
/// buffers of zeros. DDP and ZeRO-1/2: an all-reduce of every gradient bucket (ZeRO's
/// reduce-scatter and all-gather move a ring all-reduce's bytes), once per reduced
/// micro-batch. ZeRO-3, every micro-batch: each parameter group gathered (blocks twice
/// when they are resharded after the forward) and reduce-scattered.
fn start_step_collectives(
    comm: &dyn Communicator,
    config: &TrainConfig,
    layout: &FlatLayout,
    accumulation_steps: usize,
) -> anyhow::Result<Vec<Pending>> {
    let p = &config.parallel;
    let mut pending = Vec::new();
    if p.strategy == StrategyKind::Zero3 {
        let (world, rank) = (comm.world_size(), comm.rank());
        let shards = GroupShards::new(layout.group_spans()?, world, layout.align());
        let splits = shards.group_splits(rank);
        let last = splits.len().saturating_sub(1);
        for _ in 0..accumulation_steps {
            for (g, s) in splits.iter().enumerate() {
                let block = g > 0 && g < last;
                let gathers = if block && p.reshard_after_forward {
                    2
                } else {
                    1
                };
                for _ in 0..gathers {
                    let (input, output) = (vec![0f32; s.local.len()], vec![0f32; s.span.len()]);
                    pending.push(comm.start_all_gather(
                        Buffer::F32(input),
                        &s.counts,
                        Buffer::F32(output),
                    )?);
                }
                let (input, output) = (vec![0f32; s.span.len()], vec![0f32; s.local.len()]);
                pending.push(comm.start_reduce_scatter(
                    Buffer::F32(input),
                    &s.counts,
                    Buffer::F32(output),
                )?);
            }
        }
        return Ok(pending);
    }
    let mib = |x: f64| (x * (1 << 20) as f64) as usize;
    let plan = buckets::plan(
        &layout.group_ranges(),
        mib(p.bucket_cap_mb),
        mib(p.first_bucket_mb),
    );
    let reduced = match p.sync_every_micro_batch {
        Some(true) => accumulation_steps,
        _ => 1,
    };
    for _ in 0..reduced {
        for b in &plan {
            pending.push(comm.start_all_reduce(Buffer::F32(vec![0.0; b.range.len()]))?);
        }
    }
    Ok(pending)
}

/// Runs `stoker bench ddp`.
pub fn run(a: DdpBenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.steps as usize > a.warmup,
        "--steps {}: expected more than --warmup {} (the steps left to time)",
        a.steps,
        a.warmup
    );
    let mut config = TrainConfig::load(&a.config)?;
    config.train.steps = a.steps;
    config.train.eval_every = 0;
    config.train.eval_batches = 1;
    config.train.checkpoint_every = 0;
    config.train.sample_tokens = 0;
    config.run_dir = config.run_dir.join("bench-ddp");
    let launched = stoker_comm::mpi::launched_world();
    let mpi = match &launched {
        Some((_, n)) if *n > 1 => Some(Rc::new(stoker_comm::mpi::MpiComm::init(
            Duration::from_secs(120),
        )?)),
        _ => None,
    };
    let (comm, launcher): (Rc<dyn Communicator>, String) = match (&mpi, &launched) {
        (Some(m), Some((l, _))) => (m.clone(), l.clone()),
        _ => (
            Rc::new(stoker_comm::local_group(1, Duration::from_secs(120)).remove(0)),
            "this process".into(),
        ),
    };
    // The bench's own directory: an earlier bench's final checkpoint there would make
    // this run refuse to start afresh (it is a fresh run each time).
    if comm.rank() == 0 {
        let ckpts = config.run_dir.join("checkpoints");
        if ckpts.exists() {
            std::fs::remove_dir_all(&ckpts)
                .with_context(|| format!("clearing {}", ckpts.display()))?;
        }
    }
    comm.barrier()?;
    let world = comm.world_size();
    let threads = match stoker_train::device::rayon_threads_env()? {
        Some(t) => t,
        None => {
            let t = threads_per_rank(config.parallel.threads_per_rank, world);
            let _ = rayon::ThreadPoolBuilder::new()
                .num_threads(t)
                .build_global();
            t
        }
    };
    let s = run_rank(&config, &RunOptions::default(), comm.clone(), &launcher)
        .context("the timed training run")?;
    // The same collectives with nothing else running.
    let model = build_model(&config.model, config.precision, config.kernels, config.seed)?;
    let layout = FlatLayout::of(model.params())?;
    let p = &config.parallel;
    let strategy = match world {
        1 => "none",
        _ => p.strategy.stage().name(),
    };
    let mut isolated = Vec::new();
    let mut collectives = 0;
    for _ in 0..(a.steps as usize).max(10) {
        comm.barrier()?;
        let t0 = Instant::now();
        let pending = start_step_collectives(&*comm, &config, &layout, s.dims.accumulation_steps)?;
        collectives = pending.len();
        for p in pending {
            p.wait()?;
        }
        isolated.push(t0.elapsed().as_secs_f64());
    }
    let skip = a.warmup.min(s.step_times_s.len().saturating_sub(1));
    let step = median(&s.step_times_s[skip..]);
    let wait = median(&s.comm_waits_s[skip..]);
    let iso = if world > 1 { median(&isolated) } else { 0.0 };
    let overlap = if iso > 0.0 {
        ((iso - wait) / iso).clamp(0.0, 1.0)
    } else {
        f64::NAN
    };
    let planned = plan_comm_s(
        &config,
        p.strategy.stage().name(),
        world,
        s.dims.global_batch,
    );
    let result = DdpResult {
        strategy,
        ranks: world,
        threads_per_rank: threads,
        params: s.params,
        accumulation_steps: s.dims.accumulation_steps,
        sync_every_micro_batch: p.sync_every_micro_batch == Some(true),
        step_ms: 1e3 * step,
        exposed_wait_ms: 1e3 * wait,
        isolated_comm_ms: 1e3 * iso,
        overlap,
        plan_comm_ms: planned.map(|x| 1e3 * x),
        mib_sent_per_step: s.bytes_per_step / (1 << 20) as f64,
    };
    if comm.rank() == 0 {
        println!(
            "{strategy}: {} rank(s) x {} thread(s), {} parameters, {collectives} collectives per step, accumulation {}{}: step {:.1} ms (median of {}), waiting for communication the step did not hide {:.2} ms, the same collectives alone {:.2} ms: {:.0}% hidden under the computation; {:.2} MiB sent per step by each rank; stoker plan predicts {} of {} communication per step",
            world,
            threads,
            s.params,
            result.accumulation_steps,
            if p.sync_every_micro_batch == Some(true) { " (sync every micro-batch)" } else { "" },
            result.step_ms,
            s.step_times_s.len() - skip,
            result.exposed_wait_ms,
            result.isolated_comm_ms,
            100.0 * if overlap.is_nan() { 0.0 } else { overlap },
            result.mib_sent_per_step,
            planned.map_or("(no prediction for this model)".into(), |x| format!("{:.2} ms", 1e3 * x)),
            p.strategy.stage().name(),
        );
        if let Some(path) = &a.json {
            std::fs::write(path, serde_json::to_string_pretty(&result)?)
                .with_context(|| format!("writing {}", path.display()))?;
        }
    }
    drop(comm);
    if let Some(m) = mpi {
        let m = Rc::try_unwrap(m).unwrap_or_else(|_| unreachable!("the run has returned"));
        m.finalize(Duration::from_secs(10), 0);
    }
    Ok(())
}
