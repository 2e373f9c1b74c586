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
use crate::fastmath::Simd;

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
    let simd = Simd::detect();
    words
        .par_chunks_mut(pairs * ROW_BLOCK)
        .enumerate()
        .for_each(|(blk, out)| match simd {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Simd::detect` found AVX-512F (with AVX2 and FMA) on this CPU.
            Simd::Avx512 => unsafe { pack_a_block_avx512(a, pairs, blk, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Simd::detect` found AVX2 and FMA on this CPU.
            Simd::Avx2 => unsafe { pack_a_block_avx2(a, pairs, blk, out) },
            _ => pack_a_block(a, pairs, blk, out),
        });
    PackedA { words, pairs }
}

/// Packs rows `blk * ROW_BLOCK ..` of `A` into `out` (one block of rows of `pairs` words).
#[inline(always)]
fn pack_a_block<S: Bf16Source>(a: &MatRef<S>, pairs: usize, blk: usize, out: &mut [u32]) {
    let (m, k) = (a.rows, a.cols);
    let src = a.data;
    let (i0, n) = (
        blk * ROW_BLOCK,
        ROW_BLOCK.min(m.saturating_sub(blk * ROW_BLOCK)),
    );
    if a.transposed {
        // A stored k x m: element (i, j) at j * m + i. Pair by pair, the block's rows are
        // contiguous in the source; the writes stay inside this block.
        for p in 0..k.div_ceil(2) {
            let lo = &src[2 * p * m + i0..2 * p * m + i0 + n];
            let hi = (2 * p + 1 < k).then(|| &src[(2 * p + 1) * m + i0..(2 * p + 1) * m + i0 + n]);
            match hi {
                Some(hi) => {
                    for (r, (l, h)) in lo.iter().zip(hi).enumerate() {
                        out[r * pairs + p] = word(l.bf16_bits(), h.bf16_bits());
                    }
                }
                None => {
                    for (r, l) in lo.iter().enumerate() {
                        out[r * pairs + p] = word(l.bf16_bits(), 0);
                    }
                }
            }
        }
        return;
    }
    for r in 0..n {
        let i = i0 + r;
        pack_pairs(
            &src[i * k..(i + 1) * k],
            &mut out[r * pairs..r * pairs + k.div_ceil(2)],
        );
    }
}

/// Consecutive pairs of `s` into words (the last one alone, high half zero, if `s` is odd).
#[inline(always)]
fn pack_pairs<S: Bf16Source>(s: &[S], row: &mut [u32]) {
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

/// [`pack_a_block`] compiled for AVX-512 (the crate's baseline is SSE2).
///
/// # Safety
/// The CPU must have AVX-512F, AVX-512VL, AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
unsafe fn pack_a_block_avx512<S: Bf16Source>(
    a: &MatRef<S>,
    pairs: usize,
    blk: usize,
    out: &mut [u32],
) {
    pack_a_block(a, pairs, blk, out)
}

/// [`pack_a_block`] compiled for AVX2 + FMA.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn pack_a_block_avx2<S: Bf16Source>(
    a: &MatRef<S>,
    pairs: usize,
    blk: usize,
    out: &mut [u32],
) {
    pack_a_block(a, pairs, blk, out)
}

pub(crate) fn pack_b<S: Bf16Source>(b: &MatRef<S>) -> PackedB {
    let (k, n) = (b.rows, b.cols);
    let pairs = padded_pairs(k);
    let panels = n.div_ceil(2 * PANEL) * 2;
    let mut words = vec![0u32; panels * pairs * PANEL];
    let simd = Simd::detect();
    words
        .par_chunks_mut(pairs * PANEL)
        .enumerate()
        .for_each(|(q, panel)| match simd {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Simd::detect` found AVX-512F (with AVX2 and FMA) on this CPU.
            Simd::Avx512 => unsafe { pack_b_panel_avx512(b, q, panel) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Simd::detect` found AVX2 and FMA on this CPU.
            Simd::Avx2 => unsafe { pack_b_panel_avx2(b, q, panel) },
            _ => pack_b_panel(b, q, panel),
        });
    PackedB {
        words,
        pairs,
        panels,
    }
}

/// Packs panel `q` (columns `q * PANEL ..`) of `B` into `panel`.
#[inline(always)]
fn pack_b_panel<S: Bf16Source>(b: &MatRef<S>, q: usize, panel: &mut [u32]) {
    let (k, n) = (b.rows, b.cols);
    let src = b.data;
    let c0 = q * PANEL;
    let cols = PANEL.min(n.saturating_sub(c0));
    if cols == 0 {
        return; // the zero panel that makes the count even
    }
    if b.transposed {
        // B stored n x k: column c of B is row c of the storage, contiguous. Column by
        // column, its pairs go down the panel PANEL words apart (inside L1).
        let mut col = [0u32; PANEL_PAIRS_MAX];
        for c in 0..cols {
            let s = &src[(c0 + c) * k..(c0 + c + 1) * k];
            for chunk in 0..k.div_ceil(2).div_ceil(PANEL_PAIRS_MAX) {
                let (p0, p1) = (
                    chunk * PANEL_PAIRS_MAX,
                    ((chunk + 1) * PANEL_PAIRS_MAX).min(k.div_ceil(2)),
                );
                let part = &s[2 * p0..(2 * p1).min(k)];
                pack_pairs(part, &mut col[..p1 - p0]);
                for (p, &w) in (p0..p1).zip(&col[..p1 - p0]) {
                    panel[p * PANEL + c] = w;
                }
            }
        }
        return;
    }
    for p in 0..k.div_ceil(2) {
        let out = &mut panel[p * PANEL..p * PANEL + cols];
        let (r0, r1) = (2 * p, 2 * p + 1);
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

/// Pairs converted per step when packing a transposed `B` column.
const PANEL_PAIRS_MAX: usize = 256;

/// [`pack_b_panel`] compiled for AVX-512.
///
/// # Safety
/// The CPU must have AVX-512F, AVX-512VL, AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
unsafe fn pack_b_panel_avx512<S: Bf16Source>(b: &MatRef<S>, q: usize, panel: &mut [u32]) {
    pack_b_panel(b, q, panel)
}

/// [`pack_b_panel`] compiled for AVX2 + FMA.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn pack_b_panel_avx2<S: Bf16Source>(b: &MatRef<S>, q: usize, panel: &mut [u32]) {
    pack_b_panel(b, q, panel)
}
