//! The kernels as checked calls, written once for every backend: each checks its views'
//! lengths against the shapes (and its ids against their tables) and only then builds
//! the [`Call`] and launches it. Errors name the kernel and the buffer.

use half::bf16;
use stoker_kernels::AdamWStep;

use crate::args::Heads;
use crate::backend::{Backend, View};
use crate::call::{Addr, Call};
use crate::elem::Act;
use crate::error::{check_len, dim, GpuError};
use crate::ids::{Groups, Ids};

/// `view` holds at least `want` elements.
pub(crate) fn at_least<E>(
    kernel: &'static str,
    buffer: &'static str,
    view: &View<E>,
    want: usize,
) -> Result<(), GpuError> {
    check_len(kernel, buffer, view.len().min(want), want)
}

/// `out[b, t, :] = wte[tokens[b, t], :] + wpe[t, :]` over `tokens` `[B, t]`: the GPT's
/// embedding. `wte` holds at least the ids' limit rows of `c`, `wpe` at least `t`.
pub fn encoder_forward<B: Backend, T: Act>(
    b: &B,
    out: View<T>,
    tokens: &Ids<B>,
    wte: View<T>,
    wpe: Option<View<T>>,
    t: usize,
    c: usize,
) -> Result<(), GpuError> {
    const K: &str = "encoder-forward";
    let (t32, c32) = (dim(K, "t", t)?, dim(K, "c", c)?);
    let n = tokens.len();
    check_len(K, "tokens", n, n / t * t)?;
    check_len(K, "out", out.len(), n * c)?;
    at_least(K, "wte", &wte, tokens.limit * c)?;
    if let Some(wpe) = &wpe {
        at_least(K, "wpe", wpe, t * c)?;
    }
    let call = Call::EncoderForward {
        dtype: T::DTYPE,
        out: out.addr(),
        tokens: b.addr(&tokens.buf),
        wte: wte.addr(),
        wpe: wpe.map_or(0, |w| w.addr()),
        n: out.len() as i64,
        t: t32,
        c: c32,
    };
    // SAFETY: out holds n * c, every id is below the limit whose rows wte holds, wpe
    // (when not 0) holds t rows: every element the kernel touches is inside a view.
    unsafe { b.launch(&call) }
}

/// `dwpe[t, :] += sum over b of dout[b, t, :]` (f32 gradient, `dout` `[bsz, t, c]`).
pub fn encoder_backward_wpe<B: Backend, T: Act>(
    b: &B,
    dwpe: View<f32>,
    dout: View<T>,
    bsz: usize,
    t: usize,
    c: usize,
) -> Result<(), GpuError> {
    const K: &str = "encoder-backward-wpe";
    let (b32, t32, c32) = (dim(K, "b", bsz)?, dim(K, "t", t)?, dim(K, "c", c)?);
    check_len(K, "dout", dout.len(), bsz * t * c)?;
    at_least(K, "dwpe", &dwpe, t * c)?;
    let call = Call::EncoderBackwardWpe {
        dtype: T::DTYPE,
        dwpe: dwpe.addr(),
        dout: dout.addr(),
        b: b32,
        t: t32,
        c: c32,
    };
    // SAFETY: dout holds bsz * t * c and dwpe at least t * c.
    unsafe { b.launch(&call) }
}

/// `dwte[token, :] += sum over the token's positions of dout[position, :]`, one writer
/// per row (`groups` from the batch's ids; `dout` `[positions, c]`), launched over as
/// many groups as positions whatever the batch (the empty padding groups do nothing).
pub fn encoder_backward_wte<B: Backend, T: Act>(
    b: &B,
    dwte: View<f32>,
    dout: View<T>,
    groups: &Groups<B>,
    c: usize,
) -> Result<(), GpuError> {
    const K: &str = "encoder-backward-wte";
    let c32 = dim(K, "c", c)?;
    let u = dim(K, "groups", groups.positions())?;
    check_len(K, "dout", dout.len(), groups.positions() * c)?;
    at_least(K, "dwte", &dwte, groups.limit * c)?;
    let call = Call::EncoderBackwardWte {
        dtype: T::DTYPE,
        dwte: dwte.addr(),
        dout: dout.addr(),
        uniq: b.addr(&groups.tokens),
        starts: b.addr(&groups.starts),
        positions: b.addr(&groups.positions),
        u,
        c: c32,
    };
    // SAFETY: the groups hold positions 0..dout.len() / c (TokenGroups builds them from
    // the ids), `u` groups (their buffers hold u tokens and u + 1 starts, the padding's
    // empty) and tokens below the limit whose rows dwte holds.
    unsafe { b.launch(&call) }
}

