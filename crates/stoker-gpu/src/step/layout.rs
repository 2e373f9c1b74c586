//! Where every activation of the GPU step lives: one buffer of the activations' type and
//! one of f32 (statistics, losses, partial sums), each named span's offset and length
//! computed here and nowhere else (llm.c's `fill_in_activation_sizes`).

use stoker_kernels::GptDims;

/// Elements `start..start + len` of a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// First element.
    pub start: usize,
    /// Elements.
    pub len: usize,
}

impl Span {
    /// The range it covers.
    pub fn range(&self) -> std::ops::Range<usize> {
        self.start..self.start + self.len
    }
}

/// Elements each span starts on a multiple of: 128 bytes of a 16-bit buffer, so every
/// row kernel's and pack kernel's 16-byte words and cuBLASLt's operands see aligned
/// starts whatever the spans before them hold.
pub const SPAN_ALIGN: usize = 64;

/// Hands out consecutive spans of one buffer, each starting on a multiple of
/// [`SPAN_ALIGN`].
#[derive(Debug, Default)]
pub(crate) struct Cursor(pub(crate) usize);

impl Cursor {
    pub(crate) fn take(&mut self, len: usize) -> Span {
        let start = self.0.div_ceil(SPAN_ALIGN) * SPAN_ALIGN;
        self.0 = start + len;
        Span { start, len }
    }

    /// A span of `len` where `on`, else an empty one that takes nothing (and moves no
    /// later span).
    pub(crate) fn take_if(&mut self, on: bool, len: usize) -> Span {
        match on {
            true => self.take(len),
            false => Span { start: 0, len: 0 },
        }
    }
}

/// One block's saved activations (`N` rows of width `C`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockActs {
    /// The block's input, the residual stream `[N, C]` (the previous block's output sum).
    pub resid_in: Span,
    /// The first LayerNorm's output `[N, C]`.
    pub ln1: Span,
    /// The QKV projection `[N, 3C]`.
    pub qkv: Span,
    /// q, k, v per head `[3, B, H, T, D]`.
    pub heads: Span,
    /// Attention probabilities `[B, H, T, T]` (the scores before the softmax, in place);
    /// one span for every block where they are recomputed in the backward; empty with
    /// flash attention.
    pub att: Span,
    /// Attention's output per head `[B, H, T, D]`.
    pub atty_h: Span,
    /// Attention's output `[N, C]`.
    pub atty: Span,
    /// The output projection `[N, C]`.
    pub attproj: Span,
    /// The residual after attention `[N, C]`.
    pub resid2: Span,
    /// The second LayerNorm's output `[N, C]`.
    pub ln2: Span,
    /// The MLP's expansion `[N, 4C]`.
    pub fch: Span,
    /// Its GELU `[N, 4C]`; one span for every block where it is recomputed in the
    /// backward.
    pub fch_gelu: Span,
    /// The MLP's projection `[N, C]`.
    pub fcproj: Span,
}

/// One block's LayerNorm statistics (f32, `N` each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockStats {
    /// The first LayerNorm's mean and rstd.
    pub ln1: [Span; 2],
    /// The second's.
    pub ln2: [Span; 2],
    /// With flash attention, each row's log-sum-exp `[B, H, T]` (else empty).
    pub lse: Span,
}

