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
//! reference for the GEMM version.

use std::sync::{Arc, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp3, DType, Layout, Result, Shape, Tensor};
use half::bf16;
use rayon::prelude::*;

use crate::elem::{check_float, floats, Elem, Floats};
use crate::error::{shape_err, KernelError};
use crate::fastmath::{exp, max_map, simd_dispatch, sum_map, sum_map2, Simd};
use crate::linear::gemm_strided;

/// Causal attention `softmax(q k^T / sqrt(D) + causal mask) v` of `q`, `k`, `v`
/// `[B, H, T, D]` (all f32 or all bf16).
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    check_float("causal-attention", q.dtype())?;
    q.contiguous()?.apply_op3(
        &k.contiguous()?,
        &v.contiguous()?,
        CausalAttention {
            lse: OnceLock::new(),
        },
    )
}

/// Causal attention straight from a QKV projection: `qkv` `[B, T, 3 C]` holds `q`, `k`,
/// `v` side by side, each `heads` heads of `C / heads`; returns `[B, T, C]` with the heads
/// side by side again (GPT's layout on both ends). f32 runs the per-head GEMM
/// formulation, bf16 the row kernels.
pub fn causal_attention_qkv(qkv: &Tensor, heads: usize) -> Result<Tensor> {
    check_float("causal-attention-qkv", qkv.dtype())?;
    qkv.contiguous()?.apply_op1(CausalAttentionQkv {
        heads,
        lse: OnceLock::new(),
    })
}

/// Where one head's rows live in a flat buffer: row `i` of head `(b, h)` starts at
/// `off + b * batch + h * head + i * row`.
#[derive(Debug, Clone, Copy)]
struct Rows {
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
struct Dims {
    heads: usize,
    bh: usize,
    t: usize,
    d: usize,
}

/// A raw output pointer shared by the head tasks, each of which writes only its own
/// head's rows (disjoint by construction of [`Rows`]).
#[derive(Clone, Copy)]
struct Out<T>(*mut T);
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

/// Copies head `bh`'s `t` rows of `d` from `src` into `dst` as f32.
fn gather<T: Elem>(src: &[T], rows: Rows, g: Dims, bh: usize, dst: &mut [f32]) {
    for (i, out) in dst.chunks_mut(g.d).enumerate() {
        let s = rows.start(g.heads, bh, i);
        out.iter_mut()
            .zip(&src[s..s + g.d])
            .for_each(|(o, &v)| *o = v.to_f32());
    }
}

/// Keys per vector block: transposed rows are padded to a multiple of this so the loops
/// over keys run whole vectors (padding keys get probability 0).
const KEY_BLOCK: usize = 16;

/// `t` rounded up to whole key blocks: the row width of transposed buffers.
fn padded(t: usize) -> usize {
    t.div_ceil(KEY_BLOCK) * KEY_BLOCK
}

/// Keys `0..=i` rounded up to whole key blocks.
fn keys_upto(i: usize) -> usize {
    (i + 1).div_ceil(KEY_BLOCK) * KEY_BLOCK
}

/// Copies head `bh`'s `t` rows of `d` from `src` into `dst` transposed (`d` rows of
/// [`padded`]`(t)`, padding zero), so that products against every key run over
/// contiguous memory.
fn gather_t<T: Elem>(src: &[T], rows: Rows, g: Dims, bh: usize, dst: &mut [f32]) {
    let tp = padded(g.t);
    for i in 0..g.t {
        let s = rows.start(g.heads, bh, i);
        for (c, &v) in src[s..s + g.d].iter().enumerate() {
            dst[c * tp + i] = v.to_f32();
        }
    }
}

/// The three vector loops attention runs per row, in a portable and an AVX-512 version.
trait RowOps {
    /// `out[j] = scale * sum_c x[c] * mt[c * t + j]`: a row of `x M^T` with `M` stored
    /// transposed (`x.len()` rows of width `t`). `out.len()` is a multiple of [`KEY_BLOCK`].
    fn row_times_t(x: &[f32], mt: &[f32], t: usize, scale: f32, out: &mut [f32]);
    /// `out[c] = sum_j w[j] * m[j * out.len() + c]`: a weighted sum of rows.
    fn weighted_rows(w: &[f32], m: &[f32], out: &mut [f32]);
    /// `y += alpha * x`.
    fn axpy(alpha: f32, x: &[f32], y: &mut [f32]);
}

/// Plain loops (vectorized by the compiler for whatever the build targets).
struct Portable;

impl RowOps for Portable {
    #[inline(always)]
    fn row_times_t(x: &[f32], mt: &[f32], t: usize, scale: f32, out: &mut [f32]) {
        out.fill(0.0);
        let n = out.len();
        for (c, &xc) in x.iter().enumerate() {
            out.iter_mut()
                .zip(&mt[c * t..c * t + n])
                .for_each(|(o, &v)| *o += xc * v);
        }
        out.iter_mut().for_each(|o| *o *= scale);
    }

