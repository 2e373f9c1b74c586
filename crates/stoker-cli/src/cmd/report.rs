//! `stoker report`.

/// Arguments of `stoker report`.
#[derive(clap::Args)]
pub struct ReportArgs {}

/// Runs `stoker report`.
pub fn run(_args: ReportArgs) -> anyhow::Result<()> {
    anyhow::bail!("stoker report: not implemented yet")
}
