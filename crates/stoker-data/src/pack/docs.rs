//! Users' documents to token shards, as nanoGPT's and llm.c's data scripts prepare a
//! Hugging Face dataset: Parquet files (a text column) or JSON Lines (a text field), one
//! file or a directory of shards, in the order given; each document tokenized on every
//! core (GPT-2's BPE, ids identical to tiktoken's, [`super::gpt2_bpe`]; or characters) and ended with the end-of-text
//! token (nanoGPT's `prepare.py`: `encode_ordinary(text)` then `eot`), into llm.c shards
//! with a validation split ([`super::shard_writer`]). Documents stream through in batches
//! (a Parquet row group, a few thousand JSON lines), so memory stays flat in the input's
//! size; the character tokenizer reads the inputs twice (its vocabulary first).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use rayon::prelude::*;

use super::doc_sources::{expand_inputs, DocFormat, DocSource, InputFiles};
use super::gpt2_bpe::{self, Gpt2Bpe, PieceCache};
use super::shard_writer::{ShardWriter, WrittenShards};
use super::text::{Tokenizer, Vocab};
use crate::paths::{create_parent, prefixed};
use crate::{DataError, Result};

/// The end-of-text token's text, the last entry of a character vocabulary.
pub const END_OF_TEXT: &str = "<|endoftext|>";

/// How [`pack_docs`] reads and writes.
#[derive(Debug, Clone, PartialEq)]
pub struct DocsOptions {
    /// The Parquet column or JSON Lines field holding each document's text.
    pub field: String,
    /// GPT-2's BPE or characters.
    pub tokenizer: Tokenizer,
    /// Tokens per training shard (llm.c's fineweb.py: 10^8).
    pub shard_tokens: usize,
    /// Tokens of the validation split (whole documents, the first ones; 0 for none).
    pub val_tokens: usize,
}

/// What [`pack_docs`] read and wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct DocsSummary {
    /// Documents read.
    pub documents: usize,
    /// Bytes of their text (UTF-8).
    pub text_bytes: u64,
    /// The shards, with their tokens.
    pub shards: WrittenShards,
    /// The vocabulary file (`PREFIX.vocab.json`).
    pub vocab_path: PathBuf,
    /// Its size.
    pub vocab_size: usize,
    /// Files in the input directories that are neither Parquet nor JSON Lines, not read.
    pub passed_over: Vec<PathBuf>,
    /// JSON Lines files whose unpaired UTF-16 surrogates (Python's `\udXXX` escapes of
    /// text that is not Unicode) were read as U+FFFD: the file, how many, the first line.
    pub surrogates_replaced: Vec<(PathBuf, usize, usize)>,
}

/// One document's tokens, its end-of-text token last.
enum Encoder {
    Gpt2(Gpt2Bpe),
    Char(std::collections::HashMap<char, u16>, u16),
}

impl Encoder {
    fn encode(&self, doc: &str, cache: &mut PieceCache) -> Vec<u16> {
        match self {
            Encoder::Gpt2(bpe) => {
                let mut out = Vec::with_capacity(doc.len() / 3 + 1);
                bpe.encode_into(doc, cache, &mut out);
                out.push(gpt2_bpe::END_OF_TEXT);
                out
            }
            Encoder::Char(ids, eot) => {
                let mut out: Vec<u16> = doc.chars().map(|c| ids[&c]).collect();
                out.push(*eot);
                out
            }
        }
    }
}

/// Packs the documents of `inputs` into token shards named after `prefix` (see the module
/// doc) and `PREFIX.vocab.json`.
pub fn pack_docs(inputs: &[PathBuf], prefix: &Path, opts: &DocsOptions) -> Result<DocsSummary> {
    crate::paths::check_prefix(prefix)?;
    let InputFiles {
        read: files,
        passed_over,
    } = expand_inputs(inputs)?;
    // Before the character tokenizer's pass over the inputs: an earlier pack's shards
    // at the prefix are refused at once.
    create_parent(prefix)?;
    let mut writer = ShardWriter::new(prefix, opts.shard_tokens, opts.val_tokens)?;
    let (encoder, vocab) = match opts.tokenizer {
        Tokenizer::Gpt2 => {
            let bpe = Gpt2Bpe::new().map_err(|e| DataError::Config {
                field: "tokenizer",
                message: format!("gpt2 BPE unavailable: {e}"),
            })?;
            (Encoder::Gpt2(bpe), Vocab::Gpt2 { size: 50257 })
        }
        Tokenizer::Char => char_vocab(&files, &opts.field)?,
    };
    let (mut documents, mut text_bytes) = (0usize, 0u64);
    let mut surrogates_replaced = Vec::new();
    for (path, format) in &files {
        let mut source = DocSource::open(path, *format, &opts.field)?;
        while let Some(batch) = source.next_batch()? {
            let tokens: Vec<Vec<u16>> = batch
                .docs
                .par_iter()
                .map_init(PieceCache::default, |cache, d| encoder.encode(d, cache))
                .collect();
            documents += batch.docs.len();
            text_bytes += batch.docs.iter().map(|d| d.len() as u64).sum::<u64>();
            for t in &tokens {
                writer.push(t)?;
            }
        }
        if let Some((n, line)) = source.surrogates_replaced() {
            surrogates_replaced.push((path.clone(), n, line));
        }
    }
    // Nothing read: an error, as `pack text` of an empty file is, before anything is
    // written (a script checking the status would go on to a run with no data).
    if documents == 0 {
        let names: Vec<String> = files.iter().map(|(p, _)| p.display().to_string()).collect();
        return Err(DataError::Config {
            field: "inputs",
            message: format!(
                "no document in the {} file(s) read ({}): nothing to pack",
                files.len(),
                names.join(", ")
            ),
        });
    }
    let shards = writer.finish()?;
    let vocab_path = prefixed(prefix, ".vocab.json");
    let json = serde_json::to_vec(&vocab).expect("vocab serializes");
    std::fs::write(&vocab_path, json).map_err(|e| DataError::io(&vocab_path, e))?;
    Ok(DocsSummary {
        documents,
        text_bytes,
        shards,
        vocab_size: vocab.size(),
        vocab_path,
        passed_over,
        surrogates_replaced,
    })
}

/// The character vocabulary of every document of `files` (a first pass), sorted, the
/// end-of-text token last.
fn char_vocab(files: &[(PathBuf, DocFormat)], field: &str) -> Result<(Encoder, Vocab)> {
    let mut chars = BTreeSet::new();
    for (path, format) in files {
        let mut source = DocSource::open(path, *format, field)?;
        while let Some(batch) = source.next_batch()? {
            for d in &batch.docs {
                chars.extend(d.chars());
            }
        }
    }
    if chars.len() + 1 > u16::MAX as usize + 1 {
        return Err(DataError::Config {
            field: "tokenizer",
            message: format!(
                "{} distinct characters and the end-of-text token exceed u16 token ids: use gpt2",
                chars.len()
            ),
        });
    }
    let ids = chars
        .iter()
        .enumerate()
        .map(|(i, &c)| (c, i as u16))
        .collect();
    let mut tokens: Vec<String> = chars.iter().map(|c| c.to_string()).collect();
    let eot = tokens.len() as u16;
    tokens.push(END_OF_TEXT.to_string());
    Ok((Encoder::Char(ids, eot), Vocab::Char { tokens }))
}
