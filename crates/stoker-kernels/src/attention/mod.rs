//! Causal scaled-dot-product attention, fused, with a fused backward, in two layouts:
//! separate `q`, `k`, `v` `[B, H, T, D]` ([`causal_attention`]), or the packed output of a
//! QKV projection `[B, T, 3 H D]` straight to `[B, T, H D]` ([`causal_attention_qkv`]),
//! which saves the split, the head transposes and their backward copies.
//!
//! Row by row (flash-attention's idea, on a CPU): for query `i` the scores against keys
//! `0..=i` live in one scratch row of `T`, never a `T x T` matrix; forward saves only
//! each row's log-sum-exp. Backward recomputes the probabilities from it:
//! `p_ij = exp(s_ij - lse_i)`, `ds_ij = p_ij (dO_i . v_j - dO_i . O_i)`, then
//! `dq_i = scale sum_j ds_ij k_j`, `dk_j += scale ds_ij q_i`, `dv_j += p_ij dO_i`.
//! Parallel over the `B * H` heads; each head works in f32 scratch (bf16 widened once).
//!
//! The packed op in f32 (and the GPT's direct step) runs a second formulation instead,
//! per head as GEMMs over a `T x T` scratch: at GPT contexts (128 here) a GEMM's
//! throughput beats skipping the masked half row by row (about 2x on the whole attention).
//! The row kernels stay for bf16 and the `[B, H, T, D]` op, and are the unit tests'
//!
//! One idea per file: [`rows`] (the row kernels), [`ops`] (the candle custom ops),
//! [`gemm`] (the per-head GEMM formulation) and [`softmax_rows`] (its vectorized
//! softmax rows); this file holds the entry points and the geometry they share.

mod gemm;
mod ops;
mod rows;
mod softmax_rows;

pub(crate) use gemm::{qkv_backward_f32, qkv_forward_f32};
pub use ops::{
    causal_attention, causal_attention_qkv, CausalAttention, CausalAttentionBackward,
    CausalAttentionQkv, CausalAttentionQkvBackward,
};

/// Where one head's rows live in a flat buffer: row `i` of head `(b, h)` starts at
/// `off + b * batch + h * head + i * row`.

#[derive(Debug, Clone, Copy)]
pub(crate) struct Rows {
    off: usize,
    batch: usize,
    head: usize,
    row: usize,
}

impl Rows {
    /// `[B, H, T, D]`, contiguous.
    fn bhtd(h: usize, t: usize, d: usize) -> Self {
        Rows {
            off: 0,
            batch: h * t * d,
            head: t * d,
            row: d,
        }
    }

    /// Part `part` (0 = q, 1 = k, 2 = v; 0 for a `[B, T, C]` output) of a
    /// `[B, T, parts * H * D]` buffer.
    fn packed(parts: usize, part: usize, h: usize, t: usize, d: usize) -> Self {
        Rows {
            off: part * h * d,
            batch: t * parts * h * d,
            head: d,
            row: parts * h * d,
        }
    }

    #[inline(always)]
    fn start(&self, heads: usize, bh: usize, i: usize) -> usize {
        self.off + (bh / heads) * self.batch + (bh % heads) * self.head + i * self.row
    }
}

/// Attention's geometry: `heads` per batch element, `bh` heads in all, `t` rows of `d`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dims {
    heads: usize,
    bh: usize,
    t: usize,
    d: usize,
}

/// A raw output pointer shared by the head tasks, each of which writes only its own
/// head's rows (disjoint by construction of [`Rows`]).
#[derive(Clone, Copy)]
pub(crate) struct Out<T>(pub(crate) *mut T);
// SAFETY: only used for disjoint writes from parallel tasks, see `fwd` and `bwd`.
unsafe impl<T: Send> Send for Out<T> {}
unsafe impl<T: Send> Sync for Out<T> {}

impl<T> Out<T> {
    /// The element `i` places past the start (a method, so closures capture the whole
    /// `Out`, which is `Sync`, rather than its raw pointer field).
    ///
    /// # Safety
    /// `i` must be inside the buffer.
    unsafe fn at(&self, i: usize) -> *mut T {
        self.0.add(i)
    }
}

/// Deterministic values in [-0.5, 0.5) for the attention unit tests.
#[cfg(test)]
fn test_values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8) as f32
                / (1 << 24) as f32
                - 0.5
        })
        .collect()
}
