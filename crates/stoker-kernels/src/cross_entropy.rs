//! Cross-entropy from logits, fused with log-softmax, summed over valid tokens.
//!
//! Returns the SUM of token losses over rows whose target is not the ignore index;
//! the caller divides by the valid-token count of its whole accumulation window (see
//! [`valid_token_count`]), which is what makes gradient accumulation exact. Forward
//! saves each row's log-sum-exp; backward is `(softmax - onehot) * grad` for valid
//! rows and 0 for ignored ones, in one pass.

use std::sync::{Arc, OnceLock};

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use half::bf16;
use rayon::prelude::*;

use crate::elem::{check_float, floats, rows_per_task, targets, Elem, Floats, Targets};
use crate::error::{shape_err, KernelError};
use crate::fastmath::{exp, max_map, sum_map};

/// Sum of token cross-entropies of `logits` `[N, V]` (f32 or bf16) against `targets`
/// `[N]` (u32 or i64), skipping rows whose target is `ignore_index`. An f32 scalar.
pub fn cross_entropy_sum(logits: &Tensor, targets: &Tensor, ignore_index: i64) -> Result<Tensor> {
    check_float("cross-entropy", logits.dtype())?;
    logits.contiguous()?.apply_op2(
        &targets.contiguous()?,
        CrossEntropy {
            ignore: ignore_index,
            lse: OnceLock::new(),
        },
    )
}

/// Number of targets that are not `ignore_index`: the divisor of the summed loss.
/// Sum it over every micro-batch of an accumulation window (and every rank).
pub fn valid_token_count(targets: &Tensor, ignore_index: i64) -> Result<usize> {
    let t = targets
        .flatten_all()?
        .to_dtype(DType::I64)?
        .to_vec1::<i64>()?;
    Ok(t.iter().filter(|&&t| t != ignore_index).count())
}

/// The cross-entropy forward op; use [`cross_entropy_sum`].
#[derive(Debug)]
pub struct CrossEntropy {
    ignore: i64,
    lse: OnceLock<Arc<Vec<f32>>>,
}

/// `(N, V)`, checking shapes and every target up front (so the row loops cannot fail).
fn check(
    op: &'static str,
    ls: &Shape,
    ts: &Shape,
    t: &Targets,
    ignore: i64,
) -> Result<(usize, usize)> {
    let (n, v) = match ls.dims() {
        &[n, v] if v > 0 => (n, v),
        _ => return Err(shape_err(op, "logits must be [N, V] with V > 0", ls)),
    };
    if ts.dims() != [n] {
        return Err(shape_err(
            op,
            format!("targets must be [{n}], one per logits row"),
            ts,
        ));
    }
    for row in 0..n {
        let target = t.get(row);
        if target != ignore && !(0..v as i64).contains(&target) {
            return Err(KernelError::Target {
                op,
                row,
                target,
                vocab: v,
                ignore,
            }
            .into());
        }
    }
    Ok((n, v))
}

/// Per row: log-sum-exp, and the loss `lse - logit[target]` (0 if ignored).
fn fwd<T: Elem>(x: &[T], t: &Targets, v: usize, ignore: i64) -> (f32, Vec<f32>) {
    let n = x.len() / v;
    let mut lse = vec![0.0f32; n];
    let rows = rows_per_task(v);
    // Partial sums in f64, one per task, added in task order: deterministic.
    let partials: Vec<f64> = lse
        .par_chunks_mut(rows)
        .zip(x.par_chunks(rows * v))
        .enumerate()
        .map(|(task, (lse, x))| {
            let mut sum = 0.0f64;
            for (r, (lse, x)) in lse.iter_mut().zip(x.chunks_exact(v)).enumerate() {
                let max = max_map(x, T::to_f32);
                let s = sum_map(x, |v| exp(v.to_f32() - max));
                *lse = max + s.ln();
                let target = t.get(task * rows + r);
                if target != ignore {
                    sum += (*lse - x[target as usize].to_f32()) as f64;
                }
            }
            sum
        })
        .collect();
    (partials.iter().sum::<f64>() as f32, lse)
}

/// Loss and gradient in one pass over f32 `logits` `[n, v]`, in place: returns the
/// summed loss of rows whose target is not `ignore` (per-task f64 partials added in
/// order) and overwrites `logits` with `scale * (softmax - onehot)`, 0 on ignored rows.
pub(crate) fn loss_and_grad_in_place(
    logits: &mut [f32],
    targets: &[i64],
    v: usize,
    ignore: i64,
    scale: f32,
) -> f64 {
    let rows = rows_per_task(v);
    let partials: Vec<f64> = logits
        .par_chunks_mut(rows * v)
        .zip(targets.par_chunks(rows))
        .map(|(x, t)| {
            let mut sum = 0.0f64;
            for (x, &target) in x.chunks_exact_mut(v).zip(t) {
                if target == ignore {
                    x.fill(0.0);
                    continue;
                }
                let max = max_map(x, |v| v);
                let s = sum_map(x, |v| exp(v - max));
                let lse = max + s.ln();
                let k = target as usize;
                sum += (lse - x[k]) as f64;
                x.iter_mut().for_each(|x| *x = scale * exp(*x - lse));
                x[k] -= scale;
            }
            sum
        })
        .collect();
    partials.iter().sum()
}

