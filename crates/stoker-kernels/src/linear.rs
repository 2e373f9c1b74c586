//! A linear layer `y = x W^T + b` as one differentiable op.
//!
//! Composed in candle, a linear layer is five graph nodes (reshape, transpose, matmul,
//! reshape, broadcast add), each of which candle's backward gives a zero-filled gradient
//! buffer and an add; the bias gradient is a strided reduction over the leading
//! dimensions. Here it is one node: forward is one GEMM whose output starts as the bias
//! rows, backward computes `dx = dy W`, `dW = dy^T x` and `db` = column sums of `dy` into
//! one buffer. f32 runs on the `gemm` crate (candle's own f32 GEMM); bf16 on
//! [`crate::matmul`] (AMX / AVX512-BF16) with f32 accumulation and the bias added before
//! the single rounding.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use half::bf16;
use rayon::prelude::*;

use crate::elem::{floats, Elem, Floats};
use crate::error::{shape_err, KernelError};
use crate::matmul::{gemm_into, Bf16Kernel, Bf16Source, MatRef};

/// `x W^T + b` for `x` `[.., in]`, `w` `[out, in]`, `b` `[out]`, differentiable in all
/// three. All f32, all bf16, or f32 `x` with bf16 `w` and `b` (bf16 GEMM operands, f32
/// output: how bf16 training keeps CPU activations in f32, see stoker-train's `ops`).
pub fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    linear_with(x, w, b, false)
}

/// [`linear`], and with `bf16_operands` f32 inputs are rounded to bf16 (nearest-even)
/// as the GEMM packs them and multiplied on the bf16 GEMM ([`crate::matmul`]) with f32
/// accumulation; outputs and gradients stay f32. This is autocast's bf16 linear layer
/// with FP32 parameters: the parameters and activations never exist in bf16 as tensors.
pub fn linear_with(x: &Tensor, w: &Tensor, b: &Tensor, bf16_operands: bool) -> Result<Tensor> {
    let op = "linear";
    let dims = x.dims().to_vec();
    let Some(&k) = dims.last() else {
        return Err(shape_err(
            op,
            "x must have at least one dimension",
            x.shape(),
        ));
    };
    let (n, win) = w.dims2()?;
    if win != k || b.dims() != [n] {
        return Err(shape_err(
            op,
            format!(
                "x has {k} features; the weight is {:?} and the bias {:?}",
                w.dims(),
                b.dims()
            ),
            x.shape(),
        ));
    }
    x.contiguous()?
        .apply_op3(&w.contiguous()?, &b.contiguous()?, Linear { bf16_operands })
}

/// The forward op; use [`linear`] or [`linear_with`].
#[derive(Debug, Clone, Copy)]
pub struct Linear {
    /// Round f32 operands to bf16 and use the bf16 GEMM.
    pub bf16_operands: bool,
}

/// `C (m x n, row-major) = A . B` in f32 through the `gemm` crate, with `A` element
/// `(i, r)` at `a[i * a_rs + r * a_cs]` and `B` element `(r, j)` at `b[r * b_rs + j * b_cs]`.
/// With `init`, `C` starts as that row repeated (the bias); otherwise from zero.
#[allow(clippy::too_many_arguments)]
fn gemm_f32(
    (m, k, n): (usize, usize, usize),
    a: &[f32],
    a_strides: (usize, usize),
    b: &[f32],
    b_strides: (usize, usize),
    init: Option<&[f32]>,
) -> Vec<f32> {
    let mut c = match init {
        Some(row) => row.repeat(m),
        None => vec![0f32; m * n],
    };
    gemm_f32_into(
        (m, k, n),
        a,
        a_strides,
        b,
        b_strides,
        &mut c,
        init.is_some(),
    );
    c
}

/// `C = A . B`, or with `accumulate` `C += A . B`, into a caller's row-major `m x n` `C`;
/// strides as in [`gemm_f32`].
pub(crate) fn gemm_f32_into(
    (m, k, n): (usize, usize, usize),
    a: &[f32],
    a_strides: (usize, usize),
    b: &[f32],
    b_strides: (usize, usize),
    c: &mut [f32],
    accumulate: bool,
) {
    assert_eq!(Some(c.len()), m.checked_mul(n), "gemm: C must be m x n");
    let threads = rayon::current_num_threads();
    let par = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    let acc = if accumulate { Some(1.0) } else { None };
    // SAFETY: C is m x n row-major, exactly `c`.
    unsafe {
        gemm_strided(
            (m, k, n),
            a,
            a_strides,
            b,
            b_strides,
            (c.as_mut_ptr(), n),
            acc,
            1.0,
            par,
        )
    }
}

