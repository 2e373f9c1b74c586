//! The GPU kernels' host build as safe functions over slices: every length is checked
//! against the shapes, and every token id and target against the vocabulary, before the
//! C function (cuda/host.cpp) runs. The tests hold these against stoker-kernels' CPU
//! twins; the device check holds the GPU against these, bit for bit.

use half::bf16;
use stoker_kernels::AdamWStep;

use crate::args::Heads;
use crate::error::{check_len, dim, GpuError};
use crate::ffi::{self, HostFns};
use crate::token_groups::TokenGroups;

/// The element types the kernels store activations in: f32 and bf16 (computing in f32).
pub trait Act: Copy + Default + Send + Sync + 'static + sealed::Sealed {}

impl Act for f32 {}
impl Act for bf16 {}

mod sealed {
    use super::*;

    /// Picks the element type's host functions; only f32 and bf16 have them.
    pub trait Sealed: Sized {
        fn fns() -> &'static HostFns<Self>;
    }

    impl Sealed for f32 {
        fn fns() -> &'static HostFns<f32> {
            &ffi::F32
        }
    }

    impl Sealed for bf16 {
        fn fns() -> &'static HostFns<bf16> {
            &ffi::BF16
        }
    }
}

/// Checks every id in `ids` lies in `0..limit`.
fn check_ids(
    kernel: &'static str,
    buffer: &'static str,
    ids: &[i32],
    limit: usize,
    skip: Option<i32>,
) -> Result<(), GpuError> {
    match ids
        .iter()
        .enumerate()
        .find(|&(_, &t)| Some(t) != skip && (t < 0 || t as usize >= limit))
    {
        Some((index, &t)) => Err(GpuError::OutOfRange {
            kernel,
            buffer,
            index,
            value: t as i64,
            limit,
        }),
        None => Ok(()),
    }
}

/// `out[b, t, :] = wte[tokens[b, t], :] + wpe[t, :]` over `tokens` `[B, t]`: the GPT's
/// embedding. `wte` is `[V, c]`, `wpe` at least `t` rows of `c`.
pub fn encoder_forward<T: Act>(
    out: &mut [T],
    tokens: &[i32],
    wte: &[T],
    wpe: &[T],
    t: usize,
    c: usize,
) -> Result<(), GpuError> {
    const K: &str = "encoder-forward";
    let (t32, c32) = (dim(K, "t", t)?, dim(K, "c", c)?);
    check_len(K, "tokens", tokens.len(), tokens.len() / t * t)?;
    check_len(K, "out", out.len(), tokens.len() * c)?;
    check_len(K, "wte", wte.len(), wte.len() / c * c)?;
    check_len(K, "wpe", wpe.len().min(t * c), t * c)?;
    check_ids(K, "tokens", tokens, wte.len() / c, None)?;
    // SAFETY: out holds tokens * c elements, every token indexes a whole row of wte,
    // and wpe holds t rows of c: every index the kernel forms is in bounds.
    unsafe {
        (T::fns().encoder_forward)(
            out.as_mut_ptr(),
            tokens.as_ptr(),
            wte.as_ptr(),
            wpe.as_ptr(),
            out.len() as i64,
            t32,
            c32,
        )
    };
    Ok(())
}

/// `dwpe[t, :] += sum over b of dout[b, t, :]` (f32 gradient, `dout` `[b, t, c]`).
pub fn encoder_backward_wpe<T: Act>(
    dwpe: &mut [f32],
    dout: &[T],
    b: usize,
    t: usize,
    c: usize,
) -> Result<(), GpuError> {
    const K: &str = "encoder-backward-wpe";
    let (b32, t32, c32) = (dim(K, "b", b)?, dim(K, "t", t)?, dim(K, "c", c)?);
    check_len(K, "dout", dout.len(), b * t * c)?;
    check_len(K, "dwpe", dwpe.len().min(t * c), t * c)?;
    // SAFETY: dout holds b * t * c elements and dwpe at least t * c.
    unsafe { (T::fns().encoder_backward_wpe)(dwpe.as_mut_ptr(), dout.as_ptr(), b32, t32, c32) };
    Ok(())
}

