//! RMSNorm over the last dimension with a gain (Llama's norm), with a fused backward.
//!
//! Forward saves each row's reciprocal root mean square `rstd = 1 / sqrt(mean(x^2) +
//! eps)`. With `xh = x * rstd` and `dxh = dy * w`, per row of width `D`:
//! `dx = rstd * (dxh - xh * mean(dxh * xh))`; `dw = sum_rows(dy * xh)`.

use std::sync::{Arc, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use half::bf16;
use rayon::prelude::*;

use crate::elem::{check_float, float_pair, floats, rows_per_task, Elem, FloatPair, Floats};
use crate::error::{shape_err, KernelError};
use crate::fastmath::{sum_map, sum_map3};

/// RMSNorm of `x` (`[.., D]`) with gain `weight` (`[D]`), both f32 or both bf16.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    check_float("rms-norm", x.dtype())?;
    x.contiguous()?.apply_op2(
        &weight.contiguous()?,
        RmsNorm {
            eps: eps as f32,
            rstd: OnceLock::new(),
        },
    )
}

/// The RMSNorm forward op; use [`rms_norm`].
#[derive(Debug)]
pub struct RmsNorm {
    eps: f32,
    rstd: OnceLock<Arc<Vec<f32>>>,
}

/// The row width `D`, checking that `w` is `[D]`.
fn width(op: &'static str, x: &Shape, w: &Shape) -> Result<usize> {
    match x.dims().last() {
        Some(&d) if d > 0 && w.dims() == [d] => Ok(d),
        Some(&d) if d > 0 => Err(shape_err(
            op,
            format!("weight must be [{d}], the last dim of x"),
            w,
        )),
        _ => Err(shape_err(
            op,
            "x needs rank >= 1 and a non-empty last dimension",
            x,
        )),
    }
}

/// Forward into caller buffers: `y` like `x`, each row's `rstd`.
pub(crate) fn fwd_into<T: Elem>(
    x: &[T],
    w: &[T],
    d: usize,
    eps: f32,
    y: &mut [T],
    rstd: &mut [f32],
) {
    let rows = rows_per_task(d);
    y.par_chunks_mut(rows * d)
        .zip(x.par_chunks(rows * d))
        .zip(rstd.par_chunks_mut(rows))
        .for_each(|((y, x), rstd)| {
            for ((y, x), r) in y.chunks_exact_mut(d).zip(x.chunks_exact(d)).zip(rstd) {
                let ms = sum_map(x, |v| {
                    let v = v.to_f32();
                    v * v
                }) / d as f32;
                let rs = 1.0 / (ms + eps).sqrt();
                for ((y, &x), &w) in y.iter_mut().zip(x).zip(w) {
                    *y = T::from_f32(x.to_f32() * rs * w.to_f32());
                }
                *r = rs;
            }
        });
}

fn fwd<T: Elem>(x: &[T], w: &[T], d: usize, eps: f32) -> (Vec<T>, Vec<f32>) {
    let mut y = vec![T::from_f32(0.0); x.len()];
    let mut rstd = vec![0.0f32; x.len() / d];
    fwd_into(x, w, d, eps, &mut y, &mut rstd);
    (y, rstd)
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let d = width(op, l1.shape(), l2.shape())?;
        let (out, rstd) = match float_pair(op, (s1, l1), (s2, l2))? {
            FloatPair::F32(x, w) => {
                let (y, r) = fwd(x, w, d, self.eps);
                (f32::storage(y), r)
            }
            FloatPair::BF16(x, w) => {
                let (y, r) = fwd(x, w, d, self.eps);
                (bf16::storage(y), r)
            }
        };
        // A fresh op per call: the slot is empty, so `set` cannot fail.
        let _ = self.rstd.set(Arc::new(rstd));
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let rstd = match self.rstd.get() {
            Some(r) => r.clone(),
            None => return Err(shape_err(self.name(), "backward before forward", x.shape())),
        };
        let d = w.dim(0)?;
        let nd = x.elem_count();
        let flat = x.apply_op3_no_bwd(w, &dy.contiguous()?, &RmsNormBackward { rstd })?;
        let dx = flat.narrow(0, 0, nd)?.reshape(x.shape())?;
        let dw = flat.narrow(0, nd, d)?;
        Ok((Some(dx), Some(dw)))
    }
}

