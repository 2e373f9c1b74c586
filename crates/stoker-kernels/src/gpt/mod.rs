//! A GPT's whole training forward and backward, written by hand over flat f32 buffers.
//!
//! This is llm.c's design. Parameters are read straight from the trainer's flat master
//! buffer and gradients are added straight into its flat gradient buffer (the same
//! offsets), every activation the backward needs lives in buffers allocated once per
//! batch shape and reused, and each layer's backward is the fused kernels of this crate
//! called in order. There is no autograd graph, no per-node gradient buffer to zero and
//! add, and no copy of gradients out of one: on a 2-core CPU those cost about as much as
//! the non-GEMM arithmetic itself (docs/benchmarks.md).
//!
//! The model is the one of stoker-train's `models::gpt` (token + position embeddings,
//! pre-LayerNorm blocks, causal multi-head attention from one QKV projection, tanh-GELU
//! MLP, final LayerNorm, head tied to the token embedding);
//! `crates/stoker-train/tests/direct_step.rs` holds this step's gradients to the candle
//! graph's. Linear layers run on the f32 GEMM, or with
//! bf16 operands on the bf16 GEMM ([`crate::matmul`]) with f32 accumulation: autocast's
//! bf16 with FP32 parameters, activations and gradients.

use rayon::prelude::*;

use crate::attention::{qkv_backward_f32, qkv_forward_f32};
use crate::cross_entropy::{loss_and_grad_in_place, loss_and_hits};
use crate::embedding::scatter_add;
use crate::error::KernelError;
use crate::linear::{column_sums, gemm_f32_into};
use crate::matmul::{gemm_write, Bf16Kernel, MatRef, PackBuffers};
use crate::shape_cache::ShapeCache;
use crate::{gelu, layer_norm};

pub mod groups;
pub mod spec;

use groups::open_group;
pub use groups::{group_calls, replay, GroupCall, GroupView, Phase, StepParams, Whole};
pub use spec::{gpt_params, BlockOffsets, GptDims, GptOffsets, ParamSpec, SpecInit};

/// Called during the backward with a parameter group (see [`spec::ParamSpec::group`]) as
/// soon as its gradients in the flat buffer are final for this micro-batch, and the
/// buffer: the data-parallel strategy starts that bucket's all-reduce while the backward
/// goes on. Groups arrive last first: the final norm, the blocks from the last to the
/// first, then the embeddings (whose token rows the head also writes).
pub type GroupReady<'a> = &'a mut dyn FnMut(usize, &[f32]);

/// One training micro-batch for [`GptStep::forward_backward`].
#[derive(Debug, Clone, Copy)]
pub struct GptBatch<'a> {
    /// Token ids `[batch, t]`, row-major.
    pub tokens: &'a [i64],
    /// Next-token targets, one per token; `ignore` marks positions without a loss.
    pub targets: &'a [i64],
    /// Sequences in the batch.
    pub batch: usize,
    /// Positions per sequence (at most the context).
    pub t: usize,
    /// The ignore index of `targets`.
    pub ignore: i64,
}

/// One block's saved activations (`N = batch x t` rows).
struct BlockActs {
    /// The block's input (the residual stream) `[N, C]`.
    x: Vec<f32>,
    ln1: Vec<f32>,
    ln1_stats: [Vec<f32>; 2],
    qkv: Vec<f32>,
    att: Vec<f32>,
    lse: Vec<f32>,
    /// The residual stream after attention `[N, C]`.
    mid: Vec<f32>,
    ln2: Vec<f32>,
    ln2_stats: [Vec<f32>; 2],
    fc: Vec<f32>,
    gelu: Vec<f32>,
}

/// Every buffer of one batch shape: the forward's saved activations and the backward's
/// scratch.
struct Acts {
    n: usize,
    blocks: Vec<BlockActs>,
    /// The last block's output `[N, C]`.
    x_out: Vec<f32>,
    lnf: Vec<f32>,
    lnf_stats: [Vec<f32>; 2],
    /// Logits, then (in place) their gradient `[N, vocab]`.
    logits: Vec<f32>,
    dres: Vec<f32>,
    dh: Vec<f32>,
    dqkv: Vec<f32>,
    datt: Vec<f32>,
    dfc: Vec<f32>,
    /// The bf16 GEMMs' packed operands (empty for the f32 GEMM, which packs its own).
    packs: PackBuffers,
}

