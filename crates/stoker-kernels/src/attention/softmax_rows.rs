//! The GEMM formulation's row passes: the causal softmax of a score matrix and its
//! gradient, compiled for AVX-512 / AVX2 and dispatched at run time.

use crate::fastmath::{exp, max_map, simd_dispatch, sum_map, sum_map2};

simd_dispatch!(
    /// The causal softmax of each row `i` of the `t x t` scores `s` in place (keys past `i`
    /// set to 0), with each row's log-sum-exp into `lse`.
    pub(super) fn softmax_rows<>(s: &mut [f32], t: usize, lse: &mut [f32]) => softmax_rows_any
);

#[inline(always)]
fn softmax_rows_any(s: &mut [f32], t: usize, lse: &mut [f32]) {
    for (i, (row, lse)) in s.chunks_exact_mut(t).zip(lse).enumerate() {
        let (live, masked) = row.split_at_mut(i + 1);
        let m = max_map(live, |x| x);
        live.iter_mut().for_each(|x| *x = exp(*x - m));
        let z = sum_map(live, |x| x);
        let inv = 1.0 / z;
        live.iter_mut().for_each(|x| *x *= inv);
        masked.fill(0.0);
        *lse = m + z.ln();
    }
}

simd_dispatch!(
    /// Scores to probabilities `p = exp(s - lse)` (0 past the diagonal) in `p`, and `dp`
    /// (the probabilities' gradient) to the scores' gradient `p (dp - D)` with
    /// `D_i = dO_i . O_i`; `head = (o, dout, row, d)`: one head's output and its gradient,
    /// rows `row` apart.
    pub(super) fn softmax_grad_rows<>(
        p: &mut [f32],
        dp: &mut [f32],
        head: (&[f32], &[f32], usize, usize),
        t: usize,
        lse: &[f32],
    ) => softmax_grad_rows_any
);

#[inline(always)]
fn softmax_grad_rows_any(
    p: &mut [f32],
    dp: &mut [f32],
    (o, dout, row, d): (&[f32], &[f32], usize, usize),
    t: usize,
    lse: &[f32],
) {
    let rows = p.chunks_exact_mut(t).zip(dp.chunks_exact_mut(t));
    for (i, ((p, dp), &lse)) in rows.zip(lse).enumerate() {
        let di = sum_map2(
            &o[i * row..i * row + d],
            &dout[i * row..i * row + d],
            |a, b| a * b,
        );
        let (live, masked) = p.split_at_mut(i + 1);
        live.iter_mut().for_each(|x| *x = exp(*x - lse));
        masked.fill(0.0);
        dp.iter_mut()
            .zip(&*p)
            .for_each(|(g, &p)| *g = p * (*g - di));
    }
}
