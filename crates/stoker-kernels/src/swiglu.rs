//! SwiGLU's gate: `silu(gate) * up` (Llama's MLP between its up and down projections),
//! one pass forward and one backward: with `s = sigmoid(g)`,
//! `d gate = dy * up * s * (1 + g (1 - s))` and `d up = dy * g * s`.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::elem::{check_float, float_pair, floats, Elem, FloatPair, Floats};
use crate::error::{shape_err, KernelError};

/// Elements per rayon task.
const CHUNK: usize = 16 * 1024;

/// `silu(gate) * up`, both the same shape and dtype (f32 or bf16).
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    check_float("swiglu", gate.dtype())?;
    gate.contiguous()?.apply_op2(&up.contiguous()?, SwiGlu)
}

/// The SwiGLU forward op; use [`swiglu`].
#[derive(Debug, Clone, Copy)]
pub struct SwiGlu;

#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `y = silu(gate) * up`.
pub(crate) fn fwd_into<T: Elem>(gate: &[T], up: &[T], y: &mut [T]) {
    y.par_chunks_mut(CHUNK)
        .zip(gate.par_chunks(CHUNK).zip(up.par_chunks(CHUNK)))
        .for_each(|(y, (g, u))| {
            for ((y, &g), &u) in y.iter_mut().zip(g).zip(u) {
                let g = g.to_f32();
                *y = T::from_f32(g * sigmoid(g) * u.to_f32());
            }
        });
}

/// The gradients of gate and up from `dy`, into `dgate` and `dup`.
pub(crate) fn bwd_into<T: Elem>(gate: &[T], up: &[T], dy: &[T], dgate: &mut [T], dup: &mut [T]) {
    dgate
        .par_chunks_mut(CHUNK)
        .zip(dup.par_chunks_mut(CHUNK))
        .zip(gate.par_chunks(CHUNK).zip(up.par_chunks(CHUNK)))
        .zip(dy.par_chunks(CHUNK))
        .for_each(|(((dg, du), (g, u)), dy)| {
            for ((((dg, du), &g), &u), &dy) in dg.iter_mut().zip(du).zip(g).zip(u).zip(dy) {
                let (g, u, dy) = (g.to_f32(), u.to_f32(), dy.to_f32());
                let s = sigmoid(g);
                *dg = T::from_f32(dy * u * s * (1.0 + g * (1.0 - s)));
                *du = T::from_f32(dy * g * s);
            }
        });
}

fn check_same(op: &'static str, a: &Layout, b: &Layout) -> Result<()> {
    match a.shape() == b.shape() {
        true => Ok(()),
        false => Err(shape_err(
            op,
            format!("gate and up differ: up is {:?}", b.shape()),
            a.shape(),
        )),
    }
}

impl CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "swiglu"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        check_same(self.name(), l1, l2)?;
        let out = match float_pair(self.name(), (s1, l1), (s2, l2))? {
            FloatPair::F32(g, u) => {
                let mut y = vec![0.0f32; g.len()];
                fwd_into(g, u, &mut y);
                f32::storage(y)
            }
            FloatPair::BF16(g, u) => {
                let mut y = vec![half::bf16::ZERO; g.len()];
                fwd_into(g, u, &mut y);
                half::bf16::storage(y)
            }
        };
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let n = gate.elem_count();
        let flat = gate.apply_op3_no_bwd(up, &dy.contiguous()?, &SwiGluBackward)?;
        let dg = flat.narrow(0, 0, n)?.reshape(gate.shape())?;
        let du = flat.narrow(0, n, n)?.reshape(gate.shape())?;
        Ok((Some(dg), Some(du)))
    }
}

/// SwiGLU's backward as one fused pass over `(gate, up, dy)`: `[dgate, dup]` flattened
/// in one buffer of `2 N`.
#[derive(Debug, Clone, Copy)]
pub struct SwiGluBackward;

fn bwd<T: Elem>(g: &[T], u: &[T], dy: &[T]) -> Vec<T> {
    let mut out = vec![T::from_f32(0.0); 2 * g.len()];
    let (dg, du) = out.split_at_mut(g.len());
    bwd_into(g, u, dy, dg, du);
    out
}

impl CustomOp3 for SwiGluBackward {
    fn name(&self) -> &'static str {
        "swiglu-backward"
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
        check_same(op, l1, l2)?;
        check_same(op, l1, l3)?;
        let out = match (
            floats(op, s1, l1)?,
            floats(op, s2, l2)?,
            floats(op, s3, l3)?,
        ) {
            (Floats::F32(g), Floats::F32(u), Floats::F32(dy)) => f32::storage(bwd(g, u, dy)),
            (Floats::BF16(g), Floats::BF16(u), Floats::BF16(dy)) => {
                half::bf16::storage(bwd(g, u, dy))
            }
            _ => {
                return Err(KernelError::DType {
                    op,
                    dtype: s2.dtype(),
                    extra: ", the same for gate, up and dy",
                }
                .into())
            }
        };
        Ok((out, Shape::from(2 * l1.shape().elem_count())))
    }
}
