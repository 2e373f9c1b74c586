//! Fused, differentiable CPU kernels for stoker.
//!
//! candle's composed operations allocate a buffer per step and build their backward
//! from generic operations; candle's own fused softmax and layer norm have no backward
//! at all. Each op here is a candle custom op whose forward and backward are one fused
//! pass each: contiguous row loops, rayon across rows, f32 arithmetic (bf16 inputs are
//! widened on load and rounded on store). Every op keeps its composed twin in
//! [`reference`], which the tests hold it against.
//!
//! [`matmul`] is a bf16 GEMM on the AVX512-BF16 dot-product instruction (detected at run
//! time, with a portable fallback), so bf16 linear layers run faster than f32 ones.
//!
//! [`gpt`] is a whole GPT training step over flat buffers (llm.c's design): the same
//! kernels called in order, with no autograd graph in between.
//!
//! [`optim`] holds the AdamW and SGD updates over flat FP32 buffers as single fused
//! passes, bit-identical to stoker-train's optimizers, with an optional bf16 copy-out.
//!
//! Modules, one idea each:
//! - ops (each a candle custom op, forward and backward): `attention` (causal, per head),
//!   `cross_entropy`, `embedding`, `gelu`, `layer_norm`, `linear`, `rms_norm`, `rope`,
//!   `softmax`, `swiglu`; `reference`: their composed twins;
//! - arithmetic underneath: `matmul` (the bf16 GEMM), `fastmath` (exp, tanh), `elem`
//!   (f32 / bf16 element access), `error` (typed errors naming the op), `gemm_slab`
//!   (the f32 gemm crate's per-thread packing slab, primed before a run is measured);
//! - the steps over flat buffers: `param_spec` (one row of a parameter table), `gpt` and
//!   `llama` (each model's table, offsets and step), `token_step` (the trainer's interface
//!   to both), `shape_cache` (their buffers per batch shape), `flat` (whole-buffer passes),
//!   `optim` (AdamW, SGD).
//!
//! ```
//! use candle_core::{Device, Tensor, Var};
//! let x = Var::from_vec(vec![-1.0f32, 0.0, 2.0], 3, &Device::Cpu).unwrap();
//! let y = stoker_kernels::gelu(x.as_tensor()).unwrap();
//! let grads = y.sum_all().unwrap().backward().unwrap();
//! assert!(grads.get(x.as_tensor()).is_some());
//! ```
#![deny(missing_docs)]

pub mod attention;
pub mod cross_entropy;
mod elem;
pub mod embedding;
pub mod error;
mod fastmath;
pub mod flat;
pub mod gelu;
pub mod gemm_slab;
pub mod gpt;
pub mod layer_norm;
pub mod linear;
pub mod llama;
pub mod matmul;
pub mod optim;
pub mod param_spec;
pub mod reference;
pub mod rms_norm;
pub mod rope;
mod shape_cache;
pub mod softmax;
pub mod swiglu;
pub mod token_step;

pub use attention::{causal_attention, causal_attention_qkv};
pub use cross_entropy::{cross_entropy_sum, valid_token_count};
pub use embedding::embedding;
pub use error::KernelError;
pub use gelu::gelu;
pub use gpt::{
    activation_floats, gemm_pack_bytes, gpt_params, group_calls, replay, GptBatch, GptDims,
    GptOffsets, GptStep, GroupCall, GroupReady, GroupView, Phase, SpecInit, StepParams, Whole,
};
pub use layer_norm::layer_norm;
pub use linear::{linear, linear_with};
pub use llama::{llama_params, LlamaDims, LlamaOffsets, LlamaStep};
pub use matmul::{bf16_native, linear_bf16, matmul_bf16, Bf16Kernel, PackBuffers};
pub use optim::{adamw_update, sgd_update, AdamWStep, SgdStep};
pub use param_spec::ParamSpec;
pub use rms_norm::rms_norm;
pub use rope::rope;
pub use softmax::softmax_last_dim;
pub use swiglu::swiglu;
pub use token_step::TokenStep;
