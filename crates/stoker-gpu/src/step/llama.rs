//! The Llama's training step over flat buffers on any [`Backend`]: stoker-kernels'
//! `LlamaStep` (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU, an untied
//! head, no biases) over the same flat layout and offsets, with the GPT step's design:
//! one buffer each for the compute copy, the f32 gradients, the activations and the f32
//! statistics (spans from `llama_layout.rs`), products through [`matmul`], the residual
//! add fused into the next RMSNorm, the one value read back the summed loss.

use stoker_kernels::{LlamaDims, LlamaOffsets};

use super::attention::{self, Qkv};
use super::buffers::{self, BlockHooks, LossSpans, StepBuffers, StepSizes, TokenModel};
use super::fp8_linear::{Fp8Linears, Fp8Sizes};
use super::layout::{Span, PARTIAL_WARPS};
use super::linear::{self, Fp8Layer, Linear};
use super::llama_layout::{LlamaBlockActs, LlamaLayout};
use super::optimizer::{self, OptimizerState, Scalars, UpdateViews};
use super::options::StepOptions;
use super::{padded_vocab, TokenBatch};
use crate::backend::Backend;
use crate::elem::Act;
use crate::error::GpuError;
use crate::gemm::{matmul, Dims, Mat};
use crate::ids::{Groups, Ids};
use crate::{kernels, llama, Heads};

const OP: &str = "llama-gpu-step";

fn shape_err(what: String) -> GpuError {
    GpuError::Shape { kernel: OP, what }
}

/// A Llama's step at one batch shape, its buffers on backend `B`, activations in `T`.
pub struct LlamaGpuStep<B: Backend, T: Act> {
    dims: LlamaDims,
    offsets: LlamaOffsets,
    eps: f32,
    batch: usize,
    t: usize,
    layout: LlamaLayout,
    bufs: StepBuffers<B, T>,
    /// Each block's parameters as runs of the flat buffer (see `block_runs`).
    blocks: Vec<Vec<std::ops::Range<usize>>>,
    /// Attention's probabilities recomputed in each block's backward (one shared span).
    recompute_attention: bool,
    /// The MLP's activation recomputed in each block's backward (one shared span).
    recompute_mlp: bool,
    /// Attention on tensor cores keeping each row's log-sum-exp, not its probabilities.
    flash_attention: bool,
    /// The linear layers in FP8 with delayed scaling, seven per block (`q`, `k`, `v`,
    /// `o`, `gate`, `up`, `down`), where the step runs them so.
    fp8: Option<Fp8Linears<B>>,
}

/// What a Llama step of `dims` over a flat buffer of `params` elements holds for `batch`
/// sequences of `t` positions, made with `opts`: its buffers' sizes, known before the
/// step is made.
pub fn llama_step_sizes(
    dims: &LlamaDims,
    params: usize,
    (batch, t): (usize, usize),
    opts: StepOptions,
) -> StepSizes {
    let layout = LlamaLayout::new(dims, (batch, t), padded_vocab(dims.vocab), opts);
    let fp8 = opts.fp8_linears.then(|| {
        let (layers, widths, weight) = llama_fp8_layers(dims);
        let widest = widths.into_iter().max().unwrap_or(0);
        Fp8Sizes::of(layers, batch * t, widest, weight).bytes()
    });
    let sizes = StepSizes::of(
        params,
        (layout.total, layout.floats),
        (batch * t, dims.vocab),
    )
    .placed(opts, (dims.n_layer, llama_block_len(dims)));
    StepSizes {
        fp8: fp8.unwrap_or(0),
        ..sizes
    }
}

/// A block's linear layers in the step's order: `q`, `k`, `v`, `o`, `gate`, `up`, `down`.
const FP8_LAYERS_PER_BLOCK: usize = 7;

/// The Llama's FP8 layers: how many, their widths (inputs and outputs), the largest
/// weight's elements.
fn llama_fp8_layers(dims: &LlamaDims) -> (usize, [usize; 3], usize) {
    let (c, f) = (dims.d_model, dims.ffn_hidden);
    let kv = dims.n_kv_head * dims.head_dim();
    (
        FP8_LAYERS_PER_BLOCK * dims.n_layer,
        [c, kv, f],
        (c * c).max(c * f).max(kv * c),
    )
}

