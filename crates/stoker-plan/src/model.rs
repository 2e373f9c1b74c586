//! The model: architecture presets and the parameter / FLOP counts derived from them.
//!
//! Parameter counts come from the architecture formula, never from a quoted round number, so
//! presets can be checked against the published counts (GPT-2 124,439,808; Llama-2-7B
//! 6,738,415,616; Llama-2-70B 68,976,648,192).

use serde::Serialize;

use crate::error::{PlanError, Result};

/// The two transformer families the planner knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Family {
    /// GPT-2: learned positions, LayerNorm with bias, GELU MLP with biases, dropout.
    Gpt2,
    /// Llama: rotary positions, RMSNorm, SwiGLU MLP, no biases, no dropout.
    Llama,
}

impl Family {
    /// The MLP's width when a shape gives none: GPT-2's 4 x `hidden`; Llama's SwiGLU
    /// two thirds of that, rounded up to a multiple of 256 (Meta's `multiple_of`: 11,008
    /// at 4,096), as the trainer builds it (`stoker_kernels::llama::LlamaDims`; a test in
    /// stoker-train holds the two equal).
    pub fn default_ffn_hidden(self, hidden: u64) -> u64 {
        match self {
            Family::Gpt2 => 4 * hidden,
            Family::Llama => (2 * (4 * hidden) / 3).div_ceil(256) * 256,
        }
    }
}

/// A transformer's shape: what the memory and FLOP formulas need.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Architecture {
    /// GPT-2 or Llama layout.
    pub family: Family,
    /// Number of transformer blocks (L).
    pub layers: u64,
    /// Model width (h, d_model).
    pub hidden: u64,
    /// Attention heads (a).
    pub heads: u64,
    /// Key/value heads (grouped-query attention); equals `heads` without GQA.
    pub kv_heads: u64,
    /// MLP inner width (4h for GPT-2, e.g. 11008 for Llama-2-7B).
    pub ffn_hidden: u64,
    /// Vocabulary size (V).
    pub vocab: u64,
    /// Context length the model was built for (also the learned position table size).
    pub context: u64,
    /// Whether the output head shares the token embedding.
    pub tied_embeddings: bool,
}

/// A model to plan for: an architecture, or only a parameter count.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ModelSpec {
    /// Preset name or "custom".
    pub name: String,
    /// The architecture when known; `None` when only a parameter count was given.
    pub arch: Option<Architecture>,
    /// Total parameter count (shared parameters counted once).
    pub params: u64,
    /// Parameters of the largest single module (DeepSpeed's "largest layer"), when known.
    pub largest_layer: Option<u64>,
    /// Global batch (sequences) the preset is usually trained with, used when none is given.
    pub default_global_batch: Option<u64>,
}

/// Largest accepted architecture dimension (keeps every count inside u64).
pub const MAX_DIM: u64 = 10_000_000;

/// Largest accepted parameter count.
pub const MAX_PARAMS: u64 = 10_000_000_000_000_000;

/// Known model presets: (name, what it is).
pub const MODEL_PRESETS: &[(&str, &str)] = &[
    (
        "gpt2-124m",
        "GPT-2 small: 12 layers, 768 wide, 12 heads, vocab 50257, context 1024",
    ),
    (
        "gpt2-1.5b",
        "GPT-2 XL: 48 layers, 1600 wide, 25 heads, vocab 50257, context 1024",
    ),
    (
        "llama-7b",
        "Llama-2-7B: 32 layers, 4096 wide, 32 heads, SwiGLU 11008, vocab 32000",
    ),
    (
        "llama-13b",
        "Llama-2-13B: 40 layers, 5120 wide, 40 heads, SwiGLU 13824, vocab 32000",
    ),
    (
        "llama-70b",
        "Llama-2-70B: 80 layers, 8192 wide, 64 heads (8 kv), SwiGLU 28672",
    ),
    (
        "stoker-gpt",
        "stoker's demo char-level Shakespeare GPT (configs/shakespeare-gpt.toml): 4 layers, 128 wide, vocab 96",
    ),
    (
        "t5-3b",
        "T5-3B parameter count only (2,851,598,336), DeepSpeed's estimator example",
    ),
];

