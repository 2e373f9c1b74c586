//! `stoker train`: one rank, N ranks under `mpirun` / `srun` (MPI), or N ranks as threads
//! (`parallel.backend = "local"`).

use std::path::PathBuf;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use stoker_comm::Communicator;
use stoker_train::checkpoint;
use stoker_train::config::{BackendKind, TrainConfig};
use stoker_train::device::threads_per_rank;
use stoker_train::run::{run as train, run_rank, run_threads, Resume, RunOptions};

/// Arguments of `stoker train`.
#[derive(clap::Args)]
pub struct TrainArgs {
    /// The TOML config (see docs/training.md and docs/distributed.md).
    pub config: PathBuf,
    /// Resume from a checkpoint directory, or `latest` for the newest under RUN_DIR/checkpoints.
    #[arg(long)]
    pub resume: Option<String>,
    /// Hide the progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// Check the config, its model and data for a run on `--world` ranks, print what each
    /// rank will hold and send, and exit without training (nothing is written).
    #[arg(long)]
    pub dry_run: bool,
    /// With --dry-run: the number of ranks to plan for (default: the launcher's, else 1).
    #[arg(long, requires = "dry_run")]
    pub world: Option<usize>,
    /// Also write the run's results as JSON (rank 0): steps, losses, the weights' CRC-32,
    /// planned against measured; what scripts check instead of the printed lines.
    #[arg(long)]
    pub summary_json: Option<PathBuf>,
    /// Stop after this many steps (writes a checkpoint there).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub stop_after: Option<u64>,
    /// Test of crash safety, `RANK:STEP[:POINT]`: that rank aborts at POINT of that step's
    /// checkpoint: shard-written, shard-synced (the default), manifest-written, renamed or
    /// committed (checkpoint::SavePoint).
    #[arg(long, hide = true, value_parser = parse_fault)]
    pub test_crash_during_save: Option<checkpoint::SaveFault>,
}

fn parse_fault(s: &str) -> Result<checkpoint::SaveFault, String> {
    let mut parts = s.splitn(3, ':');
    let (Some(rank), Some(step)) = (parts.next(), parts.next()) else {
        return Err("expected RANK:STEP[:POINT]".into());
    };
    let at = match parts.next() {
        None => checkpoint::SavePoint::ShardSynced,
        Some(name) => checkpoint::SavePoint::from_name(name).ok_or_else(|| {
            let names: Vec<&str> = checkpoint::SavePoint::ALL
                .iter()
                .map(|p| p.name())
                .collect();
            format!("point {name:?}: expected one of {}", names.join(", "))
        })?,
    };
    Ok(checkpoint::SaveFault {
        rank: rank.parse().map_err(|e| format!("rank: {e}"))?,
        step: step.parse().map_err(|e| format!("step: {e}"))?,
        at,
    })
}

/// `--dry-run`: the checks a run makes before its first step, and its plan. The compute
/// threads are the run's (the kernels' scratch is per thread); under a launcher every
/// rank joins MPI as the run's ranks do, so that rank 0's count holds MPI's own memory,
/// and rank 0 alone counts and prints.
fn dry_run(args: &TrainArgs, config: &TrainConfig) -> anyhow::Result<()> {
    let launched = stoker_comm::mpi::launched_world();
    // The run's ranks: the flag's, else the launcher's, else those `backend = "local"`
    // runs as threads (`batch.world_size`), else one.
    let local = match config.parallel.backend {
        BackendKind::Local => config.batch.world_size,
        _ => None,
    };
    let world = args
        .world
        .or(launched.as_ref().map(|(_, n)| *n))
        .or(local)
        .unwrap_or(1);
    anyhow::ensure!(world >= 1, "--world 0: expected at least 1 rank");
    let per_host = stoker_comm::mpi::local_ranks().unwrap_or(world).min(world);
    let threads = threads_per_rank(config.parallel.threads_per_rank, per_host);
    crate::candle_threads::share_cores_with_candle(threads);
    size_global_pool(threads);
    let mpi = match &launched {
        Some((_, n)) if *n > 1 => Some(stoker_comm::mpi::MpiComm::init(
            stoker_comm::communicator::timeout_from_secs(
                config.parallel.timeout_s,
                stoker_comm::DEFAULT_TIMEOUT,
            ),
        )?),
        _ => None,
    };
    let lead = mpi.as_ref().is_none_or(|m| m.rank() == 0);
    let result = match lead {
        true => print_dry_run(args, config, world, per_host),
        false => Ok(()),
    };
    if let Some(m) = mpi {
        m.barrier()?;
        m.finalize(Duration::from_secs(10), 0);
    }
    result
}

