//! Llama: token embedding, pre-RMSNorm blocks with rotary grouped-query attention and a
//! SwiGLU MLP, final RMSNorm, untied head, no biases (transformers' `LlamaForCausalLM`,
//! torchtitan's Llama). Its parameters are stoker-kernels' Llama table.

use std::path::PathBuf;

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use super::gpt::check_tokens;
use super::token_direct::TokenDirect;
use super::{DirectStep, LossKind, Model};
use crate::error::{Result, TrainError};
use crate::layout::FlatLayout;
use crate::ops::{causal_attention_gqa, embedding, linear, rms_norm, rope, swiglu};
use crate::params::{ParamBuilder, ParamSet};
use crate::precision::Fx;
use stoker_kernels::{LlamaDims, LlamaOffsets, LlamaStep};

/// Llama size and options, with Llama's defaults where a key is left out.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LlamaConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Longest window (positions).
    pub context: usize,
    /// Embedding width.
    pub d_model: usize,
    /// Number of blocks.
    pub n_layer: usize,
    /// Query heads (must divide `d_model`, into heads of even width).
    pub n_head: usize,
    /// Key/value heads for grouped-query attention (must divide `n_head`); default
    /// `n_head` (multi-head attention).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n_kv_head: Option<usize>,
    /// SwiGLU's inner width; default Llama's: 2/3 of 4 `d_model`, rounded up to a
    /// multiple of 256.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ffn_hidden: Option<usize>,
    /// Rotary base (transformers' `rope_theta`).
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    /// RMSNorm's epsilon (transformers' `rms_norm_eps`).
    #[serde(default = "default_norm_eps")]
    pub norm_eps: f64,
    /// Start from the weights of a Hugging Face `LlamaForCausalLM` directory
    /// (`config.json` + `model.safetensors`) instead of a random initialization. Its
    /// sizes must equal these.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_from: Option<PathBuf>,
}

fn default_rope_theta() -> f64 {
    10_000.0
}

fn default_norm_eps() -> f64 {
    1e-5
}

impl LlamaConfig {
    /// The sizes as stoker-kernels' Llama table takes them (defaults resolved).
    pub fn dims(&self) -> LlamaDims {
        LlamaDims {
            vocab: self.vocab,
            context: self.context,
            d_model: self.d_model,
            n_layer: self.n_layer,
            n_head: self.n_head,
            n_kv_head: self.n_kv_head.unwrap_or(self.n_head),
            ffn_hidden: self
                .ffn_hidden
                .unwrap_or_else(|| LlamaDims::default_ffn_hidden(self.d_model)),
        }
    }

    /// Checks the sizes; the error names the key.
    pub fn validate(&self) -> std::result::Result<(), (&'static str, String)> {
        let d = self.dims();
        for (k, v) in [
            ("vocab", d.vocab),
            ("context", d.context),
            ("d_model", d.d_model),
            ("n_layer", d.n_layer),
            ("n_head", d.n_head),
            ("n_kv_head", d.n_kv_head),
            ("ffn_hidden", d.ffn_hidden),
        ] {
            if v == 0 {
                return Err((k, "must be at least 1".into()));
            }
        }
        if !d.d_model.is_multiple_of(d.n_head) || !d.head_dim().is_multiple_of(2) {
            return Err((
                "n_head",
                format!(
                    "{} does not divide d_model {} into heads of even width (rotary \
                     embeddings turn pairs)",
                    d.n_head, d.d_model
                ),
            ));
        }
        if !d.n_head.is_multiple_of(d.n_kv_head) {
            return Err((
                "n_kv_head",
                format!("{} does not divide n_head {}", d.n_kv_head, d.n_head),
            ));
        }
        for (k, v) in [("rope_theta", self.rope_theta), ("norm_eps", self.norm_eps)] {
            if !(v.is_finite() && v > 0.0) {
                return Err((k, format!("{v}: expected a positive number")));
            }
        }
        Ok(())
    }
}

struct Block {
    prefix: String,
    input_norm: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    post_norm: Tensor,
    gate: Tensor,
    up: Tensor,
    down: Tensor,
}

/// The Llama model.
pub struct Llama {
    config: LlamaConfig,
    dims: LlamaDims,
    embed: Tensor,
    blocks: Vec<Block>,
    norm: Tensor,
    head: Tensor,
    params: ParamSet,
}

impl Llama {
    /// Declares the parameters of stoker-kernels' Llama table, drawn from `seed`.
    pub fn new(
        config: LlamaConfig,
        device: &candle_core::Device,
        dtype: candle_core::DType,
        seed: u64,
    ) -> Result<Self> {
        Self::with_builder(config, ParamBuilder::new(device.clone(), dtype, seed))
    }

