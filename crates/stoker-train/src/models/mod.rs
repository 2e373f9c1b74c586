//! Reference models, written with the differentiable ops of [`crate::ops`] only.
//!
//! A model declares its parameters through a [`ParamBuilder`](crate::params::ParamBuilder),
//! keeps its candle variables, and maps a batch's input field to logits `(N, classes)` in
//! the high dtype. Token models produce one row per position, classifiers one per sample.

pub mod cnn;
pub mod config;
pub mod factory;
pub mod gpt;
pub mod llama;
pub mod mlp;
pub(crate) mod resident;
pub(crate) mod resident_fp8;
pub mod resident_run;
mod token_direct;

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::layout::FlatLayout;
use crate::params::ParamSet;
use crate::precision::Fx;

pub use cnn::{Cnn, CnnConfig};
pub use config::ModelConfig;
pub use factory::{build_meta_model_on, build_model, build_model_on};
pub use gpt::{Gpt, GptConfig};
pub use llama::{Llama, LlamaConfig};
pub use mlp::{Mlp, MlpConfig};

/// Whether the loss is per target token (language models) or per sample (classifiers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LossKind {
    /// Cross-entropy per target token, normalized by the window's valid target tokens.
    Token,
    /// Cross-entropy per sample, normalized by the window's samples.
    Sample,
}

/// A trainable model.
pub trait Model {
    /// The parameters, in execution order.
    fn params(&self) -> &ParamSet;
    /// Logits `(N, classes)` in `fx.high` for a batch's input field: every unit's
    /// [`Model::unit_forward`] in turn.
    fn forward(&self, fx: &Fx, input: &Tensor) -> Result<Tensor> {
        let mut x = input.clone();
        for u in 0..self.units() {
            x = self.unit_forward(fx, u, &x)?;
        }
        Ok(x)
    }
    /// The forward as a chain of units (FSDP's wrapped modules: a layer, a block): ZeRO-3
    /// on the graph path gathers one unit's parameters at a time.
    fn units(&self) -> usize;
    /// The parameter groups unit `u` reads (the GPT's head reads the token embedding's).
    fn unit_groups(&self, u: usize) -> Vec<usize>;
    /// Unit `u`'s forward: from the batch's input field (unit 0) or the previous unit's
    /// output, to its own output (the logits, in `fx.high`, for the last unit). A model
    /// built from some groups' values alone
    /// ([`ParamBuilder::from_groups`](crate::params::ParamBuilder::from_groups)) runs the
    /// units of those groups.
    fn unit_forward(&self, fx: &Fx, u: usize, x: &Tensor) -> Result<Tensor>;
    /// Token-level or sample-level loss.
    fn loss_kind(&self) -> LossKind;
    /// Checks that a dataset's input field (per-sample shape and dtype name) fits the
    /// model; the error says which dimension does not.
    fn check_input(&self, shape: &[usize], dtype: &str) -> std::result::Result<(), String>;
    /// The model's hand-written training step over flat buffers laid out by `layout`, if
    /// it has one (`kernels = "direct"`); `bf16_operands` runs its linear layers on bf16
    /// operands. None by default: the step then goes through candle's autograd graph.
    fn direct_step(
        &self,
        _layout: &FlatLayout,
        _bf16_operands: bool,
    ) -> Result<Option<Box<dyn DirectStep>>> {
        Ok(None)
    }
    /// The model's GPU-resident step (stoker-gpu) run by its host build, over the same
    /// flat layout (`step = "resident"`), with activations `act`, made with `opts`. None
    /// by default: only the GPT and the Llama have one.
    fn resident_step(
        &self,
        _layout: &FlatLayout,
        _act: (stoker_gpu::Dtype, stoker_gpu::step::options::StepOptions),
    ) -> Result<Option<Box<dyn DirectStep>>> {
        Ok(None)
    }
    /// The model's resident loop (stoker-gpu's step, master, optimizer and reductions on
    /// one backend) of `setup` over the same flat layout, with activations `act`. None by
    /// default: only the GPT and the Llama have one.
    fn resident_run(
        &self,
        _layout: &FlatLayout,
        _act: stoker_gpu::Dtype,
        _setup: &resident_run::RunSetup<'_>,
    ) -> Result<Option<Box<dyn resident_run::ResidentRun>>> {
        Ok(None)
    }
}

/// A training step that bypasses the autograd graph: forward, loss and backward of one
/// micro-batch straight from the flat master buffer into the flat gradient buffer.
pub trait DirectStep: Send {
    /// Adds the gradient of `grad_scale x (summed loss of the valid targets)` into
    /// `grads` and returns that summed loss (unscaled); `ready` hears of each parameter
    /// group (see [`crate::params`]) as soon as its gradients are final, last group first.
    fn forward_backward(
        &mut self,
        master: &[f32],
        input: &Tensor,
        targets: &[i64],
        grad_scale: f32,
        grads: &mut [f32],
        ready: stoker_kernels::GroupReady<'_>,
    ) -> Result<f64>;

    /// As [`DirectStep::forward_backward`] with each parameter group's values and
    /// gradients wherever `source` keeps them (ZeRO-3 gathers them one at a time).
    fn forward_backward_groups(
        &mut self,
        source: &mut dyn stoker_kernels::StepParams,
        input: &Tensor,
        targets: &[i64],
        grad_scale: f32,
    ) -> Result<f64>;

    /// Bytes of the activation buffers the step holds now, counted from them.
    fn activation_bytes(&self) -> usize;

    /// Evaluates one micro-batch with the training forward (its buffers and kernels, no
    /// graph): the summed loss of the valid targets, how many are the top-1 prediction,
    /// and how many there are.
    fn evaluate(
        &mut self,
        master: &[f32],
        input: &Tensor,
        targets: &[i64],
    ) -> Result<(f64, usize, usize)>;

    /// As [`DirectStep::evaluate`] with each parameter group's values wherever `source`
    /// keeps them (ZeRO-3 gathers them one at a time, as its training step does).
    fn evaluate_groups(
        &mut self,
        source: &mut dyn stoker_kernels::StepParams,
        input: &Tensor,
        targets: &[i64],
    ) -> Result<(f64, usize, usize)>;
}
