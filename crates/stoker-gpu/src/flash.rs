//! Causal attention that keeps no scores, on tensor cores (cuda/ops/flash.cuh,
//! FlashAttention-2's algorithm): checked calls over per-head bf16 buffers `[B*H, T, D]`.
//! The forward writes the output and each row's log-sum-exp (`[B*H, T]` f32), the one
//! thing the backward keeps of the scores; the backward recomputes the probabilities
//! from q, k and it, 16 x 16 at a time. Head widths 16, 32 and 64; any T; grouped-query
//! attention with k and v per kv head (`group` query heads each), not repeated.

use half::bf16;

use crate::backend::{check_disjoint, Backend, View};
use crate::call::Call;
use crate::error::{check_len, dim, GpuError};

/// The head widths the kernels are built for.
pub const HEAD_WIDTHS: [usize; 3] = [16, 32, 64];

/// Whether heads of width `d` run here.
pub fn supports(d: usize) -> bool {
    HEAD_WIDTHS.contains(&d)
}

/// `(B*H, T, D)`: heads, positions, head width.
pub type FlashShape = (usize, usize, usize);

/// Products each pair of 16 x 16 blocks costs the forward: the scores, the weighted
/// values.
pub const FORWARD_PRODUCTS: f64 = 2.0;
/// ... the backward over keys: the scores, dp, dv, dk.
pub const KEY_SIDE_PRODUCTS: f64 = 4.0;
/// ... the backward over queries: the scores, dp, dq.
pub const QUERY_SIDE_PRODUCTS: f64 = 3.0;

/// FLOPs of one product (2 x 16 x 16 x D) over every pair of 16-row blocks the causal
/// mask leaves at `shape`: R (R + 1) / 2 pairs a head, R = ceil(T / 16), the masked
/// halves of the diagonal's blocks included (the tensor cores run them whole).
pub fn product_flops((bh, t, d): FlashShape) -> f64 {
    let r = t.div_ceil(16) as f64;
    bh as f64 * r * (r + 1.0) / 2.0 * 512.0 * d as f64
}

/// q, k and v, each `[B*H, T, D]` bf16.
pub type FlashQkv<'a> = (View<'a, bf16>, View<'a, bf16>, View<'a, bf16>);

/// What a launch takes after the shapes' checks.
struct Checked {
    /// Tiles of 16 query rows over the query heads.
    tiles: i64,
    t: i32,
    d: i32,
    group: i32,
    scale: f32,
    /// Elements of k and v: `[B*H / group, T, D]`.
    kv_len: usize,
}

