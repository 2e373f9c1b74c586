//! Where every activation of the Llama's GPU step lives (its twin of `layout.rs`): one
//! buffer of the activations' type and one of f32, each span sized here only.

use stoker_kernels::LlamaDims;

use super::layout::{Cursor, Span, BIAS_PARTS, PARTIAL_WARPS};

/// One block's saved activations (`N` rows; `C` wide, `KV` = kv heads x head width, `F`
/// SwiGLU's width).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LlamaBlockActs {
    /// The block's input, the residual stream `[N, C]`.
    pub resid_in: Span,
    /// The attention's RMSNorm output `[N, C]`.
    pub h1: Span,
    /// Queries `[N, C]`, rotated in place.
    pub q: Span,
    /// Keys `[N, KV]`, rotated in place.
    pub k: Span,
    /// Values `[N, KV]`.
    pub v: Span,
    /// q, k, v per query head `[3, B, H, T, D]` (k and v repeated); with flash attention
    /// q `[B, H, T, D]` and k and v per kv head, `[B, KV, T, D]` each.
    pub heads: Span,
    /// Attention probabilities `[B, H, T, T]`; one span for every block where they are
    /// recomputed in the backward.
    pub att: Span,
    /// Attention's output per head `[B, H, T, D]`.
    pub atty_h: Span,
    /// Attention's output `[N, C]`.
    pub atty: Span,
    /// The output projection `[N, C]`.
    pub o: Span,
    /// The residual after attention `[N, C]`.
    pub resid2: Span,
    /// The MLP's RMSNorm output `[N, C]`.
    pub h2: Span,
    /// SwiGLU's gate and up projections and its output `[N, F]` each.
    pub gate: Span,
    /// The up projection.
    pub up: Span,
    /// `silu(gate) * up`; one span for every block where it is recomputed in the
    /// backward.
    pub act: Span,
    /// The down projection `[N, C]`.
    pub down: Span,
    /// The two RMSNorms' rstd (f32 buffer, `N` each).
    pub rstd: [Span; 2],
    /// With flash attention, each row's log-sum-exp `[B, H, T]` (f32 buffer; else empty).
    pub lse: Span,
}

/// Every span of the Llama step at one batch shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LlamaLayout {
    /// Per block.
    pub blocks: Vec<LlamaBlockActs>,
    /// The last block's output sum `[N, C]`.
    pub resid_out: Span,
    /// The final RMSNorm's output `[N, C]`.
    pub hf: Span,
    /// Logits, then their gradient `[N, Vp]`.
    pub logits: Span,
    /// The residual stream's gradient `[N, C]`.
    pub dres: Span,
    /// A norm input's or attention output's gradient `[N, C]`.
    pub dnc: Span,
    /// SwiGLU's gate and up gradients `[N, F]` each.
    pub dgate: Span,
    /// The up projection's gradient.
    pub dup: Span,
    /// The queries' gradient `[N, C]`, keys' and values' `[N, KV]`.
    pub dq: Span,
    /// The keys' gradient.
    pub dk: Span,
    /// The values' gradient.
    pub dv: Span,
    /// dq, dk, dv per query head `[3, B, H, T, D]` (with flash attention dk and dv per kv
    /// head, `[B, KV, T, D]` each).
    pub dheads: Span,
    /// Attention's output gradient per head `[B, H, T, D]`.
    pub datty_h: Span,
    /// The probabilities' gradient `[B, H, T, T]`; empty with flash attention.
    pub datt: Span,
    /// Elements of the activation buffer.
    pub total: usize,
    /// With flash attention, each row's `dout . out` `[B, H, T]` (f32; else empty).
    pub dsum: Span,
    /// The final RMSNorm's rstd (f32).
    pub rstd_f: Span,
    /// The rotary tables `[T, D/2]` each (f32).
    pub cos: Span,
    /// The sines.
    pub sin: Span,
    /// Each row's loss (f32).
    pub losses: Span,
    /// Each row's top-1 hit (f32, evaluation).
    pub hits: Span,
    /// Partial sums (f32).
    pub partials: Span,
    /// The summed loss (f32, 1).
    pub loss_sum: Span,
    /// The gradients' squared norm (f32, 1).
    pub grad_norm: Span,
    /// Elements of the f32 buffer.
    pub floats: usize,
}

impl LlamaLayout {
    /// The spans for `batch` sequences of `t` positions of a Llama of `dims`, the
    /// vocabulary padded to `vp`; what `opts` recomputes (attention's probabilities, the
    /// SwiGLU product) shares one span across the blocks.
    pub fn new(
        dims: &LlamaDims,
        (batch, t): (usize, usize),
        vp: usize,
        opts: crate::step::options::StepOptions,
    ) -> Self {
        let (n, c, f) = (batch * t, dims.d_model, dims.ffn_hidden);
        let kv = dims.n_kv_head * dims.head_dim();
        let tt = batch * dims.n_head * t * t;
        let (flash, rows) = (opts.flash_attention, batch * dims.n_head * t);
        // q per query head, and k and v repeated to every query head; with flash
        // attention k and v stay one per kv head.
        let heads_len = match flash {
            true => n * c + 2 * n * kv,
            false => 3 * n * c,
        };
        let (mut a, mut fl) = (Cursor::default(), Cursor::default());
        let shared = opts.recompute_attention.then(|| a.take(tt));
        let shared_act = opts.recompute_mlp.then(|| a.take(n * f));
        let blocks = (0..dims.n_layer)
            .map(|_| LlamaBlockActs {
                resid_in: a.take(n * c),
                h1: a.take(n * c),
                q: a.take(n * c),
                k: a.take(n * kv),
                v: a.take(n * kv),
                heads: a.take(heads_len),
                att: shared.unwrap_or_else(|| a.take_if(!flash, tt)),
                atty_h: a.take(n * c),
                atty: a.take(n * c),
                o: a.take(n * c),
                resid2: a.take(n * c),
                h2: a.take(n * c),
                gate: a.take(n * f),
                up: a.take(n * f),
                act: shared_act.unwrap_or_else(|| a.take(n * f)),
                down: a.take(n * c),
                rstd: [fl.take(n), fl.take(n)],
                lse: fl.take_if(flash, rows),
            })
            .collect();
        let (resid_out, hf, logits) = (a.take(n * c), a.take(n * c), a.take(n * vp));
        let (dres, dnc, dgate, dup) = (a.take(n * c), a.take(n * c), a.take(n * f), a.take(n * f));
        let (dq, dk, dv) = (a.take(n * c), a.take(n * kv), a.take(n * kv));
        let (dheads, datty_h) = (a.take(heads_len), a.take(n * c));
        let datt = a.take_if(!flash, tt);
        let dsum = fl.take_if(flash, rows);
        let half = dims.head_dim() / 2;
        let (rstd_f, cos, sin, losses) =
            (fl.take(n), fl.take(t * half), fl.take(t * half), fl.take(n));
        let hits = fl.take(n);
        let partials = fl.take((PARTIAL_WARPS * c).max(BIAS_PARTS * c).max(PARTIAL_WARPS));
        let (loss_sum, grad_norm) = (fl.take(1), fl.take(1));
        LlamaLayout {
            blocks,
            resid_out,
            hf,
            logits,
            dres,
            dnc,
            dgate,
            dup,
            dq,
            dk,
            dv,
            dheads,
            datty_h,
            datt,
            total: a.0,
            dsum,
            rstd_f,
            cos,
            sin,
            losses,
            hits,
            partials,
            loss_sum,
            grad_norm,
            floats: fl.0,
        }
    }
}
