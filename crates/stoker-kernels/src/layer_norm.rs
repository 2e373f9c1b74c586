//! Layer norm over the last dimension with weight and bias, with a fused backward.
//!
//! Forward saves each row's mean and reciprocal std (`rstd`), so backward reads `x`
//! once more and never recomputes the statistics. With `xh = (x - mean) * rstd` and
//! `dxh = dy * w`, per row of width `D`:
//! `dx = rstd * (dxh - mean(dxh) - xh * mean(dxh * xh))`; `dw = sum_rows(dy * xh)`,
//! `db = sum_rows(dy)`.

use std::sync::{Arc, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};
use half::bf16;
use rayon::prelude::*;

use crate::elem::{check_float, floats, rows_per_task, Elem, Floats};
use crate::error::{shape_err, KernelError};
use crate::fastmath::{sum_map, sum_map2, sum_map3};

/// Layer norm of `x` (`[.., D]`) with `weight` and `bias` (`[D]`), all f32 or all bf16.
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    check_float("layer-norm", x.dtype())?;
    x.contiguous()?.apply_op3(
        &weight.contiguous()?,
        &bias.contiguous()?,
        LayerNorm {
            eps: eps as f32,
            stats: OnceLock::new(),
        },
    )
}

/// Per-row statistics saved by the forward pass.
#[derive(Debug)]
pub struct Stats {
    /// Row means.
    pub mean: Vec<f32>,
    /// Row reciprocal standard deviations `1 / sqrt(var + eps)`.
    pub rstd: Vec<f32>,
}

/// The layer-norm forward op; use [`layer_norm`].
#[derive(Debug)]
pub struct LayerNorm {
    eps: f32,
    stats: OnceLock<Arc<Stats>>,
}

/// The row width `D`, checking that `w` and `b` are `[D]`.
fn width(op: &'static str, x: &Shape, w: &Shape, b: &Shape) -> Result<usize> {
    let d = match x.dims().last() {
        Some(&d) if d > 0 => d,
        _ => {
            return Err(shape_err(
                op,
                "x needs rank >= 1 and a non-empty last dimension",
                x,
            ))
        }
    };
    for (name, s) in [("weight", w), ("bias", b)] {
        if s.dims() != [d] {
            return Err(shape_err(
                op,
                format!("{name} must be [{d}], the last dim of x"),
                s,
            ));
        }
    }
    Ok(d)
}

fn fwd<T: Elem>(x: &[T], w: &[T], b: &[T], d: usize, eps: f32) -> (Vec<T>, Stats) {
    let n = x.len() / d;
    let mut y = vec![T::from_f32(0.0); x.len()];
    let (mut mean, mut rstd) = (vec![0.0f32; n], vec![0.0f32; n]);
    fwd_into(x, w, b, d, eps, &mut y, (&mut mean, &mut rstd));
    (y, Stats { mean, rstd })
}

