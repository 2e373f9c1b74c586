//! The table itself: every parameter's name, shape, group and initialization, in
//! execution order (token embedding; per block: input norm, q, k, v, o, post-attention
//! norm, gate, up, down; final norm and head).
//!
//! q, k and v are adjacent rows of one `[(H + 2 KV) hd, C]` matrix in a flat buffer (the
//! same input, consecutive in the table), as are gate and up (`[2 F, C]`): a step over
//! flat buffers may run each pair or triple as one GEMM.

use crate::param_spec::{ParamSpec, SpecInit};

/// A Llama's sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LlamaDims {
    /// Vocabulary (rows of the token embedding and of the head).
    pub vocab: usize,
    /// Longest window (the rotary tables' length).
    pub context: usize,
    /// Embedding width `C`.
    pub d_model: usize,
    /// Transformer blocks.
    pub n_layer: usize,
    /// Query heads (divide `C`).
    pub n_head: usize,
    /// Key and value heads (divide `n_head`): grouped-query attention, `n_head /
    /// n_kv_head` query heads per key/value head.
    pub n_kv_head: usize,
    /// SwiGLU's inner width `F`.
    pub ffn_hidden: usize,
}

impl LlamaDims {
    /// Width of one head.
    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_head
    }

    /// Llama's SwiGLU width for `d_model`: two thirds of 4 C, rounded up to a multiple of
    /// 256 (Meta's `multiple_of`; 11008 for C = 4096).
    pub fn default_ffn_hidden(d_model: usize) -> usize {
        let h = 2 * (4 * d_model) / 3;
        h.div_ceil(256) * 256
    }
}

/// Initialization scale (transformers' `initializer_range`).
const STD: f32 = 0.02;

/// Every parameter of a Llama of `dims`, in execution order. The output projections
/// (`o_proj`, `down_proj`) are initialized with `0.02 / sqrt(2 n_layer)` (GPT-2's and
/// torchtitan's depth scaling), other weights with 0.02, norm gains with ones. No biases.
pub fn llama_params(dims: &LlamaDims) -> Vec<ParamSpec> {
    let (c, f) = (dims.d_model, dims.ffn_hidden);
    let (q, kv) = (
        dims.n_head * dims.head_dim(),
        dims.n_kv_head * dims.head_dim(),
    );
    let resid = STD / (2.0 * dims.n_layer.max(1) as f32).sqrt();
    let mut out = Vec::with_capacity(3 + 9 * dims.n_layer);
    let mut push = |name: String, shape: Vec<usize>, group: usize, init: SpecInit| {
        out.push(ParamSpec {
            name,
            shape,
            group,
            init,
        })
    };
    push(
        "embed_tokens.weight".into(),
        vec![dims.vocab, c],
        0,
        SpecInit::Normal(STD),
    );
    for l in 0..dims.n_layer {
        let g = l + 1;
        let p = |part: &str| format!("layers.{l}.{part}.weight");
        push(p("input_layernorm"), vec![c], g, SpecInit::Ones);
        push(p("self_attn.q_proj"), vec![q, c], g, SpecInit::Normal(STD));
        push(p("self_attn.k_proj"), vec![kv, c], g, SpecInit::Normal(STD));
        push(p("self_attn.v_proj"), vec![kv, c], g, SpecInit::Normal(STD));
        push(
            p("self_attn.o_proj"),
            vec![c, q],
            g,
            SpecInit::Normal(resid),
        );
        push(p("post_attention_layernorm"), vec![c], g, SpecInit::Ones);
        push(p("mlp.gate_proj"), vec![f, c], g, SpecInit::Normal(STD));
        push(p("mlp.up_proj"), vec![f, c], g, SpecInit::Normal(STD));
        push(p("mlp.down_proj"), vec![c, f], g, SpecInit::Normal(resid));
    }
    let last = dims.n_layer + 1;
    push("norm.weight".into(), vec![c], last, SpecInit::Ones);
    push(
        "lm_head.weight".into(),
        vec![dims.vocab, c],
        last,
        SpecInit::Normal(STD),
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_in_execution_order_and_counts_as_the_planner_does() {
        let d = LlamaDims {
            vocab: 11,
            context: 6,
            d_model: 8,
            n_layer: 3,
            n_head: 4,
            n_kv_head: 2,
            ffn_hidden: 20,
        };
        let t = llama_params(&d);
        assert_eq!(t.len(), 1 + 9 * 3 + 2);
        assert_eq!(t[0].name, "embed_tokens.weight");
        assert_eq!(t[1].name, "layers.0.input_layernorm.weight");
        assert_eq!(t[3].shape, vec![4, 8], "k_proj: 2 kv heads of width 2");
        assert_eq!(t.last().unwrap().name, "lm_head.weight");
        assert!(t.windows(2).all(|w| w[0].group <= w[1].group));
        let numel: usize = t.iter().map(ParamSpec::numel).sum();
        // stoker-plan's Llama block: 2 C^2 + 2 C kv + 3 C F + 2 C; untied embeddings.
        let (c, kv, f) = (8, 4, 20);
        assert_eq!(
            numel,
            2 * 11 * c + 3 * (2 * c * c + 2 * c * kv + 3 * c * f + 2 * c) + c
        );
        assert_eq!(LlamaDims::default_ffn_hidden(4096), 11008);
        assert_eq!(LlamaDims::default_ffn_hidden(5120), 13824);
    }
}