/// f32 elements of the activation buffers the direct step keeps for one micro-batch of
/// `rows` = batch x positions rows: per block the residual input, both LayerNorm outputs,
/// the attention output and the residual after it (5 x rows x C), qkv (3 x rows x C), the
/// MLP's pre- and post-GELU (8 x rows x C), four LayerNorm statistics and one
/// log-sum-exp per head and row; then the final stream and LayerNorm (2 x rows x C), the
/// logits (rows x vocab) and the backward's scratch (10 x rows x C). llm.c's
/// `fill_in_activation_sizes`, for this step; a test checks it against the allocation.
pub fn activation_floats(rows: usize, dims: GptDims) -> usize {
    let (n, c) = (rows, dims.d_model);
    let block = 16 * n * c + 4 * n + n * dims.n_head;
    dims.n_layer * block + 2 * n * c + 2 * n + n * dims.vocab + 10 * n * c
}

/// Every GEMM `(m, k, n)` (`A` `m x k`, `B` `k x n`) the step runs for `rows` rows,
/// forward and backward: the tied head's three, and three per linear layer of a block
/// (forward, input gradient, weight gradient), the same in every block.
fn gemm_shapes(rows: usize, dims: GptDims) -> Vec<(usize, usize, usize)> {
    let (n, c, v) = (rows, dims.d_model, dims.vocab);
    // Head: logits = lnf wte^T; d lnf = dlogits wte; d wte += dlogits^T lnf.
    let mut shapes = vec![(n, c, v), (n, v, c), (v, n, c)];
    if dims.n_layer > 0 {
        // (in, out) of qkv, proj, fc and fc_proj: y = x W^T; dx = dy W; dW += dy^T x.
        for (k, out) in [(c, 3 * c), (c, c), (c, 4 * c), (4 * c, c)] {
            shapes.extend([(n, k, out), (n, out, k), (out, n, k)]);
        }
    }
    shapes
}

/// Bytes of the buffers the direct step with bf16 operands packs its GEMM operands into,
/// for `rows` rows ([`PackBuffers::for_shapes`] over the step's GEMMs); kept with the
/// activation buffers, and 0 with f32 operands. A test checks it against the allocation.
pub fn gemm_pack_bytes(rows: usize, dims: GptDims) -> usize {
    let (a, b) = PackBuffers::words_for(gemm_shapes(rows, dims));
    4 * (a + b)
}

impl crate::shape_cache::StepBuffers for Acts {
    fn rows(&self) -> usize {
        self.n
    }

    fn bytes(&self) -> usize {
        4 * self.floats() + self.packs.bytes()
    }
}

impl Acts {
    /// f32 elements held, counted from the buffers themselves.
    fn floats(&self) -> usize {
        let blocks: usize = self
            .blocks
            .iter()
            .map(|b| {
                [
                    &b.x, &b.ln1, &b.qkv, &b.att, &b.lse, &b.mid, &b.ln2, &b.fc, &b.gelu,
                ]
                .iter()
                .map(|v| v.len())
                .sum::<usize>()
                    + b.ln1_stats
                        .iter()
                        .chain(&b.ln2_stats)
                        .map(Vec::len)
                        .sum::<usize>()
            })
            .sum();
        let rest = [
            &self.x_out,
            &self.lnf,
            &self.logits,
            &self.dres,
            &self.dh,
            &self.dqkv,
            &self.datt,
            &self.dfc,
        ]
        .iter()
        .map(|v| v.len())
        .sum::<usize>();
        blocks + rest + self.lnf_stats.iter().map(Vec::len).sum::<usize>()
    }