    /// Declares the parameters of stoker-kernels' Llama table with the values `b` gives
    /// (drawn from its seed, a flat buffer's, or none).
    pub fn with_builder(config: LlamaConfig, mut b: ParamBuilder) -> Result<Self> {
        let dims = config.dims();
        b.params_of(&stoker_kernels::llama_params(&dims))?;
        let params = b.finish();
        let t = |name: String| -> Result<Tensor> {
            params
                .get(&name)
                .map(|p| p.var.as_tensor().clone())
                .ok_or_else(|| TrainError::Model(format!("the Llama table has no `{name}`")))
        };
        let blocks = (0..dims.n_layer)
            .map(|l| {
                let w = |part: &str| t(format!("layers.{l}.{part}.weight"));
                Ok(Block {
                    input_norm: w("input_layernorm")?,
                    q: w("self_attn.q_proj")?,
                    k: w("self_attn.k_proj")?,
                    v: w("self_attn.v_proj")?,
                    o: w("self_attn.o_proj")?,
                    post_norm: w("post_attention_layernorm")?,
                    gate: w("mlp.gate_proj")?,
                    up: w("mlp.up_proj")?,
                    down: w("mlp.down_proj")?,
                    prefix: format!("layers.{l}"),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Llama {
            embed: t("embed_tokens.weight".into())?,
            norm: t("norm.weight".into())?,
            head: t("lm_head.weight".into())?,
            blocks,
            config,
            dims,
            params,
        })
    }

    /// The size config.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    fn attention(&self, fx: &Fx, blk: &Block, x: &Tensor) -> Result<Tensor> {
        let (b, t, c) = x.dims3()?;
        let (h, kv, hd) = (self.dims.n_head, self.dims.n_kv_head, self.dims.head_dim());
        let name = format!("{}.self_attn", blk.prefix);
        let proj = |part: &str, w: &Tensor, heads: usize| -> Result<Tensor> {
            Ok(linear(fx, &format!("{name}.{part}"), x, w, None)?.reshape((b, t, heads, hd))?)
        };
        let theta = self.config.rope_theta;
        let q = rope(fx, &proj("q_proj", &blk.q, h)?, theta)?.transpose(1, 2)?;
        let k = rope(fx, &proj("k_proj", &blk.k, kv)?, theta)?.transpose(1, 2)?;
        let v = proj("v_proj", &blk.v, kv)?.transpose(1, 2)?;
        let y = causal_attention_gqa(fx, &q, &k, &v)?
            .transpose(1, 2)?
            .reshape((b, t, c))?;
        linear(fx, &format!("{name}.o_proj"), &y, &blk.o, None)
    }

    fn mlp(&self, fx: &Fx, blk: &Block, x: &Tensor) -> Result<Tensor> {
        let name = format!("{}.mlp", blk.prefix);
        let gate = linear(fx, &format!("{name}.gate_proj"), x, &blk.gate, None)?;
        let up = linear(fx, &format!("{name}.up_proj"), x, &blk.up, None)?;
        let h = swiglu(fx, &gate, &up)?;
        linear(fx, &format!("{name}.down_proj"), &h, &blk.down, None)
    }
}

impl Model for Llama {
    fn direct_step(
        &self,
        layout: &FlatLayout,
        bf16_operands: bool,
    ) -> Result<Option<Box<dyn DirectStep>>> {
        let dims = self.dims;
        let offsets = LlamaOffsets::from_table(&dims, |name| layout.offset_of(name))?;
        let c = &self.config;
        let step = LlamaStep::new(dims, offsets, bf16_operands, c.norm_eps, c.rope_theta)?;
        Ok(Some(Box::new(TokenDirect { step })))
    }

    fn resident_step(
        &self,
        layout: &FlatLayout,
        act: (stoker_gpu::Dtype, stoker_gpu::step::options::StepOptions),
    ) -> Result<Option<Box<dyn DirectStep>>> {
        let dims = self.dims;
        let offsets = LlamaOffsets::from_table(&dims, |name| layout.offset_of(name))?;
        let c = &self.config;
        Ok(Some(super::resident::llama(
            dims,
            offsets,
            (c.norm_eps, c.rope_theta),
            act,
        )))
    }

    fn resident_run(
        &self,
        layout: &FlatLayout,
        act: stoker_gpu::Dtype,
        setup: &super::resident_run::RunSetup<'_>,
    ) -> Result<Option<Box<dyn super::resident_run::ResidentRun>>> {
        let dims = self.dims;
        let offsets = LlamaOffsets::from_table(&dims, |name| layout.offset_of(name))?
            .with_end(layout.total_len())?;
        let c = &self.config;
        super::resident::llama_run(dims, offsets, (c.norm_eps, c.rope_theta), act, setup).map(Some)
    }

    fn params(&self) -> &ParamSet {
        &self.params
    }

    /// Units: the embedding (from token ids `(B, T)`, `T <= context`), each block, then
    /// the final norm with the (untied) head: logits `(B T, vocab)`.
    fn units(&self) -> usize {
        self.blocks.len() + 2
    }

    fn unit_groups(&self, u: usize) -> Vec<usize> {
        vec![u]
    }

    fn unit_forward(&self, fx: &Fx, u: usize, x: &Tensor) -> Result<Tensor> {
        let eps = self.config.norm_eps;
        if u == 0 {
            return Ok(embedding(fx, &self.embed, x)?.to_dtype(fx.activation())?);
        }
        if let Some(blk) = self.blocks.get(u - 1) {
            let h = rms_norm(fx, x, &blk.input_norm, eps)?;
            let x = (x + self.attention(fx, blk, &h)?)?;
            let h = rms_norm(fx, &x, &blk.post_norm, eps)?;
            return Ok((&x + self.mlp(fx, blk, &h)?)?);
        }
        if u != self.blocks.len() + 1 {
            return Err(TrainError::Model(format!("the Llama has no unit {u}")));
        }
        let (bsz, t, d) = x.dims3()?;
        let x = rms_norm(fx, x, &self.norm, eps)?;
        let logits = linear(fx, "lm_head", &x.reshape((bsz * t, d))?, &self.head, None)?;
        Ok(logits.to_dtype(fx.high)?)
    }

    fn loss_kind(&self) -> LossKind {
        LossKind::Token
    }

    fn check_input(&self, shape: &[usize], dtype: &str) -> std::result::Result<(), String> {
        check_tokens(self.config.context, shape, dtype)
    }
}
