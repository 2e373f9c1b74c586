//! Softmax over the last dimension, with a fused backward.
//!
//! Forward per row: max, `exp(x - max)` written straight into the output, sum, scale.
//! Backward per row from the saved output `y`: `dx = y * (dy - sum(dy * y))`.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::elem::{check_float, float_pair, floats, rows_per_task, Elem, FloatPair, Floats};
use crate::error::shape_err;
use crate::fastmath::{exp, max_map, sum_map, sum_map2};

/// Softmax over the last dimension of `x` (rank >= 1, f32 or bf16), differentiable.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    check_float("softmax", x.dtype())?;
    x.contiguous()?.apply_op1(Softmax)
}

/// The softmax forward op; use [`softmax_last_dim`].
#[derive(Debug, Clone, Copy)]
pub struct Softmax;

fn last_dim(op: &'static str, shape: &Shape) -> Result<usize> {
    match shape.dims().last() {
        Some(&d) if d > 0 => Ok(d),
        _ => Err(shape_err(
            op,
            "needs rank >= 1 and a non-empty last dimension",
            shape,
        )),
    }
}

fn fwd<T: Elem>(x: &[T], d: usize) -> Vec<T> {
    let mut y = vec![T::from_f32(0.0); x.len()];
    let rows = rows_per_task(d) * d;
    y.par_chunks_mut(rows)
        .zip(x.par_chunks(rows))
        .for_each(|(y, x)| {
            for (y, x) in y.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
                let max = max_map(x, T::to_f32);
                if T::EXACT {
                    // f32: keep the exponentials in the output, no second exp.
                    for (y, &x) in y.iter_mut().zip(x) {
                        *y = T::from_f32(exp(x.to_f32() - max));
                    }
                    let inv = 1.0 / sum_map(y, T::to_f32);
                    for y in y.iter_mut() {
                        *y = T::from_f32(y.to_f32() * inv);
                    }
                } else {
                    // bf16: rounding the exponentials before scaling would cost accuracy.
                    let inv = 1.0 / sum_map(x, |x| exp(x.to_f32() - max));
                    for (y, &x) in y.iter_mut().zip(x) {
                        *y = T::from_f32(exp(x.to_f32() - max) * inv);
                    }
                }
            }
        });
    y
}

fn bwd<T: Elem>(y: &[T], g: &[T], d: usize) -> Vec<T> {
    let mut dx = vec![T::from_f32(0.0); y.len()];
    let rows = rows_per_task(d) * d;
    dx.par_chunks_mut(rows)
        .zip(y.par_chunks(rows).zip(g.par_chunks(rows)))
        .for_each(|(dx, (y, g))| {
            for ((dx, y), g) in dx
                .chunks_exact_mut(d)
                .zip(y.chunks_exact(d))
                .zip(g.chunks_exact(d))
            {
                let dot = sum_map2(y, g, |y, g| y.to_f32() * g.to_f32());
                for ((dx, &y), &g) in dx.iter_mut().zip(y).zip(g) {
                    *dx = T::from_f32(y.to_f32() * (g.to_f32() - dot));
                }
            }
        });
    dx
}

impl CustomOp1 for Softmax {
    fn name(&self) -> &'static str {
        "softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let d = last_dim(self.name(), l.shape())?;
        let out = match floats(self.name(), s, l)? {
            Floats::F32(x) => f32::storage(fwd(x, d)),
            Floats::BF16(x) => half::bf16::storage(fwd(x, d)),
        };
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, y: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        let dy = dy.contiguous()?;
        Ok(Some(y.apply_op2_no_bwd(&dy, &SoftmaxBackward)?))
    }
}

/// Softmax's backward as one fused pass over `(y, dy)`.
#[derive(Debug, Clone, Copy)]
pub struct SoftmaxBackward;

impl CustomOp2 for SoftmaxBackward {
    fn name(&self) -> &'static str {
        "softmax-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if l1.shape() != l2.shape() {
            return Err(shape_err(
                self.name(),
                format!("grad shape {:?} differs from y", l2.shape()),
                l1.shape(),
            ));
        }
        let d = last_dim(self.name(), l1.shape())?;
        let out = match float_pair(self.name(), (s1, l1), (s2, l2))? {
            FloatPair::F32(y, g) => f32::storage(bwd(y, g, d)),
            FloatPair::BF16(y, g) => half::bf16::storage(bwd(y, g, d)),
        };
        Ok((out, l1.shape().clone()))
    }
}