fn gpt2(layers: u64, hidden: u64, heads: u64, vocab: u64, context: u64) -> Architecture {
    Architecture {
        family: Family::Gpt2,
        layers,
        hidden,
        heads,
        kv_heads: heads,
        ffn_hidden: 4 * hidden,
        vocab,
        context,
        tied_embeddings: true,
    }
}

fn llama(layers: u64, hidden: u64, heads: u64, kv_heads: u64, ffn: u64) -> Architecture {
    Architecture {
        family: Family::Llama,
        layers,
        hidden,
        heads,
        kv_heads,
        ffn_hidden: ffn,
        vocab: 32000,
        context: 4096,
        tied_embeddings: false,
    }
}

/// Looks up a model preset by name (case-insensitive); unknown names list the known ones.
pub fn preset(name: &str) -> Result<ModelSpec> {
    let key = name.to_ascii_lowercase();
    let (arch, batch) = match key.as_str() {
        "gpt2-124m" | "gpt2" => (gpt2(12, 768, 12, 50257, 1024), 512),
        "gpt2-1.5b" | "gpt2-xl" => (gpt2(48, 1600, 25, 50257, 1024), 512),
        "llama-7b" => (llama(32, 4096, 32, 32, 11008), 1024),
        "llama-13b" => (llama(40, 5120, 40, 40, 13824), 1024),
        "llama-70b" => (llama(80, 8192, 64, 8, 28672), 1024),
        // The demo's vocabulary: the Shakespeare shard's 86 characters rounded up, so an
        // emitted config trains on it (65, tiny-shakespeare's, put its ids out of range).
        "stoker-gpt" | "stoker" | "reference-gpt" => (gpt2(4, 128, 4, 96, 128), 16),
        "t5-3b" => {
            return Ok(ModelSpec {
                name: "t5-3b".into(),
                arch: None,
                params: 2_851_598_336,
                // The shared 32128 x 1024 token embedding.
                largest_layer: Some(32_128 * 1024),
                default_global_batch: None,
            });
        }
        _ => {
            return Err(PlanError::UnknownPreset {
                kind: "model",
                name: name.to_string(),
                known: MODEL_PRESETS
                    .iter()
                    .map(|p| p.0)
                    .collect::<Vec<_>>()
                    .join(", "),
            })
        }
    };
    let mut spec = ModelSpec::from_arch(key, arch)?;
    spec.default_global_batch = Some(batch);
    Ok(spec)
}

impl ModelSpec {
    /// Builds a spec from an architecture, validating its shape and counting its parameters.
    pub fn from_arch(name: String, arch: Architecture) -> Result<Self> {
        arch.validate()?;
        let total = arch.layers as u128 * arch.block_params() as u128;
        if total > MAX_PARAMS as u128 {
            return Err(crate::error::invalid(
                "model",
                "an architecture below 1e16 parameters",
                format!("{total} parameters in its blocks"),
            ));
        }
        Ok(ModelSpec {
            name,
            params: arch.param_count(),
            largest_layer: Some(arch.largest_layer()),
            arch: Some(arch),
            default_global_batch: None,
        })
    }

    /// A spec known only by its parameter count (activations cannot be estimated).
    pub fn from_params(params: u64) -> Self {
        ModelSpec {
            name: "custom".into(),
            arch: None,
            params,
            largest_layer: None,
            default_global_batch: None,
        }
    }

    /// Parameters moved together by a ZeRO-3 / FSDP gather: one transformer block, or the
    /// embedding if larger. Without an architecture, the largest layer if known.
    pub fn gather_unit(&self) -> Option<u64> {
        match &self.arch {
            Some(a) => Some(a.block_params().max(a.vocab * a.hidden)),
            None => self.largest_layer,
        }
    }

    /// Training FLOPs per token: 6 x params + attention 12 x L x h x s (PaLM, arXiv 2204.02311
    /// appendix B). Without an architecture only 6 x params.
    pub fn train_flops_per_token(&self, seq_len: u64) -> f64 {
        let attn = match &self.arch {
            Some(a) => 12.0 * a.layers as f64 * a.hidden as f64 * seq_len as f64,
            None => 0.0,
        };
        6.0 * self.params as f64 + attn
    }
}

