//! Causal scaled-dot-product attention over `[B, H, T, D]`, fused, with a fused backward.
//!
//! Row by row (flash-attention's idea, on a CPU): for query `i` the scores against keys
//! `0..=i` live in one scratch row of `T`, never a `T x T` matrix; forward saves only
//! each row's log-sum-exp. Backward recomputes the probabilities from it:
//! `p_ij = exp(s_ij - lse_i)`, `ds_ij = p_ij (dO_i . v_j - dO_i . O_i)`, then
//! `dq_i = scale sum_j ds_ij k_j`, `dk_j += scale ds_ij q_i`, `dv_j += p_ij dO_i`.
//! Parallel over the `B * H` heads; each head works in f32 scratch (bf16 widened once).

use std::sync::{Arc, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};
use half::bf16;
use rayon::prelude::*;

use crate::elem::{check_float, floats, Elem, Floats};
use crate::error::{shape_err, KernelError};
use crate::fastmath::{exp, max_map, sum_map, sum_map2};

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

/// The attention forward op; use [`causal_attention`].
#[derive(Debug)]
pub struct CausalAttention {
    lse: OnceLock<Arc<Vec<f32>>>,
}

/// `(heads, T, D)`, checking that all three shapes are the same `[B, H, T, D]`.
fn dims(op: &'static str, q: &Shape, k: &Shape, v: &Shape) -> Result<(usize, usize, usize)> {
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
    Ok((b * h, t, d))
}

fn widen<T: Elem>(src: &[T], dst: &mut [f32]) {
    dst.iter_mut().zip(src).for_each(|(d, &s)| *d = s.to_f32());
}

