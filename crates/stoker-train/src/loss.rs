//! Cross-entropy written with differentiable ops, returning a *sum* and a *count* so the
//! caller decides the normalization (see [`crate::accumulate`]).

use candle_core::{DType, Tensor};

use crate::error::{Result, TrainError};
use crate::ops::log_softmax_last;
use crate::precision::Fx;

/// Targets equal to this are padding / masked: they add nothing to the loss and count as
/// zero tokens (torch's `ignore_index` default).
pub const IGNORE_INDEX: i64 = -100;

/// Number of targets that are not [`IGNORE_INDEX`].
pub fn valid_count(targets: &[i64]) -> usize {
    targets.iter().filter(|&&t| t != IGNORE_INDEX).count()
}

/// `sum_i -log softmax(logits_i)[target_i]` over rows whose target is not ignored, as a
/// scalar in `fx.high`, and the number of such rows. `logits`: `(N, C)`. Fused: one pass
/// of log-softmax and pick (f32); composed: log-softmax, gather and mask.
pub fn cross_entropy_sum(fx: &Fx, logits: &Tensor, targets: &[i64]) -> Result<(Tensor, usize)> {
    let (n, c) = logits.dims2()?;
    if targets.len() != n {
        return Err(TrainError::Data {
            what: "target".into(),
            message: format!("{} targets for {n} rows of logits", targets.len()),
        });
    }
    if let Some(&bad) = targets
        .iter()
        .find(|&&t| t != IGNORE_INDEX && (t < 0 || t as usize >= c))
    {
        return Err(TrainError::Data {
            what: "target".into(),
            message: format!("class id {bad} outside 0..{c} (the model's vocab / classes)"),
        });
    }
    if fx.fused_for(logits) && fx.high == DType::F32 {
        let t = Tensor::from_slice(targets, n, logits.device())?;
        let sum = stoker_kernels::cross_entropy_sum(logits, &t, IGNORE_INDEX)?;
        return Ok((sum, valid_count(targets)));
    }
    let dev = logits.device();
    let idx: Vec<i64> = targets
        .iter()
        .map(|&t| if t == IGNORE_INDEX { 0 } else { t })
        .collect();
    let mask: Vec<f64> = targets
        .iter()
        .map(|&t| (t != IGNORE_INDEX) as u8 as f64)
        .collect();
    let idx = Tensor::from_vec(idx, (n, 1), dev)?;
    let mask = Tensor::from_vec(mask, n, dev)?.to_dtype(fx.high)?;
    let logp = log_softmax_last(fx, logits)?;
    let picked = logp.gather(&idx, 1)?.squeeze(1)?;
    let sum = (picked * mask)?.sum_all()?.neg()?;
    Ok((sum, valid_count(targets)))
}

/// Reads a scalar tensor as f64.
pub fn scalar(t: &Tensor) -> Result<f64> {
    Ok(t.to_dtype(DType::F64)?.to_scalar::<f64>()?)
}

/// What evaluation counts of one micro-batch's `(rows, classes)` logits: the summed loss of
/// the valid targets, how many of them are the top-1 logit, and how many there are.
pub fn loss_and_hits(fx: &Fx, logits: &Tensor, targets: &[i64]) -> Result<(f64, usize, usize)> {
    let (sum, count) = cross_entropy_sum(fx, logits, targets)?;
    let pred = logits.argmax(1)?.to_dtype(DType::I64)?.to_vec1::<i64>()?;
    let hits = pred.iter().zip(targets).filter(|(p, t)| p == t).count();
    Ok((scalar(&sum)?, hits, count))
}
