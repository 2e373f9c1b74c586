//! A rank's setup before its first step: the parallel degrees checked, the device, the
//! model (declared first without values, so that a ZeRO-3 rank draws only its pieces), the
//! strategy and the trainer, the vocabulary and the data checked against the model, the
//! checkpoint resumed, and rank 0's run directory.

use std::path::PathBuf;
use std::rc::Rc;

use stoker_comm::{CommExt, Communicator};
use stoker_data::Dataset;

use crate::checkpoint::{self, DataPosition};
use crate::config::TrainConfig;
use crate::data::{open_datasets, Datasets};
use crate::error::{config_err, io_err, Result, TrainError};
use crate::layout::FlatLayout;
use crate::metrics::MetricsLog;
use crate::models::{build_meta_model_on, build_model_on};
use crate::parallel::ParallelDims;
use crate::trainer::Trainer;

use super::run_dir_lock::RunDirLock;
use super::{slow_precision, Resume, RunOptions};

/// One rank, set up.
pub(super) struct Rank {
    /// The batch and parallel degrees.
    pub dims: ParallelDims,
    /// Whether this is rank 0, which prints and writes the run directory.
    pub lead: bool,
    /// Ranks on this rank's host (sharing its cores and memory).
    pub per_host: usize,
    /// The trainer.
    pub trainer: Trainer,
    /// The training and evaluation data.
    pub data: Datasets,
    /// Its training samples' fingerprint (`Datasets::train_fingerprint`), read once: the
    /// data does not change within a run, and every checkpoint records it.
    pub train_fingerprint: u32,
    /// Rank 0's metrics log.
    pub log: Option<MetricsLog>,
    /// Rank 0's lock on the run directory, held for the run.
    pub _run_dir_lock: Option<RunDirLock>,
    /// The checkpoint this life resumed from (the one given, or `--resume latest`'s pick).
    pub resumed_from: Option<PathBuf>,
    /// Seconds the run had run before this life: the resumed checkpoint's (0 for a new
    /// run, or a checkpoint that did not record it).
    pub elapsed_before_s: f64,
    /// The resumed checkpoint's evaluation is owed (a signal stopped it): run first.
    pub eval_pending: bool,
    /// The line that says what each rank holds and how the batch splits.
    pub accounting: String,
}

impl Rank {
    /// Sets up this rank of `comm`'s group (started by `launcher`, named in errors).
    pub fn set_up(
        config: &TrainConfig,
        opts: &RunOptions,
        comm: &Rc<dyn Communicator>,
        launcher: &str,
    ) -> Result<Rank> {
        let dims = ParallelDims::resolve(config, comm.world_size(), comm.rank(), launcher)?;
        let lead = dims.rank == 0;
        if lead {
            for note in config.notes.iter().chain(&slow_precision(config)) {
                tracing::warn!("{note}");
            }
        }
        // A GPU (`device = "cuda"`): the rank's own, one per rank on its host.
        let (launched, per_host) = (comm.backend() != "local", comm.ranks_on_this_host());
        let local = crate::device::local_rank(dims.rank, per_host, launched);
        // The resident step opens its GPU itself (stoker-gpu's device, not candle's): the
        // model's candle variables, which only sampling runs, stay on the host.
        let device = match config.resident_step() {
            true => candle_core::Device::Cpu,
            false => crate::device::TrainDevice::parse(&config.device)?.open(local)?,
        };
        let (p, k, seed) = (config.precision, config.kernels, config.seed);
        // The model declared first without values: its layout sets the strategy up, and a
        // strategy that shards the parameters (ZeRO-3) draws this rank's pieces from it
        // alone; every other gets the model built whole.
        let meta = build_meta_model_on(&config.model, p, k, seed, &device)?;
        // The data checked against the declared model before any weight is made: a
        // dataset that cannot fill one window fails at once, whatever the model's size.
        let data = open_datasets(config, &*meta)?;
        if lead {
            for note in &data.notes {
                tracing::warn!("{note}");
            }
        }
        let lens = (data.train.len(), data.eval.len());
        crate::parallel::agree::check_same_data(&**comm, lens, config)?;
        let train_fingerprint = data.train_fingerprint()?;
        let layout = FlatLayout::of(meta.params())?;
        check_master_fits(config, &layout, comm.world_size(), per_host)?;
        let strategy = crate::parallel::for_config(config, &layout, comm.clone())?;
        let len = layout.total_len();
        let model = match strategy.holds(len).is_whole(len) {
            true => build_model_on(&config.model, p, k, seed, &device)?,
            false => meta,
        };
        let mut trainer = Trainer::with_strategy_on_gpu(config, model, strategy, local)?;
        let resumed_from = match &opts.resume {
            Some(Resume::From(dir)) => Some(dir.clone()),
            Some(Resume::Latest(root)) => pick_latest(root, &**comm)?,
            None => None,
        };
        let (resumed_at, elapsed_before_s, eval_pending) = match &resumed_from {
            Some(dir) => {
                let train = (data.train.len(), train_fingerprint);
                let r = resume(&mut trainer, dir, config, &dims, train)?;
                (Some(r.step), r.elapsed_s.unwrap_or(0.0), r.eval_pending)
            }
            None => (None, 0.0, false),
        };
        // The resident loop made before the first step (its GPU opened, its buffers
        // allocated): a run fails here, not at its first window, where it cannot.
        trainer.make_resident_loop()?;
        let (log, _run_dir_lock) = match lead {
            true => {
                let (log, lock) = open_run_dir(config, resumed_at)?;
                (Some(log), Some(lock))
            }
            false => (None, None),
        };
        // An evaluation the checkpoint owes that an earlier resume already ran and
        // logged needs no second run: rank 0's log says, and every rank agrees (the
        // evaluation is a collective). Logged once however often the job is requeued.
        let eval_pending = eval_pending && {
            let logged = log.as_ref().is_some_and(MetricsLog::has_eval_at_resume);
            comm.sum(logged as u64)? == 0
        };
        let accounting = accounting(&trainer, &dims, &data);
        tracing::info!("{accounting}");
        if data.train.len() < dims.global_batch {
            return Err(TrainError::Data {
                what: config.data.train.display().to_string(),
                message: format!(
                    "{} training samples, fewer than one global batch of {} (batch.global_batch)",
                    data.train.len(),
                    dims.global_batch
                ),
            });
        }
        Ok(Rank {
            dims,
            lead,
            per_host,
            trainer,
            data,
            train_fingerprint,
            log,
            _run_dir_lock,
            resumed_from,
            elapsed_before_s,
            eval_pending,
            accounting,
        })
    }
}

