//! The GPT's training step over flat buffers on any [`Backend`]: llm.c's step on
//! stoker's flat layout. The compute copy of the parameters (f32 or bf16) sits at the
//! CPU step's offsets, so checkpoints and ZeRO's groups are unchanged; matrix products
//! go through [`matmul`], everything else through [`crate::kernels`].

use stoker_kernels::gpt::BlockOffsets;
use stoker_kernels::{GptDims, GptOffsets};

use super::buffers::{self, BlockHooks, LossSpans, StepBuffers, StepSizes, TokenModel};
use super::layout::{ActLayout, Span, PARTIAL_WARPS};
use super::optimizer::{self, OptimizerState, Scalars, UpdateViews};
use super::options::StepOptions;
use crate::backend::{Backend, View};
use crate::elem::Act;
use crate::error::GpuError;
use crate::gemm::{matmul, Dims, Mat};
use crate::ids::{Groups, Ids};
use crate::kernels::{self, Stats};
use crate::Heads;

use super::fp8_linear::{Fp8Linears, Fp8Sizes};
use super::linear::{self, Fp8Layer, Linear};
use super::{attention, layout, padded_vocab, TokenBatch};

/// A GPT's step at one batch shape, its buffers on backend `B`, activations in `T`.
pub struct GptGpuStep<B: Backend, T: Act> {
    dims: GptDims,
    offsets: GptOffsets,
    eps: f32,
    batch: usize,
    t: usize,
    layout: ActLayout,
    bufs: StepBuffers<B, T>,
    /// Each block's parameters as runs of the flat buffer (see `block_runs`).
    blocks: Vec<Vec<std::ops::Range<usize>>>,
    /// Attention's probabilities recomputed in each block's backward (one shared span).
    recompute_attention: bool,
    /// The MLP's activation recomputed in each block's backward (one shared span).
    recompute_mlp: bool,
    /// Attention on tensor cores keeping each row's log-sum-exp, not its probabilities.
    flash_attention: bool,
    /// The linear layers in FP8 with delayed scaling, four per block (`qkv`, `proj`,
    /// `fc`, `fc_proj`), where the step runs them so.
    fp8: Option<Fp8Linears<B>>,
}

const OP: &str = "gpt-gpu-step";

/// A block's linear layers: `qkv`, `proj`, `fc`, `fc_proj`.
const FP8_LAYERS_PER_BLOCK: usize = 4;

fn shape_err(what: String) -> GpuError {
    GpuError::Shape { kernel: OP, what }
}

/// What a GPT step of `dims` over a flat buffer of `params` elements holds for `batch`
/// sequences of `t` positions, made with `opts`: its buffers' sizes, known before the
/// step is made.
pub fn gpt_step_sizes(
    dims: &GptDims,
    params: usize,
    (batch, t): (usize, usize),
    opts: StepOptions,
) -> StepSizes {
    let layout = ActLayout::new(dims, (batch, t), padded_vocab(dims.vocab), opts);
    let fp8 = opts.fp8_linears.then(|| {
        let (layers, widths, weight) = gpt_fp8_layers(dims);
        let widest = widths.into_iter().max().unwrap_or(0);
        Fp8Sizes::of(layers, batch * t, widest, weight).bytes()
    });
    let sizes = StepSizes::of(
        params,
        (layout.total, layout.floats),
        (batch * t, dims.vocab),
    )
    .placed(opts, (dims.n_layer, gpt_block_len(dims)));
    StepSizes {
        fp8: fp8.unwrap_or(0),
        ..sizes
    }
}

/// The GPT's FP8 layers: how many, their widths (inputs and outputs), the largest
/// weight's elements.
fn gpt_fp8_layers(dims: &GptDims) -> (usize, [usize; 3], usize) {
    let c = dims.d_model;
    (
        FP8_LAYERS_PER_BLOCK * dims.n_layer,
        [c, 3 * c, 4 * c],
        4 * c * c,
    )
}

/// Elements of one GPT block's parameters (block 0's in stoker-kernels' table).
pub fn gpt_block_len(dims: &GptDims) -> usize {
    stoker_kernels::param_spec::group_elements(&stoker_kernels::gpt_params(dims), 1)
}

