//! A Llama's whole training forward and backward over flat f32 buffers: the GPT step's
//! design ([`crate::gpt`]: parameters read from the flat master, gradients added into the
//! flat gradient buffer, activations in buffers kept per batch shape, no autograd graph)
//! with the Llama's parts: RMSNorm ([`crate::rms_norm`]), rotary embeddings applied in
//! place to q and k ([`crate::rope`]), grouped-query attention, SwiGLU
//! ([`crate::swiglu`]) and an untied head.
//!
//! Grouped-query attention runs on the GPT's attention kernels: after the rotation, each
//! key/value head is copied to the query heads it serves (transformers' `repeat_kv`) in
//! the packed `[N, 3 C]` layout those kernels read, and the backward sums the copies'
//! gradients back. The step opens and closes parameter groups in the GPT step's order
//! ([`crate::gpt::group_calls`]), so ZeRO-3's schedule serves both.
//!
//! [`crate::TokenStep`] gives it the whole-buffer entry points. stoker-train's
//! `tests/direct_step.rs` holds this step's gradients to the candle graph's.

use rayon::prelude::*;

use super::offsets::{LlamaBlockOffsets, LlamaOffsets};
use super::spec::LlamaDims;
use crate::attention::{qkv_backward_f32, qkv_forward_f32};
use crate::cross_entropy::{loss_and_grad_in_place, loss_and_hits};
use crate::embedding::scatter_add;
use crate::error::KernelError;
use crate::gpt::groups::open_group;
use crate::gpt::{check_batch, step_gemm, GptBatch, GroupView, Phase, StepParams};
use crate::matmul::{Bf16Kernel, MatRef, PackBuffers};
use crate::shape_cache::ShapeCache;
use crate::{rms_norm, rope, swiglu};

const OP: &str = "llama-step";

/// One block's saved activations (`N = batch x t` rows).
struct BlockActs {
    /// The block's input (the residual stream) `[N, C]`.
    x: Vec<f32>,
    h1: Vec<f32>,
    rstd1: Vec<f32>,
    /// Rotated queries, and keys and values repeated per query head: `[N, 3 C]`.
    qkv: Vec<f32>,
    att: Vec<f32>,
    lse: Vec<f32>,
    /// The residual stream after attention `[N, C]`.
    mid: Vec<f32>,
    h2: Vec<f32>,
    rstd2: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    act: Vec<f32>,
}

/// Every buffer of one batch shape.
struct Acts {
    n: usize,
    blocks: Vec<BlockActs>,
    x_out: Vec<f32>,
    hf: Vec<f32>,
    rstdf: Vec<f32>,
    /// Logits, then (in place) their gradient `[N, vocab]`.
    logits: Vec<f32>,
    /// Projections before the repeat (forward), their gradients (backward).
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    dres: Vec<f32>,
    dh: Vec<f32>,
    dqkv: Vec<f32>,
    datt: Vec<f32>,
    dgate: Vec<f32>,
    dup: Vec<f32>,
    dact: Vec<f32>,
    packs: PackBuffers,
}

/// Every GEMM `(m, k, n)` of the step for `rows` rows: the head's three, and three per
/// linear layer of a block (forward, input gradient, weight gradient).
fn gemm_shapes(rows: usize, d: LlamaDims) -> Vec<(usize, usize, usize)> {
    let (n, c, v, f) = (rows, d.d_model, d.vocab, d.ffn_hidden);
    let kv = d.n_kv_head * d.head_dim();
    let mut shapes = vec![(n, c, v), (n, v, c), (v, n, c)];
    if d.n_layer > 0 {
        for (k, out) in [(c, c), (c, kv), (c, c), (c, f), (f, c)] {
            shapes.extend([(n, k, out), (n, out, k), (out, n, k)]);
        }
    }
    shapes
}