    #[inline(always)]
    fn weighted_rows(w: &[f32], m: &[f32], out: &mut [f32]) {
        let d = out.len();
        out.fill(0.0);
        for (j, &wj) in w.iter().enumerate() {
            out.iter_mut()
                .zip(&m[j * d..(j + 1) * d])
                .for_each(|(a, &v)| *a += wj * v);
        }
    }

    #[inline(always)]
    fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
        y.iter_mut().zip(x).for_each(|(y, &x)| *y += alpha * x);
    }
}

/// AVX-512 intrinsics with fused multiply-adds; only called from code compiled with
/// `avx512f` enabled, after [`Simd::detect`].
#[cfg(target_arch = "x86_64")]
struct Avx512;

#[cfg(target_arch = "x86_64")]
impl RowOps for Avx512 {
    #[inline(always)]
    fn row_times_t(x: &[f32], mt: &[f32], t: usize, scale: f32, out: &mut [f32]) {
        use std::arch::x86_64::*;
        let n = out.len();
        assert!(n.is_multiple_of(KEY_BLOCK) && (x.is_empty() || (x.len() - 1) * t + n <= mt.len()));
        // SAFETY: the assert bounds every load (rows c < x.len() of width >= n) and store
        // (j < n); the caller runs this only where AVX-512F was detected.
        unsafe {
            let (mp, op) = (mt.as_ptr(), out.as_mut_ptr());
            let sv = _mm512_set1_ps(scale);
            let mut j0 = 0;
            while j0 + 64 <= n {
                let mut a = [_mm512_setzero_ps(); 4];
                for (c, &xc) in x.iter().enumerate() {
                    let xv = _mm512_set1_ps(xc);
                    let row = mp.add(c * t + j0);
                    for (b, a) in a.iter_mut().enumerate() {
                        *a = _mm512_fmadd_ps(xv, _mm512_loadu_ps(row.add(16 * b)), *a);
                    }
                }
                for (b, a) in a.iter().enumerate() {
                    _mm512_storeu_ps(op.add(j0 + 16 * b), _mm512_mul_ps(sv, *a));
                }
                j0 += 64;
            }
            while j0 < n {
                let mut a = _mm512_setzero_ps();
                for (c, &xc) in x.iter().enumerate() {
                    a = _mm512_fmadd_ps(_mm512_set1_ps(xc), _mm512_loadu_ps(mp.add(c * t + j0)), a);
                }
                _mm512_storeu_ps(op.add(j0), _mm512_mul_ps(sv, a));
                j0 += 16;
            }
        }
    }

