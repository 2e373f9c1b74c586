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

    /// One past the last element of the layout's rows for `g` (None on overflow).
    fn end(&self, g: Dims) -> Option<usize> {
        let b = g.bh.div_ceil(g.heads.max(1));
        let last = |n: usize, stride: usize| n.saturating_sub(1).checked_mul(stride);
        self.off
            .checked_add(last(b, self.batch)?)?
            .checked_add(last(g.heads, self.head)?)?
            .checked_add(last(g.t, self.row)?)?
            .checked_add(g.d)
    }

    /// `[B, H, T, D]`-like nesting (rows of a head contiguous, heads inside a batch
    /// element), `[B, T, H, D]`-like nesting (heads side by side inside a row), or neither.
    fn nesting(&self, g: Dims) -> Option<Nesting> {
        let (d, t, h) = (g.d, g.t, g.heads);
        let fits =
            |outer: usize, n: usize, inner: usize| n.checked_mul(inner).is_some_and(|x| outer >= x);
        if self.row >= d && fits(self.head, t, self.row) && fits(self.batch, h, self.head) {
            Some(Nesting::HeadRows)
        } else if self.head >= d && fits(self.row, h, self.head) && fits(self.batch, t, self.row) {
            Some(Nesting::RowHeads)
        } else {
            None
        }
    }

    /// Whether the `d`-wide rows of every `(b, h, i)` of `g` in all of `layouts` lie
    /// inside `len` elements and never overlap (so parallel tasks, one per head, may each
    /// write their own rows through a shared pointer). Checked from the strides alone: each
    /// layout nests (see [`Rows::nesting`]); two layouts occupy disjoint spans, or, nested
    /// heads-in-a-row with equal strides, disjoint column bands of each row.
    fn disjoint(layouts: &[Rows], g: Dims, len: usize) -> bool {
        let inside = layouts.iter().all(|r| r.end(g).is_some_and(|e| e <= len));
        let nested = layouts.iter().all(|r| r.nesting(g).is_some());
        if !(inside && nested) {
            return false;
        }
        let apart = |a: &Rows, b: &Rows| {
            let (ea, eb) = (
                a.end(g).unwrap_or(usize::MAX),
                b.end(g).unwrap_or(usize::MAX),
            );
            if ea <= b.off || eb <= a.off {
                return true;
            }
            let band = |r: &Rows| (r.off, r.off + g.heads.saturating_sub(1) * r.head + g.d);
            let same = (a.row, a.batch, a.head) == (b.row, b.batch, b.head);
            let ((a0, a1), (b0, b1)) = (band(a), band(b));
            same && a.nesting(g) == Some(Nesting::RowHeads)
                && a1 <= a.row
                && b1 <= b.row
                && (a1 <= b0 || b1 <= a0)
        };
        layouts
            .iter()
            .enumerate()
            .all(|(i, a)| layouts[i + 1..].iter().all(|b| apart(a, b)))
    }
}

/// How a layout nests its rows (see [`Rows::nesting`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Nesting {
    /// Each head's rows contiguous (`[B, H, T, D]`).
    HeadRows,
    /// The heads side by side inside each row (`[B, T, H, D]`, packed QKV).
    RowHeads,
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
/// head's rows; the functions that write through it check [`Rows::disjoint`] first.
#[derive(Clone, Copy)]
pub(crate) struct Out<T>(pub(crate) *mut T);
// SAFETY: only used for writes to rows that [`Rows::disjoint`] proved apart, one task per
// head (rows::fwd_head, rows::bwd_head), or to the head columns of gemm.rs's tasks.
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every d-wide row of every (b, h, i) of `layouts`, checked the slow way: marked
    /// element by element in a buffer of `len`.
    fn brute(layouts: &[Rows], g: Dims, len: usize) -> bool {
        let mut seen = vec![false; len];
        for r in layouts {
            for bh in 0..g.bh {
                for i in 0..g.t {
                    let s = r.start(g.heads, bh, i);
                    for e in s..s + g.d {
                        match seen.get_mut(e) {
                            Some(x) if !*x => *x = true,
                            _ => return false,
                        }
                    }
                }
            }
        }
        true
    }

    #[test]
    fn disjoint_agrees_with_marking_every_element() {
        let (b, heads, t, d) = (2, 3, 4, 5);
        let g = Dims {
            heads,
            bh: b * heads,
            t,
            d,
        };
        let n = b * heads * t * d;
        let r = Rows::bhtd(heads, t, d);
        let part = |p| Rows::packed(3, p, heads, t, d);
        let shifted = |off| Rows { off, ..r };
        let cases: Vec<(Vec<Rows>, usize)> = vec![
            (vec![r], n),
            (vec![r], n - 1),
            (vec![shifted(0), shifted(n), shifted(2 * n)], 3 * n),
            (vec![shifted(0), shifted(n - 1)], 2 * n),
            (vec![part(0), part(1), part(2)], 3 * n),
            (vec![part(0), part(1), part(1)], 3 * n),
            (vec![Rows::packed(1, 0, heads, t, d)], n),
            (vec![Rows { row: d - 1, ..r }], n),
            (
                vec![Rows {
                    head: d - 1,
                    ..part(0)
                }],
                3 * n,
            ),
        ];
        for (layouts, len) in cases {
            let fast = Rows::disjoint(&layouts, g, len);
            assert_eq!(fast, brute(&layouts, g, len), "{layouts:?} in {len}");
        }
        // Both answers are exercised.
        assert!(Rows::disjoint(&[part(0), part(1), part(2)], g, 3 * n));
        assert!(!Rows::disjoint(&[part(0), part(1), part(1)], g, 3 * n));
    }
}
