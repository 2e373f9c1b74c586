//! `stoker tune`.

/// Arguments of `stoker tune`.
#[derive(clap::Args)]
pub struct TuneArgs {}

/// Runs `stoker tune`.
pub fn run(_args: TuneArgs) -> anyhow::Result<()> {
    anyhow::bail!("stoker tune: not implemented yet")
}
