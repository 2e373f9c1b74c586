//! The row kernels: causal attention row by row (flash-attention's idea on a CPU), with
//! a portable and an AVX-512 version of the per-row vector loops.

use rayon::prelude::*;

use super::{Dims, Out, Rows};
use crate::elem::Elem;
use crate::fastmath::{exp, max_map, sum_map, sum_map2, Simd};

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

/// Whether this CPU runs AVX-512F: each [`Avx512`] method checks it itself before its
/// intrinsics (a cached flag, one load per row), so its safety does not rest on the caller
/// having dispatched correctly.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn avx512_present() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
}

#[cfg(target_arch = "x86_64")]
impl RowOps for Avx512 {
    #[inline(always)]
    fn row_times_t(x: &[f32], mt: &[f32], t: usize, scale: f32, out: &mut [f32]) {
        use std::arch::x86_64::*;
        let n = out.len();
        // Checked: a wrapped product could pass a plain comparison.
        let last_row_end = match x.len() {
            0 => Some(0),
            rows => (rows - 1).checked_mul(t).and_then(|r| r.checked_add(n)),
        };
        assert!(avx512_present());
        assert!(n.is_multiple_of(KEY_BLOCK) && last_row_end.is_some_and(|e| e <= mt.len()));
        // SAFETY: AVX-512F is present (asserted); the assert bounds every load (rows
        // c < x.len() of width >= n, the last ending at `last_row_end`) and store (j < n).
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
        assert!(avx512_present());
        assert!(w.len().checked_mul(d).is_some_and(|e| e <= m.len()));
        // SAFETY: AVX-512F is present (asserted); loads stay inside rows j < w.len() of
        // width d (asserted without wrapping; masked at the tail), the stores inside `out`.
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
        assert!(avx512_present());
        // SAFETY: AVX-512F is present (asserted); masked loads and stores stay below n in
        // both slices.
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
    // The writes below go through a pointer every head task shares: this head's rows
    // must be inside the buffer and apart from every other head's.
    assert!(
        Rows::disjoint(&[o_rows], g, len),
        "attention: output rows {o_rows:?} overlap or leave {len} elements for {g:?}"
    );
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
        // SAFETY: in bounds (asserted), and row i of head bh is written by this task only:
        // the layout's rows of distinct (head, row) never overlap (checked at the top).
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
pub(super) fn fwd<T: Elem>(
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
pub(super) struct Saved<'a> {
    pub(super) o: &'a [f32],
    pub(super) dout: &'a [f32],
    pub(super) o_rows: Rows,
    pub(super) lse: &'a [f32],
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
    // The writes below go through a pointer every head task shares: the three gradients'
    // rows must be inside the buffer and apart from each other and from other heads'.
    assert!(
        Rows::disjoint(&[dq_rows, dk_rows, dv_rows], g, len),
        "attention: gradient rows overlap or leave {len} elements for {g:?}"
    );
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
        // by this task only, and the three gradients' rows never overlap (both checked
        // by Rows::disjoint at the top of this function).
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
pub(super) fn bwd<T: Elem>(
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

#[cfg(test)]
mod tests {
    use super::*;

    use super::super::test_values as vals;

    /// The AVX-512 row loops equal the portable ones (to f32 rounding of reordered sums)
    /// on widths that are and are not multiples of the vector.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn avx512_row_ops_match_portable() {
        if Simd::detect() != Simd::Avx512 {
            stoker_testkit::skip("avx512_row_ops_match_portable", "no AVX-512 on this CPU");
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
                let diff = stoker_testkit::max_abs_diff(u, v);
                assert!(diff <= 1e-5, "{name} d={d} t={t} n={n}: {diff}");
            }
        }
    }
}