/// Backward into caller buffers: `dx` written (or with `add_dx`, added to), the gain's
/// gradient added to `dw` (f32).
pub(crate) fn bwd_into<T: Elem>(
    x: &[T],
    w: &[T],
    g: &[T],
    d: usize,
    rstd: &[f32],
    (dx, add_dx): (&mut [T], bool),
    dw: &mut [f32],
) {
    let rows = rows_per_task(d);
    // Each task returns its partial dw; summed in task order so results are
    // deterministic whatever rayon's scheduling.
    let partials: Vec<Vec<f32>> = dx
        .par_chunks_mut(rows * d)
        .zip(x.par_chunks(rows * d).zip(g.par_chunks(rows * d)))
        .zip(rstd.par_chunks(rows))
        .map(|((dx, (x, g)), rstd)| {
            let mut pw = vec![0.0f32; d];
            let rows = dx
                .chunks_exact_mut(d)
                .zip(x.chunks_exact(d))
                .zip(g.chunks_exact(d));
            for (((dx, x), g), &rs) in rows.zip(rstd) {
                for ((&x, &g), pw) in x.iter().zip(g).zip(pw.iter_mut()) {
                    *pw += g.to_f32() * (x.to_f32() * rs);
                }
                let m = sum_map3(x, g, w, |x, g, w| {
                    x.to_f32() * rs * (g.to_f32() * w.to_f32())
                }) / d as f32;
                for (((dx, &x), &g), &w) in dx.iter_mut().zip(x).zip(g).zip(w) {
                    let v = rs * (g.to_f32() * w.to_f32() - x.to_f32() * rs * m);
                    *dx = T::from_f32(if add_dx { dx.to_f32() + v } else { v });
                }
            }
            pw
        })
        .collect();
    for p in &partials {
        dw.iter_mut().zip(p).for_each(|(t, &p)| *t += p);
    }
}

fn bwd<T: Elem>(x: &[T], w: &[T], g: &[T], d: usize, rstd: &[f32]) -> Vec<T> {
    let nd = x.len();
    let mut out = vec![T::from_f32(0.0); nd + d];
    let (dx, dw_out) = out.split_at_mut(nd);
    let mut dw = vec![0.0f32; d];
    bwd_into(x, w, g, d, rstd, (dx, false), &mut dw);
    dw_out
        .iter_mut()
        .zip(&dw)
        .for_each(|(o, &t)| *o = T::from_f32(t));
    out
}

/// RMSNorm's backward as one fused op over `(x, weight, dy)` with the saved `rstd`.
/// Returns `[dx (flattened), dweight]` in one buffer of `N*D + D`.
#[derive(Debug)]
pub struct RmsNormBackward {
    rstd: Arc<Vec<f32>>,
}

impl CustomOp3 for RmsNormBackward {
    fn name(&self) -> &'static str {
        "rms-norm-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let d = width(op, l1.shape(), l2.shape())?;
        if l3.shape() != l1.shape() || self.rstd.len() * d != l1.shape().elem_count() {
            return Err(shape_err(
                op,
                format!("grad {:?} or saved rstd do not match x", l3.shape()),
                l1.shape(),
            ));
        }
        let out = match (
            floats(op, s1, l1)?,
            floats(op, s2, l2)?,
            floats(op, s3, l3)?,
        ) {
            (Floats::F32(x), Floats::F32(w), Floats::F32(g)) => {
                f32::storage(bwd(x, w, g, d, &self.rstd))
            }
            (Floats::BF16(x), Floats::BF16(w), Floats::BF16(g)) => {
                bf16::storage(bwd(x, w, g, d, &self.rstd))
            }
            _ => {
                return Err(KernelError::DType {
                    op,
                    dtype: s2.dtype(),
                    extra: ", the same for x, weight and dy",
                }
                .into())
            }
        };
        Ok((out, Shape::from(l1.shape().elem_count() + d)))
    }
}
