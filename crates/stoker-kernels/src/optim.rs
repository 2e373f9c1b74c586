//! AdamW and SGD-momentum updates over flat FP32 buffers as single fused passes:
//! parallel over chunks, each chunk one loop the compiler vectorizes (with AVX2+FMA
//! when the CPU has them, picked at run time), and the bf16 copy-out of the updated
//! weights written in the same loop.
//!
//! The arithmetic is stoker-train's `optim::{AdamW, Sgd}` exactly (torch's order and
//! fused multiply-adds), so the results are bit-identical to it and to the scalar twins
//! [`adamw_update_scalar`] and [`sgd_update_scalar`]. One call updates one segment;
//! the caller loops over segments, passing each one's weight-decay flag.

use half::bf16;
use rayon::prelude::*;

use crate::error::KernelError;
use crate::fastmath::{to_bf16, Simd};

/// Elements per rayon task: 16 Ki f32 (64 KiB per stream) stays in L2.
const CHUNK: usize = 16 * 1024;

/// AdamW's scalars for one step, derived in f64 and applied in f32 as
/// stoker-train's `AdamW::step` (and torch.optim.AdamW) does.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    /// `1 - lr * weight_decay`, multiplied into decayed parameters.
    pub decay: f32,
    /// `1 - beta1`, the first-moment lerp weight.
    pub w1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// `1 - beta2`.
    pub w2: f32,
    /// `lr / (1 - beta1^t)`.
    pub step_size: f32,
    /// `sqrt(1 - beta2^t)`.
    pub bc2_sqrt: f32,
    /// Added to the denominator.
    pub eps: f32,
}

impl AdamWStep {
    /// Scalars for step `t` (1-based: the first update is `t = 1`) at learning rate `lr`.
    pub fn new(lr: f32, beta1: f64, beta2: f64, eps: f64, weight_decay: f64, t: u64) -> Self {
        let lr64 = lr as f64;
        let t = t as i32;
        AdamWStep {
            decay: (1.0 - lr64 * weight_decay) as f32,
            w1: (1.0 - beta1) as f32,
            beta2: beta2 as f32,
            w2: (1.0 - beta2) as f32,
            step_size: (lr64 / (1.0 - beta1.powi(t))) as f32,
            bc2_sqrt: (1.0 - beta2.powi(t)).sqrt() as f32,
            eps: eps as f32,
        }
    }
}

/// SGD's scalars for one step (torch.optim.SGD: coupled L2 decay, dampening 0).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdStep {
    /// Learning rate.
    pub lr: f32,
    /// Momentum factor; 0 leaves the momentum buffer untouched (it may be empty).
    pub momentum: f32,
    /// L2 penalty added to the gradient of decayed segments.
    pub weight_decay: f32,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// The first step seeds the momentum buffer with the gradient.
    pub first: bool,
}

fn check_len(
    op: &'static str,
    what: &'static str,
    len: usize,
    expected: usize,
) -> Result<(), KernelError> {
    if len == expected {
        Ok(())
    } else {
        Err(KernelError::Length {
            op,
            what,
            len,
            expected,
        })
    }
}

#[inline(always)]
fn adamw_elem(s: &AdamWStep, decay: f32, p: &mut f32, g: f32, m: &mut f32, v: &mut f32) {
    *p *= decay;
    *m += s.w1 * (g - *m);
    *v = *v * s.beta2 + s.w2 * g * g;
    let denom = v.sqrt() / s.bc2_sqrt + s.eps;
    *p = (-s.step_size).mul_add(*m / denom, *p);
}