/// `C = beta A . B`, or with `keep = Some(alpha)` `C = alpha C + beta A . B`, for `C` at
/// `c.0` with row stride `c.1` (columns contiguous); `A`, `B` strides as in [`gemm_f32`],
/// bounds-checked against the slices.
///
/// # Safety
/// `c.0` must be valid for reads and writes of `m` rows of `n` elements `c.1` apart, and
/// no other thread may touch those elements during the call.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_strided(
    (m, k, n): (usize, usize, usize),
    a: &[f32],
    (a_rs, a_cs): (usize, usize),
    b: &[f32],
    (b_rs, b_cs): (usize, usize),
    (c, c_rs): (*mut f32, usize),
    keep: Option<f32>,
    beta: f32,
    par: gemm::Parallelism,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if keep.is_none() {
            for i in 0..m {
                std::slice::from_raw_parts_mut(c.add(i * c_rs), n).fill(0.0);
            }
        }
        return;
    }
    // The last element each operand is read at, without wrapping (a wrapped offset could
    // pass a plain comparison); m, n, k >= 1 here.
    let last = |rows: usize, rs: usize, cols: usize, cs: usize| {
        (rows - 1)
            .checked_mul(rs)
            .and_then(|r| (cols - 1).checked_mul(cs).and_then(|c| r.checked_add(c)))
    };
    assert!(
        last(m, a_rs, k, a_cs).is_some_and(|e| e < a.len())
            && last(k, b_rs, n, b_cs).is_some_and(|e| e < b.len())
    );
    gemm::gemm(
        m,
        n,
        k,
        c,
        1,
        c_rs as isize,
        keep.is_some(),
        a.as_ptr(),
        a_cs as isize,
        a_rs as isize,
        b.as_ptr(),
        b_cs as isize,
        b_rs as isize,
        keep.unwrap_or(0.0),
        beta,
        false,
        false,
        false,
        par,
    );
}

/// Column sums of `g` (`m x n`, row-major) in f32.
/// Per-task partial sums are added in task order, so the result does not depend on the
/// thread count or on rayon's scheduling.
pub(crate) fn column_sums<T: Elem>(g: &[T], n: usize) -> Vec<f32> {
    let rows_per_task = (16 * 1024 / n.max(1)).max(1);
    let partials: Vec<Vec<f32>> = g
        .par_chunks(rows_per_task * n.max(1))
        .map(|rows| {
            let mut acc = vec![0f32; n];
            for row in rows.chunks(n.max(1)) {
                acc.iter_mut().zip(row).for_each(|(a, &v)| *a += v.to_f32());
            }
            acc
        })
        .collect();
    let mut total = vec![0f32; n];
    for p in &partials {
        total.iter_mut().zip(p).for_each(|(t, &v)| *t += v);
    }
    total
}

fn widen(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|v| v.to_f32()).collect()
}

/// `x W^T + b` on the bf16 GEMM (`x` `m x k`, `w` `n x k`), written in `O`.
fn forward_bf16<O: Elem, SX: Bf16Source, SW: Bf16Source>(
    x: &[SX],
    w: &[SW],
    bias: &[f32],
    (m, k, n): (usize, usize, usize),
) -> std::result::Result<Vec<O>, KernelError> {
    let a = MatRef::new(x, m, k);
    let b = MatRef::transposed(w, k, n);
    gemm_into(Bf16Kernel::detect(), &a, &b, Some(bias))
}

/// `[dx | dW | db]` on the bf16 GEMM (`dx = g W`, `dW = g^T x`, `db` = column sums of `g`),
/// written in `O`.
fn backward_bf16<O: Elem, SX: Bf16Source, SW: Bf16Source, SG: Bf16Source + Elem>(
    x: &[SX],
    w: &[SW],
    g: &[SG],
    (m, k, n): (usize, usize, usize),
) -> std::result::Result<Vec<O>, KernelError> {
    let kernel = Bf16Kernel::detect();
    let mut out: Vec<O> = gemm_into(kernel, &MatRef::new(g, m, n), &MatRef::new(w, n, k), None)?;
    out.extend(gemm_into::<O, _, _>(
        kernel,
        &MatRef::transposed(g, n, m),
        &MatRef::new(x, m, k),
        None,
    )?);
    out.extend(column_sums(g, n).into_iter().map(O::from_f32));
    Ok(out)
}

/// `(m, k, n)` of `x` `[.., k]` (its leading dims flattened into `m` rows), `w` `[n, k]`
/// and `b` `[n]`.
fn dims(op: &'static str, x: &Layout, w: &Layout, b: &Layout) -> Result<(usize, usize, usize)> {
    match (x.dims().split_last(), w.dims(), b.dims()) {
        (Some((&k, lead)), &[n, k2], &[n2]) if k == k2 && n == n2 => {
            Ok((lead.iter().product(), k, n))
        }
        _ => Err(shape_err(
            op,
            "expects x [.., k], w [n, k], b [n]",
            x.shape(),
        )),
    }
}