/// The checkpoint `--resume latest` takes under `root`: the newest whose verification,
/// split among the ranks of `comm`, passes on every rank. Each rank warns of its own
/// failed share (naming the file); rank 0 alone warns of those passed over for another
/// reason (newer than `LATEST`). None there yet: a fresh start, as a job requeued before
/// its first checkpoint needs; some, none intact: an error.
fn pick_latest(root: &std::path::Path, comm: &dyn Communicator) -> Result<Option<PathBuf>> {
    let share = checkpoint::Share {
        rank: comm.rank(),
        world: comm.world_size(),
    };
    let all_passed = |ok: bool| Ok(comm.sum(u64::from(!ok))? == 0);
    let intact = checkpoint::latest_intact_on(root, share, all_passed)?;
    let lead = share.rank == 0;
    for (dir, why) in &intact.skipped {
        // Those passed over unread are the same on every rank (rank 0 says them); a
        // failed check is said by the rank whose share failed.
        let say = match why {
            checkpoint::PassedOver::Unread(_) => lead,
            checkpoint::PassedOver::Failed(_) => true,
            checkpoint::PassedOver::FailedElsewhere => false,
        };
        if say {
            eprintln!("{}", checkpoint::skipped_line(dir, why));
        }
    }
    match (intact.dir, intact.skipped.len()) {
        (Some(dir), _) => Ok(Some(dir)),
        (None, 0) => {
            if lead {
                eprintln!(
                    "stoker: no checkpoint under {} yet: starting from step 0",
                    root.display()
                );
            }
            Ok(None)
        }
        (None, n) => Err(TrainError::Checkpoint {
            path: root.to_path_buf(),
            message: format!("no intact checkpoint: {n} passed over (above)"),
        }),
    }
}

/// Refuses a model whose FP32 master weights alone, on this host's ranks, exceed the
/// memory this machine gives the process: the least any run keeps. Without it, a size
/// key off by orders of magnitude (`model.context = 100000000000`) ends in the
/// allocator's abort, not in an error naming the key.
fn check_master_fits(
    config: &TrainConfig,
    layout: &FlatLayout,
    world: usize,
    per_host: usize,
) -> Result<()> {
    use crate::config::StrategyKind;
    let Some(limit) = stoker_data::measure::memory_limit_bytes() else {
        return Ok(());
    };
    let len = layout.total_len();
    let held = match (world, config.parallel.strategy) {
        (2.., StrategyKind::Zero3) => len.div_ceil(world),
        _ => len,
    };
    let bytes = 4.0 * held as f64 * per_host.max(1) as f64;
    if bytes <= limit as f64 {
        return Ok(());
    }
    let gib = |b: f64| b / (1u64 << 30) as f64;
    Err(crate::error::config_err(
        "model",
        format!(
            "{len} parameters: their FP32 master weights alone take {:.1} GiB on this host's \
             {} rank(s), more than the {:.1} GiB this machine gives the process; check the \
             model's sizes (context, d_model, vocab, n_layer)",
            gib(bytes),
            per_host.max(1),
            gib(limit as f64)
        ),
    ))
}

