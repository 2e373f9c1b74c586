//! Text to a token shard: char-level (vocabulary saved beside it) or GPT-2 BPE (stoker's
//! own, tiktoken's ids; the text as ordinary text, a literal `<|endoftext|>` included).
//!
//! Output: `PREFIX.bin`, an llm.c shard (1024-byte header, u16 tokens), and
//! `PREFIX.vocab.json`: `{"kind": "char", "tokens": ["\n", " ", ...]}` (id = position) or
//! `{"kind": "gpt2", "size": 50257}`.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::paths::{create_parent, prefixed};
use crate::tokens::{write_tokens, TokenFormat};
use crate::{DataError, Result};

/// How text becomes token ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tokenizer {
    /// One token per Unicode scalar; the vocabulary is the sorted set of characters seen.
    Char,
    /// GPT-2's byte-level BPE (tiktoken's `r50k_base`), 50,257 tokens.
    Gpt2,
}

/// The vocabulary file written beside a token shard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Vocab {
    /// Character vocabulary: token id `i` is `tokens[i]`.
    Char {
        /// The characters, sorted by code point.
        tokens: Vec<String>,
    },
    /// GPT-2 BPE.
    Gpt2 {
        /// Vocabulary size.
        size: usize,
    },
}

impl Vocab {
    /// GPT-2's end-of-text token, `<|endoftext|>`, the last of its 50,257.
    pub const GPT2_END_OF_TEXT: u32 = 50_256;

    /// The token that ends a document, where the vocabulary has one (GPT-2's BPE; a
    /// character vocabulary where documents were packed with it).
    pub fn end_of_text(&self) -> Option<u32> {
        match self {
            // `stoker pack docs` ends each document with it, the vocabulary's last entry.
            Vocab::Char { tokens } => tokens
                .iter()
                .position(|t| t == super::docs::END_OF_TEXT)
                .map(|i| i as u32),
            Vocab::Gpt2 { .. } => Some(Self::GPT2_END_OF_TEXT),
        }
    }

    /// Number of token ids.
    pub fn size(&self) -> usize {
        match self {
            Vocab::Char { tokens } => tokens.len(),
            Vocab::Gpt2 { size } => *size,
        }
    }

    /// Reads `PREFIX.vocab.json`: what [`pack_text`] writes (`{"kind": "char", "tokens":
    /// [...]}` or `{"kind": "gpt2", "size": 50257}`), or a hand-written `{"tokens": [...]}`
    /// (characters). Errors name the file and the field.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| DataError::io(path, e))?;
        let bad = |field: &str, message: &str| DataError::format(path, field, message);
        let v: serde_json::Value =
            serde_json::from_slice(&bytes).map_err(|e| bad("vocab", &e.to_string()))?;
        let kind = match v.get("kind") {
            None => "char",
            Some(k) => k
                .as_str()
                .ok_or_else(|| bad("kind", "expected \"char\" or \"gpt2\""))?,
        };
        match kind {
            "char" => {
                let tokens = v
                    .get("tokens")
                    .and_then(|t| t.as_array())
                    .ok_or_else(|| bad("tokens", "expected an array of token strings"))?;
                let tokens = tokens
                    .iter()
                    .enumerate()
                    .map(|(i, t)| {
                        t.as_str()
                            .map(String::from)
                            .ok_or_else(|| bad(&format!("tokens[{i}]"), "expected a token string"))
                    })
                    .collect::<Result<Vec<String>>>()?;
                Ok(Vocab::Char { tokens })
            }
            "gpt2" => {
                let size = v
                    .get("size")
                    .and_then(|n| n.as_u64())
                    .ok_or_else(|| bad("size", "expected the vocabulary's size, a count"))?;
                Ok(Vocab::Gpt2 {
                    size: size as usize,
                })
            }
            other => Err(bad(
                "kind",
                &format!("{other:?}: expected \"char\" or \"gpt2\""),
            )),
        }
    }

    /// Turns char-level ids back into text (GPT-2 ids need tiktoken; they are rendered as ids).
    pub fn decode(&self, ids: &[u32]) -> String {
        match self {
            Vocab::Char { tokens } => ids
                .iter()
                .map(|&i| {
                    tokens
                        .get(i as usize)
                        .map(String::as_str)
                        .unwrap_or("\u{fffd}")
                })
                .collect(),
            Vocab::Gpt2 { .. } => match tiktoken_rs::r50k_base() {
                Ok(bpe) => bpe.decode(ids.to_vec()).unwrap_or_default(),
                Err(_) => format!("{ids:?}"),
            },
        }
    }
}