    #[inline(always)]
    fn weighted_rows(w: &[f32], m: &[f32], out: &mut [f32]) {
        use std::arch::x86_64::*;
        let d = out.len();
        assert!(w.len() * d <= m.len());
        // SAFETY: loads stay inside rows j < w.len() of width d (masked at the tail), the
        // stores inside `out`; the caller runs this only where AVX-512F was detected.
        unsafe {
            let (mp, op) = (m.as_ptr(), out.as_mut_ptr());
            let mut c0 = 0;
            while c0 < d {
                let width = 16.min(d - c0);
                let mask: __mmask16 = if width == 16 {
                    0xFFFF
                } else {
                    (1u32 << width) as u16 - 1
                };
                let (mut a0, mut a1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
                let mut j = 0;
                while j + 1 < w.len() {
                    let r0 = _mm512_maskz_loadu_ps(mask, mp.add(j * d + c0));
                    let r1 = _mm512_maskz_loadu_ps(mask, mp.add((j + 1) * d + c0));
                    a0 = _mm512_fmadd_ps(_mm512_set1_ps(w[j]), r0, a0);
                    a1 = _mm512_fmadd_ps(_mm512_set1_ps(w[j + 1]), r1, a1);
                    j += 2;
                }
                if j < w.len() {
                    let r0 = _mm512_maskz_loadu_ps(mask, mp.add(j * d + c0));
                    a0 = _mm512_fmadd_ps(_mm512_set1_ps(w[j]), r0, a0);
                }
                _mm512_mask_storeu_ps(op.add(c0), mask, _mm512_add_ps(a0, a1));
                c0 += 16;
            }
        }
    }

    #[inline(always)]
    fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
        use std::arch::x86_64::*;
        let n = x.len().min(y.len());
        // SAFETY: masked loads and stores stay below n in both slices; the caller runs
        // this only where AVX-512F was detected.
        unsafe {
            let av = _mm512_set1_ps(alpha);
            let (xp, yp) = (x.as_ptr(), y.as_mut_ptr());
            let mut i = 0;
            while i < n {
                let width = 16.min(n - i);
                let mask: __mmask16 = if width == 16 {
                    0xFFFF
                } else {
                    (1u32 << width) as u16 - 1
                };
                let xv = _mm512_maskz_loadu_ps(mask, xp.add(i));
                let yv = _mm512_maskz_loadu_ps(mask, yp.add(i));
                _mm512_mask_storeu_ps(yp.add(i), mask, _mm512_fmadd_ps(av, xv, yv));
                i += 16;
            }
        }
    }
}

/// Everything one forward head task reads.
struct FwdHead<'a, T> {
    ins: (&'a [T], &'a [T], &'a [T]),
    rows: (Rows, Rows, Rows),
    o_rows: Rows,
    g: Dims,
    len: usize,
    scale: f32,
}

/// Forward of head `bh`: its output rows through `optr`, its log-sum-exps into `lse`.
#[inline(always)]
fn fwd_head<T: Elem, R: RowOps>(a: &FwdHead<T>, bh: usize, lse: &mut [f32], optr: Out<T>) {
    let ((q, k, v), (q_rows, k_rows, v_rows)) = (a.ins, a.rows);
    let (g, o_rows, len, scale) = (a.g, a.o_rows, a.len, a.scale);
    let (t, d) = (g.t, g.d);
    // Scratch per head: q, v widened, k transposed, one row of scores and of output.
    let tp = padded(t);
    let mut buf = vec![0.0f32; 2 * t * d + tp * d + tp + d];
    let (qf, rest) = buf.split_at_mut(t * d);
    let (kt, rest) = rest.split_at_mut(tp * d);
    let (vf, rest) = rest.split_at_mut(t * d);
    let (s, acc) = rest.split_at_mut(tp);
    gather(q, q_rows, g, bh, qf);
    gather_t(k, k_rows, g, bh, kt);
    gather(v, v_rows, g, bh, vf);
    for i in 0..t {
        let s = &mut s[..keys_upto(i)];
        R::row_times_t(&qf[i * d..(i + 1) * d], kt, tp, scale, s);
        s[i + 1..].fill(f32::NEG_INFINITY); // the causal mask
        let m = max_map(s, |x| x);
        s.iter_mut().for_each(|x| *x = exp(*x - m));
        let z = sum_map(s, |x| x);
        R::weighted_rows(&s[..=i], vf, acc);
        let inv = 1.0 / z;
        let o0 = o_rows.start(g.heads, bh, i);
        assert!(o0 + d <= len);
        // SAFETY: in bounds (asserted), and row i of head bh is written by this task only.
        let orow = unsafe { std::slice::from_raw_parts_mut(optr.at(o0), d) };
        orow.iter_mut()
            .zip(&*acc)
            .for_each(|(o, &a)| *o = T::from_f32(a * inv));
        lse[i] = m + z.ln();
    }
}

/// [`fwd_head`] compiled for AVX-512.
///
/// # Safety
/// The CPU must have AVX-512F, AVX-512VL, AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
unsafe fn fwd_head_avx512<T: Elem>(a: &FwdHead<T>, bh: usize, lse: &mut [f32], optr: Out<T>) {
    fwd_head::<T, Avx512>(a, bh, lse, optr)
}

