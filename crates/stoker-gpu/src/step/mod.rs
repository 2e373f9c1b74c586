//! The GPT's training step over flat buffers on any [`Backend`]: llm.c's step on
//! stoker's flat layout. One buffer each for the parameters (the compute copy, f32 or
//! bf16, in the CPU step's flat layout: the same offsets, so checkpoints and ZeRO's
//! groups are unchanged), the f32 gradients, the activations and the f32 statistics;
//! matrix products through [`matmul`], everything else through [`crate::kernels`].
//!
//! Written once: the host backend runs it in the tests against stoker-kernels' `GptStep`
//! (the same flat buffers, the same loss and gradients within float tolerance), and the
//! device backend runs the same calls on a GPU.

pub mod attention;
pub mod layout;
pub mod llama;
pub mod llama_layout;
pub mod optimizer;

use stoker_kernels::gpt::BlockOffsets;
use stoker_kernels::{GptDims, GptOffsets};

use crate::backend::{Backend, View};
use crate::elem::Act;
use crate::error::GpuError;
use crate::gemm::{matmul, Dims, Mat};
use crate::ids::{Groups, Ids};
use crate::kernels::{self, Stats};
use crate::token_groups::TokenGroups;
use crate::Heads;
use layout::{ActLayout, Span, BIAS_PARTS, PARTIAL_WARPS};
use optimizer::AdamWState;

/// The vocabulary padded to a multiple of 64 (GPT-2's 50,257 to 50,304): the logits'
/// row width, so their rows stay aligned.
pub fn padded_vocab(v: usize) -> usize {
    v.div_ceil(64) * 64
}

/// One micro-batch: token ids and next-token targets `[batch, t]`, row-major.
#[derive(Debug, Clone, Copy)]
pub struct TokenBatch<'a> {
    /// Token ids.
    pub tokens: &'a [i64],
    /// Targets; `ignore` marks positions without a loss.
    pub targets: &'a [i64],
    /// The ignore index.
    pub ignore: i64,
}

/// A GPT's step at one batch shape, its buffers on backend `B`, activations in `T`.
pub struct GptGpuStep<B: Backend, T: Act> {
    dims: GptDims,
    offsets: GptOffsets,
    eps: f32,
    batch: usize,
    t: usize,
    vp: usize,
    layout: ActLayout,
    params: B::Buf<T>,
    grads: B::Buf<f32>,
    acts: B::Buf<T>,
    floats: B::Buf<f32>,
}

const OP: &str = "gpt-gpu-step";