impl<B: Backend, T: Act> GptGpuStep<B, T> {
    /// A step for `batch` sequences of `t` positions of a GPT of `dims`, parameters at
    /// `offsets`, LayerNorm epsilon `eps`: every buffer allocated once, here.
    pub fn new(
        be: &B,
        dims: GptDims,
        offsets: GptOffsets,
        eps: f64,
        batch: usize,
        t: usize,
    ) -> Result<Self, GpuError> {
        Self::with_options(be, dims, offsets, eps, (batch, t), StepOptions::default())
    }

    /// [`GptGpuStep::new`] made with `opts`: the blocks' parameters offloaded to host
    /// memory ([`super::param_offload`]), attention's probabilities recomputed in the
    /// backward ([`StepOptions`]).
    pub fn with_options(
        be: &B,
        dims: GptDims,
        offsets: GptOffsets,
        eps: f64,
        (batch, t): (usize, usize),
        opts: StepOptions,
    ) -> Result<Self, GpuError> {
        if dims.n_layer == 0 || dims.n_head == 0 || !dims.d_model.is_multiple_of(dims.n_head) {
            return Err(shape_err(format!(
                "n_layer {} >= 1 and d_model {} a multiple of n_head {}",
                dims.n_layer, dims.d_model, dims.n_head
            )));
        }
        if batch == 0 || t == 0 || t > dims.context || offsets.blocks().len() != dims.n_layer {
            return Err(shape_err(format!(
                "batch {batch} x {t} positions (context {}), offsets for {} blocks",
                dims.context,
                offsets.blocks().len()
            )));
        }
        if let Some(why) = opts.flash_refusal(T::DTYPE, dims.d_model / dims.n_head) {
            return Err(shape_err(why));
        }
        if let Some(why) = opts.fp8_refusal(T::DTYPE) {
            return Err(shape_err(why));
        }
        let layout = ActLayout::new(&dims, (batch, t), padded_vocab(dims.vocab), opts);
        let c = dims.d_model;
        let blocks = offsets
            .blocks()
            .iter()
            .map(|b| {
                let [l1, qkv, proj, l2, fc, fp] = [b.ln1, b.qkv, b.proj, b.ln2, b.fc, b.fc_proj];
                super::block_runs::merge_runs(vec![
                    (l1[0], c),
                    (l1[1], c),
                    (qkv[0], 3 * c * c),
                    (qkv[1], 3 * c),
                    (proj[0], c * c),
                    (proj[1], c),
                    (l2[0], c),
                    (l2[1], c),
                    (fc[0], 4 * c * c),
                    (fc[1], 4 * c),
                    (fp[0], 4 * c * c),
                    (fp[1], c),
                ])
            })
            .collect::<Vec<_>>();
        let sizes = gpt_step_sizes(&dims, offsets.end(), (batch, t), opts);
        let fp8 = match opts.fp8_linears {
            true => {
                let (layers, widths, weight) = gpt_fp8_layers(&dims);
                Some(Fp8Linears::new(be, layers, batch * t, &widths, weight)?)
            }
            false => None,
        };
        Ok(GptGpuStep {
            fp8,
            recompute_attention: opts.recompute_attention,
            recompute_mlp: opts.recompute_mlp,
            flash_attention: opts.flash_attention,
            bufs: StepBuffers::new(be, sizes, &blocks, opts.graph_micro_batches)?,
            blocks,
            dims,
            offsets,
            eps: eps as f32,
            batch,
            t,
            layout,
        })
    }

    /// Elements of the activation buffer and of the f32 buffer.
    pub fn activation_elements(&self) -> (usize, usize) {
        (self.layout.total, self.layout.floats)
    }