/// f32 elements of the activation buffers the Llama step keeps for one micro-batch of
/// `rows` rows (`N`): per block the residual input, both RMSNorm outputs, the attention
/// output and the residual after it (5 N C), q with the repeated k and v (3 N C), gate,
/// up and their product (3 N F), two `rstd` and one log-sum-exp per head and row; then the
/// final stream and norm (2 N C + N), the logits (N V), and the scratch: the projections
/// before the repeat (N C + 2 N KV hd) and the backward's (2 N C + 3 N C + N C + 3 N F).
/// A test checks it against the allocation.
pub fn activation_floats(rows: usize, d: LlamaDims) -> usize {
    let (n, c, f) = (rows, d.d_model, d.ffn_hidden);
    let kv = d.n_kv_head * d.head_dim();
    let block = 8 * n * c + 3 * n * f + 2 * n + n * d.n_head;
    let scratch = n * c + 2 * n * kv + 6 * n * c + 3 * n * f;
    d.n_layer * block + 2 * n * c + n + n * d.vocab + scratch
}

/// Bytes of the buffers the Llama step with bf16 operands packs its GEMM operands into,
/// for `rows` rows; 0 with f32 operands. A test checks it against a step's.
pub fn gemm_pack_bytes(rows: usize, d: LlamaDims) -> usize {
    let (a, b) = PackBuffers::words_for(gemm_shapes(rows, d));
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
    fn new(n: usize, d: LlamaDims, bf16_operands: bool) -> Self {
        let (c, f, v) = (d.d_model, d.ffn_hidden, d.vocab);
        let kv = d.n_kv_head * d.head_dim();
        let z = |len: usize| vec![0f32; len];
        let blocks = (0..d.n_layer)
            .map(|_| BlockActs {
                x: z(n * c),
                h1: z(n * c),
                rstd1: z(n),
                qkv: z(3 * n * c),
                att: z(n * c),
                lse: z(n * d.n_head),
                mid: z(n * c),
                h2: z(n * c),
                rstd2: z(n),
                gate: z(n * f),
                up: z(n * f),
                act: z(n * f),
            })
            .collect();
        Acts {
            n,
            blocks,
            x_out: z(n * c),
            hf: z(n * c),
            rstdf: z(n),
            logits: z(n * v),
            q: z(n * c),
            k: z(n * kv),
            v: z(n * kv),
            dres: z(n * c),
            dh: z(n * c),
            dqkv: z(3 * n * c),
            datt: z(n * c),
            dgate: z(n * f),
            dup: z(n * f),
            dact: z(n * f),
            packs: match bf16_operands {
                true => PackBuffers::for_shapes(gemm_shapes(n, d)),
                false => PackBuffers::default(),
            },
        }
    }

    /// f32 elements held, counted from the buffers themselves.
    fn floats(&self) -> usize {
        let blocks: usize = self
            .blocks
            .iter()
            .map(|b| {
                [
                    &b.x, &b.h1, &b.rstd1, &b.qkv, &b.att, &b.lse, &b.mid, &b.h2, &b.rstd2,
                    &b.gate, &b.up, &b.act,
                ]
                .iter()
                .map(|v| v.len())
                .sum::<usize>()
            })
            .sum();
        blocks
            + [
                &self.x_out,
                &self.hf,
                &self.rstdf,
                &self.logits,
                &self.q,
                &self.k,
                &self.v,
                &self.dres,
                &self.dh,
                &self.dqkv,
                &self.datt,
                &self.dgate,
                &self.dup,
                &self.dact,
            ]
            .iter()
            .map(|v| v.len())
            .sum::<usize>()
    }
}

/// The Llama training step: forward, loss and backward of one micro-batch, gradients
/// added into a flat buffer. Reuses its activation buffers while the batch shape stays.
pub struct LlamaStep {
    dims: LlamaDims,
    pub(crate) offsets: LlamaOffsets,
    bf16: Option<Bf16Kernel>,
    eps: f32,
    /// The rotary tables for every position of the context: `cos`, `sin` `[context, hd/2]`.
    rotary: (Vec<f32>, Vec<f32>),
    acts: ShapeCache<Acts>,
}

