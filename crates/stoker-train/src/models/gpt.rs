//! GPT: token + position embeddings, pre-LayerNorm blocks with causal multi-head attention
//! and a GELU MLP, final LayerNorm, head tied to the token embedding.

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

use super::token_direct::TokenDirect;
use super::{DirectStep, LossKind, Model};
use crate::error::{Result, TrainError};
use crate::layout::FlatLayout;
use crate::ops::{causal_attention_qkv, embedding, gelu, layer_norm, linear};
use crate::params::{ParamBuilder, ParamSet};
use crate::precision::Fx;
use stoker_kernels::{GptDims, GptOffsets};

/// GPT size, and where its initial weights come from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GptConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Maximum context (positions).
    pub context: usize,
    /// Embedding width.
    pub d_model: usize,
    /// Number of blocks.
    pub n_layer: usize,
    /// Attention heads (must divide `d_model`).
    pub n_head: usize,
    /// Start from the weights of a Hugging Face GPT-2 directory (`config.json` +
    /// `model.safetensors`, as `stoker export hf` writes them) instead of a random
    /// initialization: fine-tuning. Its sizes must equal these.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_from: Option<std::path::PathBuf>,
}

impl GptConfig {
    /// The sizes as stoker-kernels' GPT table and direct step take them.
    pub fn dims(&self) -> GptDims {
        GptDims {
            vocab: self.vocab,
            context: self.context,
            d_model: self.d_model,
            n_layer: self.n_layer,
            n_head: self.n_head,
        }
    }

    /// Checks the sizes; the error names the key.
    pub fn validate(&self) -> std::result::Result<(), (&'static str, String)> {
        for (k, v) in [
            ("vocab", self.vocab),
            ("context", self.context),
            ("d_model", self.d_model),
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
        ] {
            if v == 0 {
                return Err((k, "must be at least 1".into()));
            }
        }
        if !self.d_model.is_multiple_of(self.n_head) {
            return Err((
                "n_head",
                format!("{} does not divide d_model {}", self.n_head, self.d_model),
            ));
        }
        Ok(())
    }
}

struct Block {
    prefix: String,
    ln1: [Tensor; 2],
    qkv: [Tensor; 2],
    proj: [Tensor; 2],
    ln2: [Tensor; 2],
    fc: [Tensor; 2],
    fc_proj: [Tensor; 2],
}

/// The GPT model.
pub struct Gpt {
    config: GptConfig,
    wte: Tensor,
    wpe: Tensor,
    blocks: Vec<Block>,
    ln_f: [Tensor; 2],
    params: ParamSet,
}

const LN_EPS: f64 = 1e-5;

impl Gpt {
    /// Declares the parameters of stoker-kernels' GPT table
    /// ([`stoker_kernels::gpt_params`]: execution order, GPT-2 initialization).
    pub fn new(
        config: GptConfig,
        device: &Device,
        dtype: candle_core::DType,
        seed: u64,
    ) -> Result<Self> {
        Self::with_builder(config, ParamBuilder::new(device.clone(), dtype, seed))
    }