/// What [`pack_text`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextSummary {
    /// Tokens written.
    pub tokens: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// The shard and the vocabulary file.
    pub files: [PathBuf; 2],
    /// Line ends read as `\n` (`\r\n`, or a lone `\r`), as Python's text mode reads
    /// them (nanoGPT's `prepare.py` opens its input so).
    pub line_ends_converted: usize,
    /// Files whose leading byte-order mark (U+FEFF, "UTF-8 with BOM") was dropped, as
    /// Python's `utf-8-sig` drops it (its plain text mode keeps it).
    pub boms_dropped: usize,
}

/// Tokenizes the concatenation of `sources` (UTF-8 text files, read as Python's text mode
/// reads them, `\r\n` and `\r` as `\n`, and as `utf-8-sig` reads them, a leading
/// byte-order mark dropped) to
/// `PREFIX.bin` + `PREFIX.vocab.json`.
pub fn pack_text(
    sources: &[PathBuf],
    prefix: impl AsRef<Path>,
    tokenizer: Tokenizer,
) -> Result<TextSummary> {
    let prefix = prefix.as_ref();
    crate::paths::check_prefix(prefix)?;
    let mut text = String::new();
    let (mut line_ends_converted, mut boms_dropped) = (0, 0);
    for src in sources {
        if src.is_dir() {
            return Err(DataError::format(
                src,
                "inputs",
                "a directory; pack text takes text files (pack docs reads directories of \
                 .jsonl and .parquet files)",
            ));
        }
        let bytes = std::fs::read(src).map_err(|e| DataError::io(src, e))?;
        let s = String::from_utf8(bytes).map_err(|e| {
            DataError::format(
                src,
                "encoding",
                format!(
                    "not UTF-8 at byte {}: re-encode the file as UTF-8",
                    e.utf8_error().valid_up_to()
                ),
            )
        })?;
        // What Python's text mode reads (nanoGPT's and llm.c's preparation scripts): every
        // line end as `\n`. A leading byte-order mark is an encoding's mark, not text
        // (Python keeps it unless told `utf-8-sig`; a vocabulary token of it is noise).
        let s = match s.strip_prefix('\u{feff}') {
            Some(rest) => {
                boms_dropped += 1;
                rest
            }
            None => &s,
        };
        // Every `\r` ends one line, alone or before `\n`.
        match s.matches('\r').count() {
            0 => text.push_str(s),
            ends => {
                line_ends_converted += ends;
                text.push_str(&s.replace("\r\n", "\n").replace('\r', "\n"));
            }
        }
    }
    // Nothing to train on, which a run would only find at its start ("not one window").
    if text.is_empty() {
        let names: Vec<String> = sources.iter().map(|p| p.display().to_string()).collect();
        return Err(DataError::format(
            sources.first().map_or(Path::new("-"), |p| p.as_path()),
            "text",
            format!(
                "no text to pack in {}: expected at least one character",
                names.join(", ")
            ),
        ));
    }
    let (tokens, vocab) = match tokenizer {
        Tokenizer::Char => {
            let mut chars: Vec<char> = text.chars().collect();
            chars.sort_unstable();
            chars.dedup();
            if chars.len() > u16::MAX as usize + 1 {
                return Err(DataError::Config {
                    field: "tokenizer",
                    message: format!("{} distinct characters exceed u16 token ids", chars.len()),
                });
            }
            let mut id = std::collections::HashMap::with_capacity(chars.len());
            for (i, c) in chars.iter().enumerate() {
                id.insert(*c, i as u16);
            }
            let tokens: Vec<u16> = text.chars().map(|c| id[&c]).collect();
            (
                tokens,
                Vocab::Char {
                    tokens: chars.iter().map(|c| c.to_string()).collect(),
                },
            )
        }
        Tokenizer::Gpt2 => {
            // The text as ordinary text (nanoGPT's `encode_ordinary`, as `pack docs`
            // reads documents): a literal `<|endoftext|>` in it is not a boundary.
            let bpe = super::gpt2_bpe::Gpt2Bpe::new().map_err(|e| DataError::Config {
                field: "tokenizer",
                message: format!("gpt2 BPE unavailable: {e}"),
            })?;
            let mut ids = Vec::with_capacity(text.len() / 3 + 1);
            bpe.encode_into(&text, &mut super::gpt2_bpe::PieceCache::default(), &mut ids);
            (ids, Vocab::Gpt2 { size: 50257 })
        }
    };
    create_parent(prefix)?;
    let (bin, vocab_path) = (prefixed(prefix, ".bin"), prefixed(prefix, ".vocab.json"));
    write_tokens(&bin, &tokens, TokenFormat::Llmc)?;
    let json = serde_json::to_vec(&vocab).expect("vocab serializes");
    std::fs::write(&vocab_path, json).map_err(|e| DataError::io(&vocab_path, e))?;
    Ok(TextSummary {
        tokens: tokens.len(),
        vocab_size: vocab.size(),
        files: [bin, vocab_path],
        line_ends_converted,
        boms_dropped,
    })
}