/// `dst += x`, element by element (a block's gradients added into a window's sum).
pub fn add_into<B: Backend>(b: &B, dst: View<f32>, x: View<f32>) -> Result<(), GpuError> {
    check_len("add-into", "x", x.len(), dst.len())?;
    if dst.is_empty() {
        return Ok(());
    }
    let cols = dim("add-into", "elements", dst.len())?;
    // One partial row: dst[i] += 0 + x[i], which is dst[i] + x[i] exactly.
    let call = Call::ReducePartials {
        dst: dst.addr(),
        partials: x.addr(),
        p: 1,
        cols,
        stride: cols as i64,
    };
    // SAFETY: dst and x hold cols elements each (checked).
    unsafe { b.launch(&call) }
}

/// `x` rounded to nearest even into `out` (the compute copy of an f32 master).
pub fn from_f32<B: Backend, T: Act>(b: &B, out: View<T>, x: View<f32>) -> Result<(), GpuError> {
    check_len("from-f32", "out", out.len(), x.len())?;
    let call = Call::FromF32 {
        dtype: T::DTYPE,
        out: out.addr(),
        x: x.addr(),
        n: x.len() as i64,
    };
    // SAFETY: both hold x.len() elements.
    unsafe { b.launch(&call) }
}

/// GELU (tanh approximation) of `inp` into `out`.
pub fn gelu_forward<B: Backend, T: Act>(b: &B, out: View<T>, inp: View<T>) -> Result<(), GpuError> {
    check_len("gelu-forward", "out", out.len(), inp.len())?;
    let call = Call::GeluForward {
        dtype: T::DTYPE,
        out: out.addr(),
        inp: inp.addr(),
        n: inp.len() as i64,
    };
    // SAFETY: both hold inp.len() elements.
    unsafe { b.launch(&call) }
}

/// `dinp = dout * gelu'(inp)`; `dinp` may be `dout` (in place).
pub fn gelu_backward<B: Backend, T: Act>(
    b: &B,
    dinp: View<T>,
    inp: View<T>,
    dout: View<T>,
) -> Result<(), GpuError> {
    check_len("gelu-backward", "dinp", dinp.len(), inp.len())?;
    check_len("gelu-backward", "dout", dout.len(), inp.len())?;
    let call = Call::GeluBackward {
        dtype: T::DTYPE,
        dinp: dinp.addr(),
        inp: inp.addr(),
        dout: dout.addr(),
        n: inp.len() as i64,
    };
    // SAFETY: all three hold inp.len() elements; the kernel works element by element.
    unsafe { b.launch(&call) }
}

pub(crate) fn heads_len(kernel: &'static str, g: Heads) -> Result<usize, GpuError> {
    for (name, v) in [("b", g.b), ("t", g.t), ("h", g.h), ("d", g.d)] {
        dim(kernel, name, v.max(0) as usize)?;
    }
    Ok(g.elems())
}

/// `[B, T, 3, H, D]` (the QKV projection) to q, k, v each `[B, H, T, D]`, one after
/// another, or back (`back`: the gradients' direction).
pub fn qkv_heads<B: Backend, T: Act>(
    b: &B,
    dst: View<T>,
    src: View<T>,
    g: Heads,
    back: bool,
) -> Result<(), GpuError> {
    const K: &str = "qkv-heads";
    let n = 3 * heads_len(K, g)?;
    check_len(K, "dst", dst.len(), n)?;
    check_len(K, "src", src.len(), n)?;
    let (dtype, dst, src) = (T::DTYPE, dst.addr(), src.addr());
    let call = if back {
        Call::HeadsToQkv { dtype, dst, src, g }
    } else {
        Call::QkvToHeads { dtype, dst, src, g }
    };
    // SAFETY: both hold 3 * b * h * t * d elements, the range of both index maps.
    unsafe { b.launch(&call) }
}

/// `[B, H, T, D]` (attention's output per head) to `[B, T, H * D]`, or back.
pub fn merged_heads<B: Backend, T: Act>(
    b: &B,
    dst: View<T>,
    src: View<T>,
    g: Heads,
    back: bool,
) -> Result<(), GpuError> {
    const K: &str = "merged-heads";
    let n = heads_len(K, g)?;
    check_len(K, "dst", dst.len(), n)?;
    check_len(K, "src", src.len(), n)?;
    let (dtype, dst, src) = (T::DTYPE, dst.addr(), src.addr());
    let call = if back {
        Call::MergedToHeads { dtype, dst, src, g }
    } else {
        Call::HeadsToMerged { dtype, dst, src, g }
    };
    // SAFETY: both hold b * h * t * d elements, the range of both index maps.
    unsafe { b.launch(&call) }
}

