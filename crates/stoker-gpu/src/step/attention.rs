//! Causal attention over per-head buffers `[B*H, T, D]`: the scores as batched products,
//! the causal softmax kernel in place, the weighted values as more, the heads merged back
//! to `[B, T, H*D]`; and the backward's products around the softmax's backward. Shared by
//! the GPT's and the Llama's steps, which differ only in how they lay out q, k and v
//! before.
//!
//! The queries come in chunks ([`query_chunk`] rows each), and each chunk's products
//! cover only the keys up to its last query: the masked upper triangle is skipped but
//! for each chunk's diagonal block. With 4 chunks the products and the softmax's writes
//! are 5/8 of the whole `T x T` (1/2 is the causal minimum). The backward's key-side
//! products (`dv`, `dk`) go by key chunk: a key chunk is read by the queries from its own
//! chunk on. Each element of a product still sums over every key (or query) it did
//! before, only the masked zeros left out.

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
/// Heads of the batch, positions, head width: `(B*H, T, D)`.
pub(crate) type HeadShape = (usize, usize, usize);

fn head_shape(g: Heads) -> HeadShape {
    ((g.b * g.h) as usize, g.t as usize, g.d as usize)
}

/// Flash attention's shape of `g` with `group` query heads a kv head. The kernels find a
/// query head's kv head as its flattened index (`b * H + h`) over `group`, right only
/// where `group` divides each sequence's `H` (the flattened `B * H`, which the kernels
/// check, can be a multiple where `H` is not).
fn flash_shape(g: Heads, group: usize) -> Result<(HeadShape, usize), GpuError> {
    if group == 0 || !(g.h as usize).is_multiple_of(group) {
        return Err(GpuError::Shape {
            kernel: "flash attention",
            what: format!("{} query heads are not groups of {group}", g.h),
        });
    }
    Ok((head_shape(g), group))
}

/// Query rows per chunk at `t` positions: chunks of at least 256 rows, at most 8 of
/// them (T = 1,024: 4 chunks of 256); fewer positions, one chunk (no extra launches for
/// the small models, which are launch-bound).
pub fn query_chunk(t: usize) -> usize {
    // At least 1: no positions give no chunks (and the softmax refuses t = 0).
    t.div_ceil((t / 256).clamp(1, 8)).max(1)
}

/// The query chunks of `t` positions: `(first row, rows)`; each covers the keys
/// `0..first + rows`.
pub(crate) fn chunks(t: usize) -> impl Iterator<Item = (usize, usize)> {
    let c = query_chunk(t);
    (0..t).step_by(c).map(move |r0| (r0, c.min(t - r0)))
}

/// `v` from element `at` on.
fn from<T>(v: View<T>, at: usize) -> Result<View<T>, GpuError> {
    v.slice(at..v.len())
}

