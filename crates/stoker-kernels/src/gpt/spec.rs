//! The GPT's parameter table: every parameter's name, shape, block and initialization,
//! in execution order (embeddings, block 0, block 1, ..., final norm).
//!
//! This is the one place that defines the GPT's parameters. stoker-train's candle model
//! declares its variables from it, the flat layout follows its order (so each block is
//! one contiguous range of the flat buffer: the unit of a data-parallel gradient bucket
//! and of a ZeRO-3 gather), and the direct step finds its offsets through it
//! ([`GptOffsets::from_table`]).

use crate::error::KernelError;
pub use crate::param_spec::{ParamSpec, SpecInit};

/// The GPT's sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GptDims {
    /// Vocabulary (rows of the token embedding, columns of the logits).
    pub vocab: usize,
    /// Positions (rows of the position embedding).
    pub context: usize,
    /// Embedding width `C`.
    pub d_model: usize,
    /// Transformer blocks.
    pub n_layer: usize,
    /// Attention heads (divide `C`).
    pub n_head: usize,
}

/// GPT-2's initialization scale.
const STD: f32 = 0.02;

/// The parts of one block in execution order: (name, role). `Norm` is a LayerNorm
/// `[C]` gain and bias; `Linear(out, in, residual)` a weight `[out x C, in x C]` and bias,
/// with the residual projections' smaller initialization.
const BLOCK: [(&str, Part); 6] = [
    ("ln_1", Part::Norm),
    ("attn.qkv", Part::Linear(3, 1, false)),
    ("attn.proj", Part::Linear(1, 1, true)),
    ("ln_2", Part::Norm),
    ("mlp.fc", Part::Linear(4, 1, false)),
    ("mlp.proj", Part::Linear(1, 4, true)),
];

#[derive(Debug, Clone, Copy)]
enum Part {
    Norm,
    Linear(usize, usize, bool),
}

/// Every parameter of a GPT of `dims`, in execution order. Residual projections are
/// initialized with `0.02 / sqrt(2 n_layer)` (GPT-2), other weights and the embeddings
/// with 0.02, gains with ones, biases with zeros.
pub fn gpt_params(dims: &GptDims) -> Vec<ParamSpec> {
    let c = dims.d_model;
    let resid = STD / (2.0 * dims.n_layer.max(1) as f32).sqrt();
    let mut out = Vec::with_capacity(4 + 12 * dims.n_layer);
    let mut push = |name: String, shape: Vec<usize>, group: usize, init: SpecInit| {
        out.push(ParamSpec {
            name,
            shape,
            group,
            init,
        })
    };
    push(
        "wte.weight".into(),
        vec![dims.vocab, c],
        0,
        SpecInit::Normal(STD),
    );
    push(
        "wpe.weight".into(),
        vec![dims.context, c],
        0,
        SpecInit::Normal(STD),
    );
    let part = |push: &mut dyn FnMut(String, Vec<usize>, usize, SpecInit),
                prefix: &str,
                p: Part,
                group: usize| match p {
        Part::Norm => {
            push(format!("{prefix}.weight"), vec![c], group, SpecInit::Ones);
            push(format!("{prefix}.bias"), vec![c], group, SpecInit::Zeros);
        }
        Part::Linear(o, i, residual) => {
            let std = if residual { resid } else { STD };
            push(
                format!("{prefix}.weight"),
                vec![o * c, i * c],
                group,
                SpecInit::Normal(std),
            );
            push(
                format!("{prefix}.bias"),
                vec![o * c],
                group,
                SpecInit::Zeros,
            );
        }
    };
    for l in 0..dims.n_layer {
        for (name, p) in BLOCK {
            part(&mut push, &format!("h.{l}.{name}"), p, l + 1);
        }
    }
    part(&mut push, "ln_f", Part::Norm, dims.n_layer + 1);
    out
}

/// Where one block's parameters start in the flat buffer (element offsets); each pair
/// is `[weight, bias]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockOffsets {
    /// The first LayerNorm.
    pub ln1: [usize; 2],
    /// The attention's QKV projection (`[3C, C]`).
    pub qkv: [usize; 2],
    /// The attention's output projection (`[C, C]`).
    pub proj: [usize; 2],
    /// The second LayerNorm.
    pub ln2: [usize; 2],
    /// The MLP's expansion (`[4C, C]`).
    pub fc: [usize; 2],
    /// The MLP's projection (`[C, 4C]`).
    pub fc_proj: [usize; 2],
}

impl BlockOffsets {
    /// The same offsets counted from flat element `base` (a group view's start).
    pub(crate) fn rebased(&self, base: usize) -> Self {
        let r = |o: [usize; 2]| [o[0] - base, o[1] - base];
        BlockOffsets {
            ln1: r(self.ln1),
            qkv: r(self.qkv),
            proj: r(self.proj),
            ln2: r(self.ln2),
            fc: r(self.fc),
            fc_proj: r(self.fc_proj),
        }
    }
}

