//! Token shards and (input, target) windows over them.
//!
//! Two on-disk layouts: nanoGPT's `prepare.py` output (raw little-endian u16 tokens, no header)
//! and llm.c's shards (a 256 x i32 header: magic 20240520, version 1, token count; then u16
//! tokens). A sample is `context` consecutive tokens as input and the same window shifted by
//! one as target; windows do not overlap (stride = context), as llm.c's loader reads them.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::mapped::Mapped;

use crate::{DType, DataError, Dataset, FieldSpec, Result, SampleContext};

/// llm.c's shard magic number.
pub const LLMC_MAGIC: i32 = 20240520;
/// llm.c's header: 256 little-endian i32.
pub const LLMC_HEADER_BYTES: usize = 256 * 4;

/// llm.c's magic number for its Llama 3 shards (u32 tokens).
pub const LLMC_LLAMA3_MAGIC: i32 = 20240801;

/// Why a file of `len` bytes whose first three i32 are `magic`, `version` and `count` is
/// an llm.c-style shard that stoker cannot read (None: not such a header). Raw tokens
/// whose first six bytes happen to read as a small version and a count that gives
/// exactly the file's size, with 2- or 4-byte tokens, are not a practical worry.
fn other_llmc_header(len: u64, magic: i32, version: i32, count: i32) -> Option<String> {
    let body = len.checked_sub(LLMC_HEADER_BYTES as u64)?;
    let sized = count > 0 && [2u64, 4].contains(&(body / count as u64)) && body % count as u64 == 0;
    if magic == LLMC_LLAMA3_MAGIC {
        Some(format!(
            "{magic}: llm.c's Llama 3 shard (u32 tokens), but stoker's token shards hold u16 ids \
             (llm.c's GPT-2 shards, magic {LLMC_MAGIC}); pack the text with stoker pack docs"
        ))
    } else if (1..=16).contains(&version) && sized {
        Some(format!(
            "{magic}: the file starts with an llm.c-style header (version {version}, {count} \
             tokens, which match the file's size) but its magic is not {LLMC_MAGIC}, llm.c's \
             GPT-2 shards' (u16 tokens); nanoGPT's raw .bin files have no header"
        ))
    } else {
        None
    }
}

/// How a token file is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenFormat {
    /// Raw u16 tokens (nanoGPT `train.bin`).
    NanoGpt,
    /// llm.c shard: 1024-byte header, then u16 tokens.
    Llmc,
}

/// One memory-mapped file of u16 tokens.
#[derive(Clone)]
pub struct TokenShard {
    path: PathBuf,
    map: Arc<Mapped>,
    offset: usize,
    tokens: usize,
}

impl std::fmt::Debug for TokenShard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "TokenShard({}, {} tokens)",
            self.path.display(),
            self.tokens
        )
    }
}

impl TokenShard {
    /// The mapping of the shard's file.
    pub(crate) fn mapping(&self) -> &Arc<Mapped> {
        &self.map
    }