/// `dwte[token, :] += sum over the token's positions of dout[position, :]`, one writer
/// per row (`groups` from the batch's ids; `dout` `[positions, c]`).
pub fn encoder_backward_wte<T: Act>(
    dwte: &mut [f32],
    dout: &[T],
    groups: &TokenGroups,
    c: usize,
) -> Result<(), GpuError> {
    const K: &str = "encoder-backward-wte";
    let c32 = dim(K, "c", c)?;
    let u = dim(K, "distinct tokens", groups.tokens().len())?;
    check_len(K, "dout", dout.len(), groups.positions().len() * c)?;
    check_len(K, "dwte", dwte.len(), dwte.len() / c * c)?;
    check_ids(K, "tokens", groups.tokens(), dwte.len() / c, None)?;
    // SAFETY: TokenGroups holds positions 0..n with n = dout.len() / c (built from the
    // ids) and starts indexing them; every token was checked against dwte's rows.
    unsafe {
        (T::fns().encoder_backward_wte)(
            dwte.as_mut_ptr(),
            dout.as_ptr(),
            groups.tokens().as_ptr(),
            groups.starts().as_ptr(),
            groups.positions().as_ptr(),
            u,
            c32,
        )
    };
    Ok(())
}

/// GELU (tanh approximation) of `inp` into `out`.
pub fn gelu_forward<T: Act>(out: &mut [T], inp: &[T]) -> Result<(), GpuError> {
    check_len("gelu-forward", "out", out.len(), inp.len())?;
    // SAFETY: both hold inp.len() elements.
    unsafe { (T::fns().gelu_forward)(out.as_mut_ptr(), inp.as_ptr(), inp.len() as i64) };
    Ok(())
}

/// `g *= gelu'(inp)`: the output gradient becomes the input gradient in place.
pub fn gelu_backward_in_place<T: Act>(inp: &[T], g: &mut [T]) -> Result<(), GpuError> {
    check_len("gelu-backward", "g", g.len(), inp.len())?;
    let p = g.as_mut_ptr();
    // SAFETY: both hold inp.len() elements; the kernel reads and writes g element by
    // element, so the in-place call is its documented aliasing.
    unsafe { (T::fns().gelu_backward)(p, inp.as_ptr(), p, inp.len() as i64) };
    Ok(())
}

fn heads_len(kernel: &'static str, g: Heads) -> Result<usize, GpuError> {
    for (name, v) in [("b", g.b), ("t", g.t), ("h", g.h), ("d", g.d)] {
        dim(kernel, name, v.max(0) as usize)?;
    }
    Ok(g.elems())
}

/// `[B, T, 3, H, D]` (the QKV projection) to q, k, v each `[B, H, T, D]`, one after
/// another, or back (`back`: the gradients' direction).
pub fn qkv_heads<T: Act>(dst: &mut [T], src: &[T], g: Heads, back: bool) -> Result<(), GpuError> {
    const K: &str = "qkv-heads";
    let n = 3 * heads_len(K, g)?;
    check_len(K, "dst", dst.len(), n)?;
    check_len(K, "src", src.len(), n)?;
    let f = if back {
        T::fns().heads_to_qkv
    } else {
        T::fns().qkv_to_heads
    };
    // SAFETY: both hold 3 * b * h * t * d elements, the range of both index maps.
    unsafe { f(dst.as_mut_ptr(), src.as_ptr(), g) };
    Ok(())
}

/// `[B, H, T, D]` (attention's output per head) to `[B, T, H * D]`, or back.
pub fn merged_heads<T: Act>(
    dst: &mut [T],
    src: &[T],
    g: Heads,
    back: bool,
) -> Result<(), GpuError> {
    const K: &str = "merged-heads";
    let n = heads_len(K, g)?;
    check_len(K, "dst", dst.len(), n)?;
    check_len(K, "src", src.len(), n)?;
    let f = if back {
        T::fns().merged_to_heads
    } else {
        T::fns().heads_to_merged
    };
    // SAFETY: both hold b * h * t * d elements, the range of both index maps.
    unsafe { f(dst.as_mut_ptr(), src.as_ptr(), g) };
    Ok(())
}

/// `dst[col] += sum over rows of x[row, col]` (`x` `[rows, cols]`): a bias gradient, as
/// `parts` row chunks summed each, then the chunks summed in order.
pub fn column_sums_add<T: Act>(dst: &mut [f32], x: &[T], parts: usize) -> Result<(), GpuError> {
    const K: &str = "column-sums";
    let cols = dim(K, "cols", dst.len())?;
    let r = dim(K, "parts", parts)?;
    check_len(K, "x", x.len(), x.len() / dst.len() * dst.len())?;
    let rows = x.len() / dst.len();
    let chunk = rows.div_ceil(parts).max(1);
    let mut partials = vec![0.0f32; parts * dst.len()];
    // SAFETY: partials holds parts * cols; each part reads rows below min(end, rows).
    unsafe {
        (T::fns().column_partials)(
            partials.as_mut_ptr(),
            x.as_ptr(),
            rows as i64,
            cols,
            r,
            chunk as i64,
        )
    };
    // SAFETY: dst holds cols, partials parts rows of cols.
    unsafe { ffi::reduce_partials(dst.as_mut_ptr(), partials.as_ptr(), r, cols, cols as i64) };
    Ok(())
}

