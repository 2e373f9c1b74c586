//! The direct training step of a token model (the GPT's, the Llama's): stoker-kernels'
//! step over flat buffers ([`TokenStep`]) at the parameters' offsets in the flat layout,
//! fed the batch's token ids.

use candle_core::Tensor;

use super::DirectStep;
use crate::error::Result;
use crate::loss::IGNORE_INDEX;
use stoker_kernels::{GptBatch, TokenStep};

/// A token model's direct step.
pub(crate) struct TokenDirect<S: TokenStep> {
    pub(crate) step: S,
}

/// The batch of token ids `input` `(B, T)` and `targets`, as the kernels take it.
fn batch<'a>(tokens: &'a [i64], input: &Tensor, targets: &'a [i64]) -> Result<GptBatch<'a>> {
    let (batch, t) = input.dims2()?;
    Ok(GptBatch {
        tokens,
        targets,
        batch,
        t,
        ignore: IGNORE_INDEX,
    })
}

fn token_ids(input: &Tensor) -> Result<Vec<i64>> {
    Ok(crate::ops::ids_i64(input)?
        .flatten_all()?
        .to_vec1::<i64>()?)
}

impl<S: TokenStep> DirectStep for TokenDirect<S> {
    fn forward_backward(
        &mut self,
        master: &[f32],
        input: &Tensor,
        targets: &[i64],
        grad_scale: f32,
        grads: &mut [f32],
        ready: stoker_kernels::GroupReady<'_>,
    ) -> Result<f64> {
        let tokens = token_ids(input)?;
        let b = batch(&tokens, input, targets)?;
        Ok(self
            .step
            .forward_backward(master, b, grad_scale, grads, ready)?)
    }

    fn forward_backward_groups(
        &mut self,
        source: &mut dyn stoker_kernels::StepParams,
        input: &Tensor,
        targets: &[i64],
        grad_scale: f32,
    ) -> Result<f64> {
        let tokens = token_ids(input)?;
        let b = batch(&tokens, input, targets)?;
        Ok(self.step.forward_backward_groups(source, b, grad_scale)?)
    }

    fn activation_bytes(&self) -> usize {
        self.step.activation_bytes()
    }

    fn evaluate(
        &mut self,
        master: &[f32],
        input: &Tensor,
        targets: &[i64],
    ) -> Result<(f64, usize, usize)> {
        let tokens = token_ids(input)?;
        let b = batch(&tokens, input, targets)?;
        Ok(self.step.evaluate(master, b)?)
    }

    fn evaluate_groups(
        &mut self,
        source: &mut dyn stoker_kernels::StepParams,
        input: &Tensor,
        targets: &[i64],
    ) -> Result<(f64, usize, usize)> {
        let tokens = token_ids(input)?;
        let b = batch(&tokens, input, targets)?;
        Ok(self.step.evaluate_groups(source, b)?)
    }
}
