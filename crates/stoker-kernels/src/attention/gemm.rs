//! The per-head GEMM formulation of packed-QKV attention in f32 (the direct GPT step and
//! the packed op): `S = Q K^T / sqrt(d)` over a `T x T` scratch, causal softmax in place,
//! `O = P V`, and five GEMMs back.

use rayon::prelude::*;

use super::softmax_rows::{softmax_grad_rows, softmax_rows};
use super::Out;
use crate::linear::gemm_strided;

/// The geometry of packed-QKV attention on f32 slices (`[b, t, 3 c]` in, `[b, t, c]`
/// out, `heads` heads of `d`), shared by the GEMM forward and backward.
#[derive(Debug, Clone, Copy)]
struct PackedHeads {
    t: usize,
    c: usize,
    d: usize,
    heads: usize,
    scale: f32,
}

impl PackedHeads {
    /// None for an empty batch (nothing to compute).
    fn new(qkv_len: usize, (b, t, heads): (usize, usize, usize)) -> Option<Self> {
        // Checked: the head tasks write at offsets from these sizes, so a wrapped product
        // must not pass the shape check.
        let rows3 = 3usize
            .checked_mul(b)
            .and_then(|x| x.checked_mul(t))
            .expect("attention: 3 x b x t overflows");
        if rows3 == 0 {
            return None;
        }
        let c = qkv_len / rows3;
        assert!(heads > 0, "attention: no heads");
        let d = c / heads;
        assert!(
            d * heads == c && rows3.checked_mul(c) == Some(qkv_len),
            "attention: qkv is not [b, t, 3 c]"
        );
        Some(PackedHeads {
            t,
            c,
            d,
            heads,
            scale: 1.0 / (d as f32).sqrt(),
        })
    }

    /// Where head `bh`'s `q` columns start in `qkv`, and its columns in the output.
    fn bases(&self, bh: usize) -> (usize, usize) {
        let (bi, h) = (bh / self.heads, bh % self.heads);
        (
            bi * self.t * 3 * self.c + h * self.d,
            bi * self.t * self.c + h * self.d,
        )
    }

    /// `s = Q K^T / sqrt(d)` (`t x t`) for the head whose `q` starts at `base`.
    fn scores(&self, qkv: &[f32], base: usize, s: &mut [f32]) {
        let (t, c, d) = (self.t, self.c, self.d);
        assert_eq!(s.len(), t * t);
        let (q, k) = (&qkv[base..], &qkv[base + c..]);
        // SAFETY: `s` is a t x t buffer this call owns; A and B are bounds-checked inside.
        unsafe {
            gemm_strided(
                (t, d, t),
                q,
                (3 * c, 1),
                k,
                (1, 3 * c),
                (s.as_mut_ptr(), t),
                None,
                self.scale,
                gemm::Parallelism::None,
            )
        }
    }
}

/// Packed-QKV attention forward on f32 slices: `qkv` `[b, t, 3 c]` to `out` `[b, t, c]`,
/// with each row's log-sum-exp into `lse` (`[b heads, t]`), which backward reads.
///
/// Per head as GEMMs (the direct GPT step and the packed op in f32; the row kernels
/// above serve bf16 and the `[B, H, T, D]` op): `S = Q K^T / sqrt(d)`, the causal
/// softmax of `S` in place, `O = P V`.
/// The GEMMs also multiply the masked zeros, but at this size a GEMM's throughput beats
/// skipping them row by row several times over.
pub(crate) fn qkv_forward_f32(
    qkv: &[f32],
    dims: (usize, usize, usize),
    out: &mut [f32],
    lse: &mut [f32],
) {
    let Some(g) = PackedHeads::new(qkv.len(), dims) else {
        return; // an empty batch: nothing to write
    };
    let (t, c, d) = (g.t, g.c, g.d);
    assert!(out.len() * 3 == qkv.len() && lse.len() * c == out.len() * g.heads);
    let optr = Out(out.as_mut_ptr());
    lse.par_chunks_mut(t).enumerate().for_each_init(
        || vec![0f32; t * t],
        |s, (bh, lse)| {
            let (base, ob) = g.bases(bh);
            g.scores(qkv, base, s);
            softmax_rows(s, t, lse);
            // SAFETY: this task writes rows bi t .. (bi + 1) t, columns h d .. (h + 1) d
            // of `out` (row stride c), bh = bi heads + h: inside `out` since out.len() =
            // b t c (asserted above) and heads d = c (PackedHeads::new asserts it), and
            // apart from every other task's, which differ in bi (rows) or h (columns).
            unsafe {
                let v = &qkv[base + 2 * c..];
                let o = (optr.at(ob), c);
                gemm_strided(
                    (t, t, d),
                    s,
                    (t, 1),
                    v,
                    (3 * c, 1),
                    o,
                    None,
                    1.0,
                    gemm::Parallelism::None,
                );
            }
        },
    );
}

