//! The host build's C functions (cuda/host.cpp: `stoker_host_<kernel>[_f32|_bf16|_f16]`), one
//! table per element type, and [`run`], which calls the one a [`Call`] names. Typed
//! buffers travel as untyped pointers: the table picked fixes their element type.

use std::ffi::c_void;

use crate::args::{AdamWArgs, Heads, SgdArgs};
use crate::call::{Addr, Call};
use crate::elem::Dtype;

/// An untyped buffer pointer.
type P = *mut c_void;

/// Declares the typed kernels once: the table's fields and the two extern blocks whose
/// link names add `_f32` / `_bf16` / `_f16`.
macro_rules! typed_kernels {
    ($($name:ident($($ty:ty),* $(,)?);)*) => {
        /// One element type's host kernels.
        struct HostFns {
            $($name: unsafe extern "C" fn($($ty),*),)*
        }
        typed_kernels!(@externs f32_fns, "_f32", $($name($($ty),*);)*);
        typed_kernels!(@externs bf16_fns, "_bf16", $($name($($ty),*);)*);
        typed_kernels!(@externs f16_fns, "_f16", $($name($($ty),*);)*);
        static F32: HostFns = HostFns { $($name: f32_fns::$name,)* };
        static BF16: HostFns = HostFns { $($name: bf16_fns::$name,)* };
        static F16: HostFns = HostFns { $($name: f16_fns::$name,)* };
    };
    (@externs $module:ident, $suffix:literal, $($name:ident($($ty:ty),*);)*) => {
        mod $module {
            use super::*;
            extern "C" {
                $(
                    #[link_name = concat!("stoker_host_", stringify!($name), $suffix)]
                    pub(super) fn $name($(_: $ty),*);
                )*
            }
        }
    };
}

typed_kernels! {
    encoder_forward(P, P, P, P, i64, i32, i32);
    encoder_backward_wpe(P, P, i32, i32, i32);
    encoder_backward_wte(P, P, P, P, P, i32, i32);
    from_f32(P, P, i64);
    gelu_forward(P, P, i64);
    gelu_backward(P, P, P, i64);
    add_bias(P, P, i64, i32);
    qkv_to_heads(P, P, Heads);
    heads_to_qkv(P, P, Heads);
    heads_to_merged(P, P, Heads);
    merged_to_heads(P, P, Heads);
    column_partials(P, P, i64, i32, i32, i64);
    layernorm_forward(P, P, P, P, P, P, P, P, i64, i32, f32);
    layernorm_backward(P, P, P, P, P, P, P, i64, i32, i32);
    attention_softmax_forward(P, P, i64, i32, i32, f32);
    attention_softmax_backward(P, P, P, i64, i32, i32, f32);
    classifier(P, P, P, P, i64, i32, i32, i32, f32, i32);
    rmsnorm_forward(P, P, P, P, P, P, i64, i32, f32);
    rmsnorm_backward(P, P, P, P, P, P, i64, i32, i32);
    rope(P, P, P, i64, i32, i32, i32, f32);
    swiglu_forward(P, P, P, i64);
    swiglu_backward(P, P, P, P, P, i64);
    kv_to_heads(P, P, Heads, i32);
    heads_to_kv(P, P, Heads, i32);
    fp8_quantize(P, P, P, P, P, i64, i32, i32, i32);
}

