//! Checks after backward: every trainable parameter received a gradient, and which
//! parameter first went non-finite.
//!
//! candle's fused ops without a backward return detached tensors; a parameter behind one
//! gets no gradient and an optimizer would silently skip it. The trainer runs
//! [`every_param_has_grad`] after the first backward and fails naming the parameter.

use candle_core::backprop::GradStore;

use crate::error::{Result, TrainError};
use crate::params::ParamSet;

/// Errors with [`TrainError::NoGradient`] naming the first parameter (in name order)
/// that has no gradient in `grads`.
pub fn every_param_has_grad(grads: &GradStore, params: &ParamSet) -> Result<()> {
    for p in params.iter() {
        if grads.get(p.var.as_tensor()).is_none() {
            return Err(TrainError::NoGradient {
                name: p.name.clone(),
            });
        }
    }
    Ok(())
}