/// Every span of a step at one batch shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActLayout {
    /// Per block.
    pub blocks: Vec<BlockActs>,
    /// The last block's output sum `[N, C]`.
    pub resid_out: Span,
    /// The final LayerNorm's output `[N, C]`.
    pub lnf: Span,
    /// Logits, then in place their gradient `[N, Vp]`.
    pub logits: Span,
    /// The backward's scratch: the residual stream's gradient `[N, C]`.
    pub dres: Span,
    /// A LayerNorm input's gradient or attention's output gradient `[N, C]`.
    pub dnc: Span,
    /// The MLP's hidden gradient `[N, 4C]`.
    pub dfch: Span,
    /// The QKV projection's gradient `[N, 3C]`.
    pub dqkv: Span,
    /// dq, dk, dv per head `[3, B, H, T, D]`.
    pub dheads: Span,
    /// Attention's output gradient per head `[B, H, T, D]`.
    pub datty_h: Span,
    /// The probabilities' (then the scores') gradient `[B, H, T, T]`; empty with flash
    /// attention.
    pub datt: Span,
    /// Elements of the activation buffer.
    pub total: usize,
    /// With flash attention, each row's `dout . out` `[B, H, T]` in the f32 buffer (else
    /// empty).
    pub dsum: Span,
    /// Per block, in the f32 buffer.
    pub stats: Vec<BlockStats>,
    /// The final LayerNorm's statistics.
    pub lnf_stats: [Span; 2],
    /// Each row's loss `[N]`.
    pub losses: Span,
    /// Each row's top-1 hit (evaluation) `[N]`.
    pub hits: Span,
    /// Partial sums: LayerNorm backward's per-warp rows, the bias gradients' row chunks,
    /// the loss sum's per-warp sums.
    pub partials: Span,
    /// The summed loss `[1]`.
    pub loss_sum: Span,
    /// The gradients' squared norm `[1]`.
    pub grad_norm: Span,
    /// Elements of the f32 buffer.
    pub floats: usize,
}

/// Warps of the LayerNorm backward's partial rows, and of the loss sum.
pub const PARTIAL_WARPS: usize = 1024;
/// Row chunks of a bias gradient.
pub const BIAS_PARTS: usize = 64;

impl ActLayout {
    /// The spans for `batch` sequences of `t` positions of a GPT of `dims` with the
    /// vocabulary padded to `vp`; what `opts` recomputes (attention's probabilities, the
    /// GELU's output) shares one span across the blocks.
    pub fn new(
        dims: &GptDims,
        (batch, t): (usize, usize),
        vp: usize,
        opts: crate::step::options::StepOptions,
    ) -> Self {
        let (n, c) = (batch * t, dims.d_model);
        let tt = batch * dims.n_head * t * t;
        let (flash, rows) = (opts.flash_attention, batch * dims.n_head * t);
        let mut a = Cursor::default();
        let shared = opts.recompute_attention.then(|| a.take(tt));
        let shared_gelu = opts.recompute_mlp.then(|| a.take(4 * n * c));
        let blocks = (0..dims.n_layer)
            .map(|_| BlockActs {
                resid_in: a.take(n * c),
                ln1: a.take(n * c),
                qkv: a.take(3 * n * c),
                heads: a.take(3 * n * c),
                att: shared.unwrap_or_else(|| a.take_if(!flash, tt)),
                atty_h: a.take(n * c),
                atty: a.take(n * c),
                attproj: a.take(n * c),
                resid2: a.take(n * c),
                ln2: a.take(n * c),
                fch: a.take(4 * n * c),
                fch_gelu: shared_gelu.unwrap_or_else(|| a.take(4 * n * c)),
                fcproj: a.take(n * c),
            })
            .collect();
        let (resid_out, lnf, logits) = (a.take(n * c), a.take(n * c), a.take(n * vp));
        let (dres, dnc, dfch, dqkv) = (
            a.take(n * c),
            a.take(n * c),
            a.take(4 * n * c),
            a.take(3 * n * c),
        );
        let (dheads, datty_h) = (a.take(3 * n * c), a.take(n * c));
        let datt = a.take_if(!flash, tt);
        let mut f = Cursor::default();
        let stats = (0..dims.n_layer)
            .map(|_| BlockStats {
                ln1: [f.take(n), f.take(n)],
                ln2: [f.take(n), f.take(n)],
                lse: f.take_if(flash, rows),
            })
            .collect();
        let dsum = f.take_if(flash, rows);
        let lnf_stats = [f.take(n), f.take(n)];
        let (losses, hits) = (f.take(n), f.take(n));
        let partials = f.take(
            (PARTIAL_WARPS * 2 * c)
                .max(BIAS_PARTS * 4 * c)
                .max(PARTIAL_WARPS),
        );
        let (loss_sum, grad_norm) = (f.take(1), f.take(1));
        ActLayout {
            blocks,
            resid_out,
            lnf,
            logits,
            dres,
            dnc,
            dfch,
            dqkv,
            dheads,
            datty_h,
            datt,
            total: a.0,
            dsum,
            stats,
            lnf_stats,
            losses,
            hits,
            partials,
            loss_sum,
            grad_norm,
            floats: f.0,
        }
    }
}