    fn new(n: usize, dims: GptDims, bf16_operands: bool) -> Self {
        let c = dims.d_model;
        let z = |len: usize| vec![0f32; len];
        let blocks = (0..dims.n_layer)
            .map(|_| BlockActs {
                x: z(n * c),
                ln1: z(n * c),
                ln1_stats: [z(n), z(n)],
                qkv: z(3 * n * c),
                att: z(n * c),
                lse: z(n * dims.n_head),
                mid: z(n * c),
                ln2: z(n * c),
                ln2_stats: [z(n), z(n)],
                fc: z(4 * n * c),
                gelu: z(4 * n * c),
            })
            .collect();
        Acts {
            n,
            blocks,
            x_out: z(n * c),
            lnf: z(n * c),
            lnf_stats: [z(n), z(n)],
            logits: z(n * dims.vocab),
            dres: z(n * c),
            dh: z(n * c),
            dqkv: z(3 * n * c),
            datt: z(n * c),
            dfc: z(4 * n * c),
            packs: match bf16_operands {
                true => PackBuffers::for_shapes(gemm_shapes(n, dims)),
                false => PackBuffers::default(),
            },
        }
    }
}

/// The GPT training step: forward, loss and backward of one micro-batch, gradients added
/// into a flat buffer. Reuses its activation buffers while the batch shape stays.
pub struct GptStep {
    dims: GptDims,
    pub(crate) offsets: GptOffsets,
    bf16: Option<Bf16Kernel>,
    eps: f32,
    acts: ShapeCache<Acts>,
}

const OP: &str = "gpt-step";

impl GptStep {
    /// A step for `dims` with parameters at `offsets`; `bf16_operands` runs the linear
    /// layers on the bf16 GEMM's detected kernel (the portable one on CPUs without bf16
    /// instructions: same results, only slow). `eps` is the LayerNorms' epsilon.
    pub fn new(
        dims: GptDims,
        offsets: GptOffsets,
        bf16_operands: bool,
        eps: f64,
    ) -> Result<Self, KernelError> {
        if offsets.blocks.len() != dims.n_layer {
            return Err(KernelError::Layout {
                op: OP,
                msg: format!(
                    "offsets for {} blocks, dims have n_layer {}",
                    offsets.blocks.len(),
                    dims.n_layer
                ),
            });
        }
        if dims.n_head == 0 || dims.d_model == 0 || !dims.d_model.is_multiple_of(dims.n_head) {
            return Err(KernelError::Shape {
                op: OP,
                msg: format!(
                    "d_model {} must be a positive multiple of n_head {}",
                    dims.d_model, dims.n_head
                ),
                shape: candle_core::Shape::from(dims.d_model),
            });
        }
        Ok(GptStep {
            dims,
            offsets,
            bf16: bf16_operands.then(Bf16Kernel::detect),
            eps: eps as f32,
            acts: ShapeCache::new(),
        })
    }

    fn check(&self, b: &GptBatch) -> Result<(), KernelError> {
        check_batch(OP, b, self.dims.vocab, self.dims.context)
    }

    /// [`crate::TokenStep::forward_backward`] with the parameters and gradients of each group
    /// wherever `source` keeps them (ZeRO-3: gathered one block at a time); the same
    /// arithmetic in the same order, so the same bits.
    pub fn forward_backward_groups(
        &mut self,
        source: &mut dyn StepParams,
        batch: GptBatch,
        grad_scale: f32,
    ) -> Result<f64, KernelError> {
        self.check(&batch)?;
        let n = batch.batch * batch.t;
        // Every buffer is sized by the row count alone.
        let mut acts = self.acts_for(n);
        let result = self.forward(source, &batch, &mut acts).and_then(|()| {
            let v = self.dims.vocab;
            let loss = loss_and_grad_in_place(
                &mut acts.logits,
                batch.targets,
                v,
                batch.ignore,
                grad_scale,
            );
            self.backward(source, &batch, &mut acts)?;
            Ok(loss)
        });
        self.acts.keep(acts);
        result
    }

    /// The activation buffers for `rows` rows: kept ones if a shape matched, else new.
    fn acts_for(&mut self, rows: usize) -> Acts {
        let (dims, bf16) = (self.dims, self.bf16.is_some());
        self.acts.take(rows, || Acts::new(rows, dims, bf16))
    }