/// Checks the shapes: q `[B*H, T, D]`, k and v `[B*H / group, T, D]` (`group` query heads
/// a kv head), each per-row buffer `[B*H, T]`. The shape is flattened, so only `B*H` is
/// checked against `group`; a caller that knows `H` checks that `group` divides it (the
/// GPT step's `flash_shape`), or kv heads would pair with the wrong sequence's queries.
fn checked(
    kernel: &'static str,
    ((bh, t, d), group): (FlashShape, usize),
    (q, k, v): &FlashQkv,
    per_row: &[(&'static str, usize)],
) -> Result<Checked, GpuError> {
    if !supports(d) {
        return Err(GpuError::Shape {
            kernel,
            what: format!("head width {d}: the kernels are built for {HEAD_WIDTHS:?}"),
        });
    }
    let (t32, d32) = (dim(kernel, "t", t)?, dim(kernel, "d", d)?);
    let group32 = dim(kernel, "group", group)?;
    dim(kernel, "heads", bh)?;
    if !bh.is_multiple_of(group) {
        return Err(GpuError::Shape {
            kernel,
            what: format!("{bh} query heads are not groups of {group}"),
        });
    }
    let (n, kv_len) = (bh * t * d, bh / group * t * d);
    check_len(kernel, "q", q.len(), n)?;
    check_len(kernel, "k", k.len(), kv_len)?;
    check_len(kernel, "v", v.len(), kv_len)?;
    for (name, x) in [("q", q), ("k", k), ("v", v)] {
        check_pairs(kernel, name, x)?;
    }
    for &(name, len) in per_row {
        check_len(kernel, name, len, bh * t)?;
    }
    let tiles = i64::try_from(bh * t.div_ceil(16)).map_err(|_| GpuError::Shape {
        kernel,
        what: format!("{bh} heads of {t} positions"),
    })?;
    Ok(Checked {
        tiles,
        t: t32,
        d: d32,
        group: group32,
        scale: 1.0 / (d as f32).sqrt(),
        kv_len,
    })
}

/// The kernels read two neighbouring bf16 as one 32-bit word: a view must start on a
/// multiple of 4 bytes (the step's spans start on 128).
fn check_pairs(kernel: &'static str, name: &str, x: &View<bf16>) -> Result<(), GpuError> {
    match x.addr() % 4 {
        0 => Ok(()),
        _ => Err(GpuError::Shape {
            kernel,
            what: format!("`{name}` starts at an odd element: its pairs must be 4-byte words"),
        }),
    }
}

/// `out = softmax(q k^T / sqrt(D)) v` with the causal mask, and `lse` each row's
/// log-sum-exp of its scaled scores (`[B*H, T]`); query head `h` attends with kv head
/// `h / group`.
pub fn forward<B: Backend>(
    b: &B,
    x: FlashQkv,
    (out, lse): (View<bf16>, View<f32>),
    (shape, group): (FlashShape, usize),
) -> Result<(), GpuError> {
    const K: &str = "flash-forward";
    let c = checked(K, (shape, group), &x, &[("lse", lse.len())])?;
    check_len(K, "out", out.len(), x.0.len())?;
    for input in [x.0, x.1, x.2] {
        check_disjoint(K, &out, &input)?;
    }
    let call = Call::FlashForward {
        out: out.addr(),
        lse: lse.addr(),
        q: x.0.addr(),
        k: x.1.addr(),
        v: x.2.addr(),
        tiles: c.tiles,
        t: c.t,
        d: c.d,
        group: c.group,
        scale: c.scale,
    };
    // SAFETY: q and out hold B*H*T*D elements, k and v B*H/group*T*D, lse B*H*T (checked
    // above); the kernel reads and writes rows below T of each head only.
    unsafe { b.launch(&call) }
}

/// The backward from the output's gradient `dout`: `dq` (`[B*H, T, D]`), `dk` and `dv`
/// (`[B*H / group, T, D]`, each summed over its group's query heads; all written
/// whole), with `dsum` (`[B*H, T]` f32) scratch for each row's `dout . out`.
pub fn backward<B: Backend>(
    b: &B,
    x: FlashQkv,
    (out, dout, lse): (View<bf16>, View<bf16>, View<f32>),
    dsum: View<f32>,
    (dq, dk, dv): FlashQkv,
    (shape, group): (FlashShape, usize),
) -> Result<(), GpuError> {
    const K: &str = "flash-backward";
    let rows = [("lse", lse.len()), ("dsum", dsum.len())];
    let c = checked(K, (shape, group), &x, &rows)?;
    for (name, v) in [("out", out), ("dout", dout), ("dq", dq)] {
        check_len(K, name, v.len(), x.0.len())?;
    }
    check_len(K, "dk", dk.len(), c.kv_len)?;
    check_len(K, "dv", dv.len(), c.kv_len)?;
    check_pairs(K, "dout", &dout)?;
    // The gradients are written while q, k, v, out and dout are still read.
    for written in [dq, dk, dv] {
        for read in [x.0, x.1, x.2, out, dout] {
            check_disjoint(K, &written, &read)?;
        }
    }
    let rowdot = Call::FlashRowdot {
        dsum: dsum.addr(),
        dout: dout.addr(),
        out: out.addr(),
        rows: (shape.0 * shape.1) as i64,
        d: c.d,
    };
    let kv = Call::FlashBackwardKv {
        dk: dk.addr(),
        dv: dv.addr(),
        q: x.0.addr(),
        k: x.1.addr(),
        v: x.2.addr(),
        dout: dout.addr(),
        lse: lse.addr(),
        dsum: dsum.addr(),
        // One tile a kv head's 16 rows.
        tiles: c.tiles / c.group as i64,
        t: c.t,
        d: c.d,
        group: c.group,
        scale: c.scale,
    };
    let q = Call::FlashBackwardQ {
        dq: dq.addr(),
        q: x.0.addr(),
        k: x.1.addr(),
        v: x.2.addr(),
        dout: dout.addr(),
        lse: lse.addr(),
        dsum: dsum.addr(),
        tiles: c.tiles,
        t: c.t,
        d: c.d,
        group: c.group,
        scale: c.scale,
    };
    // SAFETY: every query-side view holds B*H*T*D elements, k, v, dk and dv
    // B*H/group*T*D, lse and dsum B*H*T (checked above); each kernel reads and writes rows
    // below T of each head only.
    unsafe {
        b.launch(&rowdot)?;
        b.launch(&kv)?;
        b.launch(&q)
    }
}
