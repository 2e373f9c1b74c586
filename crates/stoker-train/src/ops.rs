//! The differentiable building blocks the models are written in, each in the dtype the
//! autocast policy gives it, and each in two implementations chosen by [`Fx::kernels`]:
//! stoker-kernels' fused ops (the default; one pass forward, one backward), or the
//! composed twin from candle primitives, which is the reference the fused ones are
//! tested against and the fallback on non-CPU devices and in f16 / f64.
//!
//! candle's own fused `softmax_last_dim`, `layer_norm` and `rms_norm` (and the
//! `LayerNorm` module) return tensors detached from the graph: a parameter behind them
//! silently gets no gradient. Neither path here uses them.

use candle_core::{DType, Tensor, D};

use crate::error::Result;
use crate::precision::Fx;

/// `y = x W^T + b` with `x` `(.., in)`, `W` `(out, in)`: a matmul, so its operands are in
/// the compute dtype (its output in the activation dtype), with FP8 quantize-dequantize of
/// both inputs (E4M3) and of the output's gradient (E5M2) in `fp8` mode.
pub fn linear(fx: &Fx, name: &str, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let mut x = x.to_dtype(fx.activation())?;
    let mut w = w.clone();
    if let Some(fp8) = fx.fp8 {
        x = fp8.qdq(name, 0, &x)?;
        w = fp8.qdq(name, 1, &w)?;
    } else if fx.fused_for(&x) && (fx.compute == DType::F32 || fx.bf16_autocast()) {
        // One fused op: GEMM, bias and their backward (bias-less layers add zeros); with
        // bf16 autocast, f32 operands are rounded to bf16 inside the GEMM.
        let bias = match b {
            Some(b) => b.clone(),
            None => Tensor::zeros(w.dim(0)?, w.dtype(), w.device())?,
        };
        return Ok(stoker_kernels::linear_with(
            &x,
            &w,
            &bias,
            fx.bf16_autocast(),
        )?);
    }
    let y = matmul_2d(&x, &w)?;
    let y = match fx.fp8 {
        Some(fp8) => fp8.grad_qdq(name, &y)?,
        None => y,
    };
    Ok(match b {
        // The bias's gradient is a sum over every row, and candle sums a bf16 or f16
        // tensor in its own type on the CPU, which stagnates: 2,048 rows of about 0.75
        // sum to 256 in bf16. Added in f32, the backward sums in f32; the forward rounds
        // once either way, and the output's gradient passes through unchanged.
        Some(b) if matches!(y.dtype(), DType::BF16 | DType::F16) => y
            .to_dtype(DType::F32)?
            .broadcast_add(&b.to_dtype(DType::F32)?)?
            .to_dtype(y.dtype())?,
        Some(b) => y.broadcast_add(b)?,
        None => y,
    })
}

/// `x W^T` as one 2-D candle matmul over all leading dims: a broadcast matmul's backward
/// would expand the weight per batch element and sum the per-element weight gradients
/// afterwards (about 10x the forward's time in f32 here, more in bf16).
fn matmul_2d(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let (k, lead) = (dims[dims.len() - 1], dims[..dims.len() - 1].to_vec());
    let x2 = x.reshape(((), k))?;
    let mut out_shape = lead;
    out_shape.push(w.dim(0)?);
    Ok(x2.matmul(&w.t()?)?.reshape(out_shape)?)
}

/// Softmax over the last dimension, in the high dtype: `exp(x - max) / sum(exp(x - max))`.
/// The max is detached: softmax does not depend on the shift, so its gradient is zero.
pub fn softmax_last(fx: &Fx, x: &Tensor) -> Result<Tensor> {
    let x = x.to_dtype(fx.high)?;
    if fx.fused_for(&x) {
        return Ok(stoker_kernels::softmax_last_dim(&x)?);
    }
    let m = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&m)?.exp()?;
    let s = e.sum_keepdim(D::Minus1)?;
    Ok(e.broadcast_div(&s)?)
}

/// Log-softmax over the last dimension, in the high dtype: `x - max - log(sum(exp(x - max)))`.
pub fn log_softmax_last(fx: &Fx, x: &Tensor) -> Result<Tensor> {
    let x = x.to_dtype(fx.high)?;
    let m = x.max_keepdim(D::Minus1)?.detach();
    let shifted = x.broadcast_sub(&m)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    Ok(shifted.broadcast_sub(&lse)?)
}

/// LayerNorm over the last dimension, in the high dtype, returned in the activation dtype
/// ([`Fx::activation`]).
pub fn layer_norm(fx: &Fx, x: &Tensor, gain: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let x = x.to_dtype(fx.high)?;
    if fx.fused_for(&x) {
        let (g, b) = (gain.to_dtype(fx.high)?, bias.to_dtype(fx.high)?);
        return Ok(stoker_kernels::layer_norm(&x, &g, &b, eps)?.to_dtype(fx.activation())?);
    }
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    let xn = xc.broadcast_div(&(var + eps)?.sqrt()?)?;
    let y = xn
        .broadcast_mul(&gain.to_dtype(fx.high)?)?
        .broadcast_add(&bias.to_dtype(fx.high)?)?;
    Ok(y.to_dtype(fx.compute)?)
}

/// RMSNorm over the last dimension (Llama's norm), in the high dtype, returned in the
/// activation dtype.
pub fn rms_norm(fx: &Fx, x: &Tensor, gain: &Tensor, eps: f64) -> Result<Tensor> {
    let x = x.to_dtype(fx.high)?;
    let g = gain.to_dtype(fx.high)?;
    if fx.fused_for(&x) {
        return Ok(stoker_kernels::rms_norm(&x, &g, eps)?.to_dtype(fx.activation())?);
    }
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    let y = x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(&g)?;
    Ok(y.to_dtype(fx.activation())?)
}