/// Loads the checkpoint `dir` into `trainer` and sets its loader position for this
/// run's batch split, after checking that `config`, over `train` training data (its
/// sample count and fingerprint), continues the run that wrote it; what the checkpoint
/// says of where the run stood (its step, seconds, an evaluation owed).
fn resume(
    trainer: &mut Trainer,
    dir: &std::path::Path,
    config: &TrainConfig,
    dims: &ParallelDims,
    train: (usize, u32),
) -> Result<checkpoint::Resumed> {
    let state = checkpoint::load(trainer, dir)?;
    let run = checkpoint::RunRecord::of(config);
    let notes = checkpoint::check_continues(&state, &run, Some(train), dir)?;
    if dims.rank == 0 {
        for note in notes {
            tracing::warn!("{note}");
        }
    }
    let pos = state.data.clone().unwrap_or_else(|| {
        // Version 1: written by one rank, k = global_batch / micro_batch.
        let k = dims.global_batch / dims.micro_batch;
        DataPosition::of(state.sampler, dims.global_batch, 1, k, None)
    });
    trainer.set_sampler_state(pos.resume_at(dims.global_batch, dims.accumulation_steps)?);
    Ok(state)
}

/// Rank 0's run directory: locked for this run, its checkpoints' folder made (a path
/// there that cannot be one fails now, not at the first save after hours of training),
/// the resolved config written, the metrics log opened (kept up to `resumed_at` where the
/// run resumes).
fn open_run_dir(config: &TrainConfig, resumed_at: Option<u64>) -> Result<(MetricsLog, RunDirLock)> {
    let run_dir = &config.run_dir;
    let lock = RunDirLock::take(run_dir)?;
    // A fresh run beside an earlier run's checkpoints would interleave its own with
    // theirs, and `--resume latest` would then continue whichever is newest by step,
    // the earlier run's included (Hugging Face's Trainer refuses a non-empty output
    // directory for the same reason).
    if resumed_at.is_none() {
        let earlier = checkpoint::complete(&run_dir.join("checkpoints"));
        if let Some(newest) = earlier.last() {
            return Err(crate::error::config_err(
                "run_dir",
                format!(
                    "{} holds {} checkpoint(s) of an earlier run (the newest {}): continue it \
                     with --resume latest, or remove its checkpoints/ (or choose another \
                     run_dir) to start afresh",
                    run_dir.display(),
                    earlier.len(),
                    newest.display()
                ),
            ));
        }
    }
    make_checkpoints_dir(&run_dir.join("checkpoints"))?;
    let cfg_text = toml::to_string(config).map_err(|e| TrainError::Setup(e.to_string()))?;
    std::fs::write(run_dir.join("config.toml"), cfg_text).map_err(|e| io_err(run_dir, e))?;
    Ok((MetricsLog::open(run_dir, resumed_at)?, lock))
}

/// Makes `dir`, where the checkpoints go; a file in its place or a link to nowhere is
/// named as what it is.
fn make_checkpoints_dir(dir: &std::path::Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| {
        let dangling = std::fs::symlink_metadata(dir).is_ok_and(|m| m.file_type().is_symlink())
            && std::fs::metadata(dir).is_err();
        match (dangling, std::fs::read_link(dir)) {
            (true, Ok(target)) => config_err(
                "run_dir",
                format!(
                    "{} is a symbolic link to {}, which does not exist: checkpoints could \
                     not be saved there (make the folder it names)",
                    dir.display(),
                    target.display()
                ),
            ),
            _ => io_err(dir, e),
        }
    })
}

/// What each rank holds (llm.c's "allocating N MiB for ..." at start-up) and how the
/// batch splits.
fn accounting(trainer: &Trainer, dims: &ParallelDims, data: &Datasets) -> String {
    let mib = |elems: usize| elems as f64 * 4.0 / (1 << 20) as f64;
    let layout = trainer.layout();
    format!(
        "{} parameters in {} tensors; FP32 master {:.2} MiB + gradients {:.2} MiB + optimizer {:.2} MiB (align {}) per rank; \
         {} x {} rank(s), micro_batch {} x accumulation_steps {} x world_size {} = global_batch {}; eval: {}",
        layout.numel(),
        layout.slots().len(),
        mib(trainer.master().len()),
        mib(trainer.grad_held().len() * (1 + trainer.extra_grad_buffers())),
        mib(trainer.optimizer().state_bytes() / 4),
        layout.align(),
        trainer.strategy().name(),
        dims.world,
        dims.micro_batch,
        dims.accumulation_steps,
        dims.world,
        dims.global_batch,
        data.eval_note
    )
}