impl LlamaStep {
    /// A step for `dims` with parameters at `offsets`; `bf16_operands` runs the linear
    /// layers on the bf16 GEMM. `eps` is RMSNorm's epsilon, `rope_theta` the rotary base.
    pub fn new(
        dims: LlamaDims,
        offsets: LlamaOffsets,
        bf16_operands: bool,
        eps: f64,
        rope_theta: f64,
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
        let heads_ok = dims.n_head > 0
            && dims.n_kv_head > 0
            && dims.d_model.is_multiple_of(dims.n_head)
            && dims.head_dim().is_multiple_of(2)
            && dims.n_head.is_multiple_of(dims.n_kv_head);
        if !heads_ok {
            return Err(KernelError::Shape {
                op: OP,
                msg: format!(
                    "d_model {} into n_head {} heads of even width, n_kv_head {} dividing them",
                    dims.d_model, dims.n_head, dims.n_kv_head
                ),
                shape: candle_core::Shape::from(dims.d_model),
            });
        }
        Ok(LlamaStep {
            rotary: rope::tables(dims.context, dims.head_dim(), rope_theta),
            dims,
            offsets,
            bf16: bf16_operands.then(Bf16Kernel::detect),
            eps: eps as f32,
            acts: ShapeCache::new(),
        })
    }

    /// [`crate::TokenStep::forward_backward`] with each group wherever `source` keeps it.
    pub fn forward_backward_groups(
        &mut self,
        source: &mut dyn StepParams,
        batch: GptBatch,
        grad_scale: f32,
    ) -> Result<f64, KernelError> {
        check_batch(OP, &batch, self.dims.vocab, self.dims.context)?;
        let mut acts = self.acts_for(batch.batch * batch.t);
        let result = self.forward(source, &batch, &mut acts).and_then(|()| {
            let loss = loss_and_grad_in_place(
                &mut acts.logits,
                batch.targets,
                self.dims.vocab,
                batch.ignore,
                grad_scale,
            );
            self.backward(source, &batch, &mut acts)?;
            Ok(loss)
        });
        self.acts.keep(acts);
        result
    }

    /// [`crate::TokenStep::evaluate`] with each group wherever `source` keeps it.
    pub fn evaluate_groups(
        &mut self,
        source: &mut dyn StepParams,
        batch: GptBatch,
    ) -> Result<(f64, usize, usize), KernelError> {
        check_batch(OP, &batch, self.dims.vocab, self.dims.context)?;
        let mut acts = self.acts_for(batch.batch * batch.t);
        let result = self
            .forward(source, &batch, &mut acts)
            .map(|()| loss_and_hits(&acts.logits, batch.targets, self.dims.vocab, batch.ignore));
        self.acts.keep(acts);
        result
    }

    /// Bytes of the activation and GEMM packing buffers this step holds now.
    pub fn activation_bytes(&self) -> usize {
        self.acts.bytes()
    }

    fn acts_for(&mut self, rows: usize) -> Acts {
        let (dims, bf16) = (self.dims, self.bf16.is_some());
        self.acts.take(rows, || Acts::new(rows, dims, bf16))
    }