    /// As [`Gpt::new`] with the values `b` gives (drawn, or a flat buffer's).
    pub fn with_builder(config: GptConfig, mut b: ParamBuilder) -> Result<Self> {
        b.params_of(&stoker_kernels::gpt_params(&config.dims()))?;
        let params = b.finish();
        let t = |name: String| -> Result<Tensor> {
            params
                .get(&name)
                .map(|p| p.var.as_tensor().clone())
                .ok_or_else(|| TrainError::Model(format!("the GPT table has no `{name}`")))
        };
        let pair = |name: &str| -> Result<[Tensor; 2]> {
            Ok([t(format!("{name}.weight"))?, t(format!("{name}.bias"))?])
        };
        let blocks = (0..config.n_layer)
            .map(|i| {
                let p = format!("h.{i}");
                Ok(Block {
                    ln1: pair(&format!("{p}.ln_1"))?,
                    qkv: pair(&format!("{p}.attn.qkv"))?,
                    proj: pair(&format!("{p}.attn.proj"))?,
                    ln2: pair(&format!("{p}.ln_2"))?,
                    fc: pair(&format!("{p}.mlp.fc"))?,
                    fc_proj: pair(&format!("{p}.mlp.proj"))?,
                    prefix: p,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Gpt {
            config,
            wte: t("wte.weight".into())?,
            wpe: t("wpe.weight".into())?,
            blocks,
            ln_f: pair("ln_f")?,
            params,
        })
    }

    /// The size config.
    pub fn config(&self) -> &GptConfig {
        &self.config
    }

    fn attention(&self, fx: &Fx, blk: &Block, x: &Tensor) -> Result<Tensor> {
        let name = format!("{}.attn", blk.prefix);
        let qkv = linear(
            fx,
            &format!("{name}.qkv"),
            x,
            &blk.qkv[0],
            Some(&blk.qkv[1]),
        )?;
        let y = causal_attention_qkv(fx, &qkv, self.config.n_head)?;
        linear(
            fx,
            &format!("{name}.proj"),
            &y,
            &blk.proj[0],
            Some(&blk.proj[1]),
        )
    }

    fn mlp(&self, fx: &Fx, blk: &Block, x: &Tensor) -> Result<Tensor> {
        let name = format!("{}.mlp", blk.prefix);
        let h = gelu(
            fx,
            &linear(fx, &format!("{name}.fc"), x, &blk.fc[0], Some(&blk.fc[1]))?,
        )?;
        linear(
            fx,
            &format!("{name}.proj"),
            &h,
            &blk.fc_proj[0],
            Some(&blk.fc_proj[1]),
        )
    }
}

impl Model for Gpt {
    fn direct_step(
        &self,
        layout: &FlatLayout,
        bf16_operands: bool,
    ) -> Result<Option<Box<dyn DirectStep>>> {
        let dims = self.config.dims();
        let offsets = GptOffsets::from_table(&dims, |name| layout.offset_of(name))?;
        let step = stoker_kernels::GptStep::new(dims, offsets, bf16_operands, LN_EPS)?;
        Ok(Some(Box::new(TokenDirect { step })))
    }

    fn resident_step(
        &self,
        layout: &FlatLayout,
        act: (stoker_gpu::Dtype, stoker_gpu::step::options::StepOptions),
    ) -> Result<Option<Box<dyn DirectStep>>> {
        let dims = self.config.dims();
        let offsets = GptOffsets::from_table(&dims, |name| layout.offset_of(name))?;
        Ok(Some(super::resident::gpt(dims, offsets, LN_EPS, act)))
    }

    fn resident_run(
        &self,
        layout: &FlatLayout,
        act: stoker_gpu::Dtype,
        setup: &super::resident_run::RunSetup<'_>,
    ) -> Result<Option<Box<dyn super::resident_run::ResidentRun>>> {
        let dims = self.config.dims();
        let offsets = GptOffsets::from_table(&dims, |name| layout.offset_of(name))?
            .with_end(layout.total_len())?;
        super::resident::gpt_run(dims, offsets, LN_EPS, act, setup).map(Some)
    }

    fn params(&self) -> &ParamSet {
        &self.params
    }

    /// Units: the embeddings (from token ids `(B, T)`, `T <= context`), each block, then
    /// the final norm with the head, which is tied to the token embedding (logits
    /// `(B T, vocab)`).
    fn units(&self) -> usize {
        self.blocks.len() + 2
    }

    fn unit_groups(&self, u: usize) -> Vec<usize> {
        match u == self.blocks.len() + 1 {
            true => vec![u, 0],
            false => vec![u],
        }
    }

    fn unit_forward(&self, fx: &Fx, u: usize, x: &Tensor) -> Result<Tensor> {
        let act = fx.activation();
        if u == 0 {
            let (_, t) = x.dims2()?;
            let tok = embedding(fx, &self.wte, x)?.to_dtype(act)?;
            let pos = self.wpe.narrow(0, 0, t)?.to_dtype(act)?;
            return Ok(tok.broadcast_add(&pos)?);
        }
        if let Some(blk) = self.blocks.get(u - 1) {
            let h = layer_norm(fx, x, &blk.ln1[0], &blk.ln1[1], LN_EPS)?;
            let x = (x + self.attention(fx, blk, &h)?)?;
            let h = layer_norm(fx, &x, &blk.ln2[0], &blk.ln2[1], LN_EPS)?;
            return Ok((&x + self.mlp(fx, blk, &h)?)?);
        }
        if u != self.blocks.len() + 1 {
            return Err(TrainError::Model(format!("the GPT has no unit {u}")));
        }
        let (bsz, t, d) = x.dims3()?;
        let x = layer_norm(fx, x, &self.ln_f[0], &self.ln_f[1], LN_EPS)?;
        let logits = linear(fx, "lm_head", &x.reshape((bsz * t, d))?, &self.wte, None)?;
        Ok(logits.to_dtype(fx.high)?)
    }

    fn loss_kind(&self) -> LossKind {
        LossKind::Token
    }

    fn check_input(&self, shape: &[usize], dtype: &str) -> std::result::Result<(), String> {
        check_tokens(self.config.context, shape, dtype)
    }
}

/// Whether a dataset field of per-sample `shape` and `dtype` holds token windows for a
/// token model of `context` positions (the check of [`Model::check_input`] for the GPT
/// and the Llama).
pub fn check_tokens(
    context: usize,
    shape: &[usize],
    dtype: &str,
) -> std::result::Result<(), String> {
    if !matches!(dtype, "u16" | "i32" | "i64") {
        return Err(format!(
            "token ids of dtype {dtype}: expected u16, i32 or i64 (a u8 array is read as \
             pixel values)"
        ));
    }
    match shape {
        [t] if *t >= 1 && *t <= context => Ok(()),
        [t] => Err(format!("windows of {t} tokens, model.context is {context}")),
        s => Err(format!("per-sample shape {s:?}, expected [context]")),
    }
}