/// Packed-QKV attention backward on f32 slices: from the forward's `qkv`, output `o`,
/// its gradient `dout` and `lse`, writes the whole of `dqkv` (`[b, t, 3 c]`). Per head as
/// GEMMs: `P` recomputed from `S` and `lse`, `dV = P^T dO`, `dP = dO V^T`,
/// `dS = P (dP - rowsum(dO O))`, `dQ = dS K / sqrt(d)`, `dK = dS^T Q / sqrt(d)`.
pub(crate) fn qkv_backward_f32(
    qkv: &[f32],
    (o, dout, lse): (&[f32], &[f32], &[f32]),
    dims: (usize, usize, usize),
    dqkv: &mut [f32],
) {
    let Some(g) = PackedHeads::new(qkv.len(), dims) else {
        return; // an empty batch: nothing to write
    };
    let (t, c, d, scale) = (g.t, g.c, g.d, g.scale);
    assert!(
        o.len() * 3 == qkv.len() && dout.len() == o.len() && lse.len() * c == o.len() * g.heads
    );
    assert!(dqkv.len() == qkv.len());
    let gptr = Out(dqkv.as_mut_ptr());
    let none = gemm::Parallelism::None;
    (0..lse.len() / t).into_par_iter().for_each_init(
        || vec![0f32; 2 * t * t],
        |buf, bh| {
            let (p, dp) = buf.split_at_mut(t * t);
            let (base, ob) = g.bases(bh);
            let (q, k, v) = (&qkv[base..], &qkv[base + c..], &qkv[base + 2 * c..]);
            let (oh, gh) = (&o[ob..], &dout[ob..]);
            let lse = &lse[bh * t..(bh + 1) * t];
            g.scores(qkv, base, p);
            // SAFETY: `dp` is t x t; this task writes rows bi t .. (bi + 1) t, columns
            // part c + h d .. part c + (h + 1) d (part 0, 1, 2 for q, k, v) of `dqkv` (row
            // stride 3 c), bh = bi heads + h: inside it since dqkv.len() = 3 b t c
            // (asserted above) and heads d = c (PackedHeads::new), and apart from every
            // other task's (another bi: other rows; another h: other columns) and from its
            // own other parts (columns c apart, d <= c wide).
            unsafe {
                gemm_strided(
                    (t, d, t),
                    gh,
                    (c, 1),
                    v,
                    (1, 3 * c),
                    (dp.as_mut_ptr(), t),
                    None,
                    1.0,
                    none,
                );
                softmax_grad_rows(p, dp, (oh, gh, c, d), t, lse);
                let (dq, dk, dv) = (gptr.at(base), gptr.at(base + c), gptr.at(base + 2 * c));
                gemm_strided(
                    (t, t, d),
                    p,
                    (1, t),
                    gh,
                    (c, 1),
                    (dv, 3 * c),
                    None,
                    1.0,
                    none,
                );
                gemm_strided(
                    (t, t, d),
                    dp,
                    (t, 1),
                    k,
                    (3 * c, 1),
                    (dq, 3 * c),
                    None,
                    scale,
                    none,
                );
                gemm_strided(
                    (t, t, d),
                    dp,
                    (1, t),
                    q,
                    (3 * c, 1),
                    (dk, 3 * c),
                    None,
                    scale,
                    none,
                );
            }
        },
    );
}

#[cfg(test)]
mod tests {
    use super::super::ops::CausalAttentionQkv;
    use super::super::rows::{bwd, fwd, Saved};
    use super::super::Dims;
    use super::*;
    use stoker_testkit::assert_close;

    use super::super::test_values as vals;

    /// The direct step's GEMM formulation equals the row kernels (which the candle op
    /// runs and the composed reference checks), forward and backward, over one position,
    /// odd head widths and lengths that are not multiples of a vector.
    #[test]
    fn gemm_formulation_matches_row_kernels() {
        for (b, t, heads, d) in [(1, 1, 1, 3), (2, 17, 3, 5), (1, 40, 2, 16), (3, 7, 4, 8)] {
            let c = heads * d;
            let qkv = vals(b * t * 3 * c, 1);
            let g = Dims {
                heads,
                bh: b * heads,
                t,
                d,
            };
            let (ins, o_rows) = CausalAttentionQkv::layouts(g);
            let x = &qkv[..];
            let (o_ref, lse_ref) = fwd((x, x, x), ins, o_rows, g, b * t * c);
            let (mut o, mut lse) = (vec![0.0; b * t * c], vec![0.0; b * heads * t]);
            qkv_forward_f32(&qkv, (b, t, heads), &mut o, &mut lse);
            let shape = format!("b {b} t {t} heads {heads} d {d}");
            assert_close(&o, &o_ref, 1e-5, &format!("out, {shape}"));
            assert_close(&lse, &lse_ref, 1e-5, &format!("lse, {shape}"));
            let dout = vals(b * t * c, 2);
            let saved = Saved {
                o: &o_ref,
                dout: &dout,
                o_rows,
                lse: &lse_ref,
            };
            let d_ref = bwd((x, x, x), ins, ins, &saved, g, 3 * b * t * c);
            let mut dqkv = vec![f32::NAN; 3 * b * t * c];
            qkv_backward_f32(&qkv, (&o_ref, &dout, &lse_ref), (b, t, heads), &mut dqkv);
            assert_close(&dqkv, &d_ref, 1e-5, &format!("dqkv, {shape}"));
        }
    }
}
