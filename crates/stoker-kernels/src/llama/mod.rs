//! The Llama family's parameter table (RMSNorm, rotary positions, SwiGLU, grouped-query
//! attention, untied head): the one place that defines a Llama's parameters.
//!
//! Names are transformers' `LlamaForCausalLM` names without its `model.` prefix, and the
//! rotary layout is transformers' (each head's first half rotated against its second
//! half), so weights move to and from transformers without permutation.

mod offsets;
mod spec;
mod step;

pub use offsets::{LlamaBlockOffsets, LlamaOffsets};
pub use spec::{llama_params, LlamaDims};
pub use step::{activation_floats, gemm_pack_bytes, LlamaStep};
