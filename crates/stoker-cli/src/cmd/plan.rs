//! `stoker plan`.

/// Arguments of `stoker plan`.
#[derive(clap::Args)]
pub struct PlanArgs {}

/// Runs `stoker plan`.
pub fn run(_args: PlanArgs) -> anyhow::Result<()> {
    anyhow::bail!("stoker plan: not implemented yet")
}
