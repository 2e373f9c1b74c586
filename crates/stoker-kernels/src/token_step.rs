//! What a token model's step over flat buffers offers the trainer (the GPT's
//! [`GptStep`], the Llama's [`LlamaStep`]): one interface, so the trainer's direct path
//! serves both.

use crate::error::KernelError;
use crate::gpt::{GptBatch, GptStep, GroupReady, StepParams};
use crate::llama::LlamaStep;

/// A training step of a token model over flat buffers.
pub trait TokenStep: Send {
    /// Forward and backward of one micro-batch into the flat `grads`; the summed loss.
    fn forward_backward(
        &mut self,
        params: &[f32],
        batch: GptBatch,
        grad_scale: f32,
        grads: &mut [f32],
        ready: GroupReady<'_>,
    ) -> Result<f64, KernelError>;
    /// As [`TokenStep::forward_backward`] with each group wherever `source` keeps it.
    fn forward_backward_groups(
        &mut self,
        source: &mut dyn StepParams,
        batch: GptBatch,
        grad_scale: f32,
    ) -> Result<f64, KernelError>;
    /// Summed loss, top-1 hits and valid targets of one micro-batch.
    fn evaluate(
        &mut self,
        params: &[f32],
        batch: GptBatch,
    ) -> Result<(f64, usize, usize), KernelError>;
    /// As [`TokenStep::evaluate`] with each group wherever `source` keeps it.
    fn evaluate_groups(
        &mut self,
        source: &mut dyn StepParams,
        batch: GptBatch,
    ) -> Result<(f64, usize, usize), KernelError>;
    /// Bytes of the activation buffers held now.
    fn activation_bytes(&self) -> usize;
}

macro_rules! token_step {
    ($t:ty) => {
        impl TokenStep for $t {
            fn forward_backward(
                &mut self,
                params: &[f32],
                batch: GptBatch,
                grad_scale: f32,
                grads: &mut [f32],
                ready: GroupReady<'_>,
            ) -> Result<f64, KernelError> {
                <$t>::forward_backward(self, params, batch, grad_scale, grads, ready)
            }
            fn forward_backward_groups(
                &mut self,
                source: &mut dyn StepParams,
                batch: GptBatch,
                grad_scale: f32,
            ) -> Result<f64, KernelError> {
                <$t>::forward_backward_groups(self, source, batch, grad_scale)
            }
            fn evaluate(
                &mut self,
                params: &[f32],
                batch: GptBatch,
            ) -> Result<(f64, usize, usize), KernelError> {
                <$t>::evaluate(self, params, batch)
            }
            fn evaluate_groups(
                &mut self,
                source: &mut dyn StepParams,
                batch: GptBatch,
            ) -> Result<(f64, usize, usize), KernelError> {
                <$t>::evaluate_groups(self, source, batch)
            }
            fn activation_bytes(&self) -> usize {
                <$t>::activation_bytes(self)
            }
        }
    };
}

token_step!(GptStep);
token_step!(LlamaStep);
