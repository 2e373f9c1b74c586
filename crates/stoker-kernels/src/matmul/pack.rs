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
use crate::fastmath::{simd_dispatch, Simd};

/// Rows of `A` per block (two AMX tiles of 16 rows).
pub(crate) const ROW_BLOCK: usize = 32;
/// Words (inner pairs) per AMX tile row.
pub(crate) const PAIR_BLOCK: usize = 16;
/// Columns per packed `B` panel (one 16-lane vector, one AMX tile row).
pub(crate) const PANEL: usize = 16;

/// Packed `A`: `rows` (padded) x `pairs` (padded) words.
pub(crate) struct PackedA<'w> {
    pub(crate) words: &'w [u32],
    pub(crate) pairs: usize,
}

/// Packed `B`: `panels` x `pairs` x [`PANEL`] words.
pub(crate) struct PackedB<'w> {
    pub(crate) words: &'w [u32],
    pub(crate) pairs: usize,
    pub(crate) panels: usize,
}

/// Words of packed `A` for an `m x k` operand.
pub(crate) fn a_words(m: usize, k: usize) -> usize {
    m.div_ceil(ROW_BLOCK) * ROW_BLOCK * padded_pairs(k)
}

/// Panels of packed `B` for `n` columns (an even count: the kernels take two at a time).
fn b_panels(n: usize) -> usize {
    n.div_ceil(2 * PANEL) * 2
}

/// Words of packed `B` for a `k x n` operand.
pub(crate) fn b_words(k: usize, n: usize) -> usize {
    b_panels(n) * padded_pairs(k) * PANEL
}

/// Inner pairs of a `k`-long inner dimension, padded for AMX tiles.
pub(crate) fn padded_pairs(k: usize) -> usize {
    k.div_ceil(2).div_ceil(PAIR_BLOCK) * PAIR_BLOCK
}

#[inline(always)]
fn word(lo: u16, hi: u16) -> u32 {
    lo as u32 | (hi as u32) << 16
}

/// Packs `a` into the first [`a_words`] words of `out` (which must hold them).
pub(crate) fn pack_a<'w, S: Bf16Source>(a: &MatRef<S>, out: &'w mut [u32]) -> PackedA<'w> {
    let (m, k) = (a.rows, a.cols);
    let pairs = padded_pairs(k);
    let words = &mut out[..a_words(m, k)];
    // Padding reads as zero, whatever the buffer held before: each block is cleared by
    // the thread that fills it (the blocks cover `words` exactly).
    words
        .par_chunks_mut(pairs * ROW_BLOCK)
        .enumerate()
        .for_each(|(blk, out)| {
            out.fill(0);
            pack_a_simd(a, pairs, blk, out)
        });
    PackedA { words, pairs }
}

simd_dispatch!(
    /// [`pack_a_block`] at the CPU's vector level.
    fn pack_a_simd<S: Bf16Source>(a: &MatRef<S>, pairs: usize, blk: usize, out: &mut [u32]) => pack_a_block
);

/// Packs rows `blk * ROW_BLOCK ..` of `A` into `out` (one block of rows of `pairs` words).
#[inline(always)]
fn pack_a_block<S: Bf16Source>(a: &MatRef<S>, pairs: usize, blk: usize, out: &mut [u32]) {
    pack_a_rows(a, pairs, blk, out, Simd::detect() == Simd::Avx512)
}