/// [`fwd_head`] compiled for AVX2 + FMA.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fwd_head_avx2<T: Elem>(a: &FwdHead<T>, bh: usize, lse: &mut [f32], optr: Out<T>) {
    fwd_head::<T, Portable>(a, bh, lse, optr)
}

/// Forward: `(q, k, v)` slices with their row layouts; writes the output through `out`
/// (layout `o_rows`, `len` elements) and returns each row's log-sum-exp `[bh, t]`.
fn fwd<T: Elem>(
    (q, k, v): (&[T], &[T], &[T]),
    (q_rows, k_rows, v_rows): (Rows, Rows, Rows),
    o_rows: Rows,
    g: Dims,
    len: usize,
) -> (Vec<T>, Vec<f32>) {
    let mut out = vec![T::from_f32(0.0); len];
    let mut lse = vec![0.0f32; g.bh * g.t];
    let (t, d) = (g.t, g.d);
    let scale = 1.0 / (d as f32).sqrt();
    let optr = Out(out.as_mut_ptr());
    let simd = Simd::detect();
    lse.par_chunks_mut(t).enumerate().for_each(|(bh, lse)| {
        let args = FwdHead {
            ins: (q, k, v),
            rows: (q_rows, k_rows, v_rows),
            o_rows,
            g,
            len,
            scale,
        };
        match simd {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Simd::detect` found AVX-512F (with FMA) on this CPU.
            Simd::Avx512 => unsafe { fwd_head_avx512(&args, bh, lse, optr) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Simd::detect` found AVX2 and FMA on this CPU.
            Simd::Avx2 => unsafe { fwd_head_avx2(&args, bh, lse, optr) },
            _ => fwd_head::<T, Portable>(&args, bh, lse, optr),
        }
    });
    (out, lse)
}

/// What backward reads besides the inputs: the forward output, its gradient (both f32,
/// in the output layout) and the saved log-sum-exp.
struct Saved<'a> {
    o: &'a [f32],
    dout: &'a [f32],
    o_rows: Rows,
    lse: &'a [f32],
}

/// Everything one backward head task reads.
struct BwdHead<'a, T> {
    ins: (&'a [T], &'a [T], &'a [T]),
    rows: (Rows, Rows, Rows),
    grad_rows: (Rows, Rows, Rows),
    saved: &'a Saved<'a>,
    g: Dims,
    len: usize,
    scale: f32,
}