/// Rotary position embeddings of `base` on `x` `(B, T, H, D)` (positions from 0 along
/// `T`; transformers' rotate-half layout), in the dtype of `x`.
pub fn rope(fx: &Fx, x: &Tensor, base: f64) -> Result<Tensor> {
    Ok(if fx.fused_for(x) {
        stoker_kernels::rope(x, base)?
    } else {
        stoker_kernels::reference::rope(x, base)?
    })
}

/// SwiGLU's gate `silu(gate) * up`, in the dtype of the inputs.
pub fn swiglu(fx: &Fx, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    Ok(if fx.fused_for(gate) {
        stoker_kernels::swiglu(gate, up)?
    } else {
        (gate.silu()? * up)?
    })
}

/// GELU, tanh approximation (GPT-2's), in the dtype of `x`.
pub fn gelu(fx: &Fx, x: &Tensor) -> Result<Tensor> {
    Ok(if fx.fused_for(x) {
        stoker_kernels::gelu(x)?
    } else {
        x.gelu()?
    })
}

/// Rows of `table` `(V, D)` picked by integer `ids` of any shape: `(.., D)`.
pub fn embedding(fx: &Fx, table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let ids = ids_i64(ids)?;
    if fx.fused_for(table) {
        return Ok(stoker_kernels::embedding(table, &ids)?);
    }
    let mut dims = ids.dims().to_vec();
    dims.push(table.dim(1)?);
    Ok(table.index_select(&ids.flatten_all()?, 0)?.reshape(dims)?)
}

/// Causal scaled-dot-product attention of `q`, `k`, `v` `(B, H, T, D)` in the compute
/// dtype. Composed: the `(B, H, T, T)` scores in the compute dtype, the masked softmax in
/// the high dtype. Fused: one op that keeps a row of scores at a time, f32 inside.
pub fn causal_attention(fx: &Fx, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    if fx.fused_for(q) {
        return Ok(stoker_kernels::causal_attention(q, k, v)?);
    }
    let hd = q.dim(D::Minus1)?;
    let scores = (q.matmul(&k.t()?.contiguous()?)? * (1.0 / (hd as f64).sqrt()))?;
    let att = softmax_last(fx, &causal_mask(&scores.to_dtype(fx.high)?)?)?.to_dtype(fx.compute)?;
    Ok(att.matmul(v)?)
}

/// Causal attention from a QKV projection `(B, T, 3 C)` to `(B, T, C)`, `heads` heads.
/// Fused: one op reading and writing the packed layouts. Composed: split, per-head
/// transposes, [`causal_attention`], merge.
pub fn causal_attention_qkv(fx: &Fx, qkv: &Tensor, heads: usize) -> Result<Tensor> {
    if fx.fused_for(qkv) {
        return Ok(stoker_kernels::causal_attention_qkv(qkv, heads)?);
    }
    let (b, t, c3) = qkv.dims3()?;
    let c = c3 / 3;
    let split = |i: usize| -> Result<Tensor> {
        Ok(qkv
            .narrow(D::Minus1, i * c, c)?
            .reshape((b, t, heads, c / heads))?
            .transpose(1, 2)?
            .contiguous()?)
    };
    let y = causal_attention(fx, &split(0)?, &split(1)?, &split(2)?)?;
    Ok(y.transpose(1, 2)?.reshape((b, t, c))?)
}

/// Causal grouped-query attention: `q` `(B, H, T, D)` against `k`, `v` `(B, KV, T, D)`,
/// each key/value head serving `H / KV` consecutive query heads (repeated, as
/// transformers' `repeat_kv` does; its backward sums the copies).
pub fn causal_attention_gqa(fx: &Fx, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    let (b, h, t, d) = q.dims4()?;
    let kv = k.dim(1)?;
    let repeat = |x: &Tensor| -> Result<Tensor> {
        Ok(match h / kv {
            1 => x.contiguous()?,
            n => x
                .unsqueeze(2)?
                .broadcast_as((b, kv, n, t, d))?
                .contiguous()?
                .reshape((b, h, t, d))?,
        })
    };
    causal_attention(fx, &q.contiguous()?, &repeat(k)?, &repeat(v)?)
}

/// Adds a causal mask to attention scores `(.., T, T)` (future positions get -inf).
pub fn causal_mask(scores: &Tensor) -> Result<Tensor> {
    let t = scores.dim(D::Minus1)?;
    let mask: Vec<f32> = (0..t * t)
        .map(|i| {
            if i % t > i / t {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    let mask = Tensor::from_vec(mask, (t, t), scores.device())?.to_dtype(scores.dtype())?;
    Ok(scores.broadcast_add(&mask)?)
}

/// 2x2 max-pooling with stride 2 over `(B, C, H, W)` (H, W even), composed from reshapes
/// and max reductions. candle 0.11's `max_pool2d` backward multiplies the gradient by the
/// fraction of maxima in the window instead of dividing by their count (1/4 of the true
/// gradient without ties; found by the CNN's finite-difference test), so it is not used.
pub fn max_pool2x2(x: &Tensor) -> Result<Tensor> {
    let (b, c, h, w) = x.dims4()?;
    let y = x
        .reshape((b, c, h / 2, 2, w / 2, 2))?
        .max_keepdim(5)?
        .max_keepdim(3)?;
    Ok(y.reshape((b, c, h / 2, w / 2))?)
}

/// Widens integer class ids to the i64 candle's `gather` and `index_select` take.
pub fn ids_i64(x: &Tensor) -> Result<Tensor> {
    Ok(if x.dtype() == DType::I64 {
        x.clone()
    } else {
        x.to_dtype(DType::I64)?
    })
}
