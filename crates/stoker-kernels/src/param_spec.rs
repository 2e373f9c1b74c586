//! A row of a model's parameter table (the GPT's, the Llama's): name, shape, execution
//! group and initialization. The tables themselves live with their models
//! ([`crate::gpt::gpt_params`], [`crate::llama::llama_params`]); everything downstream
//! (the candle models' variables, the flat layout, buckets, ZeRO's groups, checkpoints)
//! reads them through this one type; and the flat buffer's length the offsets of a table
//! take (`padded_end`).

use crate::error::KernelError;

/// How a parameter's initial values are drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SpecInit {
    /// All zeros (biases).
    Zeros,
    /// All ones (norm gains).
    Ones,
    /// Normal with mean 0 and this standard deviation.
    Normal(f32),
}

/// One row of a parameter table.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamSpec {
    /// Dotted name, as in checkpoints (`h.3.attn.qkv.weight`).
    pub name: String,
    /// Shape; weights are `[out, in]` as in PyTorch.
    pub shape: Vec<usize>,
    /// Execution-order group: 0 the embeddings, `1..=n_layer` the blocks, `n_layer + 1`
    /// the final norm (and an untied head).
    pub group: usize,
    /// Initialization.
    pub init: SpecInit,
}

impl ParamSpec {
    /// Elements of the parameter: the product of its shape.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Elements of execution group `group`'s parameters in `table` (group 1: the first
/// block's, the size of every block's in the GPT's and the Llama's tables).
pub fn group_elements(table: &[ParamSpec], group: usize) -> usize {
    table
        .iter()
        .filter(|p| p.group == group)
        .map(ParamSpec::numel)
        .sum()
}

/// A flat buffer's length for parameters that end at `end`: `len` (a layout's, padded past
/// its last parameter), or an error for `op` where it falls short of them. The GPT's and
/// the Llama's offsets take it as their buffers' length.
pub(crate) fn padded_end(op: &'static str, end: usize, len: usize) -> Result<usize, KernelError> {
    match len >= end {
        true => Ok(len),
        false => Err(KernelError::Layout {
            op,
            msg: format!(
                "a flat buffer of {len} elements, short of the last parameter's end at {end}"
            ),
        }),
    }
}
