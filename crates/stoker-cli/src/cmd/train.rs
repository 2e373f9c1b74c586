//! `stoker train`.

use std::path::PathBuf;

use anyhow::Context;
use stoker_train::checkpoint;
use stoker_train::config::TrainConfig;
use stoker_train::run::{run as train, RunOptions};

/// Arguments of `stoker train`.
#[derive(clap::Args)]
pub struct TrainArgs {
    /// The TOML config (see docs/training.md).
    pub config: PathBuf,
    /// Resume from a checkpoint directory, or `latest` for the newest under RUN_DIR/checkpoints.
    #[arg(long)]
    pub resume: Option<String>,
    /// Hide the progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// Stop after this many steps (writes a checkpoint there).
    #[arg(long)]
    pub stop_after: Option<u64>,
}

/// Runs `stoker train`.
pub fn run(args: TrainArgs) -> anyhow::Result<()> {
    let config = TrainConfig::load(&args.config)?;
    let resume = match args.resume.as_deref() {
        None => None,
        Some("latest") => {
            let root = config.run_dir.join("checkpoints");
            Some(
                checkpoint::latest(&root)
                    .with_context(|| format!("no checkpoint under {}", root.display()))?,
            )
        }
        Some(p) => Some(PathBuf::from(p)),
    };
    let opts = RunOptions {
        resume,
        progress: !args.no_progress,
        stop_after: args.stop_after,
    };
    let threads = std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "all".into());
    eprintln!(
        "stoker train: {} ({:?}, threads {threads}) -> {}",
        args.config.display(),
        config.precision,
        config.run_dir.display()
    );
    let s = train(&config, &opts)?;
    println!("parameters: {}", s.params);
    println!("steps: {}, last train loss {:.4}", s.steps, s.last_loss);
    if let Some(e) = s.eval {
        println!(
            "eval loss {:.4}, accuracy {:.2}% ({} targets)",
            e.loss,
            100.0 * e.accuracy,
            e.count
        );
    }
    println!(
        "throughput {:.0} targets/s, loader wait {:.2}% of wall time",
        s.throughput, s.loader_wait_pct
    );
    if let Some(text) = s.sample {
        println!("--- sample ---\n{text}\n--------------");
    }
    Ok(())
}
