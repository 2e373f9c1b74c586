//! Activation memory of a transformer block, with and without activation checkpointing.
//!
//! Source: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
//! Models" (arXiv 2205.05198), section 4.1: with 16-bit activations and no model parallelism a
//! GPT block stores `s*b*h*(34 + 5*a*s/h)` bytes: attention 11sbh + 5as^2b, MLP 19sbh,
//! LayerNorms 4sbh (s = sequence, b = micro-batch, h = width, a = heads). Generalised here:
//! - MLP of width f: GPT `2sbh + 4sbf + sbh` (input, GELU in/out, dropout mask; 19sbh when
//!   f = 4h); Llama SwiGLU `2sbh + 8sbf` (input, gate, up, SiLU(gate), product).
//! - No dropout (Llama): attention 10sbh + 2as^2b (no masks).
//! - Fused attention (FlashAttention) stores no s x s matrix: the `as^2b` terms vanish.
//! - Output: final-norm and head inputs 4sbh, fp32 logits for the loss 4sbV.
//! - fp32 activations double every term.
//!
//! With full checkpointing (section 4.2, "full recomputation") each block keeps only its
//! 2sbh input, and one block's full activations are rebuilt during its backward pass.

use serde::Serialize;

use crate::model::{Architecture, Family};

/// Activation bytes for one micro-batch on one device.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Activations {
    /// Bytes one block stores without checkpointing.
    pub per_block: f64,
    /// Bytes of the embedding/output side (norm and head inputs, fp32 logits).
    pub output: f64,
    /// Total bytes held at the peak (end of forward, or during a recomputed backward).
    pub total: f64,
}

/// Computes activation memory for `micro` sequences of `seq` tokens.
pub fn activations(
    arch: &Architecture,
    micro: u64,
    seq: u64,
    element_bytes: f64,
    checkpointing: bool,
    flash_attention: bool,
) -> Activations {
    let (s, b, h, a) = (
        seq as f64,
        micro as f64,
        arch.hidden as f64,
        arch.heads as f64,
    );
    let f = arch.ffn_hidden as f64;
    let v = arch.vocab as f64;
    let sbh = s * b * h;
    let scale = element_bytes / 2.0;
    let (attn_sbh, attn_s2, mlp) = match arch.family {
        Family::Gpt2 => (11.0, 5.0, 3.0 * sbh + 4.0 * s * b * f),
        Family::Llama => (10.0, 2.0, 2.0 * sbh + 8.0 * s * b * f),
    };
    let scores = if flash_attention {
        0.0
    } else {
        attn_s2 * a * s * s * b
    };
    let per_block = scale * (attn_sbh * sbh + scores + mlp + 4.0 * sbh);
    let output = scale * 4.0 * sbh + 4.0 * s * b * v;
    let stored = if checkpointing {
        arch.layers as f64 * scale * 2.0 * sbh + per_block
    } else {
        arch.layers as f64 * per_block
    };
    Activations {
        per_block,
        output,
        total: stored + output,
    }
}
