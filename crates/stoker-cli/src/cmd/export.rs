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
        /// The checkpoint to export (default: the newest under RUN_DIR/checkpoints; with
        /// none there, the model's initial weights).
        #[arg(long)]
        checkpoint: Option<PathBuf>,
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
            let ckpt = ckpt.or_else(|| checkpoint::latest(&config.run_dir.join("checkpoints")));
            match &ckpt {
                Some(dir) => {
                    let saved = checkpoint::load(&mut trainer, dir)
                        .with_context(|| format!("loading {}", dir.display()))?;
                    let ours = config.model.resolved();
                    checkpoint::continues::check_model(saved.model.as_ref(), &ours, dir)?;
                    eprintln!("exporting {} (step {})", dir.display(), trainer.step());
                }
                None => eprintln!("no checkpoint: exporting the initial weights"),
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
