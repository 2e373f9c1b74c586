//! Where every parameter of a Llama starts in a flat buffer, found through its table.

use std::collections::HashMap;
use std::ops::Range;

use super::spec::{llama_params, LlamaDims};
use crate::error::KernelError;

/// Where one block's weights start (element offsets; the Llama has no biases).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LlamaBlockOffsets {
    /// The attention's RMSNorm gain `[C]`.
    pub input_norm: usize,
    /// The query projection `[C, C]`.
    pub q: usize,
    /// The key projection `[kv heads x head width, C]`.
    pub k: usize,
    /// The value projection, the key's shape.
    pub v: usize,
    /// The output projection `[C, C]`.
    pub o: usize,
    /// The MLP's RMSNorm gain `[C]`.
    pub post_norm: usize,
    /// SwiGLU's gate projection `[F, C]`.
    pub gate: usize,
    /// SwiGLU's up projection `[F, C]`.
    pub up: usize,
    /// The down projection `[C, F]`.
    pub down: usize,
}

impl LlamaBlockOffsets {
    /// The same offsets counted from flat element `base` (a group view's start).
    pub(crate) fn rebased(&self, base: usize) -> Self {
        LlamaBlockOffsets {
            input_norm: self.input_norm - base,
            q: self.q - base,
            k: self.k - base,
            v: self.v - base,
            o: self.o - base,
            post_norm: self.post_norm - base,
            gate: self.gate - base,
            up: self.up - base,
            down: self.down - base,
        }
    }
}

/// Where every parameter of a Llama starts in a flat buffer (the gradient buffer has the
/// same layout), and each group's span.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LlamaOffsets {
    pub(crate) embed: usize,
    pub(crate) blocks: Vec<LlamaBlockOffsets>,
    pub(crate) norm: usize,
    pub(crate) head: usize,
    pub(crate) groups: Vec<Range<usize>>,
    pub(crate) end: usize,
}

impl LlamaOffsets {
    /// The offsets of every parameter of [`llama_params`]`(dims)`, as `offset_of(name)`
    /// places it; the error names the first parameter it does not know.
    pub fn from_table(
        dims: &LlamaDims,
        offset_of: impl Fn(&str) -> Option<usize>,
    ) -> Result<Self, KernelError> {
        let mut end = 0;
        let mut at = HashMap::new();
        let mut groups = vec![(usize::MAX, 0); dims.n_layer + 2];
        for p in llama_params(dims) {
            let off = offset_of(&p.name).ok_or_else(|| KernelError::Layout {
                op: "llama-step",
                msg: format!("no offset for parameter `{}` of the Llama table", p.name),
            })?;
            let len = p.numel();
            end = end.max(off + len);
            let g = &mut groups[p.group];
            *g = (g.0.min(off), g.1.max(off + len));
            at.insert(p.name, off);
        }
        let blocks = (0..dims.n_layer)
            .map(|l| {
                let w = |part: &str| at[&format!("layers.{l}.{part}.weight")];
                LlamaBlockOffsets {
                    input_norm: w("input_layernorm"),
                    q: w("self_attn.q_proj"),
                    k: w("self_attn.k_proj"),
                    v: w("self_attn.v_proj"),
                    o: w("self_attn.o_proj"),
                    post_norm: w("post_attention_layernorm"),
                    gate: w("mlp.gate_proj"),
                    up: w("mlp.up_proj"),
                    down: w("mlp.down_proj"),
                }
            })
            .collect();
        Ok(LlamaOffsets {
            embed: at["embed_tokens.weight"],
            blocks,
            norm: at["norm.weight"],
            head: at["lm_head.weight"],
            groups: groups.into_iter().map(|(a, b)| a..b).collect(),
            end,
        })
    }

    /// One past the last element any parameter occupies.
    pub fn end(&self) -> usize {
        self.end
    }

    /// The same offsets over a flat buffer of `len` elements: a layout's, padded past its
    /// last parameter (the trainer's flat buffers are), so that a step's parameter and
    /// gradient buffers are exactly as long as the trainer's. Fails where `len` falls
    /// short of the last parameter.
    pub fn with_end(mut self, len: usize) -> Result<Self, KernelError> {
        self.end = crate::param_spec::padded_end("llama-step", self.end, len)?;
        Ok(self)
    }

    /// Each group's span of the flat buffer, group order (embedding, blocks, final norm
    /// with the head).
    pub fn group_ranges(&self) -> &[Range<usize>] {
        &self.groups
    }

    /// The token embedding's offset (`[vocab, C]`).
    pub fn embed(&self) -> usize {
        self.embed
    }

    /// Each block's offsets, in order.
    pub fn blocks(&self) -> &[LlamaBlockOffsets] {
        &self.blocks
    }

    /// The final RMSNorm gain's offset (`[C]`).
    pub fn norm(&self) -> usize {
        self.norm
    }

    /// The (untied) head's offset (`[vocab, C]`).
    pub fn head(&self) -> usize {
        self.head
    }
}