impl Architecture {
    fn validate(&self) -> Result<()> {
        for (field, v) in [
            ("model.layers", self.layers),
            ("model.hidden", self.hidden),
            ("model.heads", self.heads),
            ("model.kv_heads", self.kv_heads),
            ("model.ffn_hidden", self.ffn_hidden),
            ("model.vocab", self.vocab),
            ("model.context", self.context),
        ] {
            if v == 0 || v > MAX_DIM {
                return Err(crate::error::invalid(
                    field,
                    "a positive integer up to 10^7",
                    v,
                ));
            }
        }
        if !self.hidden.is_multiple_of(self.heads) {
            return Err(crate::error::invalid(
                "model.heads",
                &format!("a divisor of model.hidden ({})", self.hidden),
                self.heads,
            ));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(crate::error::invalid(
                "model.kv_heads",
                &format!("a divisor of model.heads ({})", self.heads),
                self.kv_heads,
            ));
        }
        Ok(())
    }

    /// Parameters of one transformer block.
    ///
    /// GPT-2: qkv 3h^2+3h, projection h^2+h, MLP 2hf+f+h, two LayerNorms 4h; with f = 4h
    /// that is the familiar 12h^2 + 13h.
    /// Llama: q and o h^2 each, k and v h x h_kv each, SwiGLU 3hf, two RMSNorms 2h.
    pub fn block_params(&self) -> u64 {
        let (h, f) = (self.hidden, self.ffn_hidden);
        let kv = h / self.heads * self.kv_heads;
        match self.family {
            Family::Gpt2 => {
                (h * (h + 2 * kv) + h + 2 * kv) + (h * h + h) + (2 * h * f + f + h) + 4 * h
            }
            Family::Llama => 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h,
        }
    }

    /// Total parameters: embeddings (+ learned positions for GPT-2), blocks, final norm and
    /// an untied output head.
    pub fn param_count(&self) -> u64 {
        let h = self.hidden;
        let tokens = self.vocab * h;
        let (positions, final_norm) = match self.family {
            Family::Gpt2 => (self.context * h, 2 * h),
            Family::Llama => (0, h),
        };
        let head = if self.tied_embeddings {
            0
        } else {
            self.vocab * h
        };
        tokens + positions + self.layers * self.block_params() + final_norm + head
    }

    /// Parameters of the largest single module (embedding, fused qkv or an MLP matrix).
    pub fn largest_layer(&self) -> u64 {
        let (h, f) = (self.hidden, self.ffn_hidden);
        let kv = h / self.heads * self.kv_heads;
        let attn = match self.family {
            Family::Gpt2 => h * (h + 2 * kv) + h + 2 * kv,
            Family::Llama => h * h,
        };
        (self.vocab * h).max(h * f + f).max(attn)
    }
}

/// Parses a count such as `7.5e9`, `7.5B`, `124M`, `350k` or `1200000`.
pub fn parse_count(field: &str, s: &str) -> Result<u64> {
    let t = s.trim();
    let (num, mult) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&t[..t.len() - 1], 1e3),
        Some('M') => (&t[..t.len() - 1], 1e6),
        Some('B') | Some('G') => (&t[..t.len() - 1], 1e9),
        Some('T') => (&t[..t.len() - 1], 1e12),
        _ => (t, 1.0),
    };
    let v: f64 = num
        .trim()
        .replace('_', "")
        .parse()
        .map_err(|_| crate::error::invalid(field, "a count such as 7.5e9, 7.5B or 124M", s))?;
    let v = v * mult;
    if !(1.0..=1e16).contains(&v) {
        return Err(crate::error::invalid(
            field,
            "a positive count below 1e16",
            s,
        ));
    }
    // "7.5B" or "1.2345678912B" round by a millionth at most; "1.5" is no count.
    if (v - v.round()).abs() > 1e-6 * v {
        return Err(crate::error::invalid(field, "a whole count", s));
    }
    Ok(v.round() as u64)
}