/// Elements of one Llama block's parameters (block 0's in stoker-kernels' table).
pub fn llama_block_len(dims: &LlamaDims) -> usize {
    stoker_kernels::param_spec::group_elements(&stoker_kernels::llama_params(dims), 1)
}

impl<B: Backend, T: Act> LlamaGpuStep<B, T> {
    /// A step for `batch` sequences of `t` positions of a Llama of `dims`, parameters at
    /// `offsets`, RMSNorm epsilon `eps`, rotary base `rope_theta`: every buffer allocated
    /// once, the rotary tables (stoker-kernels' own) uploaded once.
    pub fn new(
        be: &B,
        dims: LlamaDims,
        offsets: LlamaOffsets,
        eps: f64,
        rope_theta: f64,
        batch: usize,
        t: usize,
    ) -> Result<Self, GpuError> {
        let opts = StepOptions::default();
        Self::with_options(be, dims, offsets, (eps, rope_theta), (batch, t), opts)
    }

    /// [`LlamaGpuStep::new`] made with `opts` ([`StepOptions`]).
    pub fn with_options(
        be: &B,
        dims: LlamaDims,
        offsets: LlamaOffsets,
        (eps, rope_theta): (f64, f64),
        (batch, t): (usize, usize),
        opts: StepOptions,
    ) -> Result<Self, GpuError> {
        let heads_ok = dims.n_layer > 0
            && dims.n_head > 0
            && dims.n_kv_head > 0
            && dims.d_model.is_multiple_of(dims.n_head)
            && dims.head_dim().is_multiple_of(2)
            && dims.n_head.is_multiple_of(dims.n_kv_head);
        if !heads_ok || offsets.blocks().len() != dims.n_layer {
            return Err(shape_err(format!(
                "{dims:?} with offsets for {} blocks",
                offsets.blocks().len()
            )));
        }
        if batch == 0 || t == 0 || t > dims.context {
            return Err(shape_err(format!(
                "batch {batch} x {t} positions (context {})",
                dims.context
            )));
        }
        if let Some(why) = opts.flash_refusal(T::DTYPE, dims.head_dim()) {
            return Err(shape_err(why));
        }
        if let Some(why) = opts.fp8_refusal(T::DTYPE) {
            return Err(shape_err(why));
        }
        let layout = LlamaLayout::new(&dims, (batch, t), padded_vocab(dims.vocab), opts);
        let (c, f) = (dims.d_model, dims.ffn_hidden);
        let kv = dims.n_kv_head * dims.head_dim();
        let blocks = offsets
            .blocks()
            .iter()
            .map(|b| {
                super::block_runs::merge_runs(vec![
                    (b.input_norm, c),
                    (b.q, c * c),
                    (b.k, kv * c),
                    (b.v, kv * c),
                    (b.o, c * c),
                    (b.post_norm, c),
                    (b.gate, f * c),
                    (b.up, f * c),
                    (b.down, c * f),
                ])
            })
            .collect::<Vec<_>>();
        let sizes = llama_step_sizes(&dims, offsets.end(), (batch, t), opts);
        let bufs = StepBuffers::new(be, sizes, &blocks, opts.graph_micro_batches)?;
        let (cos, sin) = stoker_kernels::rope::tables(t, dims.head_dim(), rope_theta);
        be.write(&bufs.floats, layout.cos.start, &cos)?;
        be.write(&bufs.floats, layout.sin.start, &sin)?;
        Ok(LlamaGpuStep {
            fp8: match opts.fp8_linears {
                true => {
                    let (layers, widths, weight) = llama_fp8_layers(&dims);
                    Some(Fp8Linears::new(be, layers, batch * t, &widths, weight)?)
                }
                false => None,
            },
            recompute_attention: opts.recompute_attention,
            recompute_mlp: opts.recompute_mlp,
            flash_attention: opts.flash_attention,
            blocks,
            bufs,
            dims,
            offsets,
            eps: eps as f32,
            batch,
            t,
            layout,
        })
    }

