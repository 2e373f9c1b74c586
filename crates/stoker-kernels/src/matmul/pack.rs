//! Packing of bf16 operands into the layout every GEMM kernel here reads: pairs of
//! consecutive inner-dimension elements in one 32-bit word (the first in the low half),
//! which is the operand order of both `vdpbf16ps` and AMX's `tdpbf16ps`.
//!
//! - `A` (`m x k`): row-major words, rows padded to a multiple of [`ROW_BLOCK`] and
//!   each row to [`PAIR_BLOCK`] words (an AMX `A` tile row is 16 words).
//! - `B` (`k x n`): panels of [`PANEL`] columns, panel count even; within a panel,
//!   word `(p, c)` holds `B[2p, c]` and `B[2p + 1, c]` (an AMX `B` tile row).
//!
//! Padding is zero, so padded rows, columns and pairs add nothing.

use rayon::prelude::*;

use super::{Bf16Source, MatRef};

/// Rows of `A` per block (two AMX tiles of 16 rows).
pub(crate) const ROW_BLOCK: usize = 32;
/// Words (inner pairs) per AMX tile row.
pub(crate) const PAIR_BLOCK: usize = 16;
/// Columns per packed `B` panel (one 16-lane vector, one AMX tile row).
pub(crate) const PANEL: usize = 16;

/// Packed `A`: `rows` (padded) x `pairs` (padded) words.
pub(crate) struct PackedA {
    pub(crate) words: Vec<u32>,
    pub(crate) pairs: usize,
}

/// Packed `B`: `panels` x `pairs` x [`PANEL`] words.
pub(crate) struct PackedB {
    pub(crate) words: Vec<u32>,
    pub(crate) pairs: usize,
    pub(crate) panels: usize,
}

/// Inner pairs of a `k`-long inner dimension, padded for AMX tiles.
pub(crate) fn padded_pairs(k: usize) -> usize {
    k.div_ceil(2).div_ceil(PAIR_BLOCK) * PAIR_BLOCK
}

#[inline(always)]
fn word(lo: u16, hi: u16) -> u32 {
    lo as u32 | (hi as u32) << 16
}

pub(crate) fn pack_a<S: Bf16Source>(a: &MatRef<S>) -> PackedA {
    let (m, k) = (a.rows, a.cols);
    let pairs = padded_pairs(k);
    let rows = m.div_ceil(ROW_BLOCK) * ROW_BLOCK;
    let mut words = vec![0u32; rows * pairs];
    let src = a.data;
    words
        .par_chunks_mut(pairs * ROW_BLOCK)
        .enumerate()
        .for_each(|(blk, out)| {
            let (i0, n) = (
                blk * ROW_BLOCK,
                ROW_BLOCK.min(m.saturating_sub(blk * ROW_BLOCK)),
            );
            if a.transposed {
                // A stored k x m: element (i, j) at j * m + i. Pair by pair, the block's
                // rows are contiguous in the source; the writes stay inside this block.
                for p in 0..k.div_ceil(2) {
                    let lo = &src[2 * p * m + i0..2 * p * m + i0 + n];
                    let hi = (2 * p + 1 < k)
                        .then(|| &src[(2 * p + 1) * m + i0..(2 * p + 1) * m + i0 + n]);
                    for r in 0..n {
                        let h = hi.map_or(0, |h| h[r].bf16_bits());
                        out[r * pairs + p] = word(lo[r].bf16_bits(), h);
                    }
                }
                return;
            }
            for r in 0..n {
                let i = i0 + r;
                let row = &mut out[r * pairs..r * pairs + k.div_ceil(2)];
                let s = &src[i * k..(i + 1) * k];
                let pairs = s.chunks_exact(2);
                let last = pairs.remainder().first().map(|v| v.bf16_bits());
                let full = pairs.len();
                for (w, pair) in row.iter_mut().zip(pairs) {
                    *w = word(pair[0].bf16_bits(), pair[1].bf16_bits());
                }
                if let Some(lo) = last {
                    row[full] = word(lo, 0);
                }
            }
        });
    PackedA { words, pairs }
}

pub(crate) fn pack_b<S: Bf16Source>(b: &MatRef<S>) -> PackedB {
    let (k, n) = (b.rows, b.cols);
    let pairs = padded_pairs(k);
    let panels = n.div_ceil(2 * PANEL) * 2;
    let mut words = vec![0u32; panels * pairs * PANEL];
    let src = b.data;
    let bits = |i: usize| src[i].bf16_bits();
    words
        .par_chunks_mut(pairs * PANEL)
        .enumerate()
        .for_each(|(q, panel)| {
            let c0 = q * PANEL;
            let cols = PANEL.min(n.saturating_sub(c0));
            if cols == 0 {
                return; // the zero panel that makes the count even
            }
            for p in 0..k.div_ceil(2) {
                let out = &mut panel[p * PANEL..p * PANEL + cols];
                let (r0, r1) = (2 * p, 2 * p + 1);
                if b.transposed {
                    // B stored n x k: element (r, c) at c * k + r.
                    for (c, w) in out.iter_mut().enumerate() {
                        let col = (c0 + c) * k;
                        let hi = if r1 < k { bits(col + r1) } else { 0 };
                        *w = word(bits(col + r0), hi);
                    }
                } else {
                    let lo = &src[r0 * n + c0..r0 * n + c0 + cols];
                    if r1 < k {
                        let hi = &src[r1 * n + c0..r1 * n + c0 + cols];
                        for ((w, l), h) in out.iter_mut().zip(lo).zip(hi) {
                            *w = word(l.bf16_bits(), h.bf16_bits());
                        }
                    } else {
                        for (w, l) in out.iter_mut().zip(lo) {
                            *w = word(l.bf16_bits(), 0);
                        }
                    }
                }
            }
        });
    PackedB {
        words,
        pairs,
        panels,
    }
}