/// A batched product over the `B*H` heads: `m x n` from `k`, with the strides of A, B, C
/// between heads.
fn per_head(bh: usize, (m, n, k): (usize, usize, usize), strides: [usize; 3]) -> Dims {
    Dims {
        m,
        n,
        k,
        batch: bh,
        strides,
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
/// same products and kernel on the same q and k: the same bits). Each row is written up
/// to its chunk's last query.
pub fn probabilities<B: Backend, T: Act>(
    be: &B,
    x: Qkv<T>,
    att: View<T>,
    g: Heads,
) -> Result<(), GpuError> {
    let (bh, t, d) = head_shape(g);
    scores_by_query_chunk(be, att, x.q, x.k, (bh, t, d))?;
    let scale = 1.0 / (d as f32).sqrt();
    kernels::attention_softmax_forward(be, att, att, (t, query_chunk(t)), scale)
}

fn per_head_forward<B: Backend, T: Act>(
    be: &B,
    x: Qkv<T>,
    att: View<T>,
    out: View<T>,
    g: Heads,
) -> Result<(), GpuError> {
    probabilities(be, x, att, g)?;
    weighted_by_query_chunk(be, out, att, x.v, head_shape(g))
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

/// Flash attention's forward ([`crate::flash`], bf16 alone): `out_h` and each row's
/// log-sum-exp `lse` (`[B*H, T]`, all the backward keeps), the heads merged into `out`;
/// k and v `[B*H / group, T, D]`, one kv head for each `group` query heads.
pub fn flash_forward<B: Backend, T: Act>(
    be: &B,
    x: Qkv<T>,
    lse: View<f32>,
    (out_h, out): (View<T>, View<T>),
    (g, group): (Heads, usize),
) -> Result<(), GpuError> {
    let x16 = (x.q.cast()?, x.k.cast()?, x.v.cast()?);
    crate::flash::forward(be, x16, (out_h.cast()?, lse), flash_shape(g, group)?)?;
    kernels::merged_heads(be, out, out_h, g, false)
}

/// Flash attention's backward: from the merged output's gradient `dout` (split into
/// heads in `dout_h`), the forward's q, k, v, output per head and `lse`, into `dx` (its
/// k and v per kv head, summed over their group; `dsum`, `[B*H, T]`, is scratch).
pub fn flash_backward<B: Backend, T: Act>(
    be: &B,
    (x, out_h, lse): (Qkv<T>, View<T>, View<f32>),
    (dout, dout_h): (View<T>, View<T>),
    dsum: View<f32>,
    dx: Qkv<T>,
    (g, group): (Heads, usize),
) -> Result<(), GpuError> {
    kernels::merged_heads(be, dout_h, dout, g, true)?;
    crate::flash::backward(
        be,
        (x.q.cast()?, x.k.cast()?, x.v.cast()?),
        (out_h.cast()?, dout_h.cast()?, lse),
        dsum,
        (dx.q.cast()?, dx.k.cast()?, dx.v.cast()?),
        flash_shape(g, group)?,
    )
}

/// `y[r0.., ..r0 + rows] = a[r0..] b[..r0 + rows]^T` for each query chunk: scores
/// (`[B*H, T, T]` `y`) from per-head rows (`[B*H, T, D]` `a` and `b`), each chunk's over
/// the keys up to its last query.
pub(crate) fn scores_by_query_chunk<B: Backend, T: Act>(
    be: &B,
    y: View<T>,
    a: View<T>,
    b: View<T>,
    (bh, t, d): HeadShape,
) -> Result<(), GpuError> {
    for (r0, rows) in chunks(t) {
        matmul(
            be,
            Mat::rows(from(y, r0 * t)?, t),
            Mat::rows(from(a, r0 * d)?, d),
            Mat::t(b, d),
            per_head(bh, (rows, r0 + rows, d), [t * d, t * d, t * t]),
            None,
            false,
        )?;
    }
    Ok(())
}

/// `y[r0..] = a[r0.., ..r0 + rows] b[..r0 + rows]` for each query chunk: per-head rows
/// (`[B*H, T, D]` `y` and `b`) weighted by scores (`[B*H, T, T]` `a`) up to each chunk's
/// last query.
pub(crate) fn weighted_by_query_chunk<B: Backend, T: Act>(
    be: &B,
    y: View<T>,
    a: View<T>,
    b: View<T>,
    (bh, t, d): HeadShape,
) -> Result<(), GpuError> {
    for (r0, rows) in chunks(t) {
        matmul(
            be,
            Mat::rows(from(y, r0 * d)?, d),
            Mat::rows(from(a, r0 * t)?, t),
            Mat::rows(b, d),
            per_head(bh, (rows, d, r0 + rows), [t * t, t * d, t * d]),
            None,
            false,
        )?;
    }
    Ok(())
}

/// `y[c0..c0 + cols] = a[c0.., c0..c0 + cols]^T b[c0..]` for each key chunk: a key
/// chunk's gradient from the queries of its chunk on (`[B*H, T, T]` scores `a`,
/// `[B*H, T, D]` `b` and `y`).
fn by_key_chunk<B: Backend, T: Act>(
    be: &B,
    y: View<T>,
    a: View<T>,
    b: View<T>,
    (bh, t, d): HeadShape,
) -> Result<(), GpuError> {
    for (c0, cols) in chunks(t) {
        matmul(
            be,
            Mat::rows(from(y, c0 * d)?, d),
            Mat::t(from(a, c0 * t + c0)?, t),
            Mat::rows(from(b, c0 * d)?, d),
            per_head(bh, (cols, d, t - c0), [t * t, t * d, t * d]),
            None,
            false,
        )?;
    }
    Ok(())
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
    // datt = dout v^T, by query chunk; dv = att^T dout, by key chunk.
    scores_by_query_chunk(be, datt, dout, x.v, (bh, t, d))?;
    by_key_chunk(be, dx.v, att, dout, (bh, t, d))?;
    let scale = 1.0 / (d as f32).sqrt();
    kernels::attention_softmax_backward(be, datt, datt, att, (t, query_chunk(t)), scale)?;
    // dq = dpre k, by query chunk; dk = dpre^T q, by key chunk.
    weighted_by_query_chunk(be, dx.q, datt, x.k, (bh, t, d))?;
    by_key_chunk(be, dx.k, datt, x.q, (bh, t, d))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two sequences of 3 heads make 6 flattened heads, a multiple of 2, yet 2 does not
    /// divide 3: refused by name (the flattened check alone let it through).
    #[test]
    fn flash_groups_must_divide_each_sequence_s_heads() {
        let g = |h| Heads {
            b: 2,
            t: 16,
            h,
            d: 16,
        };
        assert_eq!(flash_shape(g(4), 2).unwrap(), ((8, 16, 16), 2));
        let e = flash_shape(g(3), 2).unwrap_err().to_string();
        assert!(e.contains("3 query heads are not groups of 2"), "{e}");
        assert!(flash_shape(g(4), 0).is_err());
    }
}
