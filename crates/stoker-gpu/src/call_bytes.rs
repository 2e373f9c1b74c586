//! The bytes a launch must move at least: each buffer it reads or writes counted once
//! (a buffer read and written, twice), at the element sizes the call names. This is the
//! numerator of a kernel's effective bandwidth, and what [`crate::forecast`] times a
//! memory-bound kernel by.

use crate::call::Call;
use crate::elem::Dtype;

/// Elements of causal rows read (keys up to the query) and written (up to the last
/// query of the query's chunk, cuda/ops/softmax.cuh's `chunk_width`) over one `[t, t]`
/// matrix.
pub(crate) fn causal_elements(t: i64, chunk: i64) -> (i64, i64) {
    let read = t * (t + 1) / 2;
    let chunk = chunk.max(1);
    let written = (0..t).map(|q| ((q / chunk + 1) * chunk).min(t)).sum();
    (read, written)
}

impl Call {
    /// Bytes the launch reads and writes, each buffer once; the element sizes are the
    /// call's own (16-bit activations, f32 statistics, master and moments).
    pub fn min_bytes(&self) -> u64 {
        use Call::*;
        let e = |d: Dtype| d.bytes() as i64;
        let bytes: i64 = match *self {
            EncoderForward {
                dtype,
                wpe,
                n,
                t,
                c,
                ..
            } => {
                let rows = n / c as i64;
                // out and the tokens' rows of wte; wpe's T rows; the token ids.
                2 * n * e(dtype)
                    + if wpe != 0 {
                        (t * c) as i64 * e(dtype)
                    } else {
                        0
                    }
                    + 4 * rows
            }
            EncoderBackwardWpe { dtype, b, t, c, .. } => {
                (b * t * c) as i64 * e(dtype) + 2 * 4 * (t * c) as i64
            }
            // dout's rows of these tokens are not in the call: the gradient rows only.
            EncoderBackwardWte { u, c, .. } => 2 * 4 * (u * c) as i64 + 4 * u as i64,
            FromF32 { dtype, n, .. } => n * (4 + e(dtype)),
            GeluForward { dtype, n, .. } => 2 * n * e(dtype),
            GeluBackward { dtype, n, .. } => 3 * n * e(dtype),
            AddBias { dtype, n, cols, .. } => (2 * n + cols as i64) * e(dtype),
            QkvToHeads { dtype, g, .. } | HeadsToQkv { dtype, g, .. } => {
                2 * 3 * g.elems() as i64 * e(dtype)
            }
            HeadsToMerged { dtype, g, .. } | MergedToHeads { dtype, g, .. } => {
                2 * g.elems() as i64 * e(dtype)
            }
            KvToHeads { dtype, g, kv, .. } | HeadsToKv { dtype, g, kv, .. } => {
                let heads = g.elems() as i64;
                (heads + heads / g.h as i64 * kv as i64) * e(dtype)
            }
            ColumnPartials {
                dtype, n, cols, r, ..
            } => n * cols as i64 * e(dtype) + 4 * (r * cols) as i64,
            ReducePartials { p, cols, .. } => 4 * (p as i64 + 2) * cols as i64,
            LayernormForward {
                dtype, a2, n, c, ..
            } => {
                // a (and a2, and the sum written), out; weight and bias; mean and rstd.
                let rows = if a2 != 0 { 4 } else { 2 };
                rows * n * c as i64 * e(dtype) + 2 * c as i64 * e(dtype) + 8 * n
            }
            RmsnormForward {
                dtype, a2, n, c, ..
            } => {
                let rows = if a2 != 0 { 4 } else { 2 };
                rows * n * c as i64 * e(dtype) + c as i64 * e(dtype) + 4 * n
            }
            LayernormBackward {
                dtype, n, c, warps, ..
            } => {
                // dout, inp, dinp read and written; weight; mean, rstd; 2 partial rows a warp.
                4 * n * c as i64 * e(dtype) + c as i64 * e(dtype) + 8 * n + 8 * (warps * c) as i64
            }
            RmsnormBackward {
                dtype, n, c, warps, ..
            } => 4 * n * c as i64 * e(dtype) + c as i64 * e(dtype) + 4 * n + 4 * (warps * c) as i64,
            AttentionSoftmaxForward {
                dtype,
                rows,
                t,
                chunk,
                ..
            } => {
                let (read, written) = causal_elements(t as i64, chunk as i64);
                rows / t as i64 * (read + written) * e(dtype)
            }
            AttentionSoftmaxBackward {
                dtype,
                rows,
                t,
                chunk,
                ..
            } => {
                let (read, written) = causal_elements(t as i64, chunk as i64);
                rows / t as i64 * (2 * read + written) * e(dtype)
            }
            Classifier {
                dtype,
                hits,
                n,
                vp,
                grad,
                ..
            } => {
                let passes = if grad != 0 { 2 } else { 1 };
                passes * n * vp as i64 * e(dtype) + 8 * n + if hits != 0 { 4 * n } else { 0 }
            }
            Rope { dtype, n, .. } => 4 * n * e(dtype),
            SwigluForward { dtype, n, .. } => 3 * n * e(dtype),
            SwigluBackward { dtype, n, .. } => 5 * n * e(dtype),
            // p, m, v read and written, g read, the bf16 copy written.
            Adamw { copy, n, .. } | AdamwSegments { copy, n, .. } => {
                n * (7 * 4 + if copy != 0 { 2 } else { 0 })
            }
            SgdSegments { buf, copy, n, .. } => {
                n * (3 * 4 + if buf != 0 { 8 } else { 0 } + if copy != 0 { 2 } else { 0 })
            }
            SumPartials { n, warps, .. } => 4 * (n + warps as i64),
            Sum { n, .. } => 4 * n,
            // x read, the FP8 bytes written (twice with the transpose), the partials read
            // and written.
            Fp8Quantize {
                dtype,
                out_t,
                amax,
                rows,
                cols,
                warps,
                ..
            } => {
                let n = rows * cols as i64;
                n * e(dtype)
                    + n * if out_t != 0 { 2 } else { 1 }
                    + if amax != 0 { 8 * warps as i64 } else { 0 }
            }
            // Per scaler: its partials read and cleared, its history slot read, its amax
            // written.
            Fp8AmaxFold { count, parts, .. } => count * 8 * (parts as i64 + 1),
            // Per scaler: its three values read and written, its history read and two
            // slots written, its amax read.
            Fp8ScaleUpdate { count, len, .. } => count * 4 * (2 * 3 + len as i64 + 3),
            // q read and the output written per query row, k and v read per kv row
            // (bf16); each row's log-sum-exp (f32).
            FlashForward {
                tiles, t, d, group, ..
            } => {
                let rows = flash_rows(tiles, t);
                rows * (2 * d as i64 * 2 + 4) + rows / group.max(1) as i64 * 2 * d as i64 * 2
            }
            FlashRowdot { rows, d, .. } => rows * (2 * d as i64 * 2 + 4),
            // A kv tile: k, v read and dk, dv written per kv row; q, dout read per query
            // row of its group, with two f32 a row.
            FlashBackwardKv {
                tiles, t, d, group, ..
            } => {
                let rows = flash_rows(tiles, t);
                rows * 4 * d as i64 * 2 + rows * group as i64 * (2 * d as i64 * 2 + 8)
            }
            // q, dout read and dq written per query row, two f32; k, v per kv row.
            FlashBackwardQ {
                tiles, t, d, group, ..
            } => {
                let rows = flash_rows(tiles, t);
                rows * (3 * d as i64 * 2 + 8) + rows / group.max(1) as i64 * 2 * d as i64 * 2
            }
        };
        bytes.max(0) as u64
    }