fn shape_err(what: String) -> GpuError {
    GpuError::Shape { kernel: OP, what }
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
        let vp = padded_vocab(dims.vocab);
        let layout = ActLayout::new(&dims, batch, t, vp);
        Ok(GptGpuStep {
            params: be.zeros(offsets.end())?,
            grads: be.zeros(offsets.end())?,
            acts: be.zeros(layout.total)?,
            floats: be.zeros(layout.floats)?,
            dims,
            offsets,
            eps: eps as f32,
            batch,
            t,
            vp,
            layout,
        })
    }

    /// Elements of the activation buffer and of the f32 buffer.
    pub fn activation_elements(&self) -> (usize, usize) {
        (self.layout.total, self.layout.floats)
    }

    /// Bytes of every buffer the step allocates: the compute copy and the activations in
    /// `T`, the gradients and the f32 buffer. With AdamW add [`AdamWState::bytes`]. The
    /// planned side of the device check's memory line.
    pub fn bytes(&self) -> usize {
        let t = std::mem::size_of::<T>();
        (self.offsets.end() + self.layout.total) * t + (self.offsets.end() + self.layout.floats) * 4
    }

    /// Copies the FP32 master `params` (the flat layout) into the compute copy.
    pub fn load_params(&self, be: &B, params: &[f32]) -> Result<(), GpuError> {
        crate::error::check_len(OP, "params", params.len(), self.offsets.end())?;
        let copy: Vec<T> = params.iter().map(|&x| T::from_f32(x)).collect();
        be.write(&self.params, 0, &copy)
    }

    /// The compute copy of the parameters, widened to f32 (the flat layout).
    pub fn params(&self, be: &B) -> Result<Vec<f32>, GpuError> {
        Ok(be
            .download(&self.params)?
            .into_iter()
            .map(T::to_f32)
            .collect())
    }

    /// The gradients (f32, the flat layout).
    pub fn grads(&self, be: &B) -> Result<Vec<f32>, GpuError> {
        be.download(&self.grads)
    }

    /// Sets every gradient to 0.
    pub fn zero_grads(&self, be: &B) -> Result<(), GpuError> {
        be.zero(be.all(&self.grads))
    }

    /// The update after an accumulation window: the gradients' norm (the one value read
    /// back), then AdamW on every segment of `opt` over the gradients times `unscale`
    /// (1 / the loss scale) and the clipping coefficient for `clip` (torch's
    /// `clip_grad_norm_`), and the compute copy rewritten from the master. Returns the
    /// unscaled gradient norm. (With a loss scale the CPU multiplies twice, unscale then
    /// clip; here once by their product.)
    pub fn update(
        &self,
        be: &B,
        opt: &AdamWState<B>,
        step: &stoker_kernels::AdamWStep,
        unscale: f32,
        clip: Option<f64>,
    ) -> Result<f64, GpuError> {
        let lay = &self.layout;
        let scratch = (self.f(be, lay.grad_norm)?, self.f(be, lay.partials)?);
        optimizer::update(
            be,
            opt,
            (&self.params, &self.grads),
            scratch,
            step,
            unscale,
            clip,
        )
    }

    fn p(&self, be: &B, at: usize, len: usize) -> Result<View<'_, T>, GpuError> {
        be.view(&self.params, at..at + len)
    }

    fn g(&self, be: &B, at: usize, len: usize) -> Result<View<'_, f32>, GpuError> {
        be.view(&self.grads, at..at + len)
    }

    fn a(&self, be: &B, s: Span) -> Result<View<'_, T>, GpuError> {
        be.view(&self.acts, s.range())
    }

    fn f(&self, be: &B, s: Span) -> Result<View<'_, f32>, GpuError> {
        be.view(&self.floats, s.range())
    }

    fn stats(&self, be: &B, s: [Span; 2]) -> Result<Stats<'_>, GpuError> {
        Ok(Stats {
            mean: self.f(be, s[0])?,
            rstd: self.f(be, s[1])?,
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

    /// Forward and backward of one micro-batch: adds the gradient of `grad_scale x
    /// (summed token loss)` to the gradients and returns the summed loss of the valid
    /// targets (unscaled), as stoker-kernels' `GptStep::forward_backward`.
    pub fn forward_backward(
        &self,
        be: &B,
        batch: TokenBatch,
        grad_scale: f32,
    ) -> Result<f64, GpuError> {
        let n = self.batch * self.t;
        crate::error::check_len(OP, "tokens", batch.tokens.len(), n)?;
        crate::error::check_len(OP, "targets", batch.targets.len(), n)?;
        let ignore = i32::try_from(batch.ignore)
            .map_err(|_| shape_err(format!("ignore index {} outside i32", batch.ignore)))?;
        let to_i32 = |x: &[i64]| -> Vec<i32> {
            x.iter()
                .map(|&v| v.clamp(i32::MIN as i64, i32::MAX as i64) as i32)
                .collect()
        };
        let v = self.dims.vocab;
        let tok = to_i32(batch.tokens);
        let tokens = Ids::new(be, "tokens", &tok, v, None)?;
        let targets = Ids::new(be, "targets", &to_i32(batch.targets), v, Some(ignore))?;
        let groups = Groups::new(be, &TokenGroups::new(&tok, v)?, v)?;
        self.forward(be, &tokens)?;
        let lay = &self.layout;
        kernels::classifier(
            be,
            self.a(be, lay.logits)?,
            self.f(be, lay.losses)?,
            &targets,
            v,
            grad_scale,
            ignore,
        )?;
        if grad_scale == 0.0 {
            // The classifier leaves the logits when it writes no gradient: a zero scale
            // means a zero gradient.
            be.zero(self.a(be, lay.logits)?)?;
        }
        kernels::sum(
            be,
            self.f(be, lay.loss_sum)?,
            self.f(be, lay.losses)?,
            self.f(be, lay.partials)?,
            false,
            PARTIAL_WARPS,
            false,
        )?;
        self.backward(be, &groups)?;
        // The one read back: the summed loss (waits for the step).
        Ok(be.read(self.f(be, lay.loss_sum)?)?[0] as f64)
    }

    /// `y = x W^T + b` for the linear layer at `wb` (`W` `[out, inp]`).
    fn linear(
        &self,
        be: &B,
        y: Span,
        x: Span,
        wb: [usize; 2],
        (inp, out): (usize, usize),
    ) -> Result<(), GpuError> {
        let n = self.batch * self.t;
        let (w, b) = (self.p(be, wb[0], out * inp)?, self.p(be, wb[1], out)?);
        matmul(
            be,
            Mat::rows(self.a(be, y)?, out),
            Mat::rows(self.a(be, x)?, inp),
            Mat::t(w, inp),
            Dims::one(n, out, inp),
            Some(b),
            false,
        )
    }

    /// The linear layer's backward: `dx = dy W` (when `dx` is given), `dW += dy^T x`,
    /// `db += column sums of dy`.
    fn linear_back(
        &self,
        be: &B,
        dx: Option<Span>,
        dy: Span,
        x: Span,
        wb: [usize; 2],
        (inp, out): (usize, usize),
    ) -> Result<(), GpuError> {
        let n = self.batch * self.t;
        let dyv = self.a(be, dy)?;
        if let Some(dx) = dx {
            let w = self.p(be, wb[0], out * inp)?;
            matmul(
                be,
                Mat::rows(self.a(be, dx)?, inp),
                Mat::rows(dyv, out),
                Mat::rows(w, inp),
                Dims::one(n, inp, out),
                None,
                false,
            )?;
        }
        let dw = self.g(be, wb[0], out * inp)?;
        matmul(
            be,
            Mat::rows(dw, inp),
            Mat::t(dyv, out),
            Mat::rows(self.a(be, x)?, inp),
            Dims::one(out, inp, n),
            None,
            true,
        )?;
        kernels::column_sums_add(
            be,
            self.g(be, wb[1], out)?,
            dyv,
            self.f(be, self.layout.partials)?,
            BIAS_PARTS,
        )
    }

    fn forward(&self, be: &B, tokens: &Ids<B>) -> Result<(), GpuError> {
        let (c, v, t) = (self.dims.d_model, self.dims.vocab, self.t);
        let (o, lay) = (&self.offsets, &self.layout);
        let first = lay.blocks[0].resid_in;
        kernels::encoder_forward(
            be,
            self.a(be, first)?,
            tokens,
            self.p(be, o.wte(), v * c)?,
            Some(self.p(be, o.wpe(), self.dims.context * c)?),
            t,
            c,
        )?;
        for (l, (s, st)) in lay.blocks.iter().zip(&lay.stats).enumerate() {
            let bo = &o.blocks()[l];
            let ln = |wb: [usize; 2]| -> Result<(View<T>, View<T>), GpuError> {
                Ok((self.p(be, wb[0], c)?, self.p(be, wb[1], c)?))
            };
            // The block's input: the encoding, or the previous block's residual sum
            // (fused into this LayerNorm).
            let (x, residual) = match l {
                0 => (self.a(be, s.resid_in)?, None),
                _ => {
                    let prev = &lay.blocks[l - 1];
                    (
                        self.a(be, prev.resid2)?,
                        Some((self.a(be, s.resid_in)?, self.a(be, prev.fcproj)?)),
                    )
                }
            };
            let (w, b) = ln(bo.ln1)?;
            kernels::layernorm_forward(
                be,
                self.a(be, s.ln1)?,
                self.stats(be, st.ln1)?,
                x,
                residual,
                w,
                b,
                self.eps,
            )?;
            self.linear(be, s.qkv, s.ln1, bo.qkv, (c, 3 * c))?;
            self.attention(be, s)?;
            self.linear(be, s.attproj, s.atty, bo.proj, (c, c))?;
            let (w, b) = ln(bo.ln2)?;
            let residual = Some((self.a(be, s.resid2)?, self.a(be, s.attproj)?));
            kernels::layernorm_forward(
                be,
                self.a(be, s.ln2)?,
                self.stats(be, st.ln2)?,
                self.a(be, s.resid_in)?,
                residual,
                w,
                b,
                self.eps,
            )?;
            self.linear(be, s.fch, s.ln2, bo.fc, (c, 4 * c))?;
            kernels::gelu_forward(be, self.a(be, s.fch_gelu)?, self.a(be, s.fch)?)?;
            self.linear(be, s.fcproj, s.fch_gelu, bo.fc_proj, (4 * c, c))?;
        }
        let last = lay.blocks[lay.blocks.len() - 1];
        let [w, b] = o.ln_f();
        let residual = Some((self.a(be, lay.resid_out)?, self.a(be, last.fcproj)?));
        kernels::layernorm_forward(
            be,
            self.a(be, lay.lnf)?,
            self.stats(be, lay.lnf_stats)?,
            self.a(be, last.resid2)?,
            residual,
            self.p(be, w, c)?,
            self.p(be, b, c)?,
            self.eps,
        )?;
        // The tied head: logits[:, :V] = lnf wte^T, rows of Vp.
        let n = self.batch * t;
        matmul(
            be,
            Mat::rows(self.a(be, lay.logits)?, self.vp),
            Mat::rows(self.a(be, lay.lnf)?, c),
            Mat::t(self.p(be, o.wte(), v * c)?, c),
            Dims::one(n, v, c),
            None,
            false,
        )
    }

    /// Causal attention of block `s`: heads, scores, softmax, weighted values, merged.
    fn attention(&self, be: &B, s: &layout::BlockActs) -> Result<(), GpuError> {
        let g = self.heads();
        let nc = self.batch * self.t * self.dims.d_model;
        kernels::qkv_heads(be, self.a(be, s.heads)?, self.a(be, s.qkv)?, g, false)?;
        let h = self.a(be, s.heads)?;
        let x = attention::Qkv {
            q: h.slice(0..nc)?,
            k: h.slice(nc..2 * nc)?,
            v: h.slice(2 * nc..3 * nc)?,
        };
        let shape = ((g.b * g.h) as usize, self.t, g.d as usize);
        attention::forward(be, x, self.a(be, s.att)?, self.a(be, s.atty_h)?, shape)?;
        kernels::merged_heads(be, self.a(be, s.atty)?, self.a(be, s.atty_h)?, g, false)
    }

    /// Attention's backward: `dnc` (the output's gradient) to `dqkv`.
    fn attention_back(&self, be: &B, s: &layout::BlockActs) -> Result<(), GpuError> {
        let lay = &self.layout;
        let g = self.heads();
        let nc = self.batch * self.t * self.dims.d_model;
        let datty_h = self.a(be, lay.datty_h)?;
        kernels::merged_heads(be, datty_h, self.a(be, lay.dnc)?, g, true)?;
        let (h, dh) = (self.a(be, s.heads)?, self.a(be, lay.dheads)?);
        let x = attention::Qkv {
            q: h.slice(0..nc)?,
            k: h.slice(nc..2 * nc)?,
            v: h.slice(2 * nc..3 * nc)?,
        };
        let dx = attention::Qkv {
            q: dh.slice(0..nc)?,
            k: dh.slice(nc..2 * nc)?,
            v: dh.slice(2 * nc..3 * nc)?,
        };
        let shape = ((g.b * g.h) as usize, self.t, g.d as usize);
        attention::backward(
            be,
            x,
            self.a(be, s.att)?,
            datty_h,
            self.a(be, lay.datt)?,
            dx,
            shape,
        )?;
        kernels::qkv_heads(be, self.a(be, lay.dqkv)?, dh, g, true)
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
            self.a(be, lay.dres)?,
            self.g(be, wb[0], c)?,
            self.g(be, wb[1], c)?,
            self.f(be, lay.partials)?,
            self.a(be, dout)?,
            self.a(be, x)?,
            self.p(be, wb[0], c)?,
            self.stats(be, stats)?,
            PARTIAL_WARPS,
        )
    }

    fn backward(&self, be: &B, groups: &Groups<B>) -> Result<(), GpuError> {
        let (c, v, n) = (self.dims.d_model, self.dims.vocab, self.batch * self.t);
        let (o, lay) = (&self.offsets, &self.layout);
        let wte = self.p(be, o.wte(), v * c)?;
        // The head: dlnf = dlogits wte; dwte += dlogits^T lnf.
        let dlogits = self.a(be, lay.logits)?;
        matmul(
            be,
            Mat::rows(self.a(be, lay.dnc)?, c),
            Mat::rows(dlogits, self.vp),
            Mat::rows(wte, c),
            Dims::one(n, c, v),
            None,
            false,
        )?;
        matmul(
            be,
            Mat::rows(self.g(be, o.wte(), v * c)?, c),
            Mat::t(dlogits, self.vp),
            Mat::rows(self.a(be, lay.lnf)?, c),
            Dims::one(v, c, n),
            None,
            true,
        )?;
        be.zero(self.a(be, lay.dres)?)?;
        let last = lay.blocks.len() - 1;
        self.ln_back(be, lay.dnc, lay.resid_out, o.ln_f(), lay.lnf_stats)?;
        for l in (0..=last).rev() {
            let (s, st, bo): (_, _, &BlockOffsets) =
                (&lay.blocks[l], &lay.stats[l], &o.blocks()[l]);
            // dres is the gradient of the block's output sum: the MLP projection's too.
            self.linear_back(
                be,
                Some(lay.dfch),
                lay.dres,
                s.fch_gelu,
                bo.fc_proj,
                (4 * c, c),
            )?;
            let dfch = self.a(be, lay.dfch)?;
            kernels::gelu_backward(be, dfch, self.a(be, s.fch)?, dfch)?;
            self.linear_back(be, Some(lay.dnc), lay.dfch, s.ln2, bo.fc, (c, 4 * c))?;
            self.ln_back(be, lay.dnc, s.resid2, bo.ln2, st.ln2)?;
            // dres is now resid2's gradient: the attention projection's output's too.
            self.linear_back(be, Some(lay.dnc), lay.dres, s.atty, bo.proj, (c, c))?;
            self.attention_back(be, s)?;
            self.linear_back(be, Some(lay.dnc), lay.dqkv, s.ln1, bo.qkv, (c, 3 * c))?;
            self.ln_back(be, lay.dnc, s.resid_in, bo.ln1, st.ln1)?;
        }
        let dres = self.a(be, lay.dres)?;
        kernels::encoder_backward_wpe(
            be,
            self.g(be, o.wpe(), self.t * c)?,
            dres,
            self.batch,
            self.t,
            c,
        )?;
        kernels::encoder_backward_wte(be, self.g(be, o.wte(), v * c)?, dres, groups, c)
    }
}