/// The dry run's count and plan for `world` ranks, `per_host` of them on this host.
fn print_dry_run(
    args: &TrainArgs,
    config: &TrainConfig,
    world: usize,
    per_host: usize,
) -> anyhow::Result<()> {
    let budget = stoker_train::dry_run::MemoryBudget::of(config)?;
    let heap: &dyn stoker_train::heap::HeapCount = &crate::ALLOC;
    let d = stoker_train::dry_run::dry_run(
        config,
        world,
        Some(heap),
        budget.as_ref().map(|b| b.bytes),
    )?;
    println!("{}: valid", args.config.display());
    println!(
        "model: {} parameters; data: {} training and {} evaluation samples",
        d.params, d.train_samples, d.eval_samples
    );
    println!(
        "batch: {} per micro-batch x {} accumulation steps x {} ranks = global batch {}; strategy {:?}",
        d.dims.micro_batch, d.dims.accumulation_steps, d.dims.world, d.dims.global_batch, d.dims.strategy
    );
    println!("planned per rank: {}", d.planned.summary());
    for note in config
        .notes
        .iter()
        .chain(&stoker_train::run::slow_precision(config))
        .chain(&d.data_notes)
    {
        println!("warning: {note}");
    }
    // The run's forecast (peak memory per rank, step time) for these ranks on this host,
    // on this machine's profile where it applies; then whether the host's ranks fit.
    let mut planned = config.clone();
    if let Some(p) = crate::machine_profile::load()? {
        let threads = stoker_train::machine::rank_threads(config, world);
        println!("{}", p.line(&p.apply(&mut planned, world, threads)));
    }
    match stoker_train::planned::forecast(&planned, world, per_host, Some(&d.own)) {
        Ok(f) => {
            println!("{}", stoker_train::run::forecast_line(&f));
            if let Some(why) = d.scratch.why_not() {
                println!(
                    "not counted: the kernels' scratch{} (no scratch micro-batch ran: {why})",
                    match d.own.activations {
                        Some(_) => "",
                        None =>
                            " and candle's graph's activations (the planner's formula stands in)",
                    }
                );
            }
            let outside = stoker_comm::mpi::launched_world().is_none();
            if world > 1 && outside && config.parallel.backend != BackendKind::Local {
                println!(
                    "not counted: MPI's own memory in each rank (run the dry run under the \
                     launcher, `mpirun -n {world} stoker train CONFIG --dry-run`, to count it)"
                );
            }
            match budget {
                Some(budget) => {
                    let fit = stoker_train::dry_run::Fit {
                        ranks: per_host,
                        per_rank: f.peak_bytes,
                        shared: f.mapped_bytes,
                        budget,
                    };
                    println!("{}", fit.line());
                }
                None => println!("fit: unknown (this machine's memory cannot be read)"),
            }
        }
        Err(e) => println!("planner forecast: none ({e})"),
    }
    println!("(a run prints the same beside what it counted; nothing was trained or written)");
    Ok(())
}

