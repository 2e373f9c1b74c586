//! The resident step's linear layers in FP8 (Transformer Engine's `Linear` under its
//! HYBRID delayed-scaling recipe; stoker-train's `precision = "fp8"` on the CPU): each
//! layer's input and weight cast to E4M3 and its output's gradient to E5M2, each with a
//! delayed scaler of its own ([`Fp8Scalers`]: three per layer), and the layer's three
//! products in FP8 on the tensor cores ([`matmul_fp8`]). Everything else (the norms,
//! attention, the head, the bias and its gradient, the optimizer) stays as the step runs
//! it.
//!
//! Hopper's FP8 products take both operands with the shared dimension contiguous, so each
//! product gets the cast it needs: the forward `x` and `W` as stored; the input gradient
//! `dy` as stored and `W` transposed; the weight gradient `dy` and `x` transposed. The
//! backward casts `x` and `W` again, their transposes alone, with the same scales (they
//! change only at the end of the step), so to the same bytes, and records nothing: one
//! scratch set serves every layer, where Transformer Engine keeps each layer's casts
//! from the forward.

use std::cell::Cell;

use stoker_precision::{DelayedScalingConfig, TensorRole};

use crate::backend::{Backend, View};
use crate::elem::{Act, E4m3, E5m2};
use crate::error::GpuError;
use crate::fp8::Fp8Scalers;
use crate::gemm::{matmul_fp8, Dims, Mat};

/// Scalers per layer: its input, its weight, its output's gradient.
const PER_LAYER: usize = 3;

/// A step's FP8 linear layers: their scalers and the casts' scratch (the widest layer's
/// operands in both layouts, the largest weight in both).
pub struct Fp8Linears<B: Backend> {
    scalers: Fp8Scalers<B>,
    /// Whether the forward records amax (training) or not (evaluation, which records
    /// nothing, as on the CPU).
    recording: Cell<bool>,
    x: B::Buf<E4m3>,
    x_t: B::Buf<E4m3>,
    w: B::Buf<E4m3>,
    w_t: B::Buf<E4m3>,
    dy: B::Buf<E5m2>,
    dy_t: B::Buf<E5m2>,
}

/// A layer's backward operands: `dx` (and whether it is added to), `dy`, `x`, `W`.
pub(crate) type BackwardViews<'a, T> = (
    Option<(View<'a, T>, bool)>,
    View<'a, T>,
    View<'a, T>,
    View<'a, T>,
);

/// A layer's shape for its casts: rows, input and output widths.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fp8Shape {
    pub(crate) rows: usize,
    pub(crate) inp: usize,
    pub(crate) out: usize,
}

/// What FP8 layers of a step hold: `layers` layers' scalers and the scratch for `rows`
/// rows of layers up to `widest` wide and weights up to `weight` elements. The one place
/// that sizes them: [`Fp8Linears::new`] allocates these, the step's plan counts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fp8Sizes {
    /// Scalers (three per layer).
    pub scalers: usize,
    /// Bytes of each of the four activation casts (x, x^T, dy, dy^T).
    pub acts: usize,
    /// Bytes of each of the two weight casts (W, W^T).
    pub weight: usize,
}

impl Fp8Sizes {
    /// The sizes for `layers` layers at `rows` rows, widths up to `widest`, weights up to
    /// `weight` elements.
    pub fn of(layers: usize, rows: usize, widest: usize, weight: usize) -> Self {
        Fp8Sizes {
            scalers: PER_LAYER * layers,
            acts: rows * widest,
            weight,
        }
    }

    /// Bytes on the backend: the scalers and the casts ([`Fp8Linears::bytes`] once made).
    pub fn bytes(&self) -> usize {
        crate::fp8::planned_bytes(self.scalers, &DelayedScalingConfig::default())
            + 4 * self.acts
            + 2 * self.weight
    }
}

impl<B: Backend> Fp8Linears<B> {
    /// Scalers for `layers` linear layers (TE's default recipe, as the CPU's `Fp8State`)
    /// and scratch for `rows` rows of layers up to `widest` (input or output) and weights
    /// up to `weight` elements. Every width and `rows` must be a multiple of 16 (what
    /// Hopper's FP8 products take): refused here, naming them.
    pub(crate) fn new(
        be: &B,
        layers: usize,
        rows: usize,
        widths: &[usize],
        weight: usize,
    ) -> Result<Self, GpuError> {
        if let Some(bad) = std::iter::once(rows)
            .chain(widths.iter().copied())
            .find(|x| !x.is_multiple_of(16))
        {
            return Err(GpuError::Shape {
                kernel: "fp8-linear",
                what: format!(
                    "FP8 products need every layer width and the rows of a micro-batch \
                     (sequences x positions: {rows}) to be multiples of 16; {bad} is not \
                     (widths {widths:?})"
                ),
            });
        }
        let roles: Vec<TensorRole> = (0..layers)
            .flat_map(|_| {
                [
                    TensorRole::Forward,
                    TensorRole::Forward,
                    TensorRole::Backward,
                ]
            })
            .collect();
        let widest = widths.iter().copied().max().unwrap_or(0);
        let sizes = Fp8Sizes::of(layers, rows, widest, weight);
        Ok(Fp8Linears {
            scalers: Fp8Scalers::new(be, &DelayedScalingConfig::default(), &roles)?,
            recording: Cell::new(true),
            x: be.zeros(sizes.acts)?,
            x_t: be.zeros(sizes.acts)?,
            w: be.zeros(sizes.weight)?,
            w_t: be.zeros(sizes.weight)?,
            dy: be.zeros(sizes.acts)?,
            dy_t: be.zeros(sizes.acts)?,
        })
    }