    fn stats(&self, be: &B, s: [Span; 2]) -> Result<Stats<'_>, GpuError> {
        Ok(Stats {
            mean: self.bufs.f(be, s[0])?,
            rstd: self.bufs.f(be, s[1])?,
        })
    }

    fn heads(&self) -> Heads {
        let d = self.dims.d_model / self.dims.n_head;
        Heads {
            b: self.batch as i32,
            t: self.t as i32,
            h: self.dims.n_head as i32,
            d: d as i32,
        }
    }

    /// Block `block`'s linear layer `j` (0 `qkv`, 1 `proj`, 2 `fc`, 3 `fc_proj`) among the
    /// FP8 layers, where the step runs them.
    fn fp8_layer(&self, block: usize, j: usize) -> Fp8Layer<'_, B> {
        self.fp8
            .as_ref()
            .map(|f| (f, FP8_LAYERS_PER_BLOCK * block + j))
    }

    /// `y = x W^T + b` for the linear layer at `wb` (`W` `[out, inp]`).
    fn linear(
        &self,
        be: &B,
        (y, x): (Span, Span),
        wb: [usize; 2],
        (inp, out): (usize, usize),
        fp8: Fp8Layer<'_, B>,
    ) -> Result<(), GpuError> {
        let l = Linear {
            w: wb[0],
            b: Some(wb[1]),
            inp,
            out,
        };
        linear::forward(be, &self.bufs, self.batch * self.t, l, (y, x), fp8)
    }

    /// The linear layer's backward: `dx = dy W` (when `dx` is given), `dW += dy^T x`,
    /// `db += column sums of dy`.
    fn linear_back(
        &self,
        be: &B,
        (dx, dy, x): (Option<Span>, Span, Span),
        wb: [usize; 2],
        (inp, out): (usize, usize),
        fp8: Fp8Layer<'_, B>,
    ) -> Result<(), GpuError> {
        let l = Linear {
            w: wb[0],
            b: Some(wb[1]),
            inp,
            out,
        };
        linear::backward(
            be,
            &self.bufs,
            self.batch * self.t,
            l,
            dx.map(|d| (d, false)),
            dy,
            x,
            self.layout.partials,
            fp8,
        )
    }

    /// Causal attention of block `s`: heads, scores, softmax, weighted values, merged
    /// (with flash attention, the rows' log-sum-exp into `lse` instead of the scores).
    fn attention(&self, be: &B, s: &layout::BlockActs, lse: Span) -> Result<(), GpuError> {
        let g = self.heads();
        let heads = self.bufs.a(be, s.heads)?;
        kernels::qkv_heads(be, heads, self.bufs.a(be, s.qkv)?, g, false)?;
        if self.flash_attention {
            return attention::flash_forward(
                be,
                attention::Qkv::thirds(heads)?,
                self.bufs.f(be, lse)?,
                (self.bufs.a(be, s.atty_h)?, self.bufs.a(be, s.atty)?),
                (g, 1),
            );
        }
        attention::forward(
            be,
            attention::Qkv::thirds(heads)?,
            self.bufs.a(be, s.att)?,
            (self.bufs.a(be, s.atty_h)?, self.bufs.a(be, s.atty)?),
            g,
        )
    }

    /// Attention's backward: `dnc` (the output's gradient) to `dqkv`; the block's
    /// probabilities recomputed first where they are not kept.
    fn attention_back(&self, be: &B, s: &layout::BlockActs, lse: Span) -> Result<(), GpuError> {
        let lay = &self.layout;
        let g = self.heads();
        let dheads = self.bufs.a(be, lay.dheads)?;
        if self.flash_attention {
            attention::flash_backward(
                be,
                (
                    attention::Qkv::thirds(self.bufs.a(be, s.heads)?)?,
                    self.bufs.a(be, s.atty_h)?,
                    self.bufs.f(be, lse)?,
                ),
                (self.bufs.a(be, lay.dnc)?, self.bufs.a(be, lay.datty_h)?),
                self.bufs.f(be, lay.dsum)?,
                attention::Qkv::thirds(dheads)?,
                (g, 1),
            )?;
            return kernels::qkv_heads(be, self.bufs.a(be, lay.dqkv)?, dheads, g, true);
        }
        if self.recompute_attention {
            let heads = attention::Qkv::thirds(self.bufs.a(be, s.heads)?)?;
            attention::probabilities(be, heads, self.bufs.a(be, s.att)?, g)?;
        }
        attention::backward(
            be,
            (
                attention::Qkv::thirds(self.bufs.a(be, s.heads)?)?,
                self.bufs.a(be, s.att)?,
            ),
            (self.bufs.a(be, lay.dnc)?, self.bufs.a(be, lay.datty_h)?),
            self.bufs.a(be, lay.datt)?,
            attention::Qkv::thirds(dheads)?,
            g,
        )?;
        kernels::qkv_heads(be, self.bufs.a(be, lay.dqkv)?, dheads, g, true)
    }

    fn ln_back(
        &self,
        be: &B,
        dout: Span,
        x: Span,
        wb: [usize; 2],
        stats: [Span; 2],
    ) -> Result<(), GpuError> {
        let c = self.dims.d_model;
        let lay = &self.layout;
        kernels::layernorm_backward(
            be,
            self.bufs.a(be, lay.dres)?,
            self.bufs.g(be, wb[0], c)?,
            self.bufs.g(be, wb[1], c)?,
            self.bufs.f(be, lay.partials)?,
            self.bufs.a(be, dout)?,
            self.bufs.a(be, x)?,
            self.bufs.p(be, wb[0], c)?,
            self.stats(be, stats)?,
            PARTIAL_WARPS,
        )
    }
}

