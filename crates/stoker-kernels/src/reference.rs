//! The composed twins of the fused ops, built from candle's differentiable primitives.
//! Slow (a buffer per step, generic backward) but obviously right: the tests and the
//! benchmark hold the fused kernels against them.

use candle_core::{DType, Result, Tensor, D};

/// GELU, tanh approximation, composed.
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    let k = (2.0f64 / std::f64::consts::PI).sqrt();
    let inner = ((x + x.powf(3.0)? * 0.044715)? * k)?;
    (x * 0.5)? * (inner.tanh()? + 1.0)?
}

/// Softmax over the last dim, composed, with max subtraction.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

/// Layer norm over the last dim with weight and bias, composed.
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    let xh = xc.broadcast_div(&(var + eps)?.sqrt()?)?;
    xh.broadcast_mul(weight)?.broadcast_add(bias)
}

/// Sum of token cross-entropies over rows whose target is not `ignore_index`, composed
/// (log-softmax, gather, mask). Computed in f32 like the fused op.
pub fn cross_entropy_sum(logits: &Tensor, targets: &Tensor, ignore_index: i64) -> Result<Tensor> {
    let logits = logits.to_dtype(DType::F32)?;
    let t = targets.to_dtype(DType::I64)?;
    let valid = t.ne(ignore_index)?;
    let safe = valid
        .where_cond(&t, &t.zeros_like()?)?
        .to_dtype(DType::U32)?;
    let max = logits.max_keepdim(D::Minus1)?.detach();
    let shifted = logits.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    let logp = shifted.broadcast_sub(&lse)?;
    let picked = logp.gather(&safe.unsqueeze(1)?, 1)?.squeeze(1)?;
    let mask = valid.to_dtype(DType::F32)?;
    (picked * mask)?.sum_all()?.neg()
}

/// Causal scaled-dot-product attention over `[B, H, T, D]`, composed (materializes the
/// `T x T` scores; the mask adds `-inf` above the diagonal).
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    let (t, d) = (q.dim(2)?, q.dim(3)?);
    let mask: Vec<f32> = (0..t * t)
        .map(|i| {
            if i % t > i / t {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    let mask = Tensor::from_vec(mask, (t, t), q.device())?.to_dtype(q.dtype())?;
    let scores = (q.matmul(&k.t()?.contiguous()?)? / (d as f64).sqrt())?;
    softmax_last_dim(&scores.broadcast_add(&mask)?)?.matmul(v)
}

/// Causal attention from a packed `[B, T, 3 C]` QKV projection to `[B, T, C]`, composed:
/// split, per-head transpose, [`causal_attention`], transpose back.
pub fn causal_attention_qkv(qkv: &Tensor, heads: usize) -> Result<Tensor> {
    let (b, t, c3) = qkv.dims3()?;
    let c = c3 / 3;
    let split = |i: usize| {
        qkv.narrow(2, i * c, c)?
            .reshape((b, t, heads, c / heads))?
            .transpose(1, 2)?
            .contiguous()
    };
    let y = causal_attention(&split(0)?, &split(1)?, &split(2)?)?;
    y.transpose(1, 2)?.reshape((b, t, c))
}

/// Embedding lookup, composed: candle's `embedding` (index-select; its backward is
/// candle's index-add).
pub fn embedding(table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let mut dims = ids.dims().to_vec();
    dims.push(table.dim(1)?);
    table.embedding(&ids.flatten_all()?)?.reshape(dims)
}

/// Linear layer `x W^T + b`, composed: one 2-D matmul over the leading dims and a
/// broadcast add.
pub fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    let mut dims = x.dims().to_vec();
    let k = dims.pop().unwrap_or(1);
    dims.push(w.dim(0)?);
    x.reshape(((), k))?
        .matmul(&w.t()?)?
        .reshape(dims)?
        .broadcast_add(b)
}

/// RMSNorm over the last dim with a gain, composed: `x / sqrt(mean(x^2) + eps) * w`.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(weight)
}

/// Rotary embeddings on `[B, T, H, D]`, composed as transformers writes them:
/// `x cos + rotate_half(x) sin`, with `rotate_half(x) = [-x2, x1]`.
pub fn rope(x: &Tensor, base: f64) -> Result<Tensor> {
    let (_, t, _, d) = x.dims4()?;
    let half = d / 2;
    let mut ang = Vec::with_capacity(t * d);
    for pos in 0..t {
        for i in 0..d {
            ang.push(pos as f64 * base.powf(-2.0 * (i % half) as f64 / d as f64));
        }
    }
    let dev = x.device();
    let cos: Vec<f32> = ang.iter().map(|a| a.cos() as f32).collect();
    let sin: Vec<f32> = ang.iter().map(|a| a.sin() as f32).collect();
    let cos = Tensor::from_vec(cos, (1, t, 1, d), dev)?.to_dtype(x.dtype())?;
    let sin = Tensor::from_vec(sin, (1, t, 1, d), dev)?.to_dtype(x.dtype())?;
    let x1 = x.narrow(3, 0, half)?;
    let x2 = x.narrow(3, half, half)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], 3)?;
    x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?
}

/// `silu(gate) * up`, composed from candle's `silu`.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    gate.silu()? * up
}
