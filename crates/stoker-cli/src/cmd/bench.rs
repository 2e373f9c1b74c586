//! `stoker bench`.

/// Arguments of `stoker bench`.
#[derive(clap::Args)]
pub struct BenchArgs {}

/// Runs `stoker bench`.
pub fn run(_args: BenchArgs) -> anyhow::Result<()> {
    anyhow::bail!("stoker bench: not implemented yet")
}