/// Layer norm's statistics, per row.
pub struct RowStats<'a> {
    /// Each row's mean.
    pub mean: &'a mut [f32],
    /// Each row's reciprocal standard deviation.
    pub rstd: &'a mut [f32],
}

/// Layer norm of `x` `[rows, C]` (C = weight's length) into `out`, its statistics into
/// `stats`. With `residual = Some((sum, a2))`, the rows are first `x + a2`, written to
/// `sum` (llm.c's fused residual).
pub fn layernorm_forward<T: Act>(
    out: &mut [T],
    stats: RowStats,
    x: &[T],
    residual: Option<(&mut [T], &[T])>,
    weight: &[T],
    bias: &[T],
    eps: f32,
) -> Result<(), GpuError> {
    const K: &str = "layernorm-forward";
    let c = dim(K, "c", weight.len())?;
    check_len(K, "bias", bias.len(), weight.len())?;
    check_len(K, "x", x.len(), stats.mean.len() * weight.len())?;
    check_len(K, "out", out.len(), x.len())?;
    check_len(K, "rstd", stats.rstd.len(), stats.mean.len())?;
    let (sum, a2) = match residual {
        Some((s, a2)) => {
            check_len(K, "residual sum", s.len(), x.len())?;
            check_len(K, "residual", a2.len(), x.len())?;
            (s.as_mut_ptr(), a2.as_ptr())
        }
        None => (std::ptr::null_mut(), std::ptr::null()),
    };
    // SAFETY: x, out (and the residual pair when given) hold rows * c, the stats rows,
    // weight and bias c; the kernel reads a2 and writes sum only when they are not null.
    unsafe {
        (T::fns().layernorm_forward)(
            out.as_mut_ptr(),
            stats.mean.as_mut_ptr(),
            stats.rstd.as_mut_ptr(),
            sum,
            x.as_ptr(),
            a2,
            weight.as_ptr(),
            bias.as_ptr(),
            stats.mean.len() as i64,
            c,
            eps,
        )
    };
    Ok(())
}

/// Layer norm's gradients: the input's added to `dinp`, the weight's and bias's added
/// to `dweight`, `dbias` (f32), from the forward's input and statistics. `warps` is the
/// number of row groups the weight gradient is summed in (part of the bracketing).
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward<T: Act>(
    dinp: &mut [T],
    dweight: &mut [f32],
    dbias: &mut [f32],
    dout: &[T],
    x: &[T],
    weight: &[T],
    mean: &[f32],
    rstd: &[f32],
    warps: usize,
) -> Result<(), GpuError> {
    const K: &str = "layernorm-backward";
    let c = dim(K, "c", weight.len())?;
    let w = dim(K, "warps", warps)?;
    let rows = mean.len();
    for (name, got) in [("dinp", dinp.len()), ("dout", dout.len()), ("x", x.len())] {
        check_len(K, name, got, rows * weight.len())?;
    }
    check_len(K, "rstd", rstd.len(), rows)?;
    check_len(K, "dweight", dweight.len(), weight.len())?;
    check_len(K, "dbias", dbias.len(), weight.len())?;
    let stride = 2 * weight.len();
    let mut partials = vec![0.0f32; warps * stride];
    // SAFETY: dinp, dout, x hold rows * c, the stats rows, weight c; partials warps
    // rows of 2c, each warp writing its own.
    unsafe {
        (T::fns().layernorm_backward)(
            dinp.as_mut_ptr(),
            partials.as_mut_ptr(),
            dout.as_ptr(),
            x.as_ptr(),
            weight.as_ptr(),
            mean.as_ptr(),
            rstd.as_ptr(),
            rows as i64,
            c,
            w,
        )
    };
    // SAFETY: dweight and dbias hold c; the partial rows have stride 2c, dbias's half at c.
    unsafe {
        ffi::reduce_partials(dweight.as_mut_ptr(), partials.as_ptr(), w, c, stride as i64);
        ffi::reduce_partials(
            dbias.as_mut_ptr(),
            partials[weight.len()..].as_ptr(),
            w,
            c,
            stride as i64,
        );
    }
    Ok(())
}

/// Causal softmax of `scale * pre` over rows of `t` (`[B*H, t, t]`), keys after the
/// query masked to 0, into `att`.
pub fn attention_softmax_forward<T: Act>(
    att: &mut [T],
    pre: &[T],
    t: usize,
    scale: f32,
) -> Result<(), GpuError> {
    const K: &str = "attention-softmax-forward";
    let t32 = dim(K, "t", t)?;
    check_len(K, "pre", pre.len(), pre.len() / (t * t) * t * t)?;
    check_len(K, "att", att.len(), pre.len())?;
    // SAFETY: both hold a whole number of t x t matrices.
    unsafe {
        (T::fns().attention_softmax_forward)(
            att.as_mut_ptr(),
            pre.as_ptr(),
            (pre.len() / t) as i64,
            t32,
            scale,
        )
    };
    Ok(())
}

