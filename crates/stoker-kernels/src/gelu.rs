//! GELU, tanh approximation (GPT-2's): `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
//!
//! Forward is one pass over `x`; backward is one pass over `(x, dy)` computing
//! `dx = dy * gelu'(x)` with the tanh recomputed (cheaper than saving it).

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::elem::{check_float, float_pair, floats, Elem, FloatPair, Floats};
use crate::fastmath::{self, simd_dispatch};

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const COEF: f32 = 0.044_715;
/// Elements per rayon task.
const CHUNK: usize = 16 * 1024;

/// GELU (tanh approximation) with a fused backward. `x`: any shape, f32 or bf16.
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    check_float("gelu", x.dtype())?;
    x.contiguous()?.apply_op1(Gelu)
}

/// The GELU forward op; use [`gelu`].
#[derive(Debug, Clone, Copy)]
pub struct Gelu;

#[inline(always)]
fn gelu_f32(x: f32) -> f32 {
    let u = SQRT_2_OVER_PI * (x + COEF * x * x * x);
    0.5 * x * (1.0 + fastmath::tanh(u))
}

#[inline(always)]
fn gelu_grad_f32(x: f32) -> f32 {
    let x2 = x * x;
    let t = fastmath::tanh(SQRT_2_OVER_PI * (x + COEF * x2 * x));
    let du = SQRT_2_OVER_PI * (1.0 + 3.0 * COEF * x2);
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du
}

fn fwd<T: Elem>(x: &[T]) -> Vec<T> {
    let mut y = vec![T::from_f32(0.0); x.len()];
    fwd_into(x, &mut y);
    y
}

/// GELU of `x` into `y`.
pub(crate) fn fwd_into<T: Elem>(x: &[T], y: &mut [T]) {
    y.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .for_each(|(y, x)| fwd_simd(x, y));
}

simd_dispatch!(
    /// [`fwd_chunk`] at the CPU's vector level.
    fn fwd_simd<T: Elem>(x: &[T], y: &mut [T]) => fwd_chunk
);

#[inline(always)]
fn fwd_chunk<T: Elem>(x: &[T], y: &mut [T]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y = T::from_f32(gelu_f32(x.to_f32()));
    }
}

fn bwd<T: Elem>(x: &[T], g: &[T]) -> Vec<T> {
    let mut dx = g.to_vec();
    bwd_in_place(x, &mut dx);
    dx
}

/// Turns the output gradient `g` into the input gradient in place: `g *= GELU'(x)`.
pub(crate) fn bwd_in_place<T: Elem>(x: &[T], g: &mut [T]) {
    g.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .for_each(|(g, x)| bwd_simd(x, g));
}

simd_dispatch!(
    /// [`bwd_chunk`] at the CPU's vector level.
    fn bwd_simd<T: Elem>(x: &[T], g: &mut [T]) => bwd_chunk
);

#[inline(always)]
fn bwd_chunk<T: Elem>(x: &[T], g: &mut [T]) {
    for (g, &x) in g.iter_mut().zip(x) {
        *g = T::from_f32(g.to_f32() * gelu_grad_f32(x.to_f32()));
    }
}

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "gelu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = match floats(self.name(), s, l)? {
            Floats::F32(x) => f32::storage(fwd(x)),
            Floats::BF16(x) => half::bf16::storage(fwd(x)),
        };
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        let dy = dy.contiguous()?;
        Ok(Some(x.apply_op2_no_bwd(&dy, &GeluBackward)?))
    }
}

/// GELU's backward as one fused pass over `(x, dy)`.
#[derive(Debug, Clone, Copy)]
pub struct GeluBackward;

impl CustomOp2 for GeluBackward {
    fn name(&self) -> &'static str {
        "gelu-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if l1.shape() != l2.shape() {
            return Err(crate::error::shape_err(
                self.name(),
                format!("grad shape {:?} differs from x", l2.shape()),
                l1.shape(),
            ));
        }
        let out = match float_pair(self.name(), (s1, l1), (s2, l2))? {
            FloatPair::F32(x, g) => f32::storage(bwd(x, g)),
            FloatPair::BF16(x, g) => half::bf16::storage(bwd(x, g)),
        };
        Ok((out, l1.shape().clone()))
    }
}