/// Where every parameter of a GPT starts in a flat buffer (the gradient buffer has the
/// same layout), found through the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GptOffsets {
    pub(crate) wte: usize,
    pub(crate) wpe: usize,
    pub(crate) blocks: Vec<BlockOffsets>,
    pub(crate) ln_f: [usize; 2],
    /// Each group's span of the flat buffer (first element to one past its last).
    pub(crate) groups: Vec<std::ops::Range<usize>>,
    /// One past the last element any parameter occupies.
    pub(crate) end: usize,
}

impl GptOffsets {
    /// The offsets of every parameter of [`gpt_params`]`(dims)`, as `offset_of(name)`
    /// places it; the error names the first parameter it does not know.
    pub fn from_table(
        dims: &GptDims,
        offset_of: impl Fn(&str) -> Option<usize>,
    ) -> Result<Self, KernelError> {
        let table = gpt_params(dims);
        let mut end = 0;
        let mut at = std::collections::HashMap::new();
        let mut groups = vec![(usize::MAX, 0); dims.n_layer + 2];
        for p in &table {
            let off = offset_of(&p.name).ok_or_else(|| KernelError::Layout {
                op: "gpt-step",
                msg: format!("no offset for parameter `{}` of the GPT table", p.name),
            })?;
            let len = p.numel();
            end = end.max(off + len);
            let g = &mut groups[p.group];
            *g = (g.0.min(off), g.1.max(off + len));
            at.insert(p.name.as_str(), off);
        }
        let pair = |prefix: &str| {
            [
                at[&*format!("{prefix}.weight")],
                at[&*format!("{prefix}.bias")],
            ]
        };
        let blocks = (0..dims.n_layer)
            .map(|l| {
                let b = |part: &str| pair(&format!("h.{l}.{part}"));
                BlockOffsets {
                    ln1: b("ln_1"),
                    qkv: b("attn.qkv"),
                    proj: b("attn.proj"),
                    ln2: b("ln_2"),
                    fc: b("mlp.fc"),
                    fc_proj: b("mlp.proj"),
                }
            })
            .collect();
        Ok(GptOffsets {
            wte: at["wte.weight"],
            wpe: at["wpe.weight"],
            blocks,
            ln_f: pair("ln_f"),
            groups: groups.into_iter().map(|(a, b)| a..b).collect(),
            end,
        })
    }

    /// One past the last element any parameter occupies: the least length of a
    /// parameter or gradient buffer.
    pub fn end(&self) -> usize {
        self.end
    }

    /// The same offsets over a flat buffer of `len` elements: a layout's, padded past its
    /// last parameter (the trainer's flat buffers are), so that a step's parameter and
    /// gradient buffers are exactly as long as the trainer's. Fails where `len` falls
    /// short of the last parameter.
    pub fn with_end(mut self, len: usize) -> Result<Self, KernelError> {
        self.end = crate::param_spec::padded_end("gpt-step", self.end, len)?;
        Ok(self)
    }

    /// Each group's span of the flat buffer, group order (embeddings, blocks, final norm).
    pub fn group_ranges(&self) -> &[std::ops::Range<usize>] {
        &self.groups
    }

    /// The token embedding's offset (`[vocab, C]`, also the tied head).
    pub fn wte(&self) -> usize {
        self.wte
    }

    /// The position embedding's offset (`[context, C]`).
    pub fn wpe(&self) -> usize {
        self.wpe
    }

    /// Each block's offsets, in order.
    pub fn blocks(&self) -> &[BlockOffsets] {
        &self.blocks
    }

    /// The final LayerNorm's `[weight, bias]`.
    pub fn ln_f(&self) -> [usize; 2] {
        self.ln_f
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_in_execution_order_with_contiguous_groups() {
        let d = GptDims {
            vocab: 11,
            context: 6,
            d_model: 8,
            n_layer: 3,
            n_head: 2,
        };
        let t = gpt_params(&d);
        assert_eq!(t.len(), 2 + 12 * 3 + 2);
        assert_eq!(t[0].name, "wte.weight");
        assert_eq!(t[2].name, "h.0.ln_1.weight");
        assert_eq!(t.last().unwrap().name, "ln_f.bias");
        assert!(t.windows(2).all(|w| w[0].group <= w[1].group));
        let numel: usize = t.iter().map(ParamSpec::numel).sum();
        // 12 C^2 + 13 C per block, embeddings, final norm.
        assert_eq!(numel, 11 * 8 + 6 * 8 + 3 * (12 * 64 + 13 * 8) + 2 * 8);
        let resid = 0.02 / (6f32).sqrt();
        assert_eq!(t[6].name, "h.0.attn.proj.weight");
        assert_eq!(t[6].init, SpecInit::Normal(resid));
        let e = GptOffsets::from_table(&d, |n| (n != "h.1.mlp.fc.bias").then_some(0)).unwrap_err();
        assert!(e.to_string().contains("h.1.mlp.fc.bias"), "{e}");
    }
}
