//! One kernel launch as data: which kernel, its variant, its grid and its arguments
//! (device addresses and scalars). Both backends take the same [`Call`]: the host runs
//! the C function of that name over the whole grid, the device launches the kernel. The
//! names, argument orders and grids here are cuda/kernels.inc's.

use crate::args::{AdamWArgs, Heads, SgdArgs};
use crate::elem::{Dtype, Fp8Dtype};

/// A buffer's element address: a device pointer on the GPU, a host pointer on the CPU.
pub type Addr = u64;

/// How many elements one thread of a pack kernel moves (cuda/pack.h's `PACK`).
pub const PACK: i64 = 8;

/// How a kernel covers its work: one thread per element or per pack of elements, one
/// warp per row, or exactly this many warps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grid {
    /// Element kernels: grid-stride over this many elements.
    Elements(i64),
    /// Pack kernels: grid-stride over this many elements, a thread per pack of
    /// [`PACK`] (cuda/pack.h).
    Packs(i64),
    /// Row kernels: one warp per row, grid-stride over this many rows.
    Rows(i64),
    /// Warp kernels: exactly this many warps (their partial sums depend on it).
    Warps(i64),
}

/// One scalar or address argument, in the kernel's parameter order.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arg {
    /// An address.
    Addr(Addr),
    /// An `int64_t`.
    I64(i64),
    /// An `int`.
    I32(i32),
    /// A `float`.
    F32(f32),
    /// A `Heads` by value.
    Heads(Heads),
    /// An `AdamW` by value.
    AdamW(AdamWArgs),
    /// An `Sgd` by value.
    Sgd(SgdArgs),
}

/// One operand: its address, leading dimension (elements between rows as stored) and
/// whether it is stored transposed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Operand {
    /// First element.
    pub addr: Addr,
    /// Elements between consecutive stored rows.
    pub ld: usize,
    /// Stored transposed: `A` `m x k` held as `k x m` (or `B` `k x n` as `n x k`).
    pub trans: bool,
}

/// What a product's `A` and `B` hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AbTypes {
    /// Both in one activation type.
    Act(Dtype),
    /// FP8 values, each scaled by its tensor's delayed scale: the product's f32 sum is
    /// multiplied by both tensors' `scale_inv` (in [`Gemm::scale_inv`]) before `C` and the
    /// bias are added.
    Fp8 {
        /// `A`'s format.
        a: Fp8Dtype,
        /// `B`'s format.
        b: Fp8Dtype,
    },
}

impl AbTypes {
    /// Bytes an element of `A` and of `B` takes.
    pub fn bytes(self) -> [usize; 2] {
        match self {
            AbTypes::Act(d) => [d.bytes(); 2],
            AbTypes::Fp8 { .. } => [1, 1],
        }
    }
}

/// `C[z] = A[z] B[z] (+ C[z] when accumulating) (+ bias on every row)` for `z` in
/// `0..batch`: `A` is `m x k`, `B` `k x n`, `C` `m x n` with leading dimension `ldc`. The
/// bias is added to the f32 accumulator before the one rounding to `C`'s type (cuBLASLt's
/// bias epilogue).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gemm {
    /// Rows of `A` and `C`.
    pub m: usize,
    /// Columns of `B` and `C`.
    pub n: usize,
    /// The shared dimension.
    pub k: usize,
    /// `A`.
    pub a: Operand,
    /// `B`.
    pub b: Operand,
    /// `C`'s first element.
    pub c: Addr,
    /// Elements between `C`'s rows.
    pub ldc: usize,
    /// Products in the batch, and each operand's stride between them (elements).
    pub batch: usize,
    /// Strides of `A`, `B`, `C` between batch entries.
    pub strides: [usize; 3],
    /// `A`'s and `B`'s element types.
    pub ab: AbTypes,
    /// For FP8 operands, the addresses of `A`'s and `B`'s `scale_inv` (one f32 each, read
    /// by the backend when the product runs: a delayed scale never leaves the device);
    /// 0 otherwise.
    pub scale_inv: [Addr; 2],
    /// `C`'s element type.
    pub c_type: Dtype,
    /// Add `C`'s old value (weight gradients accumulate).
    pub accumulate: bool,
    /// `n` elements in `C`'s type added to each row (one dense product only).
    pub bias: Option<Addr>,
}