    fn heads(&self) -> Heads {
        let d = self.dims.head_dim();
        Heads {
            b: self.batch as i32,
            t: self.t as i32,
            h: self.dims.n_head as i32,
            d: d as i32,
        }
    }

    fn kv(&self) -> usize {
        self.dims.n_kv_head * self.dims.head_dim()
    }

    /// Block `block`'s linear layer `j` (`q`, `k`, `v`, `o`, `gate`, `up`, `down`) among
    /// the FP8 layers, where the step runs them.
    fn fp8_layer(&self, block: usize, j: usize) -> Fp8Layer<'_, B> {
        self.fp8
            .as_ref()
            .map(|f| (f, FP8_LAYERS_PER_BLOCK * block + j))
    }

    /// `y = x W^T` (`W` at `w`, `[out, inp]`), block `block`'s linear layer `j`.
    fn linear(
        &self,
        be: &B,
        (y, x): (Span, Span),
        w: usize,
        (inp, out): (usize, usize),
        (block, j): (usize, usize),
    ) -> Result<(), GpuError> {
        linear::forward(
            be,
            &self.bufs,
            self.batch * self.t,
            Linear {
                w,
                b: None,
                inp,
                out,
            },
            (y, x),
            self.fp8_layer(block, j),
        )
    }

    /// `dx (+)= dy W` (added when `add`), `dW += dy^T x`, block `block`'s linear layer `j`.
    fn linear_back(
        &self,
        be: &B,
        (dx, add, dy, x): (Span, bool, Span, Span),
        w: usize,
        (inp, out): (usize, usize),
        (block, j): (usize, usize),
    ) -> Result<(), GpuError> {
        let l = Linear {
            w,
            b: None,
            inp,
            out,
        };
        linear::backward(
            be,
            &self.bufs,
            self.batch * self.t,
            l,
            Some((dx, add)),
            dy,
            x,
            self.layout.partials,
            self.fp8_layer(block, j),
        )
    }

    fn rope(&self, be: &B, x: Span, heads: usize, inverse: bool) -> Result<(), GpuError> {
        let lay = &self.layout;
        llama::rope(
            be,
            self.bufs.a(be, x)?,
            self.bufs.f(be, lay.cos)?,
            self.bufs.f(be, lay.sin)?,
            self.t,
            heads,
            self.dims.head_dim(),
            inverse,
        )
    }

    /// q to heads, k and v repeated to the query heads, attention, merged back.
    fn attention(&self, be: &B, s: &LlamaBlockActs) -> Result<(), GpuError> {
        let (g, g_kv) = (self.heads(), self.kv_heads_shape());
        let kv = self.dims.n_kv_head;
        let x = self.head_views(be, s.heads)?;
        kernels::merged_heads(be, x.q, self.bufs.a(be, s.q)?, g, true)?;
        llama::kv_heads(be, x.k, self.bufs.a(be, s.k)?, g_kv, kv, false)?;
        llama::kv_heads(be, x.v, self.bufs.a(be, s.v)?, g_kv, kv, false)?;
        if self.flash_attention {
            return attention::flash_forward(
                be,
                x,
                self.bufs.f(be, s.lse)?,
                (self.bufs.a(be, s.atty_h)?, self.bufs.a(be, s.atty)?),
                (g, self.dims.n_head / kv),
            );
        }
        attention::forward(
            be,
            x,
            self.bufs.a(be, s.att)?,
            (self.bufs.a(be, s.atty_h)?, self.bufs.a(be, s.atty)?),
            g,
        )
    }

    /// The heads k and v are laid out in: every query head's (repeated), or with flash
    /// attention one per kv head.
    fn kv_heads_shape(&self) -> Heads {
        match self.flash_attention {
            true => Heads {
                h: self.dims.n_kv_head as i32,
                ..self.heads()
            },
            false => self.heads(),
        }
    }

    /// A heads span (`heads`, `dheads`) as q, k and v: thirds, or with flash attention q
    /// per query head and k and v per kv head.
    fn head_views(&self, be: &B, span: Span) -> Result<Qkv<'_, T>, GpuError> {
        let all = self.bufs.a(be, span)?;
        if !self.flash_attention {
            return Qkv::thirds(all);
        }
        let n = self.batch * self.t;
        let (nq, nkv) = (
            n * self.dims.d_model,
            n * self.dims.n_kv_head * self.dims.head_dim(),
        );
        Ok(Qkv {
            q: all.slice(0..nq)?,
            k: all.slice(nq..nq + nkv)?,
            v: all.slice(nq + nkv..nq + 2 * nkv)?,
        })
    }

    /// The MLP's activation `silu(gate) * up` of block `s` into its span (the forward's,
    /// and the backward's recompute where it is not kept).
    fn swiglu(&self, be: &B, s: &LlamaBlockActs) -> Result<(), GpuError> {
        llama::swiglu_forward(
            be,
            self.bufs.a(be, s.act)?,
            self.bufs.a(be, s.gate)?,
            self.bufs.a(be, s.up)?,
        )
    }

    /// Attention's backward: `dnc` (the output's gradient) to `dq`, `dk`, `dv` (the kv
    /// gradients summed over their query heads, q and k turned back).
    fn attention_back(&self, be: &B, s: &LlamaBlockActs) -> Result<(), GpuError> {
        let lay = &self.layout;
        let g = self.heads();
        let kv = self.dims.n_kv_head;
        if self.recompute_attention {
            let heads = Qkv::thirds(self.bufs.a(be, s.heads)?)?;
            attention::probabilities(be, heads, self.bufs.a(be, s.att)?, g)?;
        }
        let dx = self.head_views(be, lay.dheads)?;
        let x = self.head_views(be, s.heads)?;
        let dout = (self.bufs.a(be, lay.dnc)?, self.bufs.a(be, lay.datty_h)?);
        if self.flash_attention {
            let kept = (x, self.bufs.a(be, s.atty_h)?, self.bufs.f(be, s.lse)?);
            let group = self.dims.n_head / kv;
            let dsum = self.bufs.f(be, lay.dsum)?;
            attention::flash_backward(be, kept, dout, dsum, dx, (g, group))?;
        } else {
            let kept = (x, self.bufs.a(be, s.att)?);
            attention::backward(be, kept, dout, self.bufs.a(be, lay.datt)?, dx, g)?;
        }
        // The kv gradients summed over their query heads (by the flash kernel itself).
        let g_kv = self.kv_heads_shape();
        kernels::merged_heads(be, self.bufs.a(be, lay.dq)?, dx.q, g, false)?;
        llama::kv_heads(be, self.bufs.a(be, lay.dk)?, dx.k, g_kv, kv, true)?;
        llama::kv_heads(be, self.bufs.a(be, lay.dv)?, dx.v, g_kv, kv, true)?;
        self.rope(be, lay.dq, self.dims.n_head, true)?;
        self.rope(be, lay.dk, self.dims.n_kv_head, true)
    }

    /// RMSNorm's backward into the residual stream's gradient.
    fn norm_back(&self, be: &B, dout: Span, x: Span, w: usize, rstd: Span) -> Result<(), GpuError> {
        let (c, lay) = (self.dims.d_model, &self.layout);
        llama::rmsnorm_backward(
            be,
            self.bufs.a(be, lay.dres)?,
            self.bufs.g(be, w, c)?,
            self.bufs.f(be, lay.partials)?,
            self.bufs.a(be, dout)?,
            self.bufs.a(be, x)?,
            self.bufs.p(be, w, c)?,
            self.bufs.f(be, rstd)?,
            PARTIAL_WARPS,
        )
    }
}