impl<B: Backend, T: Act> GptGpuStep<B, T> {
    token_step_api!("GptStep");
}

impl<B: Backend, T: Act> TokenModel<B, T> for GptGpuStep<B, T> {
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
        let (c, v, t) = (self.dims.d_model, self.dims.vocab, self.t);
        let (o, lay) = (&self.offsets, &self.layout);
        let first = lay.blocks[0].resid_in;
        kernels::encoder_forward(
            be,
            self.bufs.a(be, first)?,
            tokens,
            self.bufs.p(be, o.wte(), v * c)?,
            Some(self.bufs.p(be, o.wpe(), self.dims.context * c)?),
            t,
            c,
        )?;
        for (l, (s, st)) in lay.blocks.iter().zip(&lay.stats).enumerate() {
            // The hook first: it may wait for what still reads the block's slots.
            hooks.run_before(l, false)?;
            self.bufs.enter_block(be, l, false)?;
            let bo = &o.blocks()[l];
            let ln = |wb: [usize; 2]| -> Result<(View<T>, View<T>), GpuError> {
                Ok((self.bufs.p(be, wb[0], c)?, self.bufs.p(be, wb[1], c)?))
            };
            // The block's input: the encoding, or the previous block's residual sum
            // (fused into this LayerNorm).
            let (x, residual) = match l {
                0 => (self.bufs.a(be, s.resid_in)?, None),
                _ => {
                    let prev = &lay.blocks[l - 1];
                    (
                        self.bufs.a(be, prev.resid2)?,
                        Some((self.bufs.a(be, s.resid_in)?, self.bufs.a(be, prev.fcproj)?)),
                    )
                }
            };
            let (w, b) = ln(bo.ln1)?;
            kernels::layernorm_forward(
                be,
                self.bufs.a(be, s.ln1)?,
                self.stats(be, st.ln1)?,
                x,
                residual,
                w,
                b,
                self.eps,
            )?;
            self.linear(be, (s.qkv, s.ln1), bo.qkv, (c, 3 * c), self.fp8_layer(l, 0))?;
            self.attention(be, s, st.lse)?;
            self.linear(
                be,
                (s.attproj, s.atty),
                bo.proj,
                (c, c),
                self.fp8_layer(l, 1),
            )?;
            let (w, b) = ln(bo.ln2)?;
            let residual = Some((self.bufs.a(be, s.resid2)?, self.bufs.a(be, s.attproj)?));
            kernels::layernorm_forward(
                be,
                self.bufs.a(be, s.ln2)?,
                self.stats(be, st.ln2)?,
                self.bufs.a(be, s.resid_in)?,
                residual,
                w,
                b,
                self.eps,
            )?;
            self.linear(be, (s.fch, s.ln2), bo.fc, (c, 4 * c), self.fp8_layer(l, 2))?;
            kernels::gelu_forward(be, self.bufs.a(be, s.fch_gelu)?, self.bufs.a(be, s.fch)?)?;
            self.linear(
                be,
                (s.fcproj, s.fch_gelu),
                bo.fc_proj,
                (4 * c, c),
                self.fp8_layer(l, 3),
            )?;
        }
        let last = lay.blocks[lay.blocks.len() - 1];
        let [w, b] = o.ln_f();
        let residual = Some((
            self.bufs.a(be, lay.resid_out)?,
            self.bufs.a(be, last.fcproj)?,
        ));
        kernels::layernorm_forward(
            be,
            self.bufs.a(be, lay.lnf)?,
            self.stats(be, lay.lnf_stats)?,
            self.bufs.a(be, last.resid2)?,
            residual,
            self.bufs.p(be, w, c)?,
            self.bufs.p(be, b, c)?,
            self.eps,
        )?;
        // The tied head: logits[:, :V] = lnf wte^T, rows of Vp.
        let n = self.batch * t;
        matmul(
            be,
            Mat::rows(self.bufs.a(be, lay.logits)?, padded_vocab(self.dims.vocab)),
            Mat::rows(self.bufs.a(be, lay.lnf)?, c),
            Mat::t(self.bufs.p(be, o.wte(), v * c)?, c),
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
        let (c, v, n) = (self.dims.d_model, self.dims.vocab, self.batch * self.t);
        let (o, lay) = (&self.offsets, &self.layout);
        let wte = self.bufs.p(be, o.wte(), v * c)?;
        // The head: dlnf = dlogits wte; dwte += dlogits^T lnf.
        let dlogits = self.bufs.a(be, lay.logits)?;
        matmul(
            be,
            Mat::rows(self.bufs.a(be, lay.dnc)?, c),
            Mat::rows(dlogits, padded_vocab(self.dims.vocab)),
            Mat::rows(wte, c),
            Dims::one(n, c, v),
            None,
            false,
        )?;
        matmul(
            be,
            Mat::rows(self.bufs.g(be, o.wte(), v * c)?, c),
            Mat::t(dlogits, padded_vocab(self.dims.vocab)),
            Mat::rows(self.bufs.a(be, lay.lnf)?, c),
            Dims::one(v, c, n),
            None,
            true,
        )?;
        be.zero(self.bufs.a(be, lay.dres)?)?;
        let last = lay.blocks.len() - 1;
        self.ln_back(be, lay.dnc, lay.resid_out, o.ln_f(), lay.lnf_stats)?;
        for l in (0..=last).rev() {
            let (s, st, bo): (_, _, &BlockOffsets) =
                (&lay.blocks[l], &lay.stats[l], &o.blocks()[l]);
            // The hook first: it may wait for what still reads the block's slots.
            hooks.run_before(l, true)?;
            self.bufs.enter_block(be, l, true)?;
            // dres is the gradient of the block's output sum: the MLP projection's too,
            // whose input (the GELU's output) is recomputed first where it is not kept.
            if self.recompute_mlp {
                let fch = self.bufs.a(be, s.fch)?;
                kernels::gelu_forward(be, self.bufs.a(be, s.fch_gelu)?, fch)?;
            }
            self.linear_back(
                be,
                (Some(lay.dfch), lay.dres, s.fch_gelu),
                bo.fc_proj,
                (4 * c, c),
                self.fp8_layer(l, 3),
            )?;
            let dfch = self.bufs.a(be, lay.dfch)?;
            kernels::gelu_backward(be, dfch, self.bufs.a(be, s.fch)?, dfch)?;
            self.linear_back(
                be,
                (Some(lay.dnc), lay.dfch, s.ln2),
                bo.fc,
                (c, 4 * c),
                self.fp8_layer(l, 2),
            )?;
            self.ln_back(be, lay.dnc, s.resid2, bo.ln2, st.ln2)?;
            // dres is now resid2's gradient: the attention projection's output's too.
            self.linear_back(
                be,
                (Some(lay.dnc), lay.dres, s.atty),
                bo.proj,
                (c, c),
                self.fp8_layer(l, 1),
            )?;
            self.attention_back(be, s, st.lse)?;
            self.linear_back(
                be,
                (Some(lay.dnc), lay.dqkv, s.ln1),
                bo.qkv,
                (c, 3 * c),
                self.fp8_layer(l, 0),
            )?;
            self.ln_back(be, lay.dnc, s.resid_in, bo.ln1, st.ln1)?;
            self.bufs.leave_block(be, l)?;
            hooks.run_after(l, &self.blocks[l])?;
        }
        let dres = self.bufs.a(be, lay.dres)?;
        kernels::encoder_backward_wpe(
            be,
            self.bufs.g(be, o.wpe(), self.t * c)?,
            dres,
            self.batch,
            self.t,
            c,
        )?;
        kernels::encoder_backward_wte(be, self.bufs.g(be, o.wte(), v * c)?, dres, groups, c)
    }
}