/// Backward of head `bh`: its rows of `dq`, `dk`, `dv` through `optr`.
#[inline(always)]
fn bwd_head<T: Elem, R: RowOps>(a: &BwdHead<T>, bh: usize, optr: Out<T>) {
    let ((q, k, v), (q_rows, k_rows, v_rows)) = (a.ins, a.rows);
    let (dq_rows, dk_rows, dv_rows) = a.grad_rows;
    let (saved, g, len, scale) = (a.saved, a.g, a.len, a.scale);
    let (t, d) = (g.t, g.d);
    // Scratch per head: q, k, O and dO widened; k and v transposed; dk and dv
    // accumulated transposed; rows of probabilities, their gradients and dq.
    let tp = padded(t);
    let mut buf = vec![0.0f32; 4 * t * d + 4 * tp * d + 2 * tp + d];
    let (qf, rest) = buf.split_at_mut(t * d);
    let (kf, rest) = rest.split_at_mut(t * d);
    let (kt, rest) = rest.split_at_mut(tp * d);
    let (vt, rest) = rest.split_at_mut(tp * d);
    let (of, rest) = rest.split_at_mut(t * d);
    let (gof, rest) = rest.split_at_mut(t * d);
    let (dkt, rest) = rest.split_at_mut(tp * d);
    let (dvt, rest) = rest.split_at_mut(tp * d);
    let (p, rest) = rest.split_at_mut(tp);
    let (ds, dqi) = rest.split_at_mut(tp);
    gather(q, q_rows, g, bh, qf);
    gather(k, k_rows, g, bh, kf);
    gather_t(k, k_rows, g, bh, kt);
    gather_t(v, v_rows, g, bh, vt);
    gather(saved.o, saved.o_rows, g, bh, of);
    gather(saved.dout, saved.o_rows, g, bh, gof);
    let lse = &saved.lse[bh * t..(bh + 1) * t];
    let write = |rows: Rows, i: usize, vals: &mut dyn Iterator<Item = f32>| {
        let s = rows.start(g.heads, bh, i);
        assert!(s + d <= len);
        // SAFETY: in bounds (asserted); row i of head bh of this gradient is written
        // by this task only, and the three gradients' rows never overlap.
        let o = unsafe { std::slice::from_raw_parts_mut(optr.at(s), d) };
        o.iter_mut()
            .zip(vals)
            .for_each(|(o, a)| *o = T::from_f32(a));
    };
    for (i, &lse_i) in lse.iter().enumerate() {
        let row = i * d..(i + 1) * d;
        let (qi, goi) = (&qf[row.clone()], &gof[row.clone()]);
        let di = sum_map2(goi, &of[row], |a, b| a * b);
        let n = keys_upto(i);
        let (p, ds) = (&mut p[..n], &mut ds[..n]);
        // p_ij = exp(s_ij - lse_i); dP_ij = dO_i . v_j; ds_ij = p_ij (dP_ij - D_i).
        // Keys past i (the mask, and padding) get p = 0, hence ds = 0.
        R::row_times_t(qi, kt, tp, scale, p);
        p.iter_mut().for_each(|x| *x = exp(*x - lse_i));
        p[i + 1..].fill(0.0);
        R::row_times_t(goi, vt, tp, 1.0, ds);
        ds.iter_mut()
            .zip(&*p)
            .for_each(|(x, &p)| *x = p * (*x - di));
        // dq_i = scale sum_j ds_ij k_j.
        R::weighted_rows(&ds[..=i], kf, dqi);
        write(dq_rows, i, &mut dqi.iter().map(|&a| scale * a));
        // dk_j += scale ds_ij q_i and dv_j += p_ij dO_i, accumulated transposed.
        for c in 0..d {
            let (qc, gc) = (scale * qi[c], goi[c]);
            R::axpy(qc, ds, &mut dkt[c * tp..c * tp + n]);
            R::axpy(gc, p, &mut dvt[c * tp..c * tp + n]);
        }
    }
    for i in 0..t {
        write(dk_rows, i, &mut (0..d).map(|c| dkt[c * tp + i]));
        write(dv_rows, i, &mut (0..d).map(|c| dvt[c * tp + i]));
    }
}

/// [`bwd_head`] compiled for AVX-512.
///
/// # Safety
/// The CPU must have AVX-512F, AVX-512VL, AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
unsafe fn bwd_head_avx512<T: Elem>(a: &BwdHead<T>, bh: usize, optr: Out<T>) {
    bwd_head::<T, Avx512>(a, bh, optr)
}

/// [`bwd_head`] compiled for AVX2 + FMA.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn bwd_head_avx2<T: Elem>(a: &BwdHead<T>, bh: usize, optr: Out<T>) {
    bwd_head::<T, Portable>(a, bh, optr)
}

/// Backward: returns `len` gradient elements, `dq`, `dk`, `dv` written in the layouts
/// `(dq_rows, dk_rows, dv_rows)` of one flat buffer.
fn bwd<T: Elem>(
    (q, k, v): (&[T], &[T], &[T]),
    (q_rows, k_rows, v_rows): (Rows, Rows, Rows),
    (dq_rows, dk_rows, dv_rows): (Rows, Rows, Rows),
    saved: &Saved,
    g: Dims,
    len: usize,
) -> Vec<T> {
    let mut out = vec![T::from_f32(0.0); len];
    let scale = 1.0 / (g.d as f32).sqrt();
    let optr = Out(out.as_mut_ptr());
    let simd = Simd::detect();
    (0..g.bh).into_par_iter().for_each(|bh| {
        let args = BwdHead {
            ins: (q, k, v),
            rows: (q_rows, k_rows, v_rows),
            grad_rows: (dq_rows, dk_rows, dv_rows),
            saved,
            g,
            len,
            scale,
        };
        match simd {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Simd::detect` found AVX-512F (with FMA) on this CPU.
            Simd::Avx512 => unsafe { bwd_head_avx512(&args, bh, optr) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Simd::detect` found AVX2 and FMA on this CPU.
            Simd::Avx2 => unsafe { bwd_head_avx2(&args, bh, optr) },
            _ => bwd_head::<T, Portable>(&args, bh, optr),
        }
    });
    out
}

