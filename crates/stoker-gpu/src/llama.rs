//! The Llama's kernels as checked calls (cuda/ops/llama.cuh), for any backend: RMSNorm
//! and its backward, rotary embeddings in place, SwiGLU and its backward, and
//! grouped-query attention's key/value heads repeated to the query heads and back.

use crate::args::Heads;
use crate::backend::{Backend, View};
use crate::call::Call;
use crate::elem::Act;
use crate::error::{check_len, dim, GpuError};
use crate::kernels::{at_least, heads_len, residual_addrs};

/// RMSNorm of `x` `[rows, C]` (C = weight's length) into `out`, each row's reciprocal
/// root mean square into `rstd`. With `residual = Some((sum, a2))` the rows are first
/// `x + a2`, written to `sum`.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_forward<B: Backend, T: Act>(
    b: &B,
    out: View<T>,
    rstd: View<f32>,
    x: View<T>,
    residual: Option<(View<T>, View<T>)>,
    weight: View<T>,
    eps: f32,
) -> Result<(), GpuError> {
    const K: &str = "rmsnorm-forward";
    let c = dim(K, "c", weight.len())?;
    let rows = rstd.len();
    check_len(K, "x", x.len(), rows * weight.len())?;
    check_len(K, "out", out.len(), x.len())?;
    let (resid, a2) = residual_addrs(K, residual, x.len())?;
    let call = Call::RmsnormForward {
        dtype: T::DTYPE,
        out: out.addr(),
        rstd: rstd.addr(),
        resid,
        a: x.addr(),
        a2,
        weight: weight.addr(),
        n: rows as i64,
        c,
        eps,
    };
    // SAFETY: x, out (and the residual pair when given) hold rows * c, rstd rows, the
    // weight c; the kernel touches a2 and sum only when they are not 0.
    unsafe { b.launch(&call) }
}

/// RMSNorm's backward: the input's gradient added to `dinp`, the weight's added to
/// `dweight` through `warps` partial rows (`partials`: at least `warps * C`).
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward<B: Backend, T: Act>(
    b: &B,
    dinp: View<T>,
    dweight: View<f32>,
    partials: View<f32>,
    dout: View<T>,
    x: View<T>,
    weight: View<T>,
    rstd: View<f32>,
    warps: usize,
) -> Result<(), GpuError> {
    const K: &str = "rmsnorm-backward";
    let c = dim(K, "c", weight.len())?;
    let w = dim(K, "warps", warps)?;
    let rows = rstd.len();
    for (name, got) in [("dinp", dinp.len()), ("dout", dout.len()), ("x", x.len())] {
        check_len(K, name, got, rows * weight.len())?;
    }
    check_len(K, "dweight", dweight.len(), weight.len())?;
    at_least(K, "partials", &partials, warps * weight.len())?;
    let rows_call = Call::RmsnormBackward {
        dtype: T::DTYPE,
        dinp: dinp.addr(),
        partials: partials.addr(),
        dout: dout.addr(),
        inp: x.addr(),
        weight: weight.addr(),
        rstd: rstd.addr(),
        n: rows as i64,
        c,
        warps: w,
    };
    let sum = Call::ReducePartials {
        dst: dweight.addr(),
        partials: partials.addr(),
        p: w,
        cols: c,
        stride: c as i64,
    };
    // SAFETY: dinp, dout, x hold rows * c, rstd rows, weight and dweight c; partials
    // warps rows of c, each warp writing its own.
    unsafe {
        b.launch(&rows_call)?;
        b.launch(&sum)
    }
}

