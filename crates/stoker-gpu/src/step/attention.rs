//! Causal attention over per-head buffers `[B*H, T, D]`: the scores as one batched
//! product, the causal softmax kernel in place, the weighted values as another, the
//! heads merged back to `[B, T, H*D]`; and the backward's four products around the
//! softmax's backward. Shared by the GPT's and the Llama's steps, which differ only in
//! how they lay out q, k and v before.

use crate::backend::{Backend, View};
use crate::elem::Act;
use crate::error::GpuError;
use crate::gemm::{matmul, Dims, Mat};
use crate::kernels;
use crate::Heads;

/// q, k and v, each `[B*H, T, D]`.
#[derive(Debug, Clone, Copy)]
pub struct Qkv<'a, T> {
    /// Queries.
    pub q: View<'a, T>,
    /// Keys.
    pub k: View<'a, T>,
    /// Values.
    pub v: View<'a, T>,
}

impl<'a, T> Qkv<'a, T> {
    /// A heads buffer `[3, B*H, T, D]` as its three thirds.
    pub fn thirds(heads: View<'a, T>) -> Result<Self, GpuError> {
        let n = heads.len() / 3;
        if 3 * n != heads.len() {
            return Err(GpuError::Shape {
                kernel: "attention",
                what: format!("{} elements are not three equal thirds", heads.len()),
            });
        }
        Ok(Qkv {
            q: heads.slice(0..n)?,
            k: heads.slice(n..2 * n)?,
            v: heads.slice(2 * n..3 * n)?,
        })
    }
}

/// Heads, positions and head width: `(B*H, T, D)`.
type HeadShape = (usize, usize, usize);

fn head_shape(g: Heads) -> HeadShape {
    ((g.b * g.h) as usize, g.t as usize, g.d as usize)
}

fn scores(bh: usize, t: usize, d: usize) -> Dims {
    Dims {
        m: t,
        n: t,
        k: d,
        batch: bh,
        strides: [t * d, t * d, t * t],
    }
}

fn weighted(bh: usize, t: usize, d: usize) -> Dims {
    Dims {
        m: t,
        n: d,
        k: t,
        batch: bh,
        strides: [t * t, t * d, t * d],
    }
}

/// `att = softmax(q k^T / sqrt(D))` with the causal mask (`[B*H, T, T]`, kept for the
/// backward), `out_h = att v` (`[B*H, T, D]`), and `out` the heads merged (`[B, T, H*D]`)
/// for the shape `g`.
pub fn forward<B: Backend, T: Act>(
    be: &B,
    x: Qkv<T>,
    att: View<T>,
    (out_h, out): (View<T>, View<T>),
    g: Heads,
) -> Result<(), GpuError> {
    per_head_forward(be, x, att, out_h, g)?;
    kernels::merged_heads(be, out, out_h, g, false)
}

/// `att = softmax(q k^T / sqrt(D))` with the causal mask (`[B*H, T, T]`) alone: the
/// forward's first half, and what a backward that did not keep `att` recomputes (the
/// same product and kernel on the same q and k: the same bits).
pub fn probabilities<B: Backend, T: Act>(
    be: &B,
    x: Qkv<T>,
    att: View<T>,
    g: Heads,
) -> Result<(), GpuError> {
    let (bh, t, d) = head_shape(g);
    matmul(
        be,
        Mat::rows(att, t),
        Mat::rows(x.q, d),
        Mat::t(x.k, d),
        scores(bh, t, d),
        None,
        false,
    )?;
    kernels::attention_softmax_forward(be, att, att, t, 1.0 / (d as f32).sqrt())
}

fn per_head_forward<B: Backend, T: Act>(
    be: &B,
    x: Qkv<T>,
    att: View<T>,
    out: View<T>,
    g: Heads,
) -> Result<(), GpuError> {
    let (bh, t, d) = head_shape(g);
    probabilities(be, x, att, g)?;
    matmul(
        be,
        Mat::rows(out, d),
        Mat::rows(att, t),
        Mat::rows(x.v, d),
        weighted(bh, t, d),
        None,
        false,
    )
}

/// The backward: from the merged output's gradient `dout` (split into heads in
/// `dout_h`), the forward's `att` and q, k, v, into `dx` (`datt` is scratch
/// `[B*H, T, T]`).
pub fn backward<B: Backend, T: Act>(
    be: &B,
    (x, att): (Qkv<T>, View<T>),
    (dout, dout_h): (View<T>, View<T>),
    datt: View<T>,
    dx: Qkv<T>,
    g: Heads,
) -> Result<(), GpuError> {
    kernels::merged_heads(be, dout_h, dout, g, true)?;
    per_head_backward(be, x, att, dout_h, datt, dx, head_shape(g))
}

fn per_head_backward<B: Backend, T: Act>(
    be: &B,
    x: Qkv<T>,
    att: View<T>,
    dout: View<T>,
    datt: View<T>,
    dx: Qkv<T>,
    (bh, t, d): HeadShape,
) -> Result<(), GpuError> {
    // datt = dout v^T; dv = att^T dout.
    matmul(
        be,
        Mat::rows(datt, t),
        Mat::rows(dout, d),
        Mat::t(x.v, d),
        scores(bh, t, d),
        None,
        false,
    )?;
    matmul(
        be,
        Mat::rows(dx.v, d),
        Mat::t(att, t),
        Mat::rows(dout, d),
        weighted(bh, t, d),
        None,
        false,
    )?;
    kernels::attention_softmax_backward(be, datt, datt, att, t, 1.0 / (d as f32).sqrt())?;
    // dq = dpre k; dk = dpre^T q.
    matmul(
        be,
        Mat::rows(dx.q, d),
        Mat::rows(datt, t),
        Mat::rows(x.k, d),
        weighted(bh, t, d),
        None,
        false,
    )?;
    matmul(
        be,
        Mat::rows(dx.k, d),
        Mat::t(datt, t),
        Mat::rows(x.q, d),
        weighted(bh, t, d),
        None,
        false,
    )
}