/// `dst[col] += sum over rows of x[row, col]` (`x` `[rows, cols]`, cols = dst's length):
/// a bias gradient, as `parts` row chunks summed into `partials`, then the chunks
/// summed in order.
pub fn column_sums_add<B: Backend, T: Act>(
    b: &B,
    dst: View<f32>,
    x: View<T>,
    partials: View<f32>,
    parts: usize,
) -> Result<(), GpuError> {
    const K: &str = "column-sums";
    let cols = dim(K, "cols", dst.len())?;
    let r = dim(K, "parts", parts)?;
    let rows = x.len() / dst.len();
    check_len(K, "x", x.len(), rows * dst.len())?;
    at_least(K, "partials", &partials, parts * dst.len())?;
    let chunk = rows.div_ceil(parts).max(1) as i64;
    let first = Call::ColumnPartials {
        dtype: T::DTYPE,
        partials: partials.addr(),
        x: x.addr(),
        n: rows as i64,
        cols,
        r,
        chunk,
    };
    let second = Call::ReducePartials {
        dst: dst.addr(),
        partials: partials.addr(),
        p: r,
        cols,
        stride: cols as i64,
    };
    // SAFETY: partials holds parts * cols, x rows * cols, dst cols; each part reads rows
    // below min(its end, rows).
    unsafe {
        b.launch(&first)?;
        b.launch(&second)
    }
}

/// A fused residual's addresses (its sum's and its second addend's), each checked to hold
/// `len` elements; (0, 0) without one: what the norms' forward kernels take.
pub(crate) fn residual_addrs<T>(
    kernel: &'static str,
    residual: Option<(View<T>, View<T>)>,
    len: usize,
) -> Result<(Addr, Addr), GpuError> {
    match residual {
        Some((s, a2)) => {
            check_len(kernel, "residual sum", s.len(), len)?;
            check_len(kernel, "residual", a2.len(), len)?;
            Ok((s.addr(), a2.addr()))
        }
        None => Ok((0, 0)),
    }
}

/// Layer norm's per-row statistics.
#[derive(Debug, Clone, Copy)]
pub struct Stats<'a> {
    /// Each row's mean.
    pub mean: View<'a, f32>,
    /// Each row's reciprocal standard deviation.
    pub rstd: View<'a, f32>,
}

/// Layer norm of `x` `[rows, C]` (C = weight's length) into `out`, its statistics into
/// `stats`. With `residual = Some((sum, a2))` the rows are first `x + a2`, written to
/// `sum` (llm.c's fused residual).
#[allow(clippy::too_many_arguments)]
pub fn layernorm_forward<B: Backend, T: Act>(
    b: &B,
    out: View<T>,
    stats: Stats,
    x: View<T>,
    residual: Option<(View<T>, View<T>)>,
    weight: View<T>,
    bias: View<T>,
    eps: f32,
) -> Result<(), GpuError> {
    const K: &str = "layernorm-forward";
    let c = dim(K, "c", weight.len())?;
    let rows = stats.mean.len();
    check_len(K, "bias", bias.len(), weight.len())?;
    check_len(K, "x", x.len(), rows * weight.len())?;
    check_len(K, "out", out.len(), x.len())?;
    check_len(K, "rstd", stats.rstd.len(), rows)?;
    let (resid, a2) = residual_addrs(K, residual, x.len())?;
    let call = Call::LayernormForward {
        dtype: T::DTYPE,
        out: out.addr(),
        mean: stats.mean.addr(),
        rstd: stats.rstd.addr(),
        resid,
        a: x.addr(),
        a2,
        weight: weight.addr(),
        bias: bias.addr(),
        n: rows as i64,
        c,
        eps,
    };
    // SAFETY: x, out (and the residual pair when given) hold rows * c, the statistics
    // rows, weight and bias c; the kernel touches a2 and sum only when they are not 0.
    unsafe { b.launch(&call) }
}