/// Rotary embeddings in place on `x` `[B, t, h, d]` (rotate-half; `d` even), with
/// `cos`, `sin` `[t, d/2]` (stoker-kernels' `rope::tables`); `inverse` turns back (the
/// backward).
#[allow(clippy::too_many_arguments)]
pub fn rope<B: Backend, T: Act>(
    b: &B,
    x: View<T>,
    cos: View<f32>,
    sin: View<f32>,
    t: usize,
    h: usize,
    d: usize,
    inverse: bool,
) -> Result<(), GpuError> {
    const K: &str = "rope";
    let (t32, h32, d32) = (dim(K, "t", t)?, dim(K, "h", h)?, dim(K, "d", d)?);
    if !d.is_multiple_of(2) {
        return Err(GpuError::Shape {
            kernel: K,
            what: format!("head width {d} must be even"),
        });
    }
    check_len(K, "x", x.len(), x.len() / (t * h * d) * t * h * d)?;
    check_len(K, "cos", cos.len(), t * d / 2)?;
    check_len(K, "sin", sin.len(), t * d / 2)?;
    let call = Call::Rope {
        dtype: T::DTYPE,
        x: x.addr(),
        cos: cos.addr(),
        sin: sin.addr(),
        n: (x.len() / 2) as i64,
        t: t32,
        h: h32,
        d: d32,
        sign: if inverse { -1.0 } else { 1.0 },
    };
    // SAFETY: x holds a whole number of [t, h, d] sequences (each pair index below
    // x.len() / 2 maps inside it), the tables t rows of d / 2.
    unsafe { b.launch(&call) }
}

/// `y = silu(gate) * up`.
pub fn swiglu_forward<B: Backend, T: Act>(
    b: &B,
    y: View<T>,
    gate: View<T>,
    up: View<T>,
) -> Result<(), GpuError> {
    check_len("swiglu-forward", "up", up.len(), gate.len())?;
    check_len("swiglu-forward", "y", y.len(), gate.len())?;
    let call = Call::SwigluForward {
        dtype: T::DTYPE,
        y: y.addr(),
        gate: gate.addr(),
        up: up.addr(),
        n: gate.len() as i64,
    };
    // SAFETY: all three hold gate.len() elements.
    unsafe { b.launch(&call) }
}

/// SwiGLU's backward: `dgate` and `dup` from `dy` (either may be `dy`: element by element).
pub fn swiglu_backward<B: Backend, T: Act>(
    b: &B,
    dgate: View<T>,
    dup: View<T>,
    gate: View<T>,
    up: View<T>,
    dy: View<T>,
) -> Result<(), GpuError> {
    const K: &str = "swiglu-backward";
    for (name, got) in [
        ("up", up.len()),
        ("dy", dy.len()),
        ("dgate", dgate.len()),
        ("dup", dup.len()),
    ] {
        check_len(K, name, got, gate.len())?;
    }
    let call = Call::SwigluBackward {
        dtype: T::DTYPE,
        dgate: dgate.addr(),
        dup: dup.addr(),
        gate: gate.addr(),
        up: up.addr(),
        dy: dy.addr(),
        n: gate.len() as i64,
    };
    // SAFETY: all five hold gate.len() elements; each thread reads its element of every
    // input before writing its element of both outputs.
    unsafe { b.launch(&call) }
}

/// Keys or values `[B, T, kv, D]` repeated to the query heads `[B, H, T, D]` (query head
/// h reads kv head h / (H / kv)), or (`back`) the heads' gradients summed back to
/// `[B, T, kv, D]`.
pub fn kv_heads<B: Backend, T: Act>(
    b: &B,
    dst: View<T>,
    src: View<T>,
    g: Heads,
    kv: usize,
    back: bool,
) -> Result<(), GpuError> {
    const K: &str = "kv-heads";
    let n = heads_len(K, g)?;
    let kv32 = dim(K, "kv heads", kv)?;
    if !(g.h as usize).is_multiple_of(kv) {
        return Err(GpuError::Shape {
            kernel: K,
            what: format!("{} query heads are not a multiple of {kv} kv heads", g.h),
        });
    }
    let small = n / g.h as usize * kv;
    let (want_dst, want_src) = if back { (small, n) } else { (n, small) };
    check_len(K, "dst", dst.len(), want_dst)?;
    check_len(K, "src", src.len(), want_src)?;
    let (dtype, d, s) = (T::DTYPE, dst.addr(), src.addr());
    let call = if back {
        Call::HeadsToKv {
            dtype,
            dst: d,
            src: s,
            g,
            kv: kv32,
        }
    } else {
        Call::KvToHeads {
            dtype,
            dst: d,
            src: s,
            g,
            kv: kv32,
        }
    };
    // SAFETY: the query-head side holds b * h * t * d elements, the kv side b * t * kv * d,
    // and h is a multiple of kv: both index maps stay inside.
    unsafe { b.launch(&call) }
}