/// Loss and hits over f32 `logits` `[n, v]` without a gradient: the summed loss of rows
/// whose target is not `ignore` (per-task f64 partials added in order, as
/// [`loss_and_grad_in_place`]), how many of them have their target as the first largest
/// logit (top-1, as `argmax`), and how many rows counted.
pub(crate) fn loss_and_hits(
    logits: &[f32],
    targets: &[i64],
    v: usize,
    ignore: i64,
) -> (f64, usize, usize) {
    let rows = rows_per_task(v);
    let partials: Vec<(f64, usize, usize)> = logits
        .par_chunks(rows * v)
        .zip(targets.par_chunks(rows))
        .map(|(x, t)| {
            let (mut sum, mut hits, mut count) = (0.0f64, 0usize, 0usize);
            for (x, &target) in x.chunks_exact(v).zip(t) {
                if target == ignore {
                    continue;
                }
                let max = max_map(x, |v| v);
                let s = sum_map(x, |v| exp(v - max));
                let k = target as usize;
                sum += (max + s.ln() - x[k]) as f64;
                // First index of the largest logit; NaN never equals it.
                let best = x.iter().position(|&l| l == max);
                hits += usize::from(best == Some(k));
                count += 1;
            }
            (sum, hits, count)
        })
        .collect();
    partials
        .iter()
        .fold((0.0, 0, 0), |a, p| (a.0 + p.0, a.1 + p.1, a.2 + p.2))
}

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        "cross-entropy"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let t = targets(op, s2, l2)?;
        let (_, v) = check(op, l1.shape(), l2.shape(), &t, self.ignore)?;
        let (loss, lse) = match floats(op, s1, l1)? {
            Floats::F32(x) => fwd(x, &t, v, self.ignore),
            Floats::BF16(x) => fwd(x, &t, v, self.ignore),
        };
        let _ = self.lse.set(Arc::new(lse));
        Ok((CpuStorage::F32(vec![loss]), Shape::from(())))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _loss: &Tensor,
        dloss: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let scale = dloss.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        let lse = match self.lse.get() {
            Some(l) => l.clone(),
            None => {
                return Err(shape_err(
                    self.name(),
                    "backward before forward",
                    logits.shape(),
                ))
            }
        };
        let back = CrossEntropyBackward {
            ignore: self.ignore,
            scale,
            lse,
        };
        Ok((Some(logits.apply_op2_no_bwd(targets, &back)?), None))
    }
}

/// Cross-entropy's backward as one pass over `(logits, targets)`:
/// `dlogits = scale * (softmax(logits) - onehot(target))`, 0 on ignored rows.
#[derive(Debug)]
pub struct CrossEntropyBackward {
    ignore: i64,
    scale: f32,
    lse: Arc<Vec<f32>>,
}

fn bwd<T: Elem>(x: &[T], t: &Targets, v: usize, b: &CrossEntropyBackward) -> Vec<T> {
    let mut dx = vec![T::from_f32(0.0); x.len()];
    let rows = rows_per_task(v);
    dx.par_chunks_mut(rows * v)
        .zip(x.par_chunks(rows * v))
        .zip(b.lse.par_chunks(rows))
        .enumerate()
        .for_each(|(task, ((dx, x), lse))| {
            for (r, ((dx, x), &lse)) in dx
                .chunks_exact_mut(v)
                .zip(x.chunks_exact(v))
                .zip(lse)
                .enumerate()
            {
                let target = t.get(task * rows + r);
                if target == b.ignore {
                    continue; // already zero
                }
                for (dx, &x) in dx.iter_mut().zip(x) {
                    *dx = T::from_f32(b.scale * exp(x.to_f32() - lse));
                }
                let k = target as usize;
                dx[k] = T::from_f32(b.scale * (exp(x[k].to_f32() - lse) - 1.0));
            }
        });
    dx
}

impl CustomOp2 for CrossEntropyBackward {
    fn name(&self) -> &'static str {
        "cross-entropy-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let t = targets(op, s2, l2)?;
        let (n, v) = check(op, l1.shape(), l2.shape(), &t, self.ignore)?;
        if self.lse.len() != n || t.len() != n {
            return Err(shape_err(
                op,
                "saved log-sum-exp does not match the logits",
                l1.shape(),
            ));
        }
        let out = match floats(op, s1, l1)? {
            Floats::F32(x) => f32::storage(bwd(x, &t, v, self)),
            Floats::BF16(x) => bf16::storage(bwd(x, &t, v, self)),
        };
        Ok((out, l1.shape().clone()))
    }
}
