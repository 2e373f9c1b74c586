//! The candle custom ops (forward and backward, `[B, H, T, D]` and packed QKV) over the
//! row kernels and, for packed f32, the GEMM formulation.

use std::sync::{Arc, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp3, DType, Layout, Result, Shape, Tensor};
use half::bf16;

use super::gemm::{qkv_backward_f32, qkv_forward_f32};
use super::rows::{bwd, fwd, Saved};
use super::{Dims, Rows};
use crate::elem::{check_float, floats, Elem, Floats};
use crate::error::{shape_err, KernelError};

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
    pub(super) fn layouts(g: Dims) -> ((Rows, Rows, Rows), Rows) {
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