impl<B: Backend, T: Act> LlamaGpuStep<B, T> {
    token_step_api!("LlamaStep");
}

impl<B: Backend, T: Act> TokenModel<B, T> for LlamaGpuStep<B, T> {
    fn bufs(&self) -> &StepBuffers<B, T> {
        &self.bufs
    }

    fn rows_and_vocab(&self) -> (usize, usize) {
        (self.batch * self.t, self.dims.vocab)
    }

    fn loss_spans(&self) -> LossSpans {
        let lay = &self.layout;
        LossSpans {
            logits: lay.logits,
            losses: lay.losses,
            hits: lay.hits,
            partials: lay.partials,
            loss_sum: lay.loss_sum,
        }
    }

    fn fp8_layers(&self) -> Option<&Fp8Linears<B>> {
        self.fp8.as_ref()
    }

    fn forward(&self, be: &B, tokens: &Ids<B>, hooks: &mut BlockHooks<'_>) -> Result<(), GpuError> {
        let d = self.dims;
        let (c, v, f, kv) = (d.d_model, d.vocab, d.ffn_hidden, self.kv());
        let (o, lay) = (&self.offsets, &self.layout);
        kernels::encoder_forward(
            be,
            self.bufs.a(be, lay.blocks[0].resid_in)?,
            tokens,
            self.bufs.p(be, o.embed(), v * c)?,
            None,
            self.t,
            c,
        )?;
        for (l, s) in lay.blocks.iter().enumerate() {
            // The hook first: it may wait for what still reads the block's slots.
            hooks.run_before(l, false)?;
            self.bufs.enter_block(be, l, false)?;
            let bo = &o.blocks()[l];
            let (x, residual) = match l {
                0 => (self.bufs.a(be, s.resid_in)?, None),
                _ => {
                    let prev = &lay.blocks[l - 1];
                    (
                        self.bufs.a(be, prev.resid2)?,
                        Some((self.bufs.a(be, s.resid_in)?, self.bufs.a(be, prev.down)?)),
                    )
                }
            };
            llama::rmsnorm_forward(
                be,
                self.bufs.a(be, s.h1)?,
                self.bufs.f(be, s.rstd[0])?,
                x,
                residual,
                self.bufs.p(be, bo.input_norm, c)?,
                self.eps,
            )?;
            self.linear(be, (s.q, s.h1), bo.q, (c, c), (l, 0))?;
            self.linear(be, (s.k, s.h1), bo.k, (c, kv), (l, 1))?;
            self.linear(be, (s.v, s.h1), bo.v, (c, kv), (l, 2))?;
            self.rope(be, s.q, d.n_head, false)?;
            self.rope(be, s.k, d.n_kv_head, false)?;
            self.attention(be, s)?;
            self.linear(be, (s.o, s.atty), bo.o, (c, c), (l, 3))?;
            let residual = Some((self.bufs.a(be, s.resid2)?, self.bufs.a(be, s.o)?));
            llama::rmsnorm_forward(
                be,
                self.bufs.a(be, s.h2)?,
                self.bufs.f(be, s.rstd[1])?,
                self.bufs.a(be, s.resid_in)?,
                residual,
                self.bufs.p(be, bo.post_norm, c)?,
                self.eps,
            )?;
            self.linear(be, (s.gate, s.h2), bo.gate, (c, f), (l, 4))?;
            self.linear(be, (s.up, s.h2), bo.up, (c, f), (l, 5))?;
            self.swiglu(be, s)?;
            self.linear(be, (s.down, s.act), bo.down, (f, c), (l, 6))?;
        }
        let last = lay.blocks[lay.blocks.len() - 1];
        let residual = Some((self.bufs.a(be, lay.resid_out)?, self.bufs.a(be, last.down)?));
        llama::rmsnorm_forward(
            be,
            self.bufs.a(be, lay.hf)?,
            self.bufs.f(be, lay.rstd_f)?,
            self.bufs.a(be, last.resid2)?,
            residual,
            self.bufs.p(be, o.norm(), c)?,
            self.eps,
        )?;
        let n = self.batch * self.t;
        let head = self.bufs.p(be, o.head(), v * c)?;
        matmul(
            be,
            Mat::rows(self.bufs.a(be, lay.logits)?, padded_vocab(self.dims.vocab)),
            Mat::rows(self.bufs.a(be, lay.hf)?, c),
            Mat::t(head, c),
            Dims::one(n, v, c),
            None,
            false,
        )
    }

