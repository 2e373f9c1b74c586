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
    /// Check every file of a checkpoint (commit marker, manifest and its layout against
    /// the model table it records, each shard's CRC-32 and tensors; or a version 1-2
    /// checkpoint's checksums) without loading a model.
    Verify {
        /// The checkpoint directory (RUN_DIR/checkpoints/step_N).
        dir: PathBuf,
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
        CkptCommand::Verify { dir } => {
            let v = stoker_train::checkpoint::verify(&dir)?;
            println!(
                "{}: intact: step {}, version {}, written by {} rank(s); {} files, {:.2} MiB of tensors checked",
                dir.display(),
                v.step,
                v.version,
                v.world_size,
                v.files,
                v.bytes as f64 / (1 << 20) as f64
            );
            Ok(())
        }
    }
}
