//! `stoker train`.

/// Arguments of `stoker train`.
#[derive(clap::Args)]
pub struct TrainArgs {}

/// Runs `stoker train`.
pub fn run(_args: TrainArgs) -> anyhow::Result<()> {
    anyhow::bail!("stoker train: not implemented yet")
}