    /// Maps `path`; `Llmc` validates the header, `NanoGpt` requires an even byte count.
    pub fn open(path: impl AsRef<Path>, format: TokenFormat) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = crate::mapped::open_file(&path)?;
        let map = Mapped::map(&file, &path)?;
        let (offset, tokens) = match format {
            TokenFormat::NanoGpt => {
                if map.len() % 2 != 0 {
                    return Err(DataError::format(
                        &path,
                        "length",
                        format!(
                            "{} bytes is odd: a u16 token file has an even size",
                            map.len()
                        ),
                    ));
                }
                (0, map.len() / 2)
            }
            TokenFormat::Llmc => {
                if map.len() < LLMC_HEADER_BYTES {
                    return Err(DataError::format(
                        &path,
                        "header",
                        format!(
                            "{} bytes: an llm.c shard starts with a 1024-byte header",
                            map.len()
                        ),
                    ));
                }
                let h = |i: usize| i32::from_le_bytes(map[4 * i..4 * i + 4].try_into().unwrap());
                if h(0) != LLMC_MAGIC {
                    return Err(DataError::format(
                        &path,
                        "header[0] (magic)",
                        format!("{} but an llm.c token shard has {LLMC_MAGIC}; HINT: raw nanoGPT .bin files have no header, open them as nanogpt", h(0)),
                    ));
                }
                if h(1) != 1 {
                    return Err(DataError::format(
                        &path,
                        "header[1] (version)",
                        format!("{}: expected 1 (u16 tokens)", h(1)),
                    ));
                }
                let n = h(2);
                let body = map.len() - LLMC_HEADER_BYTES;
                if n < 0 || n as usize * 2 != body {
                    return Err(DataError::format(
                        &path,
                        "header[2] (token count)",
                        format!(
                            "{n} tokens need {} bytes after the header, file has {body}",
                            n as i64 * 2
                        ),
                    ));
                }
                (LLMC_HEADER_BYTES, n as usize)
            }
        };
        Ok(TokenShard {
            path,
            map: Arc::new(map),
            offset,
            tokens,
        })
    }

    /// Opens a file, choosing the format from llm.c's magic number when present. A file
    /// that starts with another llm.c header (its Llama 3 shards' magic, or any header
    /// whose token count matches the file's size) is refused, naming its magic, rather
    /// than read as raw tokens, header and all.
    pub fn open_detect(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let mut head = [0u8; 12];
        let mut f = crate::mapped::open_file(path)?;
        let header = f.metadata().and_then(|m| {
            std::io::Read::read_exact(&mut f, &mut head)?;
            Ok((m.len(), head))
        });
        let format = match header {
            Ok((len, head)) => {
                let h = |i: usize| i32::from_le_bytes(head[4 * i..4 * i + 4].try_into().unwrap());
                if h(0) == LLMC_MAGIC {
                    TokenFormat::Llmc
                } else if let Some(why) = other_llmc_header(len, h(0), h(1), h(2)) {
                    return Err(DataError::format(path, "header[0] (magic)", why));
                } else {
                    TokenFormat::NanoGpt
                }
            }
            // Shorter than a header, or unreadable: the open below says which.
            Err(_) => TokenFormat::NanoGpt,
        };
        Self::open(path, format)
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.tokens
    }

    /// True when the shard holds no tokens.
    pub fn is_empty(&self) -> bool {
        self.tokens == 0
    }

    /// The file path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Token `i`.
    pub fn token(&self, i: usize) -> u16 {
        let o = self.offset + 2 * i;
        u16::from_le_bytes([self.map[o], self.map[o + 1]])
    }

    /// Little-endian bytes of tokens `start..start + n`.
    pub fn token_bytes(&self, start: usize, n: usize) -> &[u8] {
        &self.map[self.offset + 2 * start..self.offset + 2 * (start + n)]
    }
}

/// Writes `tokens` as an llm.c shard (header + u16) or a raw nanoGPT file.
pub fn write_tokens(path: impl AsRef<Path>, tokens: &[u16], format: TokenFormat) -> Result<()> {
    let path = path.as_ref();
    let mut f = std::io::BufWriter::new(File::create(path).map_err(|e| DataError::io(path, e))?);
    let mut write = || -> std::io::Result<()> {
        if format == TokenFormat::Llmc {
            let n = i32::try_from(tokens.len())
                .map_err(|_| std::io::Error::other("more than 2^31 tokens in one llm.c shard"))?;
            let mut header = [0i32; 256];
            header[0] = LLMC_MAGIC;
            header[1] = 1;
            header[2] = n;
            f.write_all(bytemuck::cast_slice(&header))?;
        }
        for t in tokens {
            f.write_all(&t.to_le_bytes())?;
        }
        f.flush()
    };
    write().map_err(|e| DataError::io(path, e))
}

/// The ids a token set may hold: fewer than `ids`, the count of the config key `key`
/// (`model.vocab`, or `data.vocab`'s tokens where that file holds fewer).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct IdLimit {
    /// Ids below this are valid.
    pub ids: usize,
    /// The key whose count it is, for the error.
    pub key: &'static str,
}

/// (input, target) windows of `context` tokens over one or more shards.
///
/// Fields: `input` and `target`, both `[context]` of the chosen integer dtype. A window never
/// spans two shards; each shard of `n` tokens yields `(n - 1) / context` windows.
#[derive(Debug, Clone)]
pub struct TokenWindows {
    shards: Vec<TokenShard>,
    context: usize,
    starts: Vec<usize>,
    fields: Vec<FieldSpec>,
    /// Ids at or above this are refused as each window is read ([`Self::with_vocab`]).
    vocab: Option<IdLimit>,
}