/// Runs `stoker train`.
pub fn run(args: TrainArgs) -> anyhow::Result<()> {
    let config = TrainConfig::load(&args.config)?;
    if args.dry_run {
        return dry_run(&args, &config);
    }
    let resume = match args.resume.as_deref() {
        None => None,
        // The ranks pick it together, once their communicator exists (each verifies its
        // share of every candidate): `stoker_train::run::Resume::Latest`.
        Some("latest") => Some(Resume::Latest(config.run_dir.join("checkpoints"))),
        Some(p) => Some(Resume::From(PathBuf::from(p))),
    };
    let opts = RunOptions {
        resume,
        progress: !args.no_progress,
        stop_after: args.stop_after,
        save_fault: args.test_crash_during_save,
        stop: Some(stop_on_signals()?),
        stop_in_eval: None,
        heap: Some(&crate::ALLOC),
        // The forecast's figures; a broken profile only loses the run its plan.
        profile: crate::machine_profile::load().unwrap_or_else(|e| {
            eprintln!(
                "stoker: warning: {}; the forecast plans from the config alone",
                crate::error_text::chain_text(&e)
            );
            None
        }),
    };
    let launched = stoker_comm::mpi::launched_world();
    if let Some((_, world)) = &launched {
        crate::candle_threads::share_cores_with_candle(threads_per_rank(
            config.parallel.threads_per_rank,
            stoker_comm::mpi::local_ranks().unwrap_or(*world),
        ));
    }
    match (config.parallel.backend, launched) {
        // Every process the launcher started would run the whole job in its threads, all
        // over the same run directory.
        (BackendKind::Local, Some((launcher, n))) if n > 1 => anyhow::bail!(
            "config key `parallel.backend`: \"local\" runs the ranks as threads of one \
             process, but {launcher} started {n} processes, each of which would run the \
             whole job into the same run_dir: start one process (`stoker train {}`), or \
             use backend \"mpi\" or \"auto\" under the launcher",
            args.config.display()
        ),
        (BackendKind::Local, _) => run_local(&args, &config, &opts),
        (BackendKind::Mpi, None) => anyhow::bail!(
            "config key `parallel.backend`: \"mpi\", but no MPI launcher started this process: run `mpirun -n N stoker train {}`",
            args.config.display()
        ),
        (BackendKind::Mpi, Some((launcher, n))) => run_mpi(&args, &config, &opts, (&launcher, n)),
        (BackendKind::Auto, Some((launcher, n))) if n > 1 => {
            run_mpi(&args, &config, &opts, (&launcher, n))
        }
        (BackendKind::Auto, _) => {
            size_global_pool(threads_per_rank(config.parallel.threads_per_rank, 1));
            banner(&args, &config, "1 rank", rayon::current_num_threads());
            let s = train(&config, &opts)?;
            super::train_report::print(&s, args.summary_json.as_deref())?;
            if s.preempted {
                super::train_report::print_preempted(&s, &config);
                std::process::exit(PREEMPTED_EXIT);
            }
            Ok(())
        }
    }
}

/// Exit status of a run stopped by SIGTERM or SIGINT after writing its checkpoint
/// (`EX_TEMPFAIL`: resume it with `--resume latest`).
pub const PREEMPTED_EXIT: i32 = 75;

/// A flag SIGTERM and SIGINT raise (the run finishes its step, checkpoints and stops:
/// Slurm sends SIGTERM before it kills a preempted job); a second signal, arriving
/// [`SAME_REQUEST`] or more after the first, ends the process at once, with status 128 +
/// the signal's number. Closer than that it is the same request delivered twice:
/// coreutils' `timeout` signals the process and then its process group, microseconds
/// apart, which ended half of such runs with 143 and no checkpoint.
fn stop_on_signals() -> anyhow::Result<Arc<AtomicBool>> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    use std::sync::atomic::AtomicU64;
    let flag = Arc::new(AtomicBool::new(false));
    // Nanoseconds after `base` at which the first signal arrived, plus one (0: none yet).
    let first = Arc::new(AtomicU64::new(0));
    let base = std::time::Instant::now();
    for sig in [SIGTERM, SIGINT] {
        let (flag, first) = (flag.clone(), first.clone());
        let handler = move || {
            let now = base.elapsed().as_nanos() as u64 + 1;
            match first.compare_exchange(0, now, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => flag.store(true, Ordering::SeqCst),
                Err(at) if now.saturating_sub(at) >= SAME_REQUEST.as_nanos() as u64 => {
                    signal_hook::low_level::exit(128 + sig)
                }
                Err(_) => {}
            }
        };
        // SAFETY: the handler runs in signal context; it only reads the monotonic clock
        // (clock_gettime, async-signal-safe), does atomic operations on memory the Arcs
        // keep alive for the process's life, and may call `_exit` (async-signal-safe).
        // It allocates nothing, takes no lock and does no I/O.
        unsafe { signal_hook::low_level::register(sig, handler) }
            .context("installing the SIGTERM / SIGINT handlers")?;
    }
    Ok(flag)
}

/// Signals closer together than this are one stop request (see [`stop_on_signals`]).
const SAME_REQUEST: Duration = Duration::from_millis(10);

/// Sizes this process's compute pool (rayon's global one) to `threads`, unless
/// `RAYON_NUM_THREADS` sizes it (checked at start). Before: one rank's pool took every
/// core whatever `parallel.threads_per_rank` said.
fn size_global_pool(threads: usize) {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        // Fails only when the pool already runs (sized by an earlier call).
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build_global();
    }
}

/// The run's first line; `threads` is each rank's compute pool.
fn banner(args: &TrainArgs, config: &TrainConfig, ranks: &str, threads: usize) {
    eprintln!(
        "stoker train: {} ({:?}, {ranks}, threads per rank {threads}) -> {}",
        args.config.display(),
        config.precision,
        config.run_dir.display()
    );
}