    /// [`crate::TokenStep::evaluate`] with each group's parameters wherever `source` keeps them
    /// (ZeRO-3: gathered one block at a time, as in training, instead of the whole model
    /// at once). Only the forward phase is asked for.
    pub fn evaluate_groups(
        &mut self,
        source: &mut dyn StepParams,
        batch: GptBatch,
    ) -> Result<(f64, usize, usize), KernelError> {
        self.check(&batch)?;
        let mut acts = self.acts_for(batch.batch * batch.t);
        let result = self
            .forward(source, &batch, &mut acts)
            .map(|()| loss_and_hits(&acts.logits, batch.targets, self.dims.vocab, batch.ignore));
        self.acts.keep(acts);
        result
    }

    /// Bytes of the activation buffers and GEMM packing buffers this step holds now (up
    /// to two batch shapes), counted from the buffers.
    pub fn activation_bytes(&self) -> usize {
        self.acts.bytes()
    }

    /// Group `group` from `source`, checked to cover the group's span.
    fn open<'s>(
        &self,
        source: &'s mut dyn StepParams,
        group: usize,
        phase: Phase,
    ) -> Result<GroupView<'s>, KernelError> {
        open_group(source, group, phase, &self.offsets.groups[group])
    }

    /// The forward pass up to the logits (`a.logits`), every activation kept for the
    /// backward.
    fn forward(
        &self,
        source: &mut dyn StepParams,
        b: &GptBatch,
        a: &mut Acts,
    ) -> Result<(), KernelError> {
        let (c, v) = (self.dims.d_model, self.dims.vocab);
        let n = a.n;
        let o = &self.offsets;
        let last = a.blocks.len() + 1;
        // Token + position embeddings into the first block's input (or the output).
        {
            let view = self.open(source, 0, Phase::Forward)?;
            let p = view.params;
            let x0 = match a.blocks.first_mut() {
                Some(blk) => &mut blk.x,
                None => &mut a.x_out,
            };
            let (wte, wpe) = (&p[o.wte - view.base..][..v * c], &p[o.wpe - view.base..]);
            x0.par_chunks_mut(c).enumerate().for_each(|(i, row)| {
                let (tok, pos) = (b.tokens[i] as usize, i % b.t);
                let (e, q) = (&wte[tok * c..(tok + 1) * c], &wpe[pos * c..(pos + 1) * c]);
                row.iter_mut()
                    .zip(e.iter().zip(q))
                    .for_each(|(r, (&e, &q))| *r = e + q);
            });
        }
        source.done(0, Phase::Forward)?;
        for l in 0..a.blocks.len() {
            let view = self.open(source, l + 1, Phase::Forward)?;
            let (p, bo) = (view.params, o.blocks[l].rebased(view.base));
            let (done, rest) = a.blocks.split_at_mut(l + 1);
            let blk = &mut done[l];
            let ln = |off: [usize; 2]| (&p[off[0]..off[0] + c], &p[off[1]..off[1] + c]);
            let (w, bias) = ln(bo.ln1);
            let [m, r] = &mut blk.ln1_stats;
            layer_norm::fwd_into(&blk.x, w, bias, c, self.eps, &mut blk.ln1, (m, r));
            self.linear(
                &blk.ln1,
                p,
                bo.qkv,
                (n, c, 3 * c),
                &mut blk.qkv,
                false,
                &mut a.packs,
            );
            qkv_forward_f32(
                &blk.qkv,
                (b.batch, b.t, self.dims.n_head),
                &mut blk.att,
                &mut blk.lse,
            );
            blk.mid.copy_from_slice(&blk.x);
            self.linear(
                &blk.att,
                p,
                bo.proj,
                (n, c, c),
                &mut blk.mid,
                true,
                &mut a.packs,
            );
            let (w, bias) = ln(bo.ln2);
            let [m, r] = &mut blk.ln2_stats;
            layer_norm::fwd_into(&blk.mid, w, bias, c, self.eps, &mut blk.ln2, (m, r));
            self.linear(
                &blk.ln2,
                p,
                bo.fc,
                (n, c, 4 * c),
                &mut blk.fc,
                false,
                &mut a.packs,
            );
            gelu::fwd_into(&blk.fc, &mut blk.gelu);
            let next = match rest.first_mut() {
                Some(nb) => &mut nb.x,
                None => &mut a.x_out,
            };
            next.copy_from_slice(&blk.mid);
            self.linear(
                &blk.gelu,
                p,
                bo.fc_proj,
                (n, 4 * c, c),
                next,
                true,
                &mut a.packs,
            );
            source.done(l + 1, Phase::Forward)?;
        }
        {
            let view = self.open(source, last, Phase::Forward)?;
            let (w, b) = (o.ln_f[0] - view.base, o.ln_f[1] - view.base);
            let (w, bias) = (&view.params[w..w + c], &view.params[b..b + c]);
            let [m, r] = &mut a.lnf_stats;
            layer_norm::fwd_into(&a.x_out, w, bias, c, self.eps, &mut a.lnf, (m, r));
        }
        source.done(last, Phase::Forward)?;
        {
            let view = self.open(source, 0, Phase::Forward)?;
            let wte = &view.params[o.wte - view.base..][..v * c];
            let head = MatRef::transposed(wte, c, v);
            self.gemm(
                MatRef::new(&a.lnf, n, c),
                head,
                None,
                &mut a.logits,
                false,
                &mut a.packs,
            );
        }
        source.done(0, Phase::Forward)?;
        Ok(())
    }

    fn backward(
        &self,
        source: &mut dyn StepParams,
        b: &GptBatch,
        a: &mut Acts,
    ) -> Result<(), KernelError> {
        let layers = a.blocks.len();
        let (c, v) = (self.dims.d_model, self.dims.vocab);
        let n = a.n;
        let o = &self.offsets;
        // Head (tied to wte): d lnf = dlogits wte; d wte += dlogits^T lnf.
        {
            let view = self.open(source, 0, Phase::Backward)?;
            let at = o.wte - view.base;
            let wte = &view.params[at..at + v * c];
            let dlogits = &a.logits;
            self.gemm(
                MatRef::new(dlogits, n, v),
                MatRef::new(wte, v, c),
                None,
                &mut a.dh,
                false,
                &mut a.packs,
            );
            self.gemm(
                MatRef::transposed(dlogits, v, n),
                MatRef::new(&a.lnf, n, c),
                None,
                &mut view.grads[at..at + v * c],
                true,
                &mut a.packs,
            );
        }
        {
            let view = self.open(source, layers + 1, Phase::Backward)?;
            let off = [o.ln_f[0] - view.base, o.ln_f[1] - view.base];
            self.layer_norm_bwd(
                (&a.x_out, &a.lnf_stats),
                view.params,
                view.grads,
                off,
                &a.dh,
                &mut a.dres,
                false,
            );
        }
        source.done(layers + 1, Phase::Backward)?;
        for (l, blk) in a.blocks.iter().enumerate().rev() {
            let view = self.open(source, l + 1, Phase::Backward)?;
            let (p, g, bo) = (view.params, view.grads, o.blocks[l].rebased(view.base));
            // MLP: x_out = mid + fc_proj(gelu(fc(ln2(mid)))).
            self.linear_bwd(
                &a.dres,
                &blk.gelu,
                p,
                g,
                bo.fc_proj,
                (n, 4 * c, c),
                &mut a.dfc,
                &mut a.packs,
            );
            gelu::bwd_in_place(&blk.fc, &mut a.dfc);
            self.linear_bwd(
                &a.dfc,
                &blk.ln2,
                p,
                g,
                bo.fc,
                (n, c, 4 * c),
                &mut a.dh,
                &mut a.packs,
            );
            self.layer_norm_bwd(
                (&blk.mid, &blk.ln2_stats),
                p,
                g,
                bo.ln2,
                &a.dh,
                &mut a.dres,
                true,
            );
            // Attention: mid = x + proj(attention(qkv(ln1(x)))).
            self.linear_bwd(
                &a.dres,
                &blk.att,
                p,
                g,
                bo.proj,
                (n, c, c),
                &mut a.datt,
                &mut a.packs,
            );
            qkv_backward_f32(
                &blk.qkv,
                (&blk.att, &a.datt, &blk.lse),
                (b.batch, b.t, self.dims.n_head),
                &mut a.dqkv,
            );
            self.linear_bwd(
                &a.dqkv,
                &blk.ln1,
                p,
                g,
                bo.qkv,
                (n, c, 3 * c),
                &mut a.dh,
                &mut a.packs,
            );
            self.layer_norm_bwd(
                (&blk.x, &blk.ln1_stats),
                p,
                g,
                bo.ln1,
                &a.dh,
                &mut a.dres,
                true,
            );
            source.done(l + 1, Phase::Backward)?;
        }
        // Embeddings: scatter-add into the token rows and the position rows.
        {
            let view = self.open(source, 0, Phase::Backward)?;
            let (wte, wpe) = (o.wte - view.base, o.wpe - view.base);
            scatter_add(
                &a.dres,
                |i| b.tokens[i] as usize,
                c,
                &mut view.grads[wte..wte + v * c],
            );
            let t = b.t;
            scatter_add(&a.dres, |i| i % t, c, &mut view.grads[wpe..wpe + t * c]);
        }
        source.done(0, Phase::Backward)
    }

    /// `out = x W^T + b` (or `out +=` with `accumulate`) for `x` `[m, k]` and the
    /// linear layer whose `[weight, bias]` start at `off`.
    #[allow(clippy::too_many_arguments)]
    fn linear(
        &self,
        x: &[f32],
        p: &[f32],
        off: [usize; 2],
        (m, k, n): (usize, usize, usize),
        out: &mut [f32],
        accumulate: bool,
        packs: &mut PackBuffers,
    ) {
        let w = MatRef::transposed(&p[off[0]..off[0] + n * k], k, n);
        let bias = &p[off[1]..off[1] + n];
        self.gemm(MatRef::new(x, m, k), w, Some(bias), out, accumulate, packs);
    }

    /// [`step_gemm`] on this step's GEMM (bf16 operands or f32).
    fn gemm(
        &self,
        a: MatRef<f32>,
        b: MatRef<f32>,
        bias: Option<&[f32]>,
        out: &mut [f32],
        accumulate: bool,
        packs: &mut PackBuffers,
    ) {
        step_gemm(self.bf16, a, b, bias, out, accumulate, packs)
    }

    /// The backward of [`GptStep::linear`] (`x` `[m, k]`, output `[m, n]`): `dx` written,
    /// weight and bias gradients added.
    #[allow(clippy::too_many_arguments)]
    fn linear_bwd(
        &self,
        dy: &[f32],
        x: &[f32],
        p: &[f32],
        g: &mut [f32],
        off: [usize; 2],
        (m, k, n): (usize, usize, usize),
        dx: &mut [f32],
        packs: &mut PackBuffers,
    ) {
        let w = &p[off[0]..off[0] + n * k];
        // dx = dy W; dW += dy^T x.
        self.gemm(
            MatRef::new(dy, m, n),
            MatRef::new(w, n, k),
            None,
            dx,
            false,
            packs,
        );
        let dw = &mut g[off[0]..off[0] + n * k];
        self.gemm(
            MatRef::transposed(dy, n, m),
            MatRef::new(x, m, k),
            None,
            dw,
            true,
            packs,
        );
        let db = column_sums(dy, n);
        g[off[1]..off[1] + n]
            .iter_mut()
            .zip(&db)
            .for_each(|(g, &d)| *g += d);
    }

    /// LayerNorm backward for the norm whose `[weight, bias]` start at `off`: `dx` written
    /// or added to, weight and bias gradients added.
    #[allow(clippy::too_many_arguments)]
    fn layer_norm_bwd(
        &self,
        (x, stats): (&[f32], &[Vec<f32>; 2]),
        p: &[f32],
        g: &mut [f32],
        off: [usize; 2],
        dy: &[f32],
        dx: &mut [f32],
        add: bool,
    ) {
        let c = self.dims.d_model;
        let w = &p[off[0]..off[0] + c];
        let mut dwb = vec![0f32; 2 * c];
        let (dw, db) = dwb.split_at_mut(c);
        layer_norm::bwd_into(x, w, dy, c, (&stats[0], &stats[1]), dx, add, (dw, db));
        for (i, d) in [(off[0], &*dw), (off[1], &*db)] {
            g[i..i + c].iter_mut().zip(d).for_each(|(g, &d)| *g += d);
        }
    }
}