#[inline(always)]
fn adamw_chunk(
    s: &AdamWStep,
    decay: f32,
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    out: Option<&mut [bf16]>,
) {
    let it = p.iter_mut().zip(g).zip(m.iter_mut().zip(v.iter_mut()));
    match out {
        None => it.for_each(|((p, &g), (m, v))| adamw_elem(s, decay, p, g, m, v)),
        Some(o) => it.zip(o).for_each(|(((p, &g), (m, v)), o)| {
            adamw_elem(s, decay, p, g, m, v);
            *o = to_bf16(*p);
        }),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn adamw_chunk_avx2(
    s: &AdamWStep,
    decay: f32,
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    out: Option<&mut [bf16]>,
) {
    adamw_chunk(s, decay, p, g, m, v, out)
}

/// Whether the AVX2 + FMA compilation of the chunk loops can run here (the shared
/// run-time detection of [`crate::fastmath::Simd`]).
fn has_avx2_fma() -> bool {
    Simd::detect() != Simd::Baseline
}

/// One AdamW update of `params` (one segment) from `grads`, with moments `exp_avg` and
/// `exp_avg_sq`; `decay` says whether the segment takes weight decay. With `bf16_out`,
/// the updated weights are also written there, rounded to nearest-even.
pub fn adamw_update(
    s: &AdamWStep,
    decay: bool,
    params: &mut [f32],
    grads: &[f32],
    exp_avg: &mut [f32],
    exp_avg_sq: &mut [f32],
    bf16_out: Option<&mut [bf16]>,
) -> Result<(), KernelError> {
    let n = params.len();
    check_len("adamw", "grads", grads.len(), n)?;
    check_len("adamw", "exp_avg", exp_avg.len(), n)?;
    check_len("adamw", "exp_avg_sq", exp_avg_sq.len(), n)?;
    if let Some(o) = &bf16_out {
        check_len("adamw", "bf16_out", o.len(), n)?;
    }
    let d = if decay { s.decay } else { 1.0 };
    let fast = has_avx2_fma();
    let chunk = |p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], o: Option<&mut [bf16]>| {
        #[cfg(target_arch = "x86_64")]
        if fast {
            // SAFETY: the CPU has AVX2 and FMA (checked at run time above).
            return unsafe { adamw_chunk_avx2(s, d, p, g, m, v, o) };
        }
        let _ = fast;
        adamw_chunk(s, d, p, g, m, v, o)
    };
    let it = params
        .par_chunks_mut(CHUNK)
        .zip(grads.par_chunks(CHUNK))
        .zip(
            exp_avg
                .par_chunks_mut(CHUNK)
                .zip(exp_avg_sq.par_chunks_mut(CHUNK)),
        );
    match bf16_out {
        None => it.for_each(|((p, g), (m, v))| chunk(p, g, m, v, None)),
        Some(o) => it
            .zip(o.par_chunks_mut(CHUNK))
            .for_each(|(((p, g), (m, v)), o)| chunk(p, g, m, v, Some(o))),
    }
    Ok(())
}

/// The slow twin of [`adamw_update`]: one plain loop, stoker-train's `AdamW::step`
/// body for one segment.
pub fn adamw_update_scalar(
    s: &AdamWStep,
    decay: bool,
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
) {
    for i in 0..p.len() {
        if decay {
            p[i] *= s.decay;
        }
        m[i] += s.w1 * (g[i] - m[i]);
        v[i] = v[i] * s.beta2 + s.w2 * g[i] * g[i];
        let denom = v[i].sqrt() / s.bc2_sqrt + s.eps;
        p[i] = (-s.step_size).mul_add(m[i] / denom, p[i]);
    }
}

#[inline(always)]
fn sgd_elem(s: &SgdStep, wd: f32, p: &mut f32, g: f32, buf: Option<&mut f32>) {
    let mut d = g;
    if wd != 0.0 {
        d = wd.mul_add(*p, d);
    }
    if let Some(b) = buf {
        *b = if s.first { d } else { *b * s.momentum + d };
        d = if s.nesterov {
            s.momentum.mul_add(*b, d)
        } else {
            *b
        };
    }
    *p = (-s.lr).mul_add(d, *p);
}

#[inline(always)]
fn sgd_chunk(
    s: &SgdStep,
    wd: f32,
    p: &mut [f32],
    g: &[f32],
    buf: &mut [f32],
    out: Option<&mut [bf16]>,
) {
    let momentum = s.momentum != 0.0;
    let store = |o: Option<&mut bf16>, p: f32| {
        if let Some(o) = o {
            *o = to_bf16(p);
        }
    };
    let mut out = out.map(|o| o.iter_mut());
    if momentum {
        for ((p, &g), b) in p.iter_mut().zip(g).zip(buf.iter_mut()) {
            sgd_elem(s, wd, p, g, Some(b));
            store(out.as_mut().and_then(|o| o.next()), *p);
        }
    } else {
        for (p, &g) in p.iter_mut().zip(g) {
            sgd_elem(s, wd, p, g, None);
            store(out.as_mut().and_then(|o| o.next()), *p);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn sgd_chunk_avx2(
    s: &SgdStep,
    wd: f32,
    p: &mut [f32],
    g: &[f32],
    buf: &mut [f32],
    out: Option<&mut [bf16]>,
) {
    sgd_chunk(s, wd, p, g, buf, out)
}

/// One SGD(-momentum) update of `params` (one segment) from `grads`; `momentum_buf`
/// must match `params` unless `s.momentum` is 0. `decay` says whether the segment takes
/// weight decay. With `bf16_out`, the updated weights are also written there.
pub fn sgd_update(
    s: &SgdStep,
    decay: bool,
    params: &mut [f32],
    grads: &[f32],
    momentum_buf: &mut [f32],
    bf16_out: Option<&mut [bf16]>,
) -> Result<(), KernelError> {
    let n = params.len();
    check_len("sgd", "grads", grads.len(), n)?;
    if s.momentum != 0.0 {
        check_len("sgd", "momentum_buf", momentum_buf.len(), n)?;
    }
    if let Some(o) = &bf16_out {
        check_len("sgd", "bf16_out", o.len(), n)?;
    }
    let wd = if decay { s.weight_decay } else { 0.0 };
    let fast = has_avx2_fma();
    let chunk = |p: &mut [f32], g: &[f32], b: &mut [f32], o: Option<&mut [bf16]>| {
        #[cfg(target_arch = "x86_64")]
        if fast {
            // SAFETY: the CPU has AVX2 and FMA (checked at run time above).
            return unsafe { sgd_chunk_avx2(s, wd, p, g, b, o) };
        }
        let _ = fast;
        sgd_chunk(s, wd, p, g, b, o)
    };
    // Without momentum the buffer may be empty: hand each chunk an empty slice.
    let nchunks = n.div_ceil(CHUNK);
    let bufs: Vec<&mut [f32]> = if s.momentum != 0.0 {
        momentum_buf.chunks_mut(CHUNK).collect()
    } else {
        (0..nchunks).map(|_| -> &mut [f32] { &mut [] }).collect()
    };
    let it = params
        .par_chunks_mut(CHUNK)
        .zip(grads.par_chunks(CHUNK))
        .zip(bufs);
    match bf16_out {
        None => it.for_each(|((p, g), b)| chunk(p, g, b, None)),
        Some(o) => it
            .zip(o.par_chunks_mut(CHUNK))
            .for_each(|(((p, g), b), o)| chunk(p, g, b, Some(o))),
    }
    Ok(())
}

/// The slow twin of [`sgd_update`]: stoker-train's `Sgd::step` body for one segment.
pub fn sgd_update_scalar(s: &SgdStep, decay: bool, p: &mut [f32], g: &[f32], buf: &mut [f32]) {
    for i in 0..p.len() {
        let mut d = g[i];
        if decay && s.weight_decay != 0.0 {
            d = s.weight_decay.mul_add(p[i], d);
        }
        if s.momentum != 0.0 {
            buf[i] = if s.first { d } else { buf[i] * s.momentum + d };
            d = if s.nesterov {
                s.momentum.mul_add(buf[i], d)
            } else {
                buf[i]
            };
        }
        p[i] = (-s.lr).mul_add(d, p[i]);
    }
}
