//! The GPU-resident training steps over flat buffers, written once for any
//! [`crate::Backend`]: `gpt` (stoker-kernels' `GptStep`'s twin) and `llama`
//! (`LlamaStep`'s), on `buffers` (the four buffers both hold, a micro-batch's ids, the
//! loss), `layout` / `llama_layout` (every activation's span, sized in one place),
//! `attention` (the causal attention products both share) and `optimizer` (AdamW over
//! the FP32 master, the gradient norm the one value read back).
//!
//! The host backend runs them in the tests against the CPU steps (the same flat buffers,
//! the same losses and gradients within float tolerance); the device backend runs the
//! same calls on a GPU.

pub mod attention;
pub mod buffers;
pub mod gpt;
pub mod layout;
mod linear;
pub mod llama;
pub mod llama_layout;
pub mod optimizer;
pub mod token_step;

pub use gpt::GptGpuStep;
pub use llama::LlamaGpuStep;

/// The vocabulary padded to a multiple of 64 (GPT-2's 50,257 to 50,304): the logits'
/// row width, so their rows stay aligned.
pub fn padded_vocab(v: usize) -> usize {
    v.div_ceil(64) * 64
}

/// One micro-batch: token ids and next-token targets `[batch, t]`, row-major.
#[derive(Debug, Clone, Copy)]
pub struct TokenBatch<'a> {
    /// Token ids.
    pub tokens: &'a [i64],
    /// Targets; `ignore` marks positions without a loss.
    pub targets: &'a [i64],
    /// The ignore index.
    pub ignore: i64,
}
