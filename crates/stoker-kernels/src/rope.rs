//! Rotary position embeddings (RoPE) in transformers' layout: within each head of width
//! `D`, element `i < D/2` turns with element `i + D/2` by the angle `t * base^(-2i/D)` at
//! position `t`. The backward is the same rotation by the opposite angle.
//!
//! The op reads `[B, T, H, D]` (a projection reshaped into heads, before any transpose)
//! and counts positions from 0 along `T`.

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::elem::{check_float, floats, Elem, Floats};
use crate::error::shape_err;

/// `x` `[B, T, H, D]` (f32 or bf16, `D` even) with rotary embeddings of `base` applied.
pub fn rope(x: &Tensor, base: f64) -> Result<Tensor> {
    check_float("rope", x.dtype())?;
    x.contiguous()?.apply_op1(Rope {
        base,
        inverse: false,
    })
}

/// The rotary op; use [`rope`]. `inverse` turns by the opposite angle (the backward).
#[derive(Debug, Clone, Copy)]
pub struct Rope {
    base: f64,
    inverse: bool,
}

/// `cos` and `sin` of every position's angle per frequency: `[T, D/2]` each. Angles are
/// computed in f64 and rounded once. (The GPU's rope kernel takes these same tables.)
pub fn tables(t: usize, d: usize, base: f64) -> (Vec<f32>, Vec<f32>) {
    let half = d / 2;
    let mut cos = Vec::with_capacity(t * half);
    let mut sin = Vec::with_capacity(t * half);
    for pos in 0..t {
        for i in 0..half {
            let angle = pos as f64 * base.powf(-2.0 * i as f64 / d as f64);
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    (cos, sin)
}

/// Rotates `x` `[B, T, H, D]` in place by each position's angles (`sign` -1: backward).
pub(crate) fn rotate<T: Elem>(
    x: &mut [T],
    (t, h, d): (usize, usize, usize),
    cs: (&[f32], &[f32]),
    sign: f32,
) {
    let half = d / 2;
    x.par_chunks_mut(h * d).enumerate().for_each(|(row, x)| {
        let pos = row % t;
        let (cos, sin) = (&cs.0[pos * half..][..half], &cs.1[pos * half..][..half]);
        for head in x.chunks_exact_mut(d) {
            let (a, b) = head.split_at_mut(half);
            for (((a, b), &c), &s) in a.iter_mut().zip(b.iter_mut()).zip(cos).zip(sin) {
                let (xa, xb, s) = (a.to_f32(), b.to_f32(), sign * s);
                *a = T::from_f32(xa * c - xb * s);
                *b = T::from_f32(xb * c + xa * s);
            }
        }
    });
}

impl CustomOp1 for Rope {
    fn name(&self) -> &'static str {
        "rope"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let (t, h, d) = match l.shape().dims() {
            &[_, t, h, d] if d % 2 == 0 && d > 0 => (t, h, d),
            _ => {
                return Err(shape_err(
                    op,
                    "x must be [B, T, H, D] with D even",
                    l.shape(),
                ))
            }
        };
        let (cos, sin) = tables(t, d, self.base);
        let sign = if self.inverse { -1.0 } else { 1.0 };
        let out = match floats(op, s, l)? {
            Floats::F32(x) => {
                let mut y = x.to_vec();
                rotate(&mut y, (t, h, d), (&cos, &sin), sign);
                f32::storage(y)
            }
            Floats::BF16(x) => {
                let mut y = x.to_vec();
                rotate(&mut y, (t, h, d), (&cos, &sin), sign);
                half::bf16::storage(y)
            }
        };
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        let back = Rope {
            base: self.base,
            inverse: !self.inverse,
        };
        Ok(Some(dy.contiguous()?.apply_op1_no_bwd(&back)?))
    }
}