/// `x`'s shape with the last dim replaced by `n`.
fn out_shape(x: &Shape, n: usize) -> Shape {
    let mut d = x.dims().to_vec();
    if let Some(last) = d.last_mut() {
        *last = n;
    }
    Shape::from(d)
}

fn dtype_err(op: &'static str, d: DType) -> candle_core::Error {
    KernelError::DType {
        op,
        dtype: d,
        extra: ", the same for x, w and b",
    }
    .into()
}

impl CustomOp3 for Linear {
    fn name(&self) -> &'static str {
        "linear"
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
        let (m, k, n) = dims(op, l1, l2, l3)?;
        let out = match (
            floats(op, s1, l1)?,
            floats(op, s2, l2)?,
            floats(op, s3, l3)?,
        ) {
            (Floats::F32(x), Floats::F32(w), Floats::F32(b)) if self.bf16_operands => {
                CpuStorage::F32(forward_bf16(x, w, b, (m, k, n))?)
            }
            (Floats::F32(x), Floats::F32(w), Floats::F32(b)) => {
                CpuStorage::F32(gemm_f32((m, k, n), x, (k, 1), w, (1, k), Some(b)))
            }
            (Floats::BF16(x), Floats::BF16(w), Floats::BF16(b)) => {
                CpuStorage::BF16(forward_bf16(x, w, &widen(b), (m, k, n))?)
            }
            // f32 activations, bf16 weights: x is rounded to bf16 while packing and the
            // output stays f32 (the accumulator).
            (Floats::F32(x), Floats::BF16(w), Floats::BF16(b)) => {
                CpuStorage::F32(forward_bf16(x, w, &widen(b), (m, k, n))?)
            }
            _ => return Err(dtype_err(op, s2.dtype())),
        };
        Ok((out, out_shape(l1.shape(), n)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let k = x.dim(candle_core::D::Minus1)?;
        let m = x.elem_count() / k.max(1);
        let n = w.dim(0)?;
        let g = grad.contiguous()?.to_dtype(x.dtype())?;
        let back = LinearBackward {
            bf16_operands: self.bf16_operands,
        };
        let flat = x.apply_op3_no_bwd(w, &g, &back)?;
        let dx = flat.narrow(0, 0, m * k)?.reshape(x.shape())?;
        let dw = flat
            .narrow(0, m * k, n * k)?
            .reshape((n, k))?
            .to_dtype(w.dtype())?;
        let db = flat.narrow(0, m * k + n * k, n)?.to_dtype(b.dtype())?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

/// The backward of [`Linear`] over `(x, w, dy)`: `[dx | dW | db]` in one flat buffer.
#[derive(Debug, Clone, Copy)]
pub struct LinearBackward {
    /// Round f32 operands to bf16 and use the bf16 GEMM.
    pub bf16_operands: bool,
}

impl CustomOp3 for LinearBackward {
    fn name(&self) -> &'static str {
        "linear-backward"
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
        let (m, k, n) = match (l1.dims().split_last(), l2.dims()) {
            (Some((&k, lead)), &[n, k2]) if k == k2 => (lead.iter().product(), k, n),
            _ => return Err(shape_err(op, "expects x [.., k], w [n, k]", l1.shape())),
        };
        if l3.shape() != &out_shape(l1.shape(), n) {
            return Err(shape_err(
                op,
                "dy must have x's shape with n features",
                l3.shape(),
            ));
        }
        let len = m * k + n * k + n;
        let out = match (
            floats(op, s1, l1)?,
            floats(op, s2, l2)?,
            floats(op, s3, l3)?,
        ) {
            (Floats::F32(x), Floats::F32(w), Floats::F32(g)) if self.bf16_operands => {
                CpuStorage::F32(backward_bf16(x, w, g, (m, k, n))?)
            }
            (Floats::F32(x), Floats::F32(w), Floats::F32(g)) => {
                let ((dx, dw), db) = rayon::join(
                    || {
                        rayon::join(
                            || gemm_f32((m, n, k), g, (n, 1), w, (k, 1), None),
                            || gemm_f32((n, m, k), g, (1, n), x, (k, 1), None),
                        )
                    },
                    || column_sums(g, n),
                );
                let mut out = Vec::with_capacity(len);
                out.extend_from_slice(&dx);
                out.extend_from_slice(&dw);
                out.extend_from_slice(&db);
                CpuStorage::F32(out)
            }
            (Floats::BF16(x), Floats::BF16(w), Floats::BF16(g)) => {
                CpuStorage::BF16(backward_bf16(x, w, g, (m, k, n))?)
            }
            // Mixed: everything returned in f32 (the op casts dW and db to bf16).
            (Floats::F32(x), Floats::BF16(w), Floats::F32(g)) => {
                CpuStorage::F32(backward_bf16(x, w, g, (m, k, n))?)
            }
            _ => return Err(dtype_err(op, s3.dtype())),
        };
        Ok((out, Shape::from(len)))
    }
}