    fn backward(
        &self,
        be: &B,
        groups: &Groups<B>,
        hooks: &mut BlockHooks<'_>,
    ) -> Result<(), GpuError> {
        let d = self.dims;
        let (c, v, f, kv, n) = (
            d.d_model,
            d.vocab,
            d.ffn_hidden,
            self.kv(),
            self.batch * self.t,
        );
        let (o, lay) = (&self.offsets, &self.layout);
        // The head: dhf = dlogits W_head; dW_head += dlogits^T hf.
        let dlogits = self.bufs.a(be, lay.logits)?;
        let head = self.bufs.p(be, o.head(), v * c)?;
        matmul(
            be,
            Mat::rows(self.bufs.a(be, lay.dnc)?, c),
            Mat::rows(dlogits, padded_vocab(self.dims.vocab)),
            Mat::rows(head, c),
            Dims::one(n, c, v),
            None,
            false,
        )?;
        matmul(
            be,
            Mat::rows(self.bufs.g(be, o.head(), v * c)?, c),
            Mat::t(dlogits, padded_vocab(self.dims.vocab)),
            Mat::rows(self.bufs.a(be, lay.hf)?, c),
            Dims::one(v, c, n),
            None,
            true,
        )?;
        be.zero(self.bufs.a(be, lay.dres)?)?;
        self.norm_back(be, lay.dnc, lay.resid_out, o.norm(), lay.rstd_f)?;
        for (l, s) in lay.blocks.iter().enumerate().rev() {
            // The hook first: it may wait for what still reads the block's slots.
            hooks.run_before(l, true)?;
            self.bufs.enter_block(be, l, true)?;
            let bo = &o.blocks()[l];
            // dres is the gradient of the block's output sum: the down projection's too,
            // whose input (the SwiGLU product) is recomputed first where it is not kept.
            if self.recompute_mlp {
                self.swiglu(be, s)?;
            }
            self.linear_back(
                be,
                (lay.dgate, false, lay.dres, s.act),
                bo.down,
                (f, c),
                (l, 6),
            )?;
            let dact = self.bufs.a(be, lay.dgate)?;
            llama::swiglu_backward(
                be,
                dact,
                self.bufs.a(be, lay.dup)?,
                self.bufs.a(be, s.gate)?,
                self.bufs.a(be, s.up)?,
                dact,
            )?;
            self.linear_back(
                be,
                (lay.dnc, false, lay.dgate, s.h2),
                bo.gate,
                (c, f),
                (l, 4),
            )?;
            self.linear_back(be, (lay.dnc, true, lay.dup, s.h2), bo.up, (c, f), (l, 5))?;
            self.norm_back(be, lay.dnc, s.resid2, bo.post_norm, s.rstd[1])?;
            // dres is now resid2's gradient: the output projection's too.
            self.linear_back(be, (lay.dnc, false, lay.dres, s.atty), bo.o, (c, c), (l, 3))?;
            self.attention_back(be, s)?;
            self.linear_back(be, (lay.dnc, false, lay.dq, s.h1), bo.q, (c, c), (l, 0))?;
            self.linear_back(be, (lay.dnc, true, lay.dk, s.h1), bo.k, (c, kv), (l, 1))?;
            self.linear_back(be, (lay.dnc, true, lay.dv, s.h1), bo.v, (c, kv), (l, 2))?;
            self.norm_back(be, lay.dnc, s.resid_in, bo.input_norm, s.rstd[0])?;
            self.bufs.leave_block(be, l)?;
            hooks.run_after(l, &self.blocks[l])?;
        }
        kernels::encoder_backward_wte(
            be,
            self.bufs.g(be, o.embed(), v * c)?,
            self.bufs.a(be, lay.dres)?,
            groups,
            c,
        )
    }
}