fn dtype_err(op: &'static str, d: DType) -> candle_core::Error {
    KernelError::DType {
        op,
        dtype: d,
        extra: ", the same for q, k and v",
    }
    .into()
}

fn saved_lse(op: &'static str, lse: &OnceLock<Arc<Vec<f32>>>, s: &Shape) -> Result<Arc<Vec<f32>>> {
    lse.get()
        .cloned()
        .ok_or_else(|| shape_err(op, "backward before forward", s))
}

fn to_f32(t: &Tensor) -> Result<Vec<f32>> {
    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
}

/// The `[B, H, T, D]` forward op; use [`causal_attention`].
#[derive(Debug)]
pub struct CausalAttention {
    lse: OnceLock<Arc<Vec<f32>>>,
}

/// `Dims`, checking that all three shapes are the same `[B, H, T, D]`.
fn dims4(op: &'static str, q: &Shape, k: &Shape, v: &Shape) -> Result<Dims> {
    let (b, h, t, d) = match q.dims() {
        &[b, h, t, d] if t > 0 && d > 0 => (b, h, t, d),
        _ => return Err(shape_err(op, "q must be [B, H, T, D] with T, D > 0", q)),
    };
    for (name, s) in [("k", k), ("v", v)] {
        if s != q {
            return Err(shape_err(
                op,
                format!("{name} must match q {:?}", q.dims()),
                s,
            ));
        }
    }
    Ok(Dims {
        heads: h.max(1),
        bh: b * h,
        t,
        d,
    })
}

impl CustomOp3 for CausalAttention {
    fn name(&self) -> &'static str {
        "causal-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let g = dims4(op, l1.shape(), l2.shape(), l3.shape())?;
        let r = Rows::bhtd(g.heads, g.t, g.d);
        let n = l1.shape().elem_count();
        let (out, lse) = match (
            floats(op, s1, l1)?,
            floats(op, s2, l2)?,
            floats(op, s3, l3)?,
        ) {
            (Floats::F32(q), Floats::F32(k), Floats::F32(v)) => {
                let (o, l) = fwd((q, k, v), (r, r, r), r, g, n);
                (f32::storage(o), l)
            }
            (Floats::BF16(q), Floats::BF16(k), Floats::BF16(v)) => {
                let (o, l) = fwd((q, k, v), (r, r, r), r, g, n);
                (bf16::storage(o), l)
            }
            _ => return Err(dtype_err(op, s2.dtype())),
        };
        let _ = self.lse.set(Arc::new(lse));
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        dout: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let back = CausalAttentionBackward {
            o: to_f32(o)?,
            dout: to_f32(dout)?,
            lse: saved_lse(self.name(), &self.lse, q.shape())?,
        };
        let n = q.elem_count();
        let flat = q.apply_op3_no_bwd(k, v, &back)?;
        let part = |i: usize| flat.narrow(0, i * n, n)?.reshape(q.shape());
        Ok((Some(part(0)?), Some(part(1)?), Some(part(2)?)))
    }
}

/// The backward of [`CausalAttention`] over `(q, k, v)` with the forward's output, its
/// gradient and the saved log-sum-exp. Returns `[dq, dk, dv]` flattened in one buffer.
#[derive(Debug)]
pub struct CausalAttentionBackward {
    o: Vec<f32>,
    dout: Vec<f32>,
    lse: Arc<Vec<f32>>,
}