impl TokenWindows {
    /// Windows of `context` tokens delivered as `dtype` (U16, I32 or I64).
    pub fn new(shards: Vec<TokenShard>, context: usize, dtype: DType) -> Result<Self> {
        if context == 0 {
            return Err(DataError::Config {
                field: "context",
                message: "must be at least 1".into(),
            });
        }
        if !matches!(dtype, DType::U16 | DType::I32 | DType::I64) {
            return Err(DataError::Config {
                field: "token_dtype",
                message: format!("{dtype}: expected u16, i32 or i64"),
            });
        }
        let mut starts = vec![0];
        for s in &shards {
            starts.push(starts.last().unwrap() + s.len().saturating_sub(1) / context);
        }
        let fields = vec![
            FieldSpec::new("input", dtype, vec![context]),
            FieldSpec::new("target", dtype, vec![context]),
        ];
        Ok(TokenWindows {
            shards,
            context,
            starts,
            fields,
            vocab: None,
        })
    }

    /// These windows with every id checked against `limit` as its window is read: an id
    /// past it fails naming the file, the token's place, the window and the key the limit
    /// comes from, not later inside the model's embedding (or, for a vocabulary file
    /// smaller than the model's, decoded as no character). The check is the largest id
    /// the widening copy finds on its one pass.
    pub fn with_vocab(self, limit: IdLimit) -> Self {
        TokenWindows {
            vocab: Some(limit),
            ..self
        }
    }

    /// Tokens per window.
    pub fn context(&self) -> usize {
        self.context
    }

    /// The shards' tokens, all of them (a window never spans two shards, so each shard's
    /// tail shorter than a window is in none).
    pub fn tokens(&self) -> usize {
        self.shards.iter().map(TokenShard::len).sum()
    }

    /// The shards the windows are cut from.
    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// (shard, first token) of window `i`.
    pub fn locate(&self, i: usize) -> (usize, usize) {
        let s = self.starts.partition_point(|&st| st <= i) - 1;
        (s, (i - self.starts[s]) * self.context)
    }
}

/// `src`'s u16 tokens written into `out` as `dtype`; returns the largest id, found in the
/// same pass (the vocabulary check's, [`TokenWindows::with_vocab`]).
fn widen(src: &[u8], dtype: DType, out: &mut [u8]) -> u16 {
    let ids = src
        .chunks_exact(2)
        .map(|t| u16::from_le_bytes([t[0], t[1]]));
    let mut top = 0;
    match dtype {
        DType::U16 => {
            out.copy_from_slice(src);
            top = ids.max().unwrap_or(0);
        }
        DType::I32 => {
            for (id, o) in ids.zip(out.chunks_exact_mut(4)) {
                top = top.max(id);
                o.copy_from_slice(&(id as i32).to_le_bytes());
            }
        }
        _ => {
            for (id, o) in ids.zip(out.chunks_exact_mut(8)) {
                top = top.max(id);
                o.copy_from_slice(&(id as i64).to_le_bytes());
            }
        }
    }
    top
}

impl Dataset for TokenWindows {
    type Worker = ();

    fn len(&self) -> usize {
        *self.starts.last().unwrap()
    }

    fn fields(&self) -> &[FieldSpec] {
        &self.fields
    }

    fn read_sample(&self, _: &mut (), ctx: SampleContext, out: &mut [&mut [u8]]) -> Result<()> {
        let i = ctx.index as usize;
        if i >= self.len() {
            return Err(DataError::Sample {
                index: ctx.index,
                message: format!("out of range: {} windows", self.len()),
            });
        }
        let (s, t0) = self.locate(i);
        let bytes = self.shards[s].token_bytes(t0, self.context + 1);
        let dtype = self.fields[0].dtype;
        let (input, target) = out.split_at_mut(1);
        let top = widen(&bytes[..2 * self.context], dtype, input[0]).max(widen(
            &bytes[2..],
            dtype,
            target[0],
        ));
        if let Some(IdLimit { ids: vocab, key }) = self.vocab.filter(|l| top as usize >= l.ids) {
            // Only on the error: where the first id past the vocabulary is.
            let ids = bytes
                .chunks_exact(2)
                .map(|t| u16::from_le_bytes([t[0], t[1]]));
            let (k, id) = ids
                .enumerate()
                .find(|&(_, id)| id as usize >= vocab)
                .expect("the largest id is past it");
            return Err(DataError::format(
                self.shards[s].path(),
                "tokens",
                format!(
                    "id {id} at token {} (window {i}) is outside the vocabulary of {vocab} ({key})",
                    t0 + k
                ),
            ));
        }
        Ok(())
    }

    fn mapped_bytes(&self) -> u64 {
        crate::mapped::distinct_bytes(self.shards.iter().map(TokenShard::mapping))
    }
}