/// Checks a token batch against a model of `vocab` tokens and `context` positions: at
/// least one sequence of 1..=context positions, every token id in the vocabulary, every
/// target in it or `ignore`. The errors name `op`, the position and the id.
pub(crate) fn check_batch(
    op: &'static str,
    b: &GptBatch,
    vocab: usize,
    context: usize,
) -> Result<(), KernelError> {
    let n = b.batch * b.t;
    let shape = candle_core::Shape::from((b.batch, b.t));
    if b.batch == 0 || b.t == 0 || b.t > context || b.tokens.len() != n || b.targets.len() != n {
        return Err(KernelError::Shape {
            op,
            msg: format!(
                "{} tokens and {} targets for batch {} x {} positions (context {context}); \
                 expected at least one sequence of 1..=context positions",
                b.tokens.len(),
                b.targets.len(),
                b.batch,
                b.t,
            ),
            shape,
        });
    }
    if let Some((pos, &id)) = b
        .tokens
        .iter()
        .enumerate()
        .find(|(_, &id)| id < 0 || id as usize >= vocab)
    {
        return Err(KernelError::Index {
            op,
            pos,
            id,
            rows: vocab,
        });
    }
    if let Some((row, &target)) = b
        .targets
        .iter()
        .enumerate()
        .find(|(_, &t)| t != b.ignore && (t < 0 || t as usize >= vocab))
    {
        return Err(KernelError::Target {
            op,
            row,
            target,
            vocab,
            ignore: b.ignore,
        });
    }
    Ok(())
}

