//! `stoker ckpt`: checkpoint tools.

use std::path::PathBuf;

/// Arguments of `stoker ckpt`.
#[derive(clap::Args)]
pub struct CkptArgs {
    #[command(subcommand)]
    command: CkptCommand,
}

#[derive(clap::Subcommand)]
enum CkptCommand {
    /// Write one model.safetensors (FP32 weights by parameter name) from a sharded
    /// checkpoint, reading only the weights of each shard (never the optimizer states).
    Consolidate {
        /// The checkpoint directory (RUN_DIR/checkpoints/step_N).
        dir: PathBuf,
        /// Output file (default DIR/model.safetensors).
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

/// Runs `stoker ckpt`.
pub fn run(args: CkptArgs) -> anyhow::Result<()> {
    match args.command {
        CkptCommand::Consolidate { dir, out } => {
            let path = stoker_train::checkpoint::consolidate(&dir, out.as_deref())?;
            println!("wrote {}", path.display());
            Ok(())
        }
    }
}