extern "C" {
    fn stoker_host_adamw(
        p: P,
        g: P,
        m: P,
        v: P,
        copy: P,
        n: i64,
        s: AdamWArgs,
        decay: i32,
        grad_scale: f32,
    );
    fn stoker_host_range_reduce_partials(
        lo: i64,
        hi: i64,
        dst: P,
        partials: P,
        p: i32,
        cols: i32,
        stride: i64,
    );
    fn stoker_host_range_adamw_segments(
        lo: i64,
        hi: i64,
        p: P,
        g: P,
        m: P,
        v: P,
        copy: P,
        n: i64,
        s: AdamWArgs,
        bounds: P,
        decay: P,
        segs: i32,
        grad_scale: f32,
    );
    fn stoker_host_range_sgd_segments(
        lo: i64,
        hi: i64,
        p: P,
        g: P,
        buf: P,
        copy: P,
        n: i64,
        s: SgdArgs,
        bounds: P,
        decay: P,
        segs: i32,
        grad_scale: f32,
    );
    fn stoker_host_sum_partials(partials: P, x: P, n: i64, squares: i32, warps: i32);
    fn stoker_host_sum(out: P, x: P, n: i64, accumulate: i32);
    fn stoker_host_fp8_amax_fold(
        amax: P,
        history: P,
        partials: P,
        count: i64,
        len: i32,
        pos: i32,
        parts: i32,
    );
    fn stoker_host_fp8_scale_update(
        state: P,
        history: P,
        amax: P,
        count: i64,
        len: i32,
        pos: i32,
        most_recent: i32,
    );
    // The tensor-core kernels, bf16 alone.
    fn stoker_host_flash_forward_bf16(
        out: P,
        lse: P,
        q: P,
        k: P,
        v: P,
        tiles: i64,
        t: i32,
        d: i32,
        group: i32,
        scale: f32,
    );
    fn stoker_host_flash_rowdot_bf16(dsum: P, dout: P, out: P, rows: i64, d: i32);
    fn stoker_host_flash_backward_kv_bf16(
        dk: P,
        dv: P,
        q: P,
        k: P,
        v: P,
        dout: P,
        lse: P,
        dsum: P,
        tiles: i64,
        t: i32,
        d: i32,
        group: i32,
        scale: f32,
    );
    fn stoker_host_flash_backward_q_bf16(
        dq: P,
        q: P,
        k: P,
        v: P,
        dout: P,
        lse: P,
        dsum: P,
        tiles: i64,
        t: i32,
        d: i32,
        group: i32,
        scale: f32,
    );
}

fn fns(d: Dtype) -> &'static HostFns {
    match d {
        Dtype::F32 => &F32,
        Dtype::Bf16 => &BF16,
        Dtype::F16 => &F16,
    }
}