/// A kernel launch. Addresses must cover what the shapes imply: [`crate::kernels`]
/// builds every call after checking that.
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Call {
    EncoderForward {
        dtype: Dtype,
        out: Addr,
        tokens: Addr,
        wte: Addr,
        wpe: Addr,
        n: i64,
        t: i32,
        c: i32,
    },
    EncoderBackwardWpe {
        dtype: Dtype,
        dwpe: Addr,
        dout: Addr,
        b: i32,
        t: i32,
        c: i32,
    },
    EncoderBackwardWte {
        dtype: Dtype,
        dwte: Addr,
        dout: Addr,
        uniq: Addr,
        starts: Addr,
        positions: Addr,
        u: i32,
        c: i32,
    },
    FromF32 {
        dtype: Dtype,
        out: Addr,
        x: Addr,
        n: i64,
    },
    GeluForward {
        dtype: Dtype,
        out: Addr,
        inp: Addr,
        n: i64,
    },
    GeluBackward {
        dtype: Dtype,
        dinp: Addr,
        inp: Addr,
        dout: Addr,
        n: i64,
    },
    AddBias {
        dtype: Dtype,
        out: Addr,
        bias: Addr,
        n: i64,
        cols: i32,
    },
    QkvToHeads {
        dtype: Dtype,
        dst: Addr,
        src: Addr,
        g: Heads,
    },
    HeadsToQkv {
        dtype: Dtype,
        dst: Addr,
        src: Addr,
        g: Heads,
    },
    HeadsToMerged {
        dtype: Dtype,
        dst: Addr,
        src: Addr,
        g: Heads,
    },
    MergedToHeads {
        dtype: Dtype,
        dst: Addr,
        src: Addr,
        g: Heads,
    },
    ColumnPartials {
        dtype: Dtype,
        partials: Addr,
        x: Addr,
        n: i64,
        cols: i32,
        r: i32,
        chunk: i64,
    },
    LayernormForward {
        dtype: Dtype,
        out: Addr,
        mean: Addr,
        rstd: Addr,
        resid: Addr,
        a: Addr,
        a2: Addr,
        weight: Addr,
        bias: Addr,
        n: i64,
        c: i32,
        eps: f32,
    },
    LayernormBackward {
        dtype: Dtype,
        dinp: Addr,
        partials: Addr,
        dout: Addr,
        inp: Addr,
        weight: Addr,
        mean: Addr,
        rstd: Addr,
        n: i64,
        c: i32,
        warps: i32,
    },
    AttentionSoftmaxForward {
        dtype: Dtype,
        att: Addr,
        pre: Addr,
        rows: i64,
        t: i32,
        chunk: i32,
        scale: f32,
    },
    AttentionSoftmaxBackward {
        dtype: Dtype,
        dpre: Addr,
        datt: Addr,
        att: Addr,
        rows: i64,
        t: i32,
        chunk: i32,
        scale: f32,
    },
    Classifier {
        dtype: Dtype,
        logits: Addr,
        losses: Addr,
        hits: Addr,
        targets: Addr,
        n: i64,
        v: i32,
        vp: i32,
        grad: i32,
        dscale: f32,
        ignore: i32,
    },
    RmsnormForward {
        dtype: Dtype,
        out: Addr,
        rstd: Addr,
        resid: Addr,
        a: Addr,
        a2: Addr,
        weight: Addr,
        n: i64,
        c: i32,
        eps: f32,
    },
    RmsnormBackward {
        dtype: Dtype,
        dinp: Addr,
        partials: Addr,
        dout: Addr,
        inp: Addr,
        weight: Addr,
        rstd: Addr,
        n: i64,
        c: i32,
        warps: i32,
    },
    Rope {
        dtype: Dtype,
        x: Addr,
        cos: Addr,
        sin: Addr,
        n: i64,
        t: i32,
        h: i32,
        d: i32,
        sign: f32,
    },
    SwigluForward {
        dtype: Dtype,
        y: Addr,
        gate: Addr,
        up: Addr,
        n: i64,
    },
    SwigluBackward {
        dtype: Dtype,
        dgate: Addr,
        dup: Addr,
        gate: Addr,
        up: Addr,
        dy: Addr,
        n: i64,
    },
    KvToHeads {
        dtype: Dtype,
        dst: Addr,
        src: Addr,
        g: Heads,
        kv: i32,
    },
    HeadsToKv {
        dtype: Dtype,
        dst: Addr,
        src: Addr,
        g: Heads,
        kv: i32,
    },
    ReducePartials {
        dst: Addr,
        partials: Addr,
        p: i32,
        cols: i32,
        stride: i64,
    },
    Adamw {
        p: Addr,
        g: Addr,
        m: Addr,
        v: Addr,
        copy: Addr,
        n: i64,
        s: AdamWArgs,
        decay: i32,
        grad_scale: f32,
    },
    AdamwSegments {
        p: Addr,
        g: Addr,
        m: Addr,
        v: Addr,
        copy: Addr,
        n: i64,
        s: AdamWArgs,
        bounds: Addr,
        decay: Addr,
        segs: i32,
        grad_scale: f32,
    },
    SgdSegments {
        p: Addr,
        g: Addr,
        buf: Addr,
        copy: Addr,
        n: i64,
        s: SgdArgs,
        bounds: Addr,
        decay: Addr,
        segs: i32,
        grad_scale: f32,
    },
    SumPartials {
        partials: Addr,
        x: Addr,
        n: i64,
        squares: i32,
        warps: i32,
    },
    Sum {
        out: Addr,
        x: Addr,
        n: i64,
        accumulate: i32,
    },
    // FP8 delayed scaling (cuda/ops/fp8.cuh): a tensor's cast with its amax folded into
    // per-warp partials, and the end of a step over a set of scalers.
    Fp8Quantize {
        dtype: Dtype,
        out: Addr,
        out_t: Addr,
        amax: Addr,
        x: Addr,
        scale: Addr,
        rows: i64,
        cols: i32,
        e5m2: i32,
        warps: i32,
    },
    Fp8AmaxFold {
        amax: Addr,
        history: Addr,
        partials: Addr,
        count: i64,
        len: i32,
        pos: i32,
        parts: i32,
    },
    Fp8ScaleUpdate {
        state: Addr,
        history: Addr,
        amax: Addr,
        count: i64,
        len: i32,
        pos: i32,
        most_recent: i32,
    },
    // Causal attention on tensor cores (bf16 only; cuda/ops/flash.cuh): `tiles` of 16 rows.
    FlashForward {
        out: Addr,
        lse: Addr,
        q: Addr,
        k: Addr,
        v: Addr,
        tiles: i64,
        t: i32,
        d: i32,
        group: i32,
        scale: f32,
    },
    FlashRowdot {
        dsum: Addr,
        dout: Addr,
        out: Addr,
        rows: i64,
        d: i32,
    },
    FlashBackwardKv {
        dk: Addr,
        dv: Addr,
        q: Addr,
        k: Addr,
        v: Addr,
        dout: Addr,
        lse: Addr,
        dsum: Addr,
        tiles: i64,
        t: i32,
        d: i32,
        group: i32,
        scale: f32,
    },
    FlashBackwardQ {
        dq: Addr,
        q: Addr,
        k: Addr,
        v: Addr,
        dout: Addr,
        lse: Addr,
        dsum: Addr,
        tiles: i64,
        t: i32,
        d: i32,
        group: i32,
        scale: f32,
    },
}

