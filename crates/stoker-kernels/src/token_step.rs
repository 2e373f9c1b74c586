//! What a token model's step over flat buffers offers the trainer (the GPT's
//! [`GptStep`], the Llama's [`LlamaStep`]): one interface, so the trainer's direct path
//! serves both, and one place for the whole-buffer entry points both steps share.

use crate::error::KernelError;
use crate::gpt::{GptBatch, GptStep, GroupReady, StepParams, Whole};
use crate::llama::LlamaStep;

/// A training step of a token model over flat buffers.
pub trait TokenStep: Send {
    /// One past the last flat element any parameter occupies: the least length of a
    /// parameter or gradient buffer.
    fn param_end(&self) -> usize;

    /// Forward and backward of one micro-batch with each parameter group wherever
    /// `source` keeps it (ZeRO-3: gathered one block at a time): adds the gradient of
    /// `grad_scale x (summed token loss)` and returns the summed loss of the valid targets
    /// (unscaled).
    fn forward_backward_groups(
        &mut self,
        source: &mut dyn StepParams,
        batch: GptBatch,
        grad_scale: f32,
    ) -> Result<f64, KernelError>;

    /// The training forward of one micro-batch with each group wherever `source` keeps
    /// it, and the loss without its gradient: the summed loss of the valid targets, how
    /// many are the top-1 logit, and how many there are.
    fn evaluate_groups(
        &mut self,
        source: &mut dyn StepParams,
        batch: GptBatch,
    ) -> Result<(f64, usize, usize), KernelError>;

    /// Bytes of the activation and GEMM packing buffers the step holds now.
    fn activation_bytes(&self) -> usize;

    /// [`TokenStep::forward_backward_groups`] over the whole flat buffers `params` and
    /// `grads`; `ready` hears of each parameter group as its gradients become final.
    fn forward_backward(
        &mut self,
        params: &[f32],
        batch: GptBatch,
        grad_scale: f32,
        grads: &mut [f32],
        ready: GroupReady<'_>,
    ) -> Result<f64, KernelError> {
        check_len(self.param_end(), "params", params.len())?;
        check_len(self.param_end(), "grads", grads.len())?;
        let mut whole = Whole {
            params,
            grads,
            ready,
        };
        self.forward_backward_groups(&mut whole, batch, grad_scale)
    }

    /// [`TokenStep::evaluate_groups`] over the whole flat buffer `params`.
    fn evaluate(
        &mut self,
        params: &[f32],
        batch: GptBatch,
    ) -> Result<(f64, usize, usize), KernelError> {
        check_len(self.param_end(), "params", params.len())?;
        // The forward reads parameters only; no gradient buffer, nobody to tell.
        let mut no_grads: [f32; 0] = [];
        let mut nobody = |_: usize, _: &[f32]| {};
        let mut source = Whole {
            params,
            grads: &mut no_grads,
            ready: &mut nobody,
        };
        self.evaluate_groups(&mut source, batch)
    }
}

/// A flat buffer (`what`) of `len` elements must reach `end`, past every parameter.
fn check_len(end: usize, what: &'static str, len: usize) -> Result<(), KernelError> {
    match len < end {
        true => Err(KernelError::Length {
            op: "token-step",
            what,
            len,
            expected: end,
        }),
        false => Ok(()),
    }
}

macro_rules! token_step {
    ($t:ty) => {
        impl TokenStep for $t {
            fn param_end(&self) -> usize {
                self.offsets.end()
            }
            fn forward_backward_groups(
                &mut self,
                source: &mut dyn StepParams,
                batch: GptBatch,
                grad_scale: f32,
            ) -> Result<f64, KernelError> {
                <$t>::forward_backward_groups(self, source, batch, grad_scale)
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