impl CustomOp3 for CausalAttentionBackward {
    fn name(&self) -> &'static str {
        "causal-attention-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let g = dims4(op, l1.shape(), l2.shape(), l3.shape())?;
        let n = g.bh * g.t * g.d;
        if self.o.len() != n || self.dout.len() != n || self.lse.len() != g.bh * g.t {
            return Err(shape_err(
                op,
                "saved output, its gradient or log-sum-exp do not match q",
                l1.shape(),
            ));
        }
        let r = Rows::bhtd(g.heads, g.t, g.d);
        let grads = |part: usize| Rows { off: part * n, ..r };
        let saved = Saved {
            o: &self.o,
            dout: &self.dout,
            o_rows: r,
            lse: &self.lse,
        };
        let layouts = ((r, r, r), (grads(0), grads(1), grads(2)));
        let out = match (
            floats(op, s1, l1)?,
            floats(op, s2, l2)?,
            floats(op, s3, l3)?,
        ) {
            (Floats::F32(q), Floats::F32(k), Floats::F32(v)) => {
                f32::storage(bwd((q, k, v), layouts.0, layouts.1, &saved, g, 3 * n))
            }
            (Floats::BF16(q), Floats::BF16(k), Floats::BF16(v)) => {
                bf16::storage(bwd((q, k, v), layouts.0, layouts.1, &saved, g, 3 * n))
            }
            _ => return Err(dtype_err(op, s2.dtype())),
        };
        Ok((out, Shape::from(3 * n)))
    }
}

/// The packed-QKV forward op; use [`causal_attention_qkv`].
#[derive(Debug)]
pub struct CausalAttentionQkv {
    heads: usize,
    lse: OnceLock<Arc<Vec<f32>>>,
}

/// `Dims` of a `[B, T, 3 C]` input split into `heads` heads.
fn qkv_dims(op: &'static str, heads: usize, s: &Shape) -> Result<Dims> {
    match s.dims() {
        &[b, t, c3] if t > 0 && heads > 0 && c3 > 0 && c3 % (3 * heads) == 0 => Ok(Dims {
            heads,
            bh: b * heads,
            t,
            d: c3 / (3 * heads),
        }),
        _ => Err(shape_err(
            op,
            format!("qkv must be [B, T, 3 C] with T > 0 and C a multiple of the {heads} heads"),
            s,
        )),
    }
}

impl CausalAttentionQkv {
    fn layouts(g: Dims) -> ((Rows, Rows, Rows), Rows) {
        let part = |p| Rows::packed(3, p, g.heads, g.t, g.d);
        (
            (part(0), part(1), part(2)),
            Rows::packed(1, 0, g.heads, g.t, g.d),
        )
    }
}

impl CustomOp1 for CausalAttentionQkv {
    fn name(&self) -> &'static str {
        "causal-attention-qkv"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let g = qkv_dims(op, self.heads, l.shape())?;
        let (ins, o_rows) = Self::layouts(g);
        let n = g.bh * g.t * g.d;
        let (out, lse) = match floats(op, s, l)? {
            Floats::F32(x) => {
                let (mut o, mut lse) = (vec![0f32; n], vec![0f32; g.bh * g.t]);
                qkv_forward_f32(x, (g.bh / g.heads, g.t, g.heads), &mut o, &mut lse);
                (f32::storage(o), lse)
            }
            Floats::BF16(x) => {
                let (o, l) = fwd((x, x, x), ins, o_rows, g, n);
                (bf16::storage(o), l)
            }
        };
        let _ = self.lse.set(Arc::new(lse));
        let b = g.bh / g.heads;
        Ok((out, Shape::from((b, g.t, g.heads * g.d))))
    }

    fn bwd(&self, qkv: &Tensor, o: &Tensor, dout: &Tensor) -> Result<Option<Tensor>> {
        let back = CausalAttentionQkvBackward {
            heads: self.heads,
            o: to_f32(o)?,
            dout: to_f32(dout)?,
            lse: saved_lse(self.name(), &self.lse, qkv.shape())?,
        };
        Ok(Some(qkv.apply_op1_no_bwd(&back)?))
    }
}

/// The backward of [`CausalAttentionQkv`]: the gradient of the packed `qkv`.
#[derive(Debug)]
pub struct CausalAttentionQkvBackward {
    heads: usize,
    o: Vec<f32>,
    dout: Vec<f32>,
    lse: Arc<Vec<f32>>,
}

