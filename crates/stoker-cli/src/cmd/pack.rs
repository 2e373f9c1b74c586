//! `stoker pack`: raw data into stoker's memory-mappable formats.

use std::path::PathBuf;

use stoker_data::pack::docs::{pack_docs, DocsOptions};
use stoker_data::pack::idx::pack_idx;
use stoker_data::pack::image_folder::{pack_image_folder_with, PackOptions};
use stoker_data::pack::shard_writer::WrittenShards;
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
    /// Documents from Parquet or JSON Lines files (a Hugging Face dataset's shards) to
    /// llm.c token shards PREFIX_val_000000.bin, PREFIX_train_000001.bin, ... and
    /// PREFIX.vocab.json; every document ends with the end-of-text token.
    Docs {
        /// Output prefix, e.g. data/fineweb/fineweb.
        out: PathBuf,
        /// .parquet or .jsonl files, or directories of them, read in the order given.
        #[arg(required = true)]
        inputs: Vec<PathBuf>,
        /// The Parquet column or JSON Lines field holding the text.
        #[arg(long, default_value = "text")]
        column: String,
        /// gpt2 (BPE via tiktoken-rs) or char (vocabulary of the characters seen).
        #[arg(long, default_value = "gpt2")]
        tokenizer: String,
        /// Tokens per training shard (llm.c's fineweb.py writes 10^8).
        #[arg(long, default_value_t = 100_000_000)]
        shard_tokens: usize,
        /// Tokens of the validation split: the first documents, whole, until this many
        /// (0: no validation shard).
        #[arg(long, default_value_t = 0)]
        val_tokens: usize,
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

/// The tokenizer `--tokenizer` names.
fn tokenizer_named(name: &str) -> anyhow::Result<Tokenizer> {
    Ok(match name {
        "char" => Tokenizer::Char,
        "gpt2" => Tokenizer::Gpt2,
        other => anyhow::bail!("--tokenizer {other}: expected char or gpt2"),
    })
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
            let s = pack_text(&sources, &out, tokenizer_named(&tokenizer)?)?;
            println!(
                "packed {} tokens (vocabulary {}) -> {} and {}",
                s.tokens,
                s.vocab_size,
                s.files[0].display(),
                s.files[1].display()
            );
            if s.line_ends_converted + s.boms_dropped > 0 {
                println!(
                    "  read as Python's text mode reads it ({} line end(s) \\r\\n or \\r as \\n) \
                     and as utf-8-sig does ({} byte-order mark(s) dropped)",
                    s.line_ends_converted, s.boms_dropped
                );
            }
        }
        PackWhat::Docs {
            out,
            inputs,
            column,
            tokenizer,
            shard_tokens,
            val_tokens,
        } => {
            let opts = DocsOptions {
                field: column,
                tokenizer: tokenizer_named(&tokenizer)?,
                shard_tokens,
                val_tokens,
            };
            let t0 = std::time::Instant::now();
            let s = pack_docs(&inputs, &out, &opts)?;
            let secs = t0.elapsed().as_secs_f64().max(1e-9);
            let tokens = |split: &[(PathBuf, usize)]| WrittenShards::tokens(split);
            let (val, train) = (tokens(&s.shards.val), tokens(&s.shards.train));
            println!(
                "packed {} documents ({:.1} MB of text) into {} tokens (vocabulary {}): {} validation \
                 in {} shard(s), {} training in {} shard(s); {:.1} MB/s of text in, {:.0} tokens/s out",
                s.documents,
                s.text_bytes as f64 / 1e6,
                val + train,
                s.vocab_size,
                val,
                s.shards.val.len(),
                train,
                s.shards.train.len(),
                s.text_bytes as f64 / 1e6 / secs,
                (val + train) as f64 / secs
            );
            for (p, n) in s.shards.val.iter().chain(&s.shards.train) {
                println!("  {} ({n} tokens)", p.display());
            }
            println!("  {}", s.vocab_path.display());
            // Nothing for a training glob to read: say so now, not at the first run.
            // (No document at all is pack_docs's error.)
            if s.shards.train.is_empty() {
                eprintln!(
                    "warning: no training shard was written: all {val} tokens went to the \
                     validation split (--val-tokens {val_tokens})"
                );
            }
            for (path, n, line) in &s.surrogates_replaced {
                eprintln!(
                    "warning: {}: {n} unpaired UTF-16 surrogate(s) in its lines (\\udXXX \
                     escapes, not Unicode; the first on line {line}) read as U+FFFD",
                    path.display()
                );
            }
            if !s.passed_over.is_empty() {
                eprintln!(
                    "warning: {} file(s) in the input directories are neither .parquet nor .jsonl and were not read:",
                    s.passed_over.len()
                );
                for p in &s.passed_over {
                    eprintln!("  {}", p.display());
                }
            }
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
