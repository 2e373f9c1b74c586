//! `stoker export hf`: a trained GPT as a Hugging Face GPT-2 directory, a Llama as a
//! `LlamaForCausalLM` one.

use std::path::PathBuf;

use anyhow::Context;
use stoker_train::checkpoint;
use stoker_train::config::TrainConfig;
use stoker_train::models::ModelConfig;
use stoker_train::trainer::Trainer;

/// Arguments of `stoker export`.
#[derive(clap::Args)]
pub struct ExportArgs {
    #[command(subcommand)]
    command: ExportCommand,
}

#[derive(clap::Subcommand)]
enum ExportCommand {
    /// Write model.safetensors and config.json, which transformers' from_pretrained
    /// loads: GPT2LMHeadModel for a GPT, LlamaForCausalLM for a Llama.
    Hf {
        /// The training config (its [model] section gives the sizes).
        config: PathBuf,
        /// The checkpoint to export (default: the newest intact one under
        /// RUN_DIR/checkpoints, as `train --resume latest` picks it; with none there, an
        /// error).
        #[arg(long)]
        checkpoint: Option<PathBuf>,
        /// Export the model's initial (untrained) weights instead of a checkpoint.
        #[arg(long, conflicts_with = "checkpoint")]
        initial: bool,
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
    },
}

/// Runs `stoker export`.
pub fn run(args: ExportArgs) -> anyhow::Result<()> {
    match args.command {
        ExportCommand::Hf {
            config,
            checkpoint: ckpt,
            initial,
            out,
        } => {
            let config = TrainConfig::load(&config)?;
            if matches!(config.model, ModelConfig::Cnn(_) | ModelConfig::Mlp(_)) {
                anyhow::bail!(
                    "config key `model.kind`: only the GPT (GPT-2) and the Llama \
                     (LlamaForCausalLM) have a Hugging Face form"
                );
            }
            let mut trainer = Trainer::new(&config)?;
            let ckpt = match (ckpt, initial) {
                (Some(dir), _) => Some(dir),
                (None, true) => None,
                (None, false) => Some(newest_intact(&config.run_dir)?),
            };
            match &ckpt {
                Some(dir) => {
                    let saved = checkpoint::load(&mut trainer, dir)
                        .with_context(|| format!("loading {}", dir.display()))?;
                    let ours = config.model.resolved();
                    checkpoint::continues::check_model(saved.model.as_ref(), &ours, dir)?;
                    eprintln!("exporting {} (step {})", dir.display(), trainer.step());
                }
                None => eprintln!("--initial: exporting the initial (untrained) weights"),
            }
            // The vocabulary's end-of-text token becomes config.json's bos and eos.
            let end_of_text = match &config.data.vocab {
                Some(path) => stoker_data::pack::text::Vocab::load(path)?.end_of_text(),
                None => None,
            };
            let dir = stoker_train::hf::export(
                &config.model,
                trainer.layout(),
                trainer.master(),
                end_of_text,
                &out,
            )?;
            println!("wrote {}", dir.display());
            Ok(())
        }
    }
}

/// The newest checkpoint under `run_dir/checkpoints` that verifies, as `train --resume
/// latest` picks it (those passed over are warned of); none is an error: exporting the
/// untrained weights instead would hand over a useless model without a word.
fn newest_intact(run_dir: &std::path::Path) -> anyhow::Result<PathBuf> {
    let root = run_dir.join("checkpoints");
    let intact = stoker_train::checkpoint::latest_intact(&root);
    for (dir, why) in &intact.skipped {
        eprintln!("{}", stoker_train::checkpoint::skipped_line(dir, why));
    }
    intact.dir.ok_or_else(|| {
        let relative = match run_dir.is_relative() {
            true => format!(
                " (run_dir is relative, read from the working directory {})",
                std::env::current_dir().map_or_else(|_| "?".into(), |d| d.display().to_string())
            ),
            false => String::new(),
        };
        anyhow::anyhow!(
            "no intact checkpoint under {}{relative}: give --checkpoint DIR, or --initial to \
             export the untrained weights",
            root.display()
        )
    })
}