/// `out = A B (+ bias)`, or with `accumulate` `out += A B (+ bias)`, on the bf16 GEMM
/// (`bf16`: bf16 operands) or the f32 one, either operand stored transposed as its
/// `MatRef` says; `out` is `A.rows x B.cols`, row-major. The GEMM of the steps over flat
/// buffers (the GPT's, the Llama's).
pub(crate) fn step_gemm(
    bf16: Option<Bf16Kernel>,
    a: MatRef<f32>,
    b: MatRef<f32>,
    bias: Option<&[f32]>,
    out: &mut [f32],
    accumulate: bool,
    packs: &mut PackBuffers,
) {
    if let Some(kernel) = bf16 {
        gemm_write(kernel, &a, &b, bias, out, accumulate, packs)
            .expect("step GEMM: shapes are fixed by the checked dims");
        return;
    }
    let n = b.cols;
    match (bias, accumulate) {
        (Some(bias), true) => out
            .par_chunks_mut(n)
            .for_each(|r| r.iter_mut().zip(bias).for_each(|(o, &b)| *o += b)),
        (Some(bias), false) => out.par_chunks_mut(n).for_each(|r| r.copy_from_slice(bias)),
        (None, _) => {}
    }
    // Element (i, j) of a logical rows x cols matrix: i * cols + j stored as is, j * rows
    // + i stored transposed.
    let strides = |m: &MatRef<f32>| match m.transposed {
        false => (m.cols, 1),
        true => (1, m.rows),
    };
    let dims = (a.rows, a.cols, n);
    let acc = accumulate || bias.is_some();
    gemm_f32_into(dims, a.data, strides(&a), b.data, strides(&b), out, acc);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TokenStep;

    #[test]
    fn activation_floats_is_what_the_step_allocates() {
        for (rows, vocab, context, d_model, n_layer, n_head) in [
            (1, 11, 6, 8, 2, 2),
            (2048, 96, 128, 128, 4, 4),
            (12 * 192, 50257, 192, 320, 5, 5),
            (7, 3, 7, 12, 0, 3),
        ] {
            let dims = GptDims {
                vocab,
                context,
                d_model,
                n_layer,
                n_head,
            };
            assert_eq!(
                Acts::new(rows, dims, false).floats(),
                activation_floats(rows, dims),
                "{dims:?} rows {rows}"
            );
        }
    }

    /// A small GPT with contiguous offsets and deterministic parameters.
    fn small_step() -> (GptStep, Vec<f32>) {
        let dims = GptDims {
            vocab: 13,
            context: 8,
            d_model: 16,
            n_layer: 2,
            n_head: 4,
        };
        step_for(dims, false)
    }

    /// A GPT of `dims` with contiguous offsets and deterministic parameters.
    fn step_for(dims: GptDims, bf16_operands: bool) -> (GptStep, Vec<f32>) {
        let mut at = std::collections::HashMap::new();
        let mut end = 0;
        for p in gpt_params(&dims) {
            at.insert(p.name.clone(), end);
            end += p.numel();
        }
        let offsets = GptOffsets::from_table(&dims, |n| at.get(n).copied()).unwrap();
        let params = (0..end)
            .map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * 0.2)
            .collect();
        (
            GptStep::new(dims, offsets, bf16_operands, 1e-5).unwrap(),
            params,
        )
    }

    /// The packing buffers are sized before the first GEMM from the table of the step's
    /// GEMMs, and grow if a GEMM needs more: after a whole step they hold what
    /// `gemm_pack_bytes` says, so the table missed none (nor does f32 keep any).
    #[test]
    fn gemm_pack_bytes_is_what_the_bf16_step_holds_after_a_step() {
        for (vocab, d_model, n_layer, n_head, batch, t) in [
            (13, 16, 2, 4, 3, 8),
            (70, 32, 1, 2, 2, 5),
            (5, 48, 1, 3, 1, 40),
            (9, 8, 0, 2, 2, 3),
        ] {
            let dims = GptDims {
                vocab,
                context: t,
                d_model,
                n_layer,
                n_head,
            };
            let rows = batch * t;
            let tokens: Vec<i64> = (0..rows).map(|i| (i * 5 % vocab) as i64).collect();
            let targets: Vec<i64> = (0..rows).map(|i| (i * 3 % vocab) as i64).collect();
            for bf16 in [true, false] {
                let (mut step, params) = step_for(dims, bf16);
                let mut grads = vec![0f32; params.len()];
                let b = GptBatch {
                    tokens: &tokens,
                    targets: &targets,
                    batch,
                    t,
                    ignore: -100,
                };
                step.forward_backward(&params, b, 1.0, &mut grads, &mut |_, _| {})
                    .unwrap();
                let packs = if bf16 { gemm_pack_bytes(rows, dims) } else { 0 };
                assert_eq!(
                    step.activation_bytes(),
                    4 * activation_floats(rows, dims) + packs,
                    "{dims:?} rows {rows} bf16 {bf16}"
                );
            }
        }
    }

    #[test]
    fn evaluation_gives_the_training_forwards_loss_bit_for_bit_and_its_argmax_hits() {
        let (mut step, params) = small_step();
        let (batch, t) = (3, 8);
        let tokens: Vec<i64> = (0..batch * t).map(|i| (i * 5 % 13) as i64).collect();
        let mut targets: Vec<i64> = (0..batch * t).map(|i| (i * 3 % 13) as i64).collect();
        targets[4] = -100; // an ignored row
        let b = || GptBatch {
            tokens: &tokens,
            targets: &targets,
            batch,
            t,
            ignore: -100,
        };
        let mut grads = vec![0f32; params.len()];
        let train_loss = step
            .forward_backward(&params, b(), 1.0, &mut grads, &mut |_, _| {})
            .unwrap();
        let (loss, hits, count) = step.evaluate(&params, b()).unwrap();
        assert_eq!(loss.to_bits(), train_loss.to_bits());
        assert_eq!(count, batch * t - 1);
        // Top-1 from the logits the evaluation left in its buffers.
        let v = 13;
        let logits = &step.acts.iter().last().unwrap().logits;
        let expected = logits
            .chunks_exact(v)
            .zip(&targets)
            .filter(|(row, &t)| {
                let best = (0..v).fold(0, |b, j| if row[j] > row[b] { j } else { b });
                t != -100 && best == t as usize
            })
            .count();
        assert_eq!(hits, expected);
        // Evaluation reuses the training shape's buffers: nothing more is held.
        assert_eq!(
            step.activation_bytes(),
            4 * activation_floats(batch * t, step.dims)
        );
    }
}