fn run_local(args: &TrainArgs, config: &TrainConfig, opts: &RunOptions) -> anyhow::Result<()> {
    let world = config.batch.world_size.unwrap_or(1);
    // Each rank's own pool (run_threads), not the global one.
    let threads = stoker_train::machine::rank_threads(config, world);
    banner(args, config, &format!("{world} ranks as threads"), threads);
    let results = run_threads(config, opts)?;
    let mut errors = Vec::new();
    let mut preempted = false;
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(s) if rank == 0 => {
                super::train_report::print(&s, args.summary_json.as_deref())?;
                if s.preempted {
                    super::train_report::print_preempted(&s, config);
                    preempted = true;
                }
            }
            Ok(_) => {}
            Err(e) => errors.push((rank, e)),
        }
    }
    // Every rank refused alike (a config error each thread rank finds): said once, as
    // the process's error. Otherwise each failing rank is named.
    let texts: Vec<String> = errors.iter().map(|(_, e)| e.to_string()).collect();
    let alike = errors.len() == world && texts.iter().all(|t| *t == texts[0]);
    for (rank, e) in errors.iter().filter(|_| !alike) {
        stoker_comm::say(&format!("stoker: rank {rank} of {world}: error: {e}"));
    }
    let first_err = errors.into_iter().next().map(|(_, e)| e);
    match (first_err, preempted) {
        (Some(e), _) => Err(e.into()),
        (None, true) => std::process::exit(PREEMPTED_EXIT),
        (None, false) => Ok(()),
    }
}

fn run_mpi(
    args: &TrainArgs,
    config: &TrainConfig,
    opts: &RunOptions,
    (launcher, started): (&str, usize),
) -> anyhow::Result<()> {
    let timeout = stoker_comm::communicator::timeout_from_secs(
        config.parallel.timeout_s,
        stoker_comm::DEFAULT_TIMEOUT,
    );
    let comm = stoker_comm::mpi::MpiComm::init(timeout)?;
    let (rank, world) = (comm.rank(), comm.world_size());
    // A launcher whose process manager this binary's MPI does not speak (srun without
    // `--mpi=pmi2`, Open MPI's mpirun starting an MPICH binary) leaves every process a
    // world of its own: each would train alone, all into the same run directory.
    anyhow::ensure!(
        world == started,
        "{launcher} started {started} processes, but MPI gives this one a world of {world}: \
         the launcher and this binary's MPI (MPICH) do not speak the same process manager \
         (under Slurm run `srun --mpi=pmi2`; an MPICH binary needs MPICH's mpirun), and each \
         process would train alone into the same run_dir"
    );
    // A panic on any rank ends the whole job (a rank that unwinds while the others wait
    // in a collective would hang them until the timeout).
    std::panic::set_hook(Box::new(move |info| {
        stoker_comm::say(&format!("stoker: rank {rank} of {world}: panic: {info}"));
        stoker_comm::mpi::abort_world(101);
    }));
    size_global_pool(threads_per_rank(
        config.parallel.threads_per_rank,
        stoker_comm::mpi::local_ranks().unwrap_or(world),
    ));
    // One write, so that lines of different ranks do not interleave in the launcher's
    // merged output; the pid maps a launcher's "PID n" message back to the rank.
    stoker_comm::say(&format!(
        "stoker: rank {rank} of {world}: pid {} on {} ({launcher})",
        std::process::id(),
        stoker_comm::mpi::host_name()
    ));
    if rank == 0 {
        banner(
            args,
            config,
            &format!("{world} MPI ranks"),
            rayon::current_num_threads(),
        );
    }
    let comm = Rc::new(comm);
    let result = run_rank(config, opts, comm.clone(), launcher);
    match result {
        Ok(s) => {
            if rank == 0 {
                super::train_report::print(&s, args.summary_json.as_deref())?;
                if s.preempted {
                    super::train_report::print_preempted(&s, config);
                }
            }
            use std::io::Write;
            let _ = std::io::stdout().flush();
            let comm =
                Rc::try_unwrap(comm).unwrap_or_else(|_| unreachable!("the run has returned"));
            let code = if s.preempted { PREEMPTED_EXIT } else { 0 };
            comm.finalize(Duration::from_secs(10), code);
            if s.preempted {
                std::process::exit(PREEMPTED_EXIT);
            }
            Ok(())
        }
        Err(e) => {
            let e = anyhow::Error::from(e);
            let kind = crate::error_kind::ErrorKind::of(&e).name();
            comm.abort(
                1,
                &format!("error[{kind}]: {}", crate::error_text::chain_text(&e)),
            )
        }
    }
}