    fn open<'s>(
        &self,
        source: &'s mut dyn StepParams,
        group: usize,
        phase: Phase,
    ) -> Result<GroupView<'s>, KernelError> {
        open_group(source, group, phase, &self.offsets.groups[group])
    }

    /// `(cos, sin)` of the rotary tables.
    fn tables(&self) -> (&[f32], &[f32]) {
        (&self.rotary.0, &self.rotary.1)
    }

    fn forward(
        &self,
        source: &mut dyn StepParams,
        b: &GptBatch,
        a: &mut Acts,
    ) -> Result<(), KernelError> {
        let d = self.dims;
        let (c, v, f) = (d.d_model, d.vocab, d.ffn_hidden);
        let (hd, kv) = (d.head_dim(), d.n_kv_head * d.head_dim());
        let n = a.n;
        let last = a.blocks.len() + 1;
        {
            let view = self.open(source, 0, Phase::Forward)?;
            let embed = &view.params[self.offsets.embed - view.base..][..v * c];
            let x0 = match a.blocks.first_mut() {
                Some(blk) => &mut blk.x,
                None => &mut a.x_out,
            };
            x0.par_chunks_mut(c).enumerate().for_each(|(i, row)| {
                let tok = b.tokens[i] as usize;
                row.copy_from_slice(&embed[tok * c..(tok + 1) * c]);
            });
        }
        source.done(0, Phase::Forward)?;
        for l in 0..a.blocks.len() {
            let view = self.open(source, l + 1, Phase::Forward)?;
            let (p, bo) = (view.params, self.offsets.blocks[l].rebased(view.base));
            let (done, rest) = a.blocks.split_at_mut(l + 1);
            let blk = &mut done[l];
            let packs = &mut a.packs;
            self.rms_fwd(&blk.x, (p, bo.input_norm), &mut blk.h1, &mut blk.rstd1);
            self.linear(&blk.h1, (p, bo.q), (n, c, c), &mut a.q, false, packs);
            self.linear(&blk.h1, (p, bo.k), (n, c, kv), &mut a.k, false, packs);
            self.linear(&blk.h1, (p, bo.v), (n, c, kv), &mut a.v, false, packs);
            rope::rotate(&mut a.q, (b.t, d.n_head, hd), self.tables(), 1.0);
            rope::rotate(&mut a.k, (b.t, d.n_kv_head, hd), self.tables(), 1.0);
            self.repeat_kv(&a.q, &a.k, &a.v, &mut blk.qkv);
            qkv_forward_f32(
                &blk.qkv,
                (b.batch, b.t, d.n_head),
                &mut blk.att,
                &mut blk.lse,
            );
            blk.mid.copy_from_slice(&blk.x);
            self.linear(&blk.att, (p, bo.o), (n, c, c), &mut blk.mid, true, packs);
            self.rms_fwd(&blk.mid, (p, bo.post_norm), &mut blk.h2, &mut blk.rstd2);
            self.linear(
                &blk.h2,
                (p, bo.gate),
                (n, c, f),
                &mut blk.gate,
                false,
                packs,
            );
            self.linear(&blk.h2, (p, bo.up), (n, c, f), &mut blk.up, false, packs);
            swiglu::fwd_into(&blk.gate, &blk.up, &mut blk.act);
            let next = match rest.first_mut() {
                Some(nb) => &mut nb.x,
                None => &mut a.x_out,
            };
            next.copy_from_slice(&blk.mid);
            self.linear(&blk.act, (p, bo.down), (n, f, c), next, true, packs);
            source.done(l + 1, Phase::Forward)?;
        }
        {
            let view = self.open(source, last, Phase::Forward)?;
            let p = view.params;
            let norm = self.offsets.norm - view.base;
            self.rms_fwd(&a.x_out, (p, norm), &mut a.hf, &mut a.rstdf);
            let head = self.offsets.head - view.base;
            self.linear(
                &a.hf,
                (p, head),
                (n, c, v),
                &mut a.logits,
                false,
                &mut a.packs,
            );
        }
        source.done(last, Phase::Forward)?;
        // The GPT step's order (its tied head reads the embedding again here).
        self.open(source, 0, Phase::Forward)?;
        source.done(0, Phase::Forward)
    }

    fn backward(
        &self,
        source: &mut dyn StepParams,
        b: &GptBatch,
        a: &mut Acts,
    ) -> Result<(), KernelError> {
        let d = self.dims;
        let (c, v, f) = (d.d_model, d.vocab, d.ffn_hidden);
        let (hd, kv) = (d.head_dim(), d.n_kv_head * d.head_dim());
        let n = a.n;
        let layers = a.blocks.len();
        // The GPT step's order: group 0 first (its tied head's gradient); here it holds
        // nothing the head needs.
        self.open(source, 0, Phase::Backward)?;
        {
            let view = self.open(source, layers + 1, Phase::Backward)?;
            let (p, g) = (view.params, view.grads);
            let (head, norm) = (self.offsets.head - view.base, self.offsets.norm - view.base);
            self.linear_bwd(
                (&a.logits, &a.hf),
                (p, &mut *g, head),
                (n, c, v),
                (&mut a.dh, false),
                &mut a.packs,
            );
            self.rms_bwd(
                &a.x_out,
                (p, &mut *g, norm),
                &a.dh,
                &a.rstdf,
                (&mut a.dres, false),
            );
        }
        source.done(layers + 1, Phase::Backward)?;
        for (l, blk) in a.blocks.iter().enumerate().rev() {
            let view = self.open(source, l + 1, Phase::Backward)?;
            let (p, g) = (view.params, view.grads);
            let bo: LlamaBlockOffsets = self.offsets.blocks[l].rebased(view.base);
            let packs = &mut a.packs;
            // MLP: next = mid + down(swiglu(gate(h2), up(h2))).
            self.linear_bwd(
                (&a.dres, &blk.act),
                (p, &mut *g, bo.down),
                (n, f, c),
                (&mut a.dact, false),
                packs,
            );
            swiglu::bwd_into(&blk.gate, &blk.up, &a.dact, &mut a.dgate, &mut a.dup);
            for (dy, at, add) in [(&a.dgate, bo.gate, false), (&a.dup, bo.up, true)] {
                self.linear_bwd(
                    (dy, &blk.h2),
                    (p, &mut *g, at),
                    (n, c, f),
                    (&mut a.dh, add),
                    packs,
                );
            }
            self.rms_bwd(
                &blk.mid,
                (p, &mut *g, bo.post_norm),
                &a.dh,
                &blk.rstd2,
                (&mut a.dres, true),
            );
            // Attention: mid = x + o(attention(rope(q(h1)), rope(k(h1)), v(h1))).
            self.linear_bwd(
                (&a.dres, &blk.att),
                (p, &mut *g, bo.o),
                (n, c, c),
                (&mut a.datt, false),
                packs,
            );
            qkv_backward_f32(
                &blk.qkv,
                (&blk.att, &a.datt, &blk.lse),
                (b.batch, b.t, d.n_head),
                &mut a.dqkv,
            );
            self.sum_repeats(&a.dqkv, &mut a.q, &mut a.k, &mut a.v);
            rope::rotate(&mut a.q, (b.t, d.n_head, hd), self.tables(), -1.0);
            rope::rotate(&mut a.k, (b.t, d.n_kv_head, hd), self.tables(), -1.0);
            for (dy, at, out, add) in [
                (&a.q, bo.q, c, false),
                (&a.k, bo.k, kv, true),
                (&a.v, bo.v, kv, true),
            ] {
                self.linear_bwd(
                    (dy, &blk.h1),
                    (p, &mut *g, at),
                    (n, c, out),
                    (&mut a.dh, add),
                    packs,
                );
            }
            self.rms_bwd(
                &blk.x,
                (p, &mut *g, bo.input_norm),
                &a.dh,
                &blk.rstd1,
                (&mut a.dres, true),
            );
            source.done(l + 1, Phase::Backward)?;
        }
        {
            let view = self.open(source, 0, Phase::Backward)?;
            let at = self.offsets.embed - view.base;
            scatter_add(
                &a.dres,
                |i| b.tokens[i] as usize,
                c,
                &mut view.grads[at..][..v * c],
            );
        }
        source.done(0, Phase::Backward)
    }

    /// Rows of `q` `[N, C]`, `k` and `v` `[N, KV hd]` into `qkv` `[N, 3 C]`: q as is, each
    /// key/value head copied to the `H / KV` query heads it serves.
    fn repeat_kv(&self, q: &[f32], k: &[f32], v: &[f32], qkv: &mut [f32]) {
        let d = self.dims;
        let (c, hd) = (d.d_model, d.head_dim());
        let (kv, rep) = (d.n_kv_head * hd, d.n_head / d.n_kv_head);
        qkv.par_chunks_mut(3 * c).enumerate().for_each(|(i, row)| {
            let (rq, rest) = row.split_at_mut(c);
            rq.copy_from_slice(&q[i * c..][..c]);
            let (rk, rv) = rest.split_at_mut(c);
            for h in 0..d.n_head {
                let src = i * kv + (h / rep) * hd;
                rk[h * hd..][..hd].copy_from_slice(&k[src..][..hd]);
                rv[h * hd..][..hd].copy_from_slice(&v[src..][..hd]);
            }
        });
    }

    /// The backward of [`LlamaStep::repeat_kv`]: `dqkv` `[N, 3 C]` into `dq`, and `dk`,
    /// `dv` summed over each key/value head's copies (in head order: deterministic).
    fn sum_repeats(&self, dqkv: &[f32], dq: &mut [f32], dk: &mut [f32], dv: &mut [f32]) {
        let d = self.dims;
        let (c, hd) = (d.d_model, d.head_dim());
        let (kv, rep) = (d.n_kv_head * hd, d.n_head / d.n_kv_head);
        dq.par_chunks_mut(c)
            .zip(dk.par_chunks_mut(kv).zip(dv.par_chunks_mut(kv)))
            .enumerate()
            .for_each(|(i, (rq, (rk, rv)))| {
                let row = &dqkv[i * 3 * c..][..3 * c];
                rq.copy_from_slice(&row[..c]);
                rk.fill(0.0);
                rv.fill(0.0);
                for h in 0..d.n_head {
                    let dst = (h / rep) * hd;
                    let (sk, sv) = (&row[c + h * hd..][..hd], &row[2 * c + h * hd..][..hd]);
                    rk[dst..dst + hd]
                        .iter_mut()
                        .zip(sk)
                        .for_each(|(o, &s)| *o += s);
                    rv[dst..dst + hd]
                        .iter_mut()
                        .zip(sv)
                        .for_each(|(o, &s)| *o += s);
                }
            });
    }

    /// `out = x W^T` (or `out +=` with `accumulate`) for `x` `[m, k]` and the weight
    /// `[n, k]` at `at` in the group's parameters `p`.
    fn linear(
        &self,
        x: &[f32],
        (p, at): (&[f32], usize),
        (m, k, n): (usize, usize, usize),
        out: &mut [f32],
        accumulate: bool,
        packs: &mut PackBuffers,
    ) {
        let (a, b) = (
            MatRef::new(x, m, k),
            MatRef::transposed(&p[at..][..n * k], k, n),
        );
        step_gemm(self.bf16, a, b, None, out, accumulate, packs);
    }

    /// The backward of [`LlamaStep::linear`] from `dy` `[m, n]` and its input `x`, the
    /// weight `[n, k]` at `at` in the group's parameters `p` and gradients `g`:
    /// `dx = dy W` written (or added, with `add_dx`), `dw += dy^T x`.
    fn linear_bwd(
        &self,
        (dy, x): (&[f32], &[f32]),
        (p, g, at): (&[f32], &mut [f32], usize),
        (m, k, n): (usize, usize, usize),
        (dx, add_dx): (&mut [f32], bool),
        packs: &mut PackBuffers,
    ) {
        let (w, dw) = (&p[at..][..n * k], &mut g[at..][..n * k]);
        let dy_m = MatRef::new(dy, m, n);
        step_gemm(
            self.bf16,
            dy_m,
            MatRef::new(w, n, k),
            None,
            dx,
            add_dx,
            packs,
        );
        let (dyt, xm) = (MatRef::transposed(dy, n, m), MatRef::new(x, m, k));
        step_gemm(self.bf16, dyt, xm, None, dw, true, packs);
    }

    /// RMSNorm of `x` with the gain at `at` in `p` into `y`, each row's `rstd` saved.
    fn rms_fwd(&self, x: &[f32], (p, at): (&[f32], usize), y: &mut [f32], rstd: &mut [f32]) {
        let c = self.dims.d_model;
        rms_norm::fwd_into(x, &p[at..][..c], c, self.eps, y, rstd);
    }

    /// RMSNorm's backward for the gain at `at` in `p` (its gradient added in `g`): `dx`
    /// written or, with `add`, added to.
    fn rms_bwd(
        &self,
        x: &[f32],
        (p, g, at): (&[f32], &mut [f32], usize),
        dy: &[f32],
        rstd: &[f32],
        (dx, add): (&mut [f32], bool),
    ) {
        let c = self.dims.d_model;
        rms_norm::bwd_into(x, &p[at..][..c], dy, c, rstd, (dx, add), &mut g[at..][..c]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llama::llama_params;
    use crate::TokenStep;

    fn dims(vocab: usize, d_model: usize, n_layer: usize, heads: (usize, usize)) -> LlamaDims {
        LlamaDims {
            vocab,
            context: 16,
            d_model,
            n_layer,
            n_head: heads.0,
            n_kv_head: heads.1,
            ffn_hidden: 3 * d_model - 4,
        }
    }

    #[test]
    fn activation_floats_is_what_the_step_allocates() {
        for (rows, d) in [
            (1, dims(11, 8, 2, (2, 1))),
            (2048, dims(96, 128, 4, (4, 2))),
            (7, dims(3, 12, 0, (3, 3))),
        ] {
            assert_eq!(
                Acts::new(rows, d, false).floats(),
                activation_floats(rows, d),
                "{d:?} rows {rows}"
            );
        }
    }

    /// After a whole bf16 step the packing buffers hold what `gemm_pack_bytes` says.
    #[test]
    fn gemm_pack_bytes_is_what_the_bf16_step_holds_after_a_step() {
        for (d, batch, t) in [
            (dims(13, 16, 2, (4, 2)), 3, 8),
            (dims(9, 8, 0, (2, 2)), 2, 3),
        ] {
            let mut at = std::collections::HashMap::new();
            let mut end = 0;
            for p in llama_params(&d) {
                at.insert(p.name.clone(), end);
                end += p.numel();
            }
            let offsets = LlamaOffsets::from_table(&d, |n| at.get(n).copied()).unwrap();
            let params: Vec<f32> = (0..end)
                .map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 4e-4)
                .collect();
            let rows = batch * t;
            let tokens: Vec<i64> = (0..rows).map(|i| (i * 5 % d.vocab) as i64).collect();
            let targets: Vec<i64> = (0..rows).map(|i| (i * 3 % d.vocab) as i64).collect();
            for bf16 in [true, false] {
                let mut step = LlamaStep::new(d, offsets.clone(), bf16, 1e-5, 1e4).unwrap();
                let mut grads = vec![0f32; end];
                let b = GptBatch {
                    tokens: &tokens,
                    targets: &targets,
                    batch,
                    t,
                    ignore: -100,
                };
                step.forward_backward(&params, b, 1.0, &mut grads, &mut |_, _| {})
                    .unwrap();
                let packs = if bf16 { gemm_pack_bytes(rows, d) } else { 0 };
                assert_eq!(
                    step.activation_bytes(),
                    4 * activation_floats(rows, d) + packs,
                    "{d:?} rows {rows} bf16 {bf16}"
                );
            }
        }
    }
}
