//! `stoker report`.

use std::path::PathBuf;

/// Arguments of `stoker report`.
#[derive(clap::Args)]
pub struct ReportArgs {
    /// The run directory (holds metrics.jsonl); the PNGs are written next to it.
    pub run_dir: PathBuf,
}

/// Runs `stoker report`.
pub fn run(args: ReportArgs) -> anyhow::Result<()> {
    for p in stoker_train::report::write_report(&args.run_dir)? {
        println!("wrote {}", p.display());
    }
    Ok(())
}