/// Layer norm's backward: the input's gradient added to `dinp`, the weight's and bias's
/// added to `dweight`, `dbias`, through `warps` partial rows (`partials`: at least
/// `warps * 2 * C`; the warp count is part of the bracketing).
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward<B: Backend, T: Act>(
    b: &B,
    dinp: View<T>,
    dweight: View<f32>,
    dbias: View<f32>,
    partials: View<f32>,
    dout: View<T>,
    x: View<T>,
    weight: View<T>,
    stats: Stats,
    warps: usize,
) -> Result<(), GpuError> {
    const K: &str = "layernorm-backward";
    let c = dim(K, "c", weight.len())?;
    let w = dim(K, "warps", warps)?;
    let rows = stats.mean.len();
    for (name, got) in [("dinp", dinp.len()), ("dout", dout.len()), ("x", x.len())] {
        check_len(K, name, got, rows * weight.len())?;
    }
    check_len(K, "rstd", stats.rstd.len(), rows)?;
    check_len(K, "dweight", dweight.len(), weight.len())?;
    check_len(K, "dbias", dbias.len(), weight.len())?;
    let stride = 2 * weight.len();
    at_least(K, "partials", &partials, warps * stride)?;
    let rows_call = Call::LayernormBackward {
        dtype: T::DTYPE,
        dinp: dinp.addr(),
        partials: partials.addr(),
        dout: dout.addr(),
        inp: x.addr(),
        weight: weight.addr(),
        mean: stats.mean.addr(),
        rstd: stats.rstd.addr(),
        n: rows as i64,
        c,
        warps: w,
    };
    let dbias_partials = partials.slice(weight.len()..partials.len())?;
    let sum_w = Call::ReducePartials {
        dst: dweight.addr(),
        partials: partials.addr(),
        p: w,
        cols: c,
        stride: stride as i64,
    };
    let sum_b = Call::ReducePartials {
        dst: dbias.addr(),
        partials: dbias_partials.addr(),
        p: w,
        cols: c,
        stride: stride as i64,
    };
    // SAFETY: dinp, dout, x hold rows * c, the statistics rows, weight, dweight and
    // dbias c; partials warps rows of 2c, each warp writing its own, dbias's half at c.
    unsafe {
        b.launch(&rows_call)?;
        b.launch(&sum_w)?;
        b.launch(&sum_b)
    }
}

/// Rows of `t` in a whole number of `t x t` matrices: `view`'s row count.
fn square_rows<E>(
    kernel: &'static str,
    buffer: &'static str,
    view: &View<E>,
    t: usize,
) -> Result<i64, GpuError> {
    check_len(kernel, buffer, view.len(), view.len() / (t * t) * t * t)?;
    Ok((view.len() / t) as i64)
}

/// `chunk` as query rows per chunk of `t`: 1 to `t`.
fn chunk_rows(kernel: &'static str, chunk: usize, t: usize) -> Result<i32, GpuError> {
    if chunk == 0 || chunk > t {
        return Err(GpuError::Shape {
            kernel,
            what: format!("query chunks of {chunk} rows for {t} positions (1 to {t})"),
        });
    }
    dim(kernel, "chunk", chunk)
}

/// Causal softmax of `scale * pre` over rows of `t` (`[B*H, t, t]`), keys after the
/// query masked to 0, into `att`; queries in chunks of `chunk` rows, each row written up
/// to its chunk's last query (`t`: every row whole).
pub fn attention_softmax_forward<B: Backend, T: Act>(
    b: &B,
    att: View<T>,
    pre: View<T>,
    (t, chunk): (usize, usize),
    scale: f32,
) -> Result<(), GpuError> {
    const K: &str = "attention-softmax-forward";
    let t32 = dim(K, "t", t)?;
    let chunk = chunk_rows(K, chunk, t)?;
    let rows = square_rows(K, "pre", &pre, t)?;
    check_len(K, "att", att.len(), pre.len())?;
    let call = Call::AttentionSoftmaxForward {
        dtype: T::DTYPE,
        att: att.addr(),
        pre: pre.addr(),
        rows,
        t: t32,
        chunk,
        scale,
    };
    // SAFETY: both hold a whole number of t x t matrices.
    unsafe { b.launch(&call) }
}

/// The causal softmax's backward: `dpre` (which may be `datt`) from the probabilities'
/// gradient `datt` and the forward's probabilities `att`, queries in chunks of `chunk`
/// rows as in the forward.
pub fn attention_softmax_backward<B: Backend, T: Act>(
    b: &B,
    dpre: View<T>,
    datt: View<T>,
    att: View<T>,
    (t, chunk): (usize, usize),
    scale: f32,
) -> Result<(), GpuError> {
    const K: &str = "attention-softmax-backward";
    let t32 = dim(K, "t", t)?;
    let chunk = chunk_rows(K, chunk, t)?;
    let rows = square_rows(K, "att", &att, t)?;
    check_len(K, "datt", datt.len(), att.len())?;
    check_len(K, "dpre", dpre.len(), att.len())?;
    let call = Call::AttentionSoftmaxBackward {
        dtype: T::DTYPE,
        dpre: dpre.addr(),
        datt: datt.addr(),
        att: att.addr(),
        rows,
        t: t32,
        chunk,
        scale,
    };
    // SAFETY: all hold a whole number of t x t matrices; each element of datt is read
    // before the same lane writes dpre there (the kernel's documented aliasing).
    unsafe { b.launch(&call) }
}