impl CustomOp1 for CausalAttentionQkvBackward {
    fn name(&self) -> &'static str {
        "causal-attention-qkv-backward"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let g = qkv_dims(op, self.heads, l.shape())?;
        let n = g.bh * g.t * g.d;
        if self.o.len() != n || self.dout.len() != n || self.lse.len() != g.bh * g.t {
            return Err(shape_err(
                op,
                "saved output, its gradient or log-sum-exp do not match qkv",
                l.shape(),
            ));
        }
        let (ins, o_rows) = CausalAttentionQkv::layouts(g);
        let saved = Saved {
            o: &self.o,
            dout: &self.dout,
            o_rows,
            lse: &self.lse,
        };
        let out = match floats(op, s, l)? {
            Floats::F32(x) => {
                let mut dqkv = vec![0f32; 3 * n];
                let saved = (&self.o[..], &self.dout[..], &self.lse[..]);
                qkv_backward_f32(x, saved, (g.bh / g.heads, g.t, g.heads), &mut dqkv);
                f32::storage(dqkv)
            }
            Floats::BF16(x) => bf16::storage(bwd((x, x, x), ins, ins, &saved, g, 3 * n)),
        };
        Ok((out, l.shape().clone()))
    }
}

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
        if b * t == 0 {
            return None;
        }
        let c = qkv_len / (3 * b * t);
        let d = c / heads;
        assert!(
            d * heads == c && 3 * b * t * c == qkv_len,
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
            // SAFETY: head bh's columns of `out` (rows of `c`) are written by this task
            // only, and lie inside `out` (asserted above).
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
            // SAFETY: `dp` is t x t; head bh's columns of the q, k and v parts of `dqkv`
            // are written by this task only, and lie inside it (asserted above).
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

simd_dispatch!(
    /// The causal softmax of each row `i` of the `t x t` scores `s` in place (keys past `i`
    /// set to 0), with each row's log-sum-exp into `lse`.
    fn softmax_rows<>(s: &mut [f32], t: usize, lse: &mut [f32]) => softmax_rows_any
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
    fn softmax_grad_rows<>(
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

#[cfg(test)]
mod tests {
    use super::*;

    fn vals(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8) as f32
                    / (1 << 24) as f32
                    - 0.5
            })
            .collect()
    }

    fn assert_close(what: &str, a: &[f32], b: &[f32], tol: f32) {
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
        let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(
            diff <= tol * scale,
            "{what}: max diff {diff:e}, max |ref| {scale:e}"
        );
    }

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
            assert_close(&format!("out, {shape}"), &o, &o_ref, 1e-5);
            assert_close(&format!("lse, {shape}"), &lse, &lse_ref, 1e-5);
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
            assert_close(&format!("dqkv, {shape}"), &dqkv, &d_ref, 1e-5);
        }
    }

    /// The AVX-512 row loops equal the portable ones (to f32 rounding of reordered sums)
    /// on widths that are and are not multiples of the vector.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn avx512_row_ops_match_portable() {
        if Simd::detect() != Simd::Avx512 {
            eprintln!("skipped: no AVX-512 on this CPU");
            return;
        }
        #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
        unsafe fn run(x: &[f32], mt: &[f32], t: usize, n: usize, d: usize) -> [Vec<f32>; 3] {
            let mut a = vec![0.0; n];
            Avx512::row_times_t(x, mt, t, 0.5, &mut a);
            let mut b = vec![0.0; d];
            Avx512::weighted_rows(&x[..n.min(x.len())], mt, &mut b);
            let mut c = mt[..n].to_vec();
            Avx512::axpy(0.25, &x[..n.min(x.len())], &mut c);
            [a, b, c]
        }
        for (d, t, n) in [(32, 128, 64), (5, 48, 16), (37, 80, 80), (64, 144, 144)] {
            let (x, mt) = (vals(d.max(n), 1), vals(d.max(n) * t.max(d), 2));
            // SAFETY: AVX-512 detected above.
            let [a, b, c] = unsafe { run(&x[..d], &mt, t, n, d) };
            let mut pa = vec![0.0; n];
            Portable::row_times_t(&x[..d], &mt, t, 0.5, &mut pa);
            let mut pb = vec![0.0; d];
            Portable::weighted_rows(&x[..n.min(d)], &mt, &mut pb);
            let mut pc = mt[..n].to_vec();
            Portable::axpy(0.25, &x[..n.min(d)], &mut pc);
            for (name, u, v) in [
                ("row_times_t", &a, &pa),
                ("weighted_rows", &b, &pb),
                ("axpy", &c, &pc),
            ] {
                let diff = u.iter().zip(v).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
                assert!(diff <= 1e-5, "{name} d={d} t={t} n={n}: {diff}");
            }
        }
    }
}