fn fwd<T: Elem>(q: &[T], k: &[T], v: &[T], t: usize, d: usize) -> (Vec<T>, Vec<f32>) {
    let scale = 1.0 / (d as f32).sqrt();
    let mut out = vec![T::from_f32(0.0); q.len()];
    let mut lse = vec![0.0f32; q.len() / d];
    let hd = t * d;
    out.par_chunks_mut(hd)
        .zip(lse.par_chunks_mut(t))
        .zip(q.par_chunks(hd).zip(k.par_chunks(hd)).zip(v.par_chunks(hd)))
        .for_each(|((o, lse), ((q, k), v))| {
            // Scratch per head: k and v widened, one row of scores, one output row.
            let mut buf = vec![0.0f32; 2 * hd + t + d];
            let (kf, rest) = buf.split_at_mut(hd);
            let (vf, rest) = rest.split_at_mut(hd);
            let (s, acc) = rest.split_at_mut(t);
            widen(k, kf);
            widen(v, vf);
            for i in 0..t {
                let qi = &q[i * d..(i + 1) * d];
                let s = &mut s[..=i];
                for (j, s) in s.iter_mut().enumerate() {
                    *s = scale * sum_map2(qi, &kf[j * d..(j + 1) * d], |a, b| a.to_f32() * b);
                }
                let m = max_map(s, |x| x);
                s.iter_mut().for_each(|x| *x = exp(*x - m));
                let z = sum_map(s, |x| x);
                acc.fill(0.0);
                for (j, &p) in s.iter().enumerate() {
                    acc.iter_mut()
                        .zip(&vf[j * d..(j + 1) * d])
                        .for_each(|(a, &v)| *a += p * v);
                }
                let inv = 1.0 / z;
                o[i * d..(i + 1) * d]
                    .iter_mut()
                    .zip(&*acc)
                    .for_each(|(o, &a)| *o = T::from_f32(a * inv));
                lse[i] = m + z.ln();
            }
        });
    (out, lse)
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
        let (_, t, d) = dims(op, l1.shape(), l2.shape(), l3.shape())?;
        let (out, lse) = match (
            floats(op, s1, l1)?,
            floats(op, s2, l2)?,
            floats(op, s3, l3)?,
        ) {
            (Floats::F32(q), Floats::F32(k), Floats::F32(v)) => {
                let (o, l) = fwd(q, k, v, t, d);
                (f32::storage(o), l)
            }
            (Floats::BF16(q), Floats::BF16(k), Floats::BF16(v)) => {
                let (o, l) = fwd(q, k, v, t, d);
                (bf16::storage(o), l)
            }
            _ => {
                return Err(KernelError::DType {
                    op,
                    dtype: s2.dtype(),
                    extra: ", the same for q, k and v",
                }
                .into())
            }
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
        let lse = match self.lse.get() {
            Some(l) => l.clone(),
            None => return Err(shape_err(self.name(), "backward before forward", q.shape())),
        };
        // O and dO travel as f32 vectors: a CustomOp3 has only three tensor inputs.
        let to_f32 = |t: &Tensor| -> Result<Vec<f32>> {
            t.to_dtype(candle_core::DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()
        };
        let back = CausalAttentionBackward {
            o: to_f32(o)?,
            dout: to_f32(dout)?,
            lse,
        };
        let n = q.elem_count();
        let flat = q.apply_op3_no_bwd(k, v, &back)?;
        let part = |i: usize| flat.narrow(0, i * n, n)?.reshape(q.shape());
        Ok((Some(part(0)?), Some(part(1)?), Some(part(2)?)))
    }
}

/// Attention's backward as one fused op over `(q, k, v)` with the forward's output,
/// its gradient and the saved log-sum-exp. Returns `[dq, dk, dv]` flattened in one buffer.
#[derive(Debug)]
pub struct CausalAttentionBackward {
    o: Vec<f32>,
    dout: Vec<f32>,
    lse: Arc<Vec<f32>>,
}

fn bwd<T: Elem>(
    q: &[T],
    k: &[T],
    v: &[T],
    b: &CausalAttentionBackward,
    t: usize,
    d: usize,
) -> Vec<T> {
    let scale = 1.0 / (d as f32).sqrt();
    let (n, hd) = (q.len(), t * d);
    let mut out = vec![T::from_f32(0.0); 3 * n];
    let (dq, rest) = out.split_at_mut(n);
    let (dk, dv) = rest.split_at_mut(n);
    let heads = dq
        .par_chunks_mut(hd)
        .zip(dk.par_chunks_mut(hd))
        .zip(dv.par_chunks_mut(hd));
    let inputs = q.par_chunks(hd).zip(k.par_chunks(hd)).zip(v.par_chunks(hd));
    let saved =
        b.o.par_chunks(hd)
            .zip(b.dout.par_chunks(hd))
            .zip(b.lse.par_chunks(t));
    heads
        .zip(inputs.zip(saved))
        .for_each(|(((dq, dk), dv), (((q, k), v), ((o, go), lse)))| {
            // Scratch per head: q, k, v widened; dk, dv accumulated; one dq row.
            let mut buf = vec![0.0f32; 5 * hd + d];
            let (qf, rest) = buf.split_at_mut(hd);
            let (kf, rest) = rest.split_at_mut(hd);
            let (vf, rest) = rest.split_at_mut(hd);
            let (dkf, rest) = rest.split_at_mut(hd);
            let (dvf, dqi) = rest.split_at_mut(hd);
            widen(q, qf);
            widen(k, kf);
            widen(v, vf);
            for (i, &lse_i) in lse.iter().enumerate() {
                let row = i * d..(i + 1) * d;
                let (qi, goi) = (&qf[row.clone()], &go[row.clone()]);
                let di = sum_map2(goi, &o[row.clone()], |a, b| a * b);
                dqi.fill(0.0);
                for j in 0..=i {
                    let col = j * d..(j + 1) * d;
                    let p = exp(scale * sum_map2(qi, &kf[col.clone()], |a, b| a * b) - lse_i);
                    let ds = p * (sum_map2(goi, &vf[col.clone()], |a, b| a * b) - di);
                    dqi.iter_mut()
                        .zip(&kf[col.clone()])
                        .for_each(|(a, &k)| *a += ds * k);
                    dkf[col.clone()]
                        .iter_mut()
                        .zip(qi)
                        .for_each(|(a, &q)| *a += ds * q);
                    dvf[col].iter_mut().zip(goi).for_each(|(a, &g)| *a += p * g);
                }
                dq[row]
                    .iter_mut()
                    .zip(&*dqi)
                    .for_each(|(o, &a)| *o = T::from_f32(scale * a));
            }
            dk.iter_mut()
                .zip(&*dkf)
                .for_each(|(o, &a)| *o = T::from_f32(scale * a));
            dv.iter_mut()
                .zip(&*dvf)
                .for_each(|(o, &a)| *o = T::from_f32(a));
        });
    out
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
        let (heads, t, d) = dims(op, l1.shape(), l2.shape(), l3.shape())?;
        let n = heads * t * d;
        if self.o.len() != n || self.dout.len() != n || self.lse.len() != heads * t {
            return Err(shape_err(
                op,
                "saved output, its gradient or log-sum-exp do not match q",
                l1.shape(),
            ));
        }
        let out = match (
            floats(op, s1, l1)?,
            floats(op, s2, l2)?,
            floats(op, s3, l3)?,
        ) {
            (Floats::F32(q), Floats::F32(k), Floats::F32(v)) => {
                f32::storage(bwd(q, k, v, self, t, d))
            }
            (Floats::BF16(q), Floats::BF16(k), Floats::BF16(v)) => {
                bf16::storage(bwd(q, k, v, self, t, d))
            }
            _ => {
                return Err(KernelError::DType {
                    op,
                    dtype: s2.dtype(),
                    extra: ", the same for q, k and v",
                }
                .into())
            }
        };
        Ok((out, Shape::from(3 * n)))
    }
}
