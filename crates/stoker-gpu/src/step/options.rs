//! How a resident step is made beyond its model and batch shape: what it keeps on the
//! backend, traded for copies or recomputation, and whether its micro-batches replay as
//! graphs.

/// A step's options (none by default: everything kept on the backend, each launch its
/// own).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepOptions {
    /// The blocks' parameters offloaded to host memory, each block's streamed up as it
    /// runs ([`super::param_offload`]; FSDP's `CPUOffload(offload_params=True)`). With
    /// [`Self::shard_params`], the rank's shard lives in host memory instead
    /// ([`super::sharded_params`]; DeepSpeed's stage 3 with `offload_param`).
    pub offload_params: bool,
    /// Attention's probabilities recomputed in each block's backward (the scores'
    /// product and the softmax again, the same kernels on the same inputs, so the same
    /// bits) instead of kept per block: one `[B, H, T, T]` buffer for every block
    /// (Megatron-LM's selective activation recomputation).
    pub recompute_attention: bool,
    /// The MLP's activation recomputed in each block's backward from the kept
    /// pre-activations (the GPT's GELU output `[N, 4C]` from its expansion, the Llama's
    /// SwiGLU product `[N, F]` from its gate and up; the same kernel on the same inputs,
    /// so the same bits) instead of kept per block: one buffer for every block (llm.c's
    /// default, `recompute = 1`).
    pub recompute_mlp: bool,
    /// The blocks' gradients in two slots instead of one buffer each ([`super::grad_slots`]):
    /// ZeRO-2's, whose replica reduce-scatters each block's into the rank's shard after
    /// its backward, every micro-batch, so that no rank holds the whole gradient.
    pub grads_in_slots: bool,
    /// The parameters sharded over ranks `(rank, world)` (ZeRO-3, FSDP's `FULL_SHARD`):
    /// the step keeps this rank's shard of the compute copy, the runs outside the blocks
    /// whole, and two slots each for a block's parameters and gradients; whoever runs the
    /// step gathers each block into its slot before it runs ([`super::sharded_params`]).
    /// The blocks' gradients are in slots too, as [`Self::grads_in_slots`] has them.
    pub shard_params: Option<(usize, usize)>,
    /// Each micro-batch that runs without hooks between its blocks (one rank; every
    /// micro-batch of a window under DDP and ZeRO-1 but the last, whose backward starts
    /// the reductions) replayed as one captured graph ([`super::graphs`]; CUDA graphs).
    /// Refused with parameters or gradients in slots or offloaded: those run hooks in
    /// every micro-batch.
    pub graph_micro_batches: bool,
    /// Attention on tensor cores keeping no scores ([`crate::flash`], FlashAttention-2's
    /// algorithm): each block keeps its rows' log-sum-exp (`[B, H, T]` f32) instead of its
    /// probabilities (`[B, H, T, T]`), and the backward recomputes them 16 x 16 at a time.
    /// bf16 activations and head widths 16, 32 or 64; not with `recompute_attention`
    /// (there is nothing to recompute).
    pub flash_attention: bool,
    /// The GPT's or the Llama's linear layers in FP8 with delayed scaling
    /// ([`super::fp8_linear`]; Transformer Engine's HYBRID recipe): f32 or bf16
    /// activations; the casts read the weights and write the weight gradients wherever
    /// the step keeps them (its buffers, or ZeRO-2's and ZeRO-3's slots).
    pub fp8_linears: bool,
}

impl StepOptions {
    /// Why `fp8_linears` cannot run on a step of `dtype` activations, if it cannot.
    pub fn fp8_refusal(&self, dtype: crate::Dtype) -> Option<String> {
        if !self.fp8_linears {
            return None;
        }
        if dtype == crate::Dtype::F16 {
            return Some(
                "FP8 linear layers write bf16 or f32 activations, not f16 (precision = \"fp8\" \
                 runs bf16 around them)"
                    .into(),
            );
        }
        None
    }

    /// Why `flash_attention` cannot run on a step of `dtype` activations and heads of
    /// `head_width`, if it cannot.
    pub fn flash_refusal(&self, dtype: crate::Dtype, head_width: usize) -> Option<String> {
        if !self.flash_attention {
            return None;
        }
        if dtype != crate::Dtype::Bf16 {
            return Some(format!(
                "flash attention runs on bf16 activations (precision = \"bf16\"); this \
                 step's are {} (precision = \"{}\")",
                dtype.suffix(),
                match dtype {
                    crate::Dtype::F16 => "fp16",
                    _ => "fp32",
                }
            ));
        }
        if !crate::flash::supports(head_width) {
            return Some(format!(
                "flash attention is built for head widths {:?}; this model's heads are {head_width} wide",
                crate::flash::HEAD_WIDTHS
            ));
        }
        if self.recompute_attention {
            return Some(
                "flash attention keeps no probabilities: recompute = \"attention\" has nothing to recompute"
                    .into(),
            );
        }
        None
    }
}