/// The fused classifier over `logits` `[N, Vp]` (the first `v` columns real): each
/// row's loss into `losses`, with `hits` each row's top-1 hit (1 where the target is the
/// first largest logit), and with `dscale` given the logits overwritten by their
/// gradient `dscale * (softmax - onehot)` (0 where the scale is 0). Rows whose target is
/// `ignore` get 0.
#[allow(clippy::too_many_arguments)]
pub fn classifier<B: Backend, T: Act>(
    b: &B,
    logits: View<T>,
    losses: View<f32>,
    hits: Option<View<f32>>,
    targets: &Ids<B>,
    v: usize,
    dscale: Option<f32>,
    ignore: i32,
) -> Result<(), GpuError> {
    const K: &str = "classifier";
    let n = dim(K, "rows", targets.len())? as usize;
    check_len(K, "losses", losses.len(), n)?;
    if let Some(h) = &hits {
        check_len(K, "hits", h.len(), n)?;
    }
    let vp = logits.len() / n;
    check_len(K, "logits", logits.len(), vp * n)?;
    let (v32, vp32) = (dim(K, "v", v)?, dim(K, "padded v", vp)?);
    if v > vp || targets.limit > v || targets.skip.is_some_and(|s| s != ignore) {
        return Err(GpuError::Shape {
            kernel: K,
            what: format!("v = {v} with rows of {vp}, targets checked against {} (skipping {:?}), ignore {ignore}", targets.limit, targets.skip),
        });
    }
    let call = Call::Classifier {
        dtype: T::DTYPE,
        logits: logits.addr(),
        losses: losses.addr(),
        hits: hits.map_or(0, |h| h.addr()),
        targets: b.addr(&targets.buf),
        n: n as i64,
        v: v32,
        vp: vp32,
        grad: dscale.is_some() as i32,
        dscale: dscale.unwrap_or(0.0),
        ignore,
    };
    // SAFETY: logits hold n rows of vp >= v, losses (and hits when not 0) n; every
    // target is below v or the ignore index, which the kernel never indexes with.
    unsafe { b.launch(&call) }
}

/// One AdamW step over a segment (stoker-kernels' `adamw_update_scalar` bit for bit on
/// `g * grad_scale`), writing the bf16 copy when `copy` is given.
#[allow(clippy::too_many_arguments)]
pub fn adamw<B: Backend>(
    b: &B,
    p: View<f32>,
    g: View<f32>,
    m: View<f32>,
    v: View<f32>,
    copy: Option<View<bf16>>,
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
            c.addr()
        }
        None => 0,
    };
    let call = Call::Adamw {
        p: p.addr(),
        g: g.addr(),
        m: m.addr(),
        v: v.addr(),
        copy,
        n: p.len() as i64,
        s: step.into(),
        decay: decay as i32,
        grad_scale,
    };
    // SAFETY: p, g, m, v (and copy when not 0) hold p.len() elements.
    unsafe { b.launch(&call) }
}

/// `out[0]` = (or += with `accumulate`) the sum of `x` (or of its squares) as the device
/// brackets it: `warps` grid-stride partial sums into `partials`, then one warp.
pub fn sum<B: Backend>(
    b: &B,
    out: View<f32>,
    x: View<f32>,
    partials: View<f32>,
    squares: bool,
    warps: usize,
    accumulate: bool,
) -> Result<(), GpuError> {
    const K: &str = "sum";
    let w = dim(K, "warps", warps)?;
    check_len(K, "out", out.len(), 1)?;
    at_least(K, "partials", &partials, warps)?;
    let first = Call::SumPartials {
        partials: partials.addr(),
        x: x.addr(),
        n: x.len() as i64,
        squares: squares as i32,
        warps: w,
    };
    let second = Call::Sum {
        out: out.addr(),
        x: partials.addr(),
        n: warps as i64,
        accumulate: accumulate as i32,
    };
    // SAFETY: partials holds warps elements, one per warp; x is read below its length;
    // out holds one.
    unsafe {
        b.launch(&first)?;
        b.launch(&second)
    }
}