    /// Multiply-adds times two that the launch does on tensor cores (the flash attention
    /// kernels' products over their causal blocks of 16 x 16); 0 for the others, whose
    /// time is their bytes'.
    pub fn tensor_flops(&self) -> f64 {
        use crate::flash::{FORWARD_PRODUCTS, KEY_SIDE_PRODUCTS, QUERY_SIDE_PRODUCTS};
        use Call::*;
        let heads = |tiles: i64, t: i32| tiles / ((t as i64 + 15) / 16).max(1);
        let of = |tiles: i64, t: i32, d: i32, products: f64| {
            let shape = (heads(tiles, t) as usize, t as usize, d as usize);
            products * crate::flash::product_flops(shape)
        };
        match *self {
            FlashForward { tiles, t, d, .. } => of(tiles, t, d, FORWARD_PRODUCTS),
            // A kv tile runs its group's query heads.
            FlashBackwardKv {
                tiles, t, d, group, ..
            } => group as f64 * of(tiles, t, d, KEY_SIDE_PRODUCTS),
            FlashBackwardQ { tiles, t, d, .. } => of(tiles, t, d, QUERY_SIDE_PRODUCTS),
            _ => 0.0,
        }
    }
}

/// The rows `tiles` tiles of 16 cover over heads of `t` positions.
fn flash_rows(tiles: i64, t: i32) -> i64 {
    let per = (t as i64 + 15) / 16;
    tiles / per.max(1) * t as i64
}