/// Runs `call` on the CPU.
///
/// # Safety
/// Every address in `call` is a host pointer (or 0 where the kernel allows null) to as
/// many elements as the call's shapes imply, valid for reads and writes.
pub(crate) unsafe fn run(call: &Call) {
    let p = |a: Addr| a as usize as P;
    use Call::*;
    // SAFETY: the caller's contract; each arm passes the call's fields in kernels.inc's order.
    unsafe {
        match *call {
            EncoderForward {
                dtype,
                out,
                tokens,
                wte,
                wpe,
                n,
                t,
                c,
            } => (fns(dtype).encoder_forward)(p(out), p(tokens), p(wte), p(wpe), n, t, c),
            EncoderBackwardWpe {
                dtype,
                dwpe,
                dout,
                b,
                t,
                c,
            } => (fns(dtype).encoder_backward_wpe)(p(dwpe), p(dout), b, t, c),
            EncoderBackwardWte {
                dtype,
                dwte,
                dout,
                uniq,
                starts,
                positions,
                u,
                c,
            } => (fns(dtype).encoder_backward_wte)(
                p(dwte),
                p(dout),
                p(uniq),
                p(starts),
                p(positions),
                u,
                c,
            ),
            FromF32 { dtype, out, x, n } => (fns(dtype).from_f32)(p(out), p(x), n),
            GeluForward { dtype, out, inp, n } => (fns(dtype).gelu_forward)(p(out), p(inp), n),
            GeluBackward {
                dtype,
                dinp,
                inp,
                dout,
                n,
            } => (fns(dtype).gelu_backward)(p(dinp), p(inp), p(dout), n),
            AddBias {
                dtype,
                out,
                bias,
                n,
                cols,
            } => (fns(dtype).add_bias)(p(out), p(bias), n, cols),
            QkvToHeads { dtype, dst, src, g } => (fns(dtype).qkv_to_heads)(p(dst), p(src), g),
            HeadsToQkv { dtype, dst, src, g } => (fns(dtype).heads_to_qkv)(p(dst), p(src), g),
            HeadsToMerged { dtype, dst, src, g } => (fns(dtype).heads_to_merged)(p(dst), p(src), g),
            MergedToHeads { dtype, dst, src, g } => (fns(dtype).merged_to_heads)(p(dst), p(src), g),
            ColumnPartials {
                dtype,
                partials,
                x,
                n,
                cols,
                r,
                chunk,
            } => (fns(dtype).column_partials)(p(partials), p(x), n, cols, r, chunk),
            LayernormForward {
                dtype,
                out,
                mean,
                rstd,
                resid,
                a,
                a2,
                weight,
                bias,
                n,
                c,
                eps,
            } => (fns(dtype).layernorm_forward)(
                p(out),
                p(mean),
                p(rstd),
                p(resid),
                p(a),
                p(a2),
                p(weight),
                p(bias),
                n,
                c,
                eps,
            ),
            LayernormBackward {
                dtype,
                dinp,
                partials,
                dout,
                inp,
                weight,
                mean,
                rstd,
                n,
                c,
                warps,
            } => (fns(dtype).layernorm_backward)(
                p(dinp),
                p(partials),
                p(dout),
                p(inp),
                p(weight),
                p(mean),
                p(rstd),
                n,
                c,
                warps,
            ),
            AttentionSoftmaxForward {
                dtype,
                att,
                pre,
                rows,
                t,
                chunk,
                scale,
            } => (fns(dtype).attention_softmax_forward)(p(att), p(pre), rows, t, chunk, scale),
            AttentionSoftmaxBackward {
                dtype,
                dpre,
                datt,
                att,
                rows,
                t,
                chunk,
                scale,
            } => (fns(dtype).attention_softmax_backward)(
                p(dpre),
                p(datt),
                p(att),
                rows,
                t,
                chunk,
                scale,
            ),
            Classifier {
                dtype,
                logits,
                losses,
                hits,
                targets,
                n,
                v,
                vp,
                grad,
                dscale,
                ignore,
            } => (fns(dtype).classifier)(
                p(logits),
                p(losses),
                p(hits),
                p(targets),
                n,
                v,
                vp,
                grad,
                dscale,
                ignore,
            ),
            RmsnormForward {
                dtype,
                out,
                rstd,
                resid,
                a,
                a2,
                weight,
                n,
                c,
                eps,
            } => (fns(dtype).rmsnorm_forward)(
                p(out),
                p(rstd),
                p(resid),
                p(a),
                p(a2),
                p(weight),
                n,
                c,
                eps,
            ),
            RmsnormBackward {
                dtype,
                dinp,
                partials,
                dout,
                inp,
                weight,
                rstd,
                n,
                c,
                warps,
            } => (fns(dtype).rmsnorm_backward)(
                p(dinp),
                p(partials),
                p(dout),
                p(inp),
                p(weight),
                p(rstd),
                n,
                c,
                warps,
            ),
            Rope {
                dtype,
                x,
                cos,
                sin,
                n,
                t,
                h,
                d,
                sign,
            } => (fns(dtype).rope)(p(x), p(cos), p(sin), n, t, h, d, sign),
            SwigluForward {
                dtype,
                y,
                gate,
                up,
                n,
            } => (fns(dtype).swiglu_forward)(p(y), p(gate), p(up), n),
            SwigluBackward {
                dtype,
                dgate,
                dup,
                gate,
                up,
                dy,
                n,
            } => (fns(dtype).swiglu_backward)(p(dgate), p(dup), p(gate), p(up), p(dy), n),
            KvToHeads {
                dtype,
                dst,
                src,
                g,
                kv,
            } => (fns(dtype).kv_to_heads)(p(dst), p(src), g, kv),
            HeadsToKv {
                dtype,
                dst,
                src,
                g,
                kv,
            } => (fns(dtype).heads_to_kv)(p(dst), p(src), g, kv),
            // The pack kernels that also run in pieces: the whole grid as one piece.
            ReducePartials { .. } | AdamwSegments { .. } | SgdSegments { .. } => {
                if let Some(n) = pack_extent(call) {
                    run_packs(call, 0, n)
                }
            }
            Adamw {
                p: w,
                g,
                m,
                v,
                copy,
                n,
                s,
                decay,
                grad_scale,
            } => stoker_host_adamw(p(w), p(g), p(m), p(v), p(copy), n, s, decay, grad_scale),
            SumPartials {
                partials,
                x,
                n,
                squares,
                warps,
            } => stoker_host_sum_partials(p(partials), p(x), n, squares, warps),
            Sum {
                out,
                x,
                n,
                accumulate,
            } => stoker_host_sum(p(out), p(x), n, accumulate),
            Fp8Quantize {
                dtype,
                out,
                out_t,
                amax,
                x,
                scale,
                rows,
                cols,
                e5m2,
                warps,
            } => (fns(dtype).fp8_quantize)(
                p(out),
                p(out_t),
                p(amax),
                p(x),
                p(scale),
                rows,
                cols,
                e5m2,
                warps,
            ),
            Fp8AmaxFold {
                amax,
                history,
                partials,
                count,
                len,
                pos,
                parts,
            } => {
                stoker_host_fp8_amax_fold(p(amax), p(history), p(partials), count, len, pos, parts)
            }
            Fp8ScaleUpdate {
                state,
                history,
                amax,
                count,
                len,
                pos,
                most_recent,
            } => stoker_host_fp8_scale_update(
                p(state),
                p(history),
                p(amax),
                count,
                len,
                pos,
                most_recent,
            ),
            FlashForward {
                out,
                lse,
                q,
                k,
                v,
                tiles,
                t,
                d,
                group,
                scale,
            } => stoker_host_flash_forward_bf16(
                p(out),
                p(lse),
                p(q),
                p(k),
                p(v),
                tiles,
                t,
                d,
                group,
                scale,
            ),
            FlashRowdot {
                dsum,
                dout,
                out,
                rows,
                d,
            } => stoker_host_flash_rowdot_bf16(p(dsum), p(dout), p(out), rows, d),
            FlashBackwardKv {
                dk,
                dv,
                q,
                k,
                v,
                dout,
                lse,
                dsum,
                tiles,
                t,
                d,
                group,
                scale,
            } => stoker_host_flash_backward_kv_bf16(
                p(dk),
                p(dv),
                p(q),
                p(k),
                p(v),
                p(dout),
                p(lse),
                p(dsum),
                tiles,
                t,
                d,
                group,
                scale,
            ),
            FlashBackwardQ {
                dq,
                q,
                k,
                v,
                dout,
                lse,
                dsum,
                tiles,
                t,
                d,
                group,
                scale,
            } => stoker_host_flash_backward_q_bf16(
                p(dq),
                p(q),
                p(k),
                p(v),
                p(dout),
                p(lse),
                p(dsum),
                tiles,
                t,
                d,
                group,
                scale,
            ),
        }
    }
}

