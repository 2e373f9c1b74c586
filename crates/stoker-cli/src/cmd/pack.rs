//! `stoker pack`: raw data into stoker's memory-mappable formats.

use std::path::PathBuf;

use stoker_data::pack::idx::pack_idx;
use stoker_data::pack::image_folder::{pack_image_folder_with, PackOptions};
use stoker_data::pack::text::{pack_text, Tokenizer};

/// Arguments of `stoker pack`.
#[derive(clap::Args)]
pub struct PackArgs {
    #[command(subcommand)]
    what: PackWhat,
}

#[derive(clap::Subcommand)]
enum PackWhat {
    /// MNIST / Fashion-MNIST IDX files (raw or .gz) to PREFIX.image.npy + PREFIX.label.npy.
    Idx {
        /// The IDX image file (e.g. train-images-idx3-ubyte.gz).
        #[arg(long)]
        images: PathBuf,
        /// The IDX label file.
        #[arg(long)]
        labels: PathBuf,
        /// Output prefix, e.g. data/mnist/train.
        out: PathBuf,
    },
    /// Text files to an llm.c token shard PREFIX.bin + PREFIX.vocab.json.
    Text {
        /// Output prefix, e.g. data/shakespeare/shakespeare.
        out: PathBuf,
        /// UTF-8 text files, concatenated in the order given.
        #[arg(required = true)]
        sources: Vec<PathBuf>,
        /// char (vocabulary of the characters seen) or gpt2 (BPE via tiktoken-rs).
        #[arg(long, default_value = "char")]
        tokenizer: String,
    },
    /// A folder of JPEGs, one sub-folder per class, to record shards + labels.
    Images {
        /// Source folder with one sub-folder per class.
        src: PathBuf,
        /// Output prefix.
        out: PathBuf,
        /// Skip (and list) non-JPEG files instead of failing.
        #[arg(long)]
        skip_non_jpeg: bool,
        /// Shrink photos whose longer side exceeds this (re-encoded; lossy).
        #[arg(long)]
        max_side: Option<u32>,
    },
}

/// Runs `stoker pack`.
pub fn run(args: PackArgs) -> anyhow::Result<()> {
    match args.what {
        PackWhat::Idx {
            images,
            labels,
            out,
        } => {
            let s = pack_idx(&images, &labels, &out)?;
            println!(
                "packed {} images of {}x{} -> {} and {}",
                s.samples,
                s.rows,
                s.cols,
                s.files[0].display(),
                s.files[1].display()
            );
        }
        PackWhat::Text {
            out,
            sources,
            tokenizer,
        } => {
            let tok = match tokenizer.as_str() {
                "char" => Tokenizer::Char,
                "gpt2" => Tokenizer::Gpt2,
                other => anyhow::bail!("--tokenizer {other}: expected char or gpt2"),
            };
            let s = pack_text(&sources, &out, tok)?;
            println!(
                "packed {} tokens (vocabulary {}) -> {} and {}",
                s.tokens,
                s.vocab_size,
                s.files[0].display(),
                s.files[1].display()
            );
        }
        PackWhat::Images {
            src,
            out,
            skip_non_jpeg,
            max_side,
        } => {
            let opts = PackOptions {
                skip_non_jpeg,
                max_side,
                ..PackOptions::default()
            };
            let s = pack_image_folder_with(&src, &out, &opts)?;
            println!(
                "packed {} images in {} classes ({} skipped, {} downscaled) -> {}",
                s.per_class.iter().sum::<u64>(),
                s.classes.len(),
                s.skipped.len(),
                s.downscaled,
                out.display()
            );
            for p in &s.skipped {
                println!("  skipped (not a JPEG): {}", p.display());
            }
        }
    }
    Ok(())
}
