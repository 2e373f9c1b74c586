//! A linear layer of the flat layout (`y = x W^T (+ b)`, PyTorch's `[out, in]` weight),
//! forward and backward, for both steps: the GPT's layers have biases, the Llama's none.

use crate::backend::Backend;
use crate::elem::Act;
use crate::error::GpuError;
use crate::gemm::{matmul, Dims, Mat};
use crate::kernels;

use super::buffers::StepBuffers;
use super::fp8_linear::{Fp8Linears, Fp8Shape};
use super::layout::{Span, BIAS_PARTS};

/// Where a layer's parameters are and its shape.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Linear {
    /// The weight `[out, inp]`'s offset.
    pub(crate) w: usize,
    /// The bias `[out]`'s offset, if it has one.
    pub(crate) b: Option<usize>,
    /// Input width.
    pub(crate) inp: usize,
    /// Output width.
    pub(crate) out: usize,
}

/// The FP8 layers of a step and this layer's index among them, where the step runs its
/// linear layers in FP8.
pub(crate) type Fp8Layer<'a, B> = Option<(&'a Fp8Linears<B>, usize)>;

/// `y = x W^T (+ b)` over `rows` rows.
pub(crate) fn forward<B: Backend, T: Act>(
    be: &B,
    bufs: &StepBuffers<B, T>,
    rows: usize,
    l: Linear,
    (y, x): (Span, Span),
    fp8: Fp8Layer<'_, B>,
) -> Result<(), GpuError> {
    let w = bufs.p(be, l.w, l.out * l.inp)?;
    let b = l.b.map(|b| bufs.p(be, b, l.out)).transpose()?;
    if let Some((f, layer)) = fp8 {
        let shape = Fp8Shape {
            rows,
            inp: l.inp,
            out: l.out,
        };
        return f.forward(be, layer, shape, (bufs.a(be, y)?, bufs.a(be, x)?, w, b));
    }
    matmul(
        be,
        Mat::rows(bufs.a(be, y)?, l.out),
        Mat::rows(bufs.a(be, x)?, l.inp),
        Mat::t(w, l.inp),
        Dims::one(rows, l.out, l.inp),
        b,
        false,
    )
}

/// The backward: `dx = dy W` into `dx.0` (added to it when `dx.1`) if given, `dW += dy^T
/// x`, and for a biased layer `db += column sums of dy` through `partials`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<B: Backend, T: Act>(
    be: &B,
    bufs: &StepBuffers<B, T>,
    rows: usize,
    l: Linear,
    dx: Option<(Span, bool)>,
    dy: Span,
    x: Span,
    partials: Span,
    fp8: Fp8Layer<'_, B>,
) -> Result<(), GpuError> {
    let dyv = bufs.a(be, dy)?;
    if let Some((f, layer)) = fp8 {
        let shape = Fp8Shape {
            rows,
            inp: l.inp,
            out: l.out,
        };
        let dxv = dx
            .map(|(d, add)| bufs.a(be, d).map(|v| (v, add)))
            .transpose()?;
        let w = bufs.p(be, l.w, l.out * l.inp)?;
        f.backward(
            be,
            layer,
            shape,
            (dxv, dyv, bufs.a(be, x)?, w),
            bufs.g(be, l.w, l.out * l.inp)?,
        )?;
        return bias_backward(be, bufs, l, dyv, partials);
    }
    if let Some((dx, add)) = dx {
        let w = bufs.p(be, l.w, l.out * l.inp)?;
        matmul(
            be,
            Mat::rows(bufs.a(be, dx)?, l.inp),
            Mat::rows(dyv, l.out),
            Mat::rows(w, l.inp),
            Dims::one(rows, l.inp, l.out),
            None,
            add,
        )?;
    }
    let dw = bufs.g(be, l.w, l.out * l.inp)?;
    matmul(
        be,
        Mat::rows(dw, l.inp),
        Mat::t(dyv, l.out),
        Mat::rows(bufs.a(be, x)?, l.inp),
        Dims::one(l.out, l.inp, rows),
        None,
        true,
    )?;
    bias_backward(be, bufs, l, dyv, partials)
}

/// A biased layer's `db += column sums of dy` through `partials` (from `dy` as the step
/// holds it, in FP8 runs too, as Transformer Engine does).
fn bias_backward<B: Backend, T: Act>(
    be: &B,
    bufs: &StepBuffers<B, T>,
    l: Linear,
    dyv: crate::backend::View<'_, T>,
    partials: Span,
) -> Result<(), GpuError> {
    match l.b {
        Some(b) => kernels::column_sums_add(
            be,
            bufs.g(be, b, l.out)?,
            dyv,
            bufs.f(be, partials)?,
            BIAS_PARTS,
        ),
        None => Ok(()),
    }
}
