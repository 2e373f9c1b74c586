//! The host build's C functions (cuda/host.cpp: `stoker_host_<kernel>[_f32|_bf16]`), and
//! one table of them per element type. Only [`crate::host`] calls them, after checking
//! every length.

use half::bf16;

use crate::args::{AdamWArgs, Heads};

/// Declares the typed kernels once: the table's fields, and the two extern blocks whose
/// link names add `_f32` / `_bf16` (`T` is the element type in each).
macro_rules! typed_kernels {
    ($($name:ident($($arg:ident: $ty:ty),* $(,)?);)*) => {
        /// One element type's host kernels.
        pub struct HostFns<T> {
            $(pub(crate) $name: unsafe extern "C" fn($($ty),*),)*
        }
        typed_kernels!(@externs f32_fns, f32, "_f32", $($name($($arg: $ty),*);)*);
        typed_kernels!(@externs bf16_fns, bf16, "_bf16", $($name($($arg: $ty),*);)*);
        /// The f32 kernels.
        pub(crate) static F32: HostFns<f32> = HostFns { $($name: f32_fns::$name,)* };
        /// The bf16 kernels.
        pub(crate) static BF16: HostFns<bf16> = HostFns { $($name: bf16_fns::$name,)* };
    };
    (@externs $module:ident, $t:ty, $suffix:literal, $($name:ident($($arg:ident: $ty:ty),*);)*) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;
            #[allow(dead_code)]
            type T = $t;
            extern "C" {
                $(
                    #[link_name = concat!("stoker_host_", stringify!($name), $suffix)]
                    pub(crate) fn $name($($arg: $ty),*);
                )*
            }
        }
    };
}

typed_kernels! {
    encoder_forward(out: *mut T, tokens: *const i32, wte: *const T, wpe: *const T, n: i64, t: i32, c: i32);
    encoder_backward_wpe(dwpe: *mut f32, dout: *const T, b: i32, t: i32, c: i32);
    encoder_backward_wte(dwte: *mut f32, dout: *const T, uniq: *const i32, starts: *const i32, positions: *const i32, u: i32, c: i32);
    gelu_forward(out: *mut T, inp: *const T, n: i64);
    gelu_backward(dinp: *mut T, inp: *const T, dout: *const T, n: i64);
    qkv_to_heads(qkvh: *mut T, qkv: *const T, g: Heads);
    heads_to_qkv(dqkv: *mut T, dqkvh: *const T, g: Heads);
    heads_to_merged(out: *mut T, heads: *const T, g: Heads);
    merged_to_heads(dheads: *mut T, dout: *const T, g: Heads);
    column_partials(partials: *mut f32, x: *const T, n: i64, cols: i32, r: i32, chunk: i64);
    layernorm_forward(out: *mut T, mean: *mut f32, rstd: *mut f32, resid: *mut T, a: *const T, a2: *const T, weight: *const T, bias: *const T, n: i64, c: i32, eps: f32);
    layernorm_backward(dinp: *mut T, partials: *mut f32, dout: *const T, inp: *const T, weight: *const T, mean: *const f32, rstd: *const f32, n: i64, c: i32, warps: i32);
    attention_softmax_forward(att: *mut T, pre: *const T, rows: i64, t: i32, scale: f32);
    attention_softmax_backward(dpre: *mut T, datt: *const T, att: *const T, rows: i64, t: i32, scale: f32);
    classifier(logits: *mut T, losses: *mut f32, targets: *const i32, n: i64, v: i32, vp: i32, dscale: f32, ignore: i32);
}

extern "C" {
    #[link_name = "stoker_host_reduce_partials"]
    pub(crate) fn reduce_partials(
        dst: *mut f32,
        partials: *const f32,
        p: i32,
        cols: i32,
        stride: i64,
    );
    #[link_name = "stoker_host_adamw"]
    pub(crate) fn adamw(
        p: *mut f32,
        g: *const f32,
        m: *mut f32,
        v: *mut f32,
        copy: *mut bf16,
        n: i64,
        s: AdamWArgs,
        decay: i32,
        grad_scale: f32,
    );
    #[link_name = "stoker_host_sum_partials"]
    pub(crate) fn sum_partials(partials: *mut f32, x: *const f32, n: i64, squares: i32, warps: i32);
    #[link_name = "stoker_host_sum"]
    pub(crate) fn sum(out: *mut f32, x: *const f32, n: i64, accumulate: i32);
}
