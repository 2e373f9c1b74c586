//! `stoker pack`.

/// Arguments of `stoker pack`.
#[derive(clap::Args)]
pub struct PackArgs {}

/// Runs `stoker pack`.
pub fn run(_args: PackArgs) -> anyhow::Result<()> {
    anyhow::bail!("stoker pack: not implemented yet")
}