/// The elements of `call`'s grid where it is a pack kernel that [`run_packs`] can run in
/// pieces (the sum of a block's gradients, the optimizers: the long element-wise
/// launches of an update on the host); None for any other.
pub(crate) fn pack_extent(call: &Call) -> Option<i64> {
    match *call {
        Call::ReducePartials { cols, .. } => Some(cols as i64),
        Call::AdamwSegments { n, .. } | Call::SgdSegments { n, .. } => Some(n),
        _ => None,
    }
}

/// Runs the packs of `call` (one that [`pack_extent`] names) that start in `lo..hi`, `lo`
/// a multiple of eight: each pack writes only its own elements, so pieces run in any
/// order, on any threads at once, give the whole launch's bits. Does nothing for any
/// other call.
///
/// # Safety
/// [`run`]'s for `call`; and no other piece running at the same time overlaps `lo..hi`.
pub(crate) unsafe fn run_packs(call: &Call, lo: i64, hi: i64) {
    let p = |a: Addr| a as usize as P;
    use Call::*;
    // SAFETY: the caller's contract; each arm passes the call's fields in kernels.inc's
    // order after the range.
    unsafe {
        match *call {
            ReducePartials {
                dst,
                partials,
                p: parts,
                cols,
                stride,
            } => {
                stoker_host_range_reduce_partials(lo, hi, p(dst), p(partials), parts, cols, stride)
            }
            AdamwSegments {
                p: w,
                g,
                m,
                v,
                copy,
                n,
                s,
                bounds,
                decay,
                segs,
                grad_scale,
            } => stoker_host_range_adamw_segments(
                lo,
                hi,
                p(w),
                p(g),
                p(m),
                p(v),
                p(copy),
                n,
                s,
                p(bounds),
                p(decay),
                segs,
                grad_scale,
            ),
            SgdSegments {
                p: w,
                g,
                buf,
                copy,
                n,
                s,
                bounds,
                decay,
                segs,
                grad_scale,
            } => stoker_host_range_sgd_segments(
                lo,
                hi,
                p(w),
                p(g),
                p(buf),
                p(copy),
                n,
                s,
                p(bounds),
                p(decay),
                segs,
                grad_scale,
            ),
            _ => {}
        }
    }
}