/// The causal softmax's backward in place: `g` (the probabilities' gradient) becomes
/// the scores' (`pre`'s) gradient, from the forward's probabilities `att`.
pub fn attention_softmax_backward_in_place<T: Act>(
    att: &[T],
    g: &mut [T],
    t: usize,
    scale: f32,
) -> Result<(), GpuError> {
    const K: &str = "attention-softmax-backward";
    let t32 = dim(K, "t", t)?;
    check_len(K, "att", att.len(), att.len() / (t * t) * t * t)?;
    check_len(K, "g", g.len(), att.len())?;
    let p = g.as_mut_ptr();
    // SAFETY: both hold a whole number of t x t matrices; each element of g is read
    // before it is written, by the same lane (the kernel's documented aliasing).
    unsafe {
        (T::fns().attention_softmax_backward)(
            p,
            p,
            att.as_ptr(),
            (att.len() / t) as i64,
            t32,
            scale,
        )
    };
    Ok(())
}

/// The fused classifier over `logits` `[N, Vp]` (the first `v` columns real): each
/// row's loss into `losses`, and with `dscale` nonzero the logits overwritten by
/// `dscale * (softmax - onehot)`. Rows whose target is `ignore` get 0.
pub fn classifier<T: Act>(
    logits: &mut [T],
    losses: &mut [f32],
    targets: &[i32],
    v: usize,
    dscale: f32,
    ignore: i32,
) -> Result<(), GpuError> {
    const K: &str = "classifier";
    let n = dim(K, "rows", targets.len())? as usize;
    check_len(K, "losses", losses.len(), n)?;
    let vp = logits.len() / n;
    check_len(K, "logits", logits.len(), vp * n)?;
    let (v32, vp32) = (dim(K, "v", v)?, dim(K, "padded v", vp)?);
    if v > vp {
        return Err(GpuError::Shape {
            kernel: K,
            what: format!("v = {v} exceeds the logits' row of {vp}"),
        });
    }
    check_ids(K, "targets", targets, v, Some(ignore))?;
    // SAFETY: logits hold n rows of vp >= v, losses n; every target is in 0..v or the
    // ignored value, which the kernel never indexes with.
    unsafe {
        (T::fns().classifier)(
            logits.as_mut_ptr(),
            losses.as_mut_ptr(),
            targets.as_ptr(),
            n as i64,
            v32,
            vp32,
            dscale,
            ignore,
        )
    };
    Ok(())
}

/// One AdamW step over a segment (stoker-kernels' `adamw_update_scalar` bit for bit on
/// `g * grad_scale`), writing the bf16 copy when `copy` is given.
#[allow(clippy::too_many_arguments)]
pub fn adamw(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    copy: Option<&mut [bf16]>,
    step: &AdamWStep,
    decay: bool,
    grad_scale: f32,
) -> Result<(), GpuError> {
    const K: &str = "adamw";
    for (name, got) in [("g", g.len()), ("m", m.len()), ("v", v.len())] {
        check_len(K, name, got, p.len())?;
    }
    let copy = match copy {
        Some(c) => {
            check_len(K, "copy", c.len(), p.len())?;
            c.as_mut_ptr()
        }
        None => std::ptr::null_mut(),
    };
    // SAFETY: p, g, m, v (and copy when not null) hold p.len() elements.
    unsafe {
        ffi::adamw(
            p.as_mut_ptr(),
            g.as_ptr(),
            m.as_mut_ptr(),
            v.as_mut_ptr(),
            copy,
            p.len() as i64,
            step.into(),
            decay as i32,
            grad_scale,
        )
    };
    Ok(())
}

/// The sum of `x` (or of its squares) as the device brackets it: `warps` grid-stride
/// partial sums, then one warp over them.
pub fn sum(x: &[f32], squares: bool, warps: usize) -> Result<f32, GpuError> {
    let w = dim("sum", "warps", warps)?;
    let mut partials = vec![0.0f32; warps];
    let mut out = 0.0f32;
    // SAFETY: partials holds warps elements, one per warp; x is read below its length.
    unsafe {
        ffi::sum_partials(
            partials.as_mut_ptr(),
            x.as_ptr(),
            x.len() as i64,
            squares as i32,
            w,
        );
        ffi::sum(&mut out, partials.as_ptr(), warps as i64, 0);
    }
    Ok(out)
}