impl Call {
    /// The kernel's base name (kernels.inc), without the element type's suffix.
    pub fn name(&self) -> &'static str {
        match self {
            Call::EncoderForward { .. } => "encoder_forward",
            Call::EncoderBackwardWpe { .. } => "encoder_backward_wpe",
            Call::EncoderBackwardWte { .. } => "encoder_backward_wte",
            Call::FromF32 { .. } => "from_f32",
            Call::GeluForward { .. } => "gelu_forward",
            Call::GeluBackward { .. } => "gelu_backward",
            Call::AddBias { .. } => "add_bias",
            Call::QkvToHeads { .. } => "qkv_to_heads",
            Call::HeadsToQkv { .. } => "heads_to_qkv",
            Call::HeadsToMerged { .. } => "heads_to_merged",
            Call::MergedToHeads { .. } => "merged_to_heads",
            Call::ColumnPartials { .. } => "column_partials",
            Call::LayernormForward { .. } => "layernorm_forward",
            Call::LayernormBackward { .. } => "layernorm_backward",
            Call::AttentionSoftmaxForward { .. } => "attention_softmax_forward",
            Call::AttentionSoftmaxBackward { .. } => "attention_softmax_backward",
            Call::Classifier { .. } => "classifier",
            Call::RmsnormForward { .. } => "rmsnorm_forward",
            Call::RmsnormBackward { .. } => "rmsnorm_backward",
            Call::Rope { .. } => "rope",
            Call::SwigluForward { .. } => "swiglu_forward",
            Call::SwigluBackward { .. } => "swiglu_backward",
            Call::KvToHeads { .. } => "kv_to_heads",
            Call::HeadsToKv { .. } => "heads_to_kv",
            Call::ReducePartials { .. } => "reduce_partials",
            Call::Adamw { .. } => "adamw",
            Call::AdamwSegments { .. } => "adamw_segments",
            Call::SgdSegments { .. } => "sgd_segments",
            Call::SumPartials { .. } => "sum_partials",
            Call::Sum { .. } => "sum",
            Call::Fp8Quantize { .. } => "fp8_quantize",
            Call::Fp8AmaxFold { .. } => "fp8_amax_fold",
            Call::Fp8ScaleUpdate { .. } => "fp8_scale_update",
            Call::FlashForward { .. } => "flash_forward",
            Call::FlashRowdot { .. } => "flash_rowdot",
            Call::FlashBackwardKv { .. } => "flash_backward_kv",
            Call::FlashBackwardQ { .. } => "flash_backward_q",
        }
    }

    /// The element type of a typed kernel; `None` for the f32-only ones.
    pub fn dtype(&self) -> Option<Dtype> {
        use Call::*;
        match *self {
            EncoderForward { dtype, .. }
            | EncoderBackwardWpe { dtype, .. }
            | EncoderBackwardWte { dtype, .. }
            | FromF32 { dtype, .. }
            | GeluForward { dtype, .. }
            | GeluBackward { dtype, .. }
            | AddBias { dtype, .. }
            | QkvToHeads { dtype, .. }
            | HeadsToQkv { dtype, .. }
            | HeadsToMerged { dtype, .. }
            | MergedToHeads { dtype, .. }
            | ColumnPartials { dtype, .. }
            | LayernormForward { dtype, .. }
            | LayernormBackward { dtype, .. }
            | AttentionSoftmaxForward { dtype, .. }
            | AttentionSoftmaxBackward { dtype, .. }
            | Classifier { dtype, .. }
            | RmsnormForward { dtype, .. }
            | RmsnormBackward { dtype, .. }
            | Rope { dtype, .. }
            | SwigluForward { dtype, .. }
            | SwigluBackward { dtype, .. }
            | KvToHeads { dtype, .. }
            | HeadsToKv { dtype, .. }
            | Fp8Quantize { dtype, .. } => Some(dtype),
            ReducePartials { .. }
            | Adamw { .. }
            | AdamwSegments { .. }
            | SgdSegments { .. }
            | SumPartials { .. }
            | Sum { .. }
            | Fp8AmaxFold { .. }
            | Fp8ScaleUpdate { .. } => None,
            FlashForward { .. }
            | FlashRowdot { .. }
            | FlashBackwardKv { .. }
            | FlashBackwardQ { .. } => Some(Dtype::Bf16),
        }
    }

    /// The kernel's full name: the base name and, for typed kernels, `_f32`, `_bf16` or
    /// `_f16`.
    pub fn symbol(&self) -> String {
        match self.dtype() {
            Some(d) => format!("{}_{}", self.name(), d.suffix()),
            None => self.name().to_string(),
        }
    }

    /// How the kernel covers its work (kernels.inc's `n`, `rows` or `warps`).
    pub fn grid(&self) -> Grid {
        use Call::*;
        let heads = |g: &Heads| g.elems() as i64;
        match self {
            EncoderForward { n, .. }
            | FromF32 { n, .. }
            | GeluForward { n, .. }
            | GeluBackward { n, .. }
            | Adamw { n, .. }
            | AddBias { n, .. }
            | AdamwSegments { n, .. }
            | SgdSegments { n, .. }
            | SwigluForward { n, .. }
            | SwigluBackward { n, .. } => Grid::Packs(*n),
            EncoderBackwardWpe { t, c, .. } => Grid::Packs(*t as i64 * *c as i64),
            EncoderBackwardWte { u, c, .. } => Grid::Packs(*u as i64 * *c as i64),
            QkvToHeads { g, .. } | HeadsToQkv { g, .. } => Grid::Packs(3 * heads(g)),
            HeadsToMerged { g, .. } | MergedToHeads { g, .. } => Grid::Packs(heads(g)),
            ColumnPartials { cols, r, .. } => Grid::Packs(*cols as i64 * *r as i64),
            ReducePartials { cols, .. } => Grid::Packs(*cols as i64),
            LayernormForward { n, .. } | Classifier { n, .. } => Grid::Rows(*n),
            AttentionSoftmaxForward { rows, .. } | AttentionSoftmaxBackward { rows, .. } => {
                Grid::Rows(*rows)
            }
            LayernormBackward { warps, .. }
            | SumPartials { warps, .. }
            | Fp8Quantize { warps, .. } => Grid::Warps(*warps as i64),
            Fp8AmaxFold { count, .. } | Fp8ScaleUpdate { count, .. } => Grid::Rows(*count),
            Sum { .. } => Grid::Warps(1),
            FlashForward { tiles, .. }
            | FlashBackwardKv { tiles, .. }
            | FlashBackwardQ { tiles, .. } => Grid::Rows(*tiles),
            FlashRowdot { rows, .. } => Grid::Rows(*rows),
            RmsnormForward { n, .. } => Grid::Rows(*n),
            RmsnormBackward { warps, .. } => Grid::Warps(*warps as i64),
            Rope { n, .. } => Grid::Elements(*n),
            KvToHeads { g, .. } => Grid::Packs(heads(g)),
            HeadsToKv { g, kv, .. } => Grid::Packs(heads(g) / g.h as i64 * *kv as i64),
        }
    }

    /// The arguments in the kernel's parameter order.
    pub fn args(&self) -> Vec<Arg> {
        use Arg::{Addr as A, F32, I32, I64};
        use Call::*;
        match *self {
            EncoderForward {
                out,
                tokens,
                wte,
                wpe,
                n,
                t,
                c,
                ..
            } => vec![A(out), A(tokens), A(wte), A(wpe), I64(n), I32(t), I32(c)],
            EncoderBackwardWpe {
                dwpe,
                dout,
                b,
                t,
                c,
                ..
            } => vec![A(dwpe), A(dout), I32(b), I32(t), I32(c)],
            EncoderBackwardWte {
                dwte,
                dout,
                uniq,
                starts,
                positions,
                u,
                c,
                ..
            } => {
                vec![
                    A(dwte),
                    A(dout),
                    A(uniq),
                    A(starts),
                    A(positions),
                    I32(u),
                    I32(c),
                ]
            }
            GeluForward { out, inp, n, .. } | FromF32 { out, x: inp, n, .. } => {
                vec![A(out), A(inp), I64(n)]
            }
            AddBias {
                out, bias, n, cols, ..
            } => vec![A(out), A(bias), I64(n), I32(cols)],
            GeluBackward {
                dinp, inp, dout, n, ..
            } => vec![A(dinp), A(inp), A(dout), I64(n)],
            QkvToHeads { dst, src, g, .. }
            | HeadsToQkv { dst, src, g, .. }
            | HeadsToMerged { dst, src, g, .. }
            | MergedToHeads { dst, src, g, .. } => {
                vec![A(dst), A(src), Arg::Heads(g)]
            }
            ColumnPartials {
                partials,
                x,
                n,
                cols,
                r,
                chunk,
                ..
            } => vec![A(partials), A(x), I64(n), I32(cols), I32(r), I64(chunk)],
            LayernormForward {
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
                ..
            } => {
                vec![
                    A(out),
                    A(mean),
                    A(rstd),
                    A(resid),
                    A(a),
                    A(a2),
                    A(weight),
                    A(bias),
                    I64(n),
                    I32(c),
                    F32(eps),
                ]
            }
            LayernormBackward {
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
                ..
            } => {
                vec![
                    A(dinp),
                    A(partials),
                    A(dout),
                    A(inp),
                    A(weight),
                    A(mean),
                    A(rstd),
                    I64(n),
                    I32(c),
                    I32(warps),
                ]
            }
            AttentionSoftmaxForward {
                att,
                pre,
                rows,
                t,
                chunk,
                scale,
                ..
            } => vec![A(att), A(pre), I64(rows), I32(t), I32(chunk), F32(scale)],
            AttentionSoftmaxBackward {
                dpre,
                datt,
                att,
                rows,
                t,
                chunk,
                scale,
                ..
            } => vec![
                A(dpre),
                A(datt),
                A(att),
                I64(rows),
                I32(t),
                I32(chunk),
                F32(scale),
            ],
            Classifier {
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
                ..
            } => {
                vec![
                    A(logits),
                    A(losses),
                    A(hits),
                    A(targets),
                    I64(n),
                    I32(v),
                    I32(vp),
                    I32(grad),
                    F32(dscale),
                    I32(ignore),
                ]
            }
            RmsnormForward {
                out,
                rstd,
                resid,
                a,
                a2,
                weight,
                n,
                c,
                eps,
                ..
            } => {
                vec![
                    A(out),
                    A(rstd),
                    A(resid),
                    A(a),
                    A(a2),
                    A(weight),
                    I64(n),
                    I32(c),
                    F32(eps),
                ]
            }
            RmsnormBackward {
                dinp,
                partials,
                dout,
                inp,
                weight,
                rstd,
                n,
                c,
                warps,
                ..
            } => {
                vec![
                    A(dinp),
                    A(partials),
                    A(dout),
                    A(inp),
                    A(weight),
                    A(rstd),
                    I64(n),
                    I32(c),
                    I32(warps),
                ]
            }
            Rope {
                x,
                cos,
                sin,
                n,
                t,
                h,
                d,
                sign,
                ..
            } => vec![
                A(x),
                A(cos),
                A(sin),
                I64(n),
                I32(t),
                I32(h),
                I32(d),
                F32(sign),
            ],
            SwigluForward { y, gate, up, n, .. } => vec![A(y), A(gate), A(up), I64(n)],
            SwigluBackward {
                dgate,
                dup,
                gate,
                up,
                dy,
                n,
                ..
            } => vec![A(dgate), A(dup), A(gate), A(up), A(dy), I64(n)],
            KvToHeads {
                dst, src, g, kv, ..
            }
            | HeadsToKv {
                dst, src, g, kv, ..
            } => vec![A(dst), A(src), Arg::Heads(g), I32(kv)],
            ReducePartials {
                dst,
                partials,
                p,
                cols,
                stride,
            } => vec![A(dst), A(partials), I32(p), I32(cols), I64(stride)],
            Adamw {
                p,
                g,
                m,
                v,
                copy,
                n,
                s,
                decay,
                grad_scale,
            } => {
                vec![
                    A(p),
                    A(g),
                    A(m),
                    A(v),
                    A(copy),
                    I64(n),
                    Arg::AdamW(s),
                    I32(decay),
                    F32(grad_scale),
                ]
            }
            AdamwSegments {
                p,
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
            } => {
                vec![
                    A(p),
                    A(g),
                    A(m),
                    A(v),
                    A(copy),
                    I64(n),
                    Arg::AdamW(s),
                    A(bounds),
                    A(decay),
                    I32(segs),
                    F32(grad_scale),
                ]
            }
            SgdSegments {
                p,
                g,
                buf,
                copy,
                n,
                s,
                bounds,
                decay,
                segs,
                grad_scale,
            } => {
                vec![
                    A(p),
                    A(g),
                    A(buf),
                    A(copy),
                    I64(n),
                    Arg::Sgd(s),
                    A(bounds),
                    A(decay),
                    I32(segs),
                    F32(grad_scale),
                ]
            }
            SumPartials {
                partials,
                x,
                n,
                squares,
                warps,
            } => vec![A(partials), A(x), I64(n), I32(squares), I32(warps)],
            Sum {
                out,
                x,
                n,
                accumulate,
            } => vec![A(out), A(x), I64(n), I32(accumulate)],
            Fp8Quantize {
                out,
                out_t,
                amax,
                x,
                scale,
                rows,
                cols,
                e5m2,
                warps,
                ..
            } => vec![
                A(out),
                A(out_t),
                A(amax),
                A(x),
                A(scale),
                I64(rows),
                I32(cols),
                I32(e5m2),
                I32(warps),
            ],
            Fp8AmaxFold {
                amax,
                history,
                partials,
                count,
                len,
                pos,
                parts,
            } => vec![
                A(amax),
                A(history),
                A(partials),
                I64(count),
                I32(len),
                I32(pos),
                I32(parts),
            ],
            Fp8ScaleUpdate {
                state,
                history,
                amax,
                count,
                len,
                pos,
                most_recent,
            } => vec![
                A(state),
                A(history),
                A(amax),
                I64(count),
                I32(len),
                I32(pos),
                I32(most_recent),
            ],
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
            } => vec![
                A(out),
                A(lse),
                A(q),
                A(k),
                A(v),
                I64(tiles),
                I32(t),
                I32(d),
                I32(group),
                F32(scale),
            ],
            FlashRowdot {
                dsum,
                dout,
                out,
                rows,
                d,
            } => vec![A(dsum), A(dout), A(out), I64(rows), I32(d)],
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
            } => vec![
                A(dk),
                A(dv),
                A(q),
                A(k),
                A(v),
                A(dout),
                A(lse),
                A(dsum),
                I64(tiles),
                I32(t),
                I32(d),
                I32(group),
                F32(scale),
            ],
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
            } => vec![
                A(dq),
                A(q),
                A(k),
                A(v),
                A(dout),
                A(lse),
                A(dsum),
                I64(tiles),
                I32(t),
                I32(d),
                I32(group),
                F32(scale),
            ],
        }
    }
}