    /// The scalers (three per layer: input, weight, output gradient).
    pub(crate) fn scalers(&self) -> &Fp8Scalers<B> {
        &self.scalers
    }

    /// Bytes the scalers and the casts' scratch hold on the backend.
    pub(crate) fn bytes(&self) -> usize {
        let casts = [&self.x, &self.x_t, &self.w, &self.w_t]
            .into_iter()
            .map(B::len)
            .sum::<usize>()
            + B::len(&self.dy)
            + B::len(&self.dy_t);
        self.scalers.bytes() + casts
    }

    /// Whether the forwards from now on record amax: a training micro-batch's do, an
    /// evaluation's do not.
    pub(crate) fn set_recording(&self, on: bool) {
        self.recording.set(on);
    }

    /// `y = x W^T (+ b)` in FP8 for layer `layer` (`x` `[rows, inp]`, `W` `[out, inp]`).
    pub(crate) fn forward<T: Act>(
        &self,
        be: &B,
        layer: usize,
        s: Fp8Shape,
        (y, x, w, b): (View<T>, View<T>, View<T>, Option<View<T>>),
    ) -> Result<(), GpuError> {
        let record = self.recording.get();
        let (sx, sw) = (PER_LAYER * layer, PER_LAYER * layer + 1);
        let xq = be.view(&self.x, 0..s.rows * s.inp)?;
        let wq = be.view(&self.w, 0..s.out * s.inp)?;
        self.scalers
            .quantize(be, sx, x, (s.rows, s.inp), xq, None, record)?;
        self.scalers
            .quantize(be, sw, w, (s.out, s.inp), wq, None, record)?;
        matmul_fp8(
            be,
            Mat::rows(y, s.out),
            Mat::rows(xq, s.inp),
            Mat::t(wq, s.inp),
            [
                self.scalers.scale_inv(be, sx)?,
                self.scalers.scale_inv(be, sw)?,
            ],
            Dims::one(s.rows, s.out, s.inp),
            b,
            false,
        )
    }

    /// The backward's two products in FP8 for layer `layer`: `dx = dy W` into `dx.0`
    /// (added to it when `dx.1`) if given, and `dW += dy^T x` (f32). `dy` is cast once
    /// (its amax recorded), `x` and `W` again transposed (nothing recorded).
    pub(crate) fn backward<T: Act>(
        &self,
        be: &B,
        layer: usize,
        s: Fp8Shape,
        (dx, dy, x, w): BackwardViews<'_, T>,
        dw: View<f32>,
    ) -> Result<(), GpuError> {
        let (sx, sw, sg) = (
            PER_LAYER * layer,
            PER_LAYER * layer + 1,
            PER_LAYER * layer + 2,
        );
        let gq = be.view(&self.dy, 0..s.rows * s.out)?;
        let gt = be.view(&self.dy_t, 0..s.rows * s.out)?;
        self.scalers
            .quantize(be, sg, dy, (s.rows, s.out), gq, Some(gt), true)?;
        let g_inv = self.scalers.scale_inv(be, sg)?;
        if let Some((dx, add)) = dx {
            let wt = be.view(&self.w_t, 0..s.out * s.inp)?;
            self.scalers
                .quantize_transposed(be, sw, w, (s.out, s.inp), wt)?;
            // dx [rows, inp] = dy [rows, out] W [out, inp]: W's transpose [inp, out] holds
            // the shared dimension (out) contiguous.
            matmul_fp8(
                be,
                Mat::rows(dx, s.inp),
                Mat::rows(gq, s.out),
                Mat::t(wt, s.out),
                [g_inv, self.scalers.scale_inv(be, sw)?],
                Dims::one(s.rows, s.inp, s.out),
                None,
                add,
            )?;
        }
        let xt = be.view(&self.x_t, 0..s.rows * s.inp)?;
        self.scalers
            .quantize_transposed(be, sx, x, (s.rows, s.inp), xt)?;
        // dW [out, inp] += dy^T [out, rows] x [rows, inp]: dy's transpose and x's hold the
        // shared dimension (rows) contiguous.
        matmul_fp8(
            be,
            Mat::rows(dw, s.inp),
            Mat::rows(gt, s.rows),
            Mat::t(xt, s.rows),
            [g_inv, self.scalers.scale_inv(be, sx)?],
            Dims::one(s.out, s.inp, s.rows),
            None,
            true,
        )
    }
}