/// [`pack_a_block`]; with `tiles` (the CPU has AVX-512F), a transposed f32 `A` goes
/// through 16 x 16 register tiles, otherwise element by element.
#[inline(always)]
fn pack_a_rows<S: Bf16Source>(
    a: &MatRef<S>,
    pairs: usize,
    blk: usize,
    out: &mut [u32],
    tiles: bool,
) {
    let (m, k) = (a.rows, a.cols);
    let src = a.data;
    let (i0, n) = (
        blk * ROW_BLOCK,
        ROW_BLOCK.min(m.saturating_sub(blk * ROW_BLOCK)),
    );
    if a.transposed {
        // A stored k x m: element (i, j) at j * m + i. Pair p's two source rows hold the
        // block's rows contiguously; each goes to a different output row (a transpose).
        // Whole 16 x 16 tiles of (rows, pairs) go through registers; the rest one by one.
        let (mut rows_tiled, mut pairs_tiled) = (0, 0);
        #[cfg(not(target_arch = "x86_64"))]
        let _ = tiles;
        #[cfg(target_arch = "x86_64")]
        if let (true, Some(f)) = (tiles, S::as_f32(src)) {
            (rows_tiled, pairs_tiled) = (n / 16 * 16, k / 2 / 16 * 16);
            for r0 in (0..rows_tiled).step_by(16) {
                for p0 in (0..pairs_tiled).step_by(16) {
                    // SAFETY: `tiles`: the CPU has AVX-512F; the tile's source rows 2 p0 ..
                    // 2 p0 + 32 < k and columns i0 + r0 .. + 16 <= m, and its output rows
                    // r0 .. r0 + 16 < n, words p0 .. p0 + 16 <= pairs, are in bounds.
                    unsafe {
                        transpose_tile_avx512(f, m, i0 + r0, p0, &mut out[r0 * pairs..], pairs)
                    };
                }
            }
        }
        for p in 0..k.div_ceil(2) {
            let r_from = if p < pairs_tiled { rows_tiled } else { 0 };
            let lo = &src[2 * p * m + i0..2 * p * m + i0 + n];
            let hi = (2 * p + 1 < k).then(|| &src[(2 * p + 1) * m + i0..(2 * p + 1) * m + i0 + n]);
            for r in r_from..n {
                let h = hi.map_or(0, |h| h[r].bf16_bits());
                out[r * pairs + p] = word(lo[r].bf16_bits(), h);
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

/// Packs `b` into the first [`b_words`] words of `out` (which must hold them).
pub(crate) fn pack_b<'w, S: Bf16Source>(b: &MatRef<S>, out: &'w mut [u32]) -> PackedB<'w> {
    let (k, n) = (b.rows, b.cols);
    let pairs = padded_pairs(k);
    let panels = b_panels(n);
    let words = &mut out[..b_words(k, n)];
    // As for `A`: each panel cleared by the thread that fills it.
    words
        .par_chunks_mut(pairs * PANEL)
        .enumerate()
        .for_each(|(q, panel)| {
            panel.fill(0);
            pack_b_simd(b, q, panel)
        });
    PackedB {
        words,
        pairs,
        panels,
    }
}

simd_dispatch!(
    /// [`pack_b_panel`] at the CPU's vector level.
    fn pack_b_simd<S: Bf16Source>(b: &MatRef<S>, q: usize, panel: &mut [u32]) => pack_b_panel
);

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

/// One 16 x 16 tile of a transposed f32 `A` (stored `k x m`): for pairs `p0 .. p0 + 16`
/// and rows `i .. i + 16`, rounds both source rows of each pair to bf16 (nearest even,
/// NaN quieted, as [`crate::fastmath::to_bf16`]), joins them into words, and transposes
/// the 16 x 16 words in registers so each output row `r` (at `out[r * pairs + p0 ..]`)
/// is one store.
///
/// # Safety
/// The CPU must have AVX-512F; `src` must hold rows `2 p0 .. 2 p0 + 32` of `m` columns
/// with `i + 16 <= m`, and `out` 16 rows of `pairs >= p0 + 16` words.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn transpose_tile_avx512(
    src: &[f32],
    m: usize,
    i: usize,
    p0: usize,
    out: &mut [u32],
    pairs: usize,
) {
    use std::arch::x86_64::*;
    // Checked: a wrapped offset could pass a plain comparison.
    let src_end = p0
        .checked_mul(2)
        .and_then(|r| r.checked_add(31))
        .and_then(|r| r.checked_mul(m))
        .and_then(|o| o.checked_add(i))
        .and_then(|o| o.checked_add(16));
    let out_end = pairs
        .checked_mul(15)
        .and_then(|o| o.checked_add(p0))
        .and_then(|o| o.checked_add(16));
    assert!(i.checked_add(16).is_some_and(|e| e <= m) && src_end.is_some_and(|e| e <= src.len()));
    assert!(out_end.is_some_and(|e| e <= out.len()));
    let bits = |row: usize| -> __m512i {
        let x = _mm512_castps_si512(_mm512_loadu_ps(src.as_ptr().add(row * m + i)));
        let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(x), _mm512_set1_epi32(1));
        let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(
            x,
            _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb),
        ));
        let quiet = _mm512_or_si512(_mm512_srli_epi32::<16>(x), _mm512_set1_epi32(0x40));
        let abs = _mm512_and_si512(x, _mm512_set1_epi32(0x7FFF_FFFF));
        let nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7F80_0000));
        _mm512_mask_blend_epi32(nan, rounded, quiet)
    };
    let mut r = [_mm512_setzero_si512(); 16];
    for (j, w) in r.iter_mut().enumerate() {
        let p = p0 + j;
        *w = _mm512_or_si512(bits(2 * p), _mm512_slli_epi32::<16>(bits(2 * p + 1)));
    }
    // 16 x 16 transpose of 32-bit words: within 128-bit lanes, then across them.
    let mut t = [_mm512_setzero_si512(); 16];
    for q in 0..8 {
        t[2 * q] = _mm512_unpacklo_epi32(r[2 * q], r[2 * q + 1]);
        t[2 * q + 1] = _mm512_unpackhi_epi32(r[2 * q], r[2 * q + 1]);
    }
    let mut u = [_mm512_setzero_si512(); 16];
    for q in 0..4 {
        u[4 * q] = _mm512_unpacklo_epi64(t[4 * q], t[4 * q + 2]);
        u[4 * q + 1] = _mm512_unpackhi_epi64(t[4 * q], t[4 * q + 2]);
        u[4 * q + 2] = _mm512_unpacklo_epi64(t[4 * q + 1], t[4 * q + 3]);
        u[4 * q + 3] = _mm512_unpackhi_epi64(t[4 * q + 1], t[4 * q + 3]);
    }
    let mut x = [_mm512_setzero_si512(); 16];
    for kk in 0..4 {
        x[kk] = _mm512_shuffle_i32x4::<0x88>(u[kk], u[4 + kk]);
        x[kk + 4] = _mm512_shuffle_i32x4::<0xDD>(u[kk], u[4 + kk]);
        x[kk + 8] = _mm512_shuffle_i32x4::<0x88>(u[8 + kk], u[12 + kk]);
        x[kk + 12] = _mm512_shuffle_i32x4::<0xDD>(u[8 + kk], u[12 + kk]);
    }
    let mut store = |row: usize, v: __m512i| {
        _mm512_storeu_si512(out.as_mut_ptr().add(row * pairs + p0) as *mut __m512i, v)
    };
    for kk in 0..4 {
        store(kk, _mm512_shuffle_i32x4::<0x88>(x[kk], x[kk + 8]));
        store(8 + kk, _mm512_shuffle_i32x4::<0xDD>(x[kk], x[kk + 8]));
        store(4 + kk, _mm512_shuffle_i32x4::<0x88>(x[kk + 4], x[kk + 12]));
        store(12 + kk, _mm512_shuffle_i32x4::<0xDD>(x[kk + 4], x[kk + 12]));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The dispatched packing (AVX-512 tiles for transposed f32 `A` where the CPU has
    /// them) writes exactly the words of the scalar path, over shapes with partial tiles
    /// and odd `k`, and values that round to even, overflow to infinity, are NaN or
    /// subnormal.
    #[test]
    fn vector_packing_equals_scalar_packing() {
        let specials = [
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::from_bits(0x3F80_8000), // a tie: rounds to even
            f32::from_bits(0x3F81_8000), // a tie: rounds up
            f32::MAX,
            1e-40, // subnormal
            -0.0,
        ];
        for (m, k) in [(37, 70), (64, 64), (16, 32), (33, 31), (100, 129), (5, 3)] {
            let data: Vec<f32> = (0..m * k)
                .map(|i| match i % 41 {
                    j if j < specials.len() => specials[j],
                    _ => ((i * 7919 % 1000) as f32 - 500.0) / 37.0,
                })
                .collect();
            for transposed in [true, false] {
                let a = if transposed {
                    MatRef::transposed(&data, m, k)
                } else {
                    MatRef::new(&data, m, k)
                };
                let mut out = vec![u32::MAX; a_words(m, k)];
                let packed = pack_a(&a, &mut out);
                let pairs = padded_pairs(k);
                let rows = m.div_ceil(ROW_BLOCK) * ROW_BLOCK;
                let mut scalar = vec![0u32; rows * pairs];
                for (blk, out) in scalar.chunks_mut(pairs * ROW_BLOCK).enumerate() {
                    pack_a_rows(&a, pairs, blk, out, false);
                }
                assert!(
                    packed.words == scalar,
                    "m {m} k {k} transposed {transposed}: vector and scalar packing differ"
                );
            }
        }
    }
}