/// Forward into caller buffers: `y` like `x`, each row's mean and reciprocal std.
pub(crate) fn fwd_into<T: Elem>(
    x: &[T],
    w: &[T],
    b: &[T],
    d: usize,
    eps: f32,
    y: &mut [T],
    (mean, rstd): (&mut [f32], &mut [f32]),
) {
    let rows = rows_per_task(d);
    y.par_chunks_mut(rows * d)
        .zip(x.par_chunks(rows * d))
        .zip(mean.par_chunks_mut(rows).zip(rstd.par_chunks_mut(rows)))
        .for_each(|((y, x), (mean, rstd))| {
            for (((y, x), m), r) in y
                .chunks_exact_mut(d)
                .zip(x.chunks_exact(d))
                .zip(mean)
                .zip(rstd)
            {
                let mu = sum_map(x, T::to_f32) / d as f32;
                let var = sum_map(x, |v| {
                    let c = v.to_f32() - mu;
                    c * c
                }) / d as f32;
                let rs = 1.0 / (var + eps).sqrt();
                for (((y, &x), &w), &b) in y.iter_mut().zip(x).zip(w).zip(b) {
                    *y = T::from_f32((x.to_f32() - mu) * rs * w.to_f32() + b.to_f32());
                }
                (*m, *r) = (mu, rs);
            }
        });
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "layer-norm"
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
        let d = width(op, l1.shape(), l2.shape(), l3.shape())?;
        let (out, stats) = match (
            floats(op, s1, l1)?,
            floats(op, s2, l2)?,
            floats(op, s3, l3)?,
        ) {
            (Floats::F32(x), Floats::F32(w), Floats::F32(b)) => {
                let (y, s) = fwd(x, w, b, d, self.eps);
                (f32::storage(y), s)
            }
            (Floats::BF16(x), Floats::BF16(w), Floats::BF16(b)) => {
                let (y, s) = fwd(x, w, b, d, self.eps);
                (bf16::storage(y), s)
            }
            _ => return Err(mixed(op, s1, s2, s3)),
        };
        // A fresh op per call: the slot is empty, so `set` cannot fail.
        let _ = self.stats.set(Arc::new(stats));
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let stats = match self.stats.get() {
            Some(s) => s.clone(),
            None => return Err(shape_err(self.name(), "backward before forward", x.shape())),
        };
        let d = w.dim(0)?;
        let nd = x.elem_count();
        let flat = x.apply_op3_no_bwd(w, &dy.contiguous()?, &LayerNormBackward { stats })?;
        let dx = flat.narrow(0, 0, nd)?.reshape(x.shape())?;
        let dw = flat.narrow(0, nd, d)?;
        let db = flat.narrow(0, nd + d, d)?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

fn mixed(
    op: &'static str,
    s1: &CpuStorage,
    s2: &CpuStorage,
    s3: &CpuStorage,
) -> candle_core::Error {
    let dtype = [s2, s3]
        .iter()
        .map(|s| s.dtype())
        .find(|&t| t != s1.dtype())
        .unwrap_or(s1.dtype());
    KernelError::DType {
        op,
        dtype,
        extra: ", the same for x, weight and bias",
    }
    .into()
}

/// Layer norm's backward as one fused op over `(x, weight, dy)` using the saved
/// statistics. Returns `[dx (flattened), dweight, dbias]` in one buffer of `N*D + 2*D`.
#[derive(Debug)]
pub struct LayerNormBackward {
    stats: Arc<Stats>,
}

fn bwd<T: Elem>(x: &[T], w: &[T], g: &[T], d: usize, st: &Stats) -> Vec<T> {
    let nd = x.len();
    let mut out = vec![T::from_f32(0.0); nd + 2 * d];
    let (dx, dwb) = out.split_at_mut(nd);
    let mut total = vec![0.0f32; 2 * d];
    let (tw, tb) = total.split_at_mut(d);
    bwd_into(x, w, g, d, (&st.mean, &st.rstd), dx, false, (tw, tb));
    dwb.iter_mut()
        .zip(&total)
        .for_each(|(o, &t)| *o = T::from_f32(t));
    out
}

/// Backward into caller buffers: `dx` written (or with `add_dx`, added to), the weight
/// and bias gradients added to `dw`, `db` (f32).
#[allow(clippy::too_many_arguments)]
pub(crate) fn bwd_into<T: Elem>(
    x: &[T],
    w: &[T],
    g: &[T],
    d: usize,
    (mean, rstd): (&[f32], &[f32]),
    dx: &mut [T],
    add_dx: bool,
    (dw, db): (&mut [f32], &mut [f32]),
) {
    let rows = rows_per_task(d);
    // Each task returns its partial [dw, db]; summed in task order so results are
    // deterministic whatever rayon's scheduling.
    let partials: Vec<Vec<f32>> = dx
        .par_chunks_mut(rows * d)
        .zip(x.par_chunks(rows * d).zip(g.par_chunks(rows * d)))
        .zip(mean.par_chunks(rows).zip(rstd.par_chunks(rows)))
        .map(|((dx, (x, g)), (mean, rstd))| {
            let mut acc = vec![0.0f32; 2 * d];
            let (pw, pb) = acc.split_at_mut(d);
            let rows = dx
                .chunks_exact_mut(d)
                .zip(x.chunks_exact(d))
                .zip(g.chunks_exact(d));
            for (((dx, x), g), (&mu, &rs)) in rows.zip(mean.iter().zip(rstd)) {
                let dwb = pw.iter_mut().zip(pb.iter_mut());
                for ((&x, &g), (pw, pb)) in x.iter().zip(g).zip(dwb) {
                    let g = g.to_f32();
                    *pw += g * ((x.to_f32() - mu) * rs);
                    *pb += g;
                }
                let s1 = sum_map2(g, w, |g, w| g.to_f32() * w.to_f32());
                let s2 = sum_map3(x, g, w, |x, g, w| {
                    (x.to_f32() - mu) * rs * (g.to_f32() * w.to_f32())
                });
                let (m1, m2) = (s1 / d as f32, s2 / d as f32);
                for (((dx, &x), &g), &w) in dx.iter_mut().zip(x).zip(g).zip(w) {
                    let xh = (x.to_f32() - mu) * rs;
                    let dxh = g.to_f32() * w.to_f32();
                    let v = rs * (dxh - m1 - xh * m2);
                    *dx = T::from_f32(if add_dx { dx.to_f32() + v } else { v });
                }
            }
            acc
        })
        .collect();
    for p in &partials {
        dw.iter_mut().zip(&p[..d]).for_each(|(t, &p)| *t += p);
        db.iter_mut().zip(&p[d..]).for_each(|(t, &p)| *t += p);
    }
}

impl CustomOp3 for LayerNormBackward {
    fn name(&self) -> &'static str {
        "layer-norm-backward"
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
        let d = width(op, l1.shape(), l2.shape(), l2.shape())?;
        if l3.shape() != l1.shape() || self.stats.mean.len() * d != l1.shape().elem_count() {
            return Err(shape_err(
                op,
                format!("grad {:?} or saved stats do not match x", l3.shape()),
                l1.shape(),
            ));
        }
        let out = match (
            floats(op, s1, l1)?,
            floats(op, s2, l2)?,
            floats(op, s3, l3)?,
        ) {
            (Floats::F32(x), Floats::F32(w), Floats::F32(g)) => {
                f32::storage(bwd(x, w, g, d, &self.stats))
            }
            (Floats::BF16(x), Floats::BF16(w), Floats::BF16(g)) => {
                bf16::storage(bwd(x, w, g, d, &self.stats))
            }
            _ => return Err(mixed(op, s1, s2, s3)),
        };
        Ok((out, Shape::from(l1.shape().elem_count() + 2 * d)))
    }
}
