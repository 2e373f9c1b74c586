//! Matrix products: [`matmul`] checks every operand's extent against its view, then hands
//! the backend a [`Gemm`] (one batched, strided product as data, row-major, A and B in the
//! activations' type, C in it or in f32: weight gradients accumulate in f32; a linear
//! layer's bias added before C is rounded). [`matmul_fp8`] does the same for FP8
//! operands with their delayed scales, in the one layout Hopper runs them in. The host
//! runs products with the `gemm` crate in f32 (`host_gemm`), the device with cuBLASLt (the
//! bias in its epilogue), or cuBLAS (never FP8).

use crate::backend::{Backend, View};
use crate::call::{AbTypes, Addr, Gemm, Operand};
use crate::elem::{Act, Dtype, Fp8, Fp8Dtype};
use crate::error::GpuError;

/// The element count an operand must hold: the last batch entry's last element plus one.
fn extent(rows: usize, cols: usize, ld: usize, trans: bool, batch: usize, stride: usize) -> usize {
    let (r, c) = if trans { (cols, rows) } else { (rows, cols) };
    (batch - 1) * stride + (r - 1) * ld + c
}

/// A matrix operand: a view, its leading dimension, transposed or not.
#[derive(Debug, Clone, Copy)]
pub struct Mat<'a, E> {
    /// The elements.
    pub view: View<'a, E>,
    /// Elements between stored rows.
    pub ld: usize,
    /// Stored transposed.
    pub trans: bool,
}

impl<'a, E> Mat<'a, E> {
    /// A row-major matrix with rows of `ld`.
    pub fn rows(view: View<'a, E>, ld: usize) -> Self {
        Mat {
            view,
            ld,
            trans: false,
        }
    }

    /// The transpose of a row-major matrix with rows of `ld`.
    pub fn t(view: View<'a, E>, ld: usize) -> Self {
        Mat {
            view,
            ld,
            trans: true,
        }
    }
}

/// The product's sizes and batch: `(m, n, k)`, batch count and strides of A, B, C.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    /// Rows of A and C.
    pub m: usize,
    /// Columns of B and C.
    pub n: usize,
    /// The shared dimension.
    pub k: usize,
    /// Products in the batch.
    pub batch: usize,
    /// Strides of A, B, C between batch entries.
    pub strides: [usize; 3],
}

impl Dims {
    /// One product.
    pub fn one(m: usize, n: usize, k: usize) -> Self {
        Dims {
            m,
            n,
            k,
            batch: 1,
            strides: [0; 3],
        }
    }
}

/// Checks every operand's extent (its last batch entry's last element) against its view,
/// rows that do not overlap, and C stored as is.
fn check_extents(
    d: &Dims,
    a: (usize, usize, bool),
    b: (usize, usize, bool),
    c: (usize, usize, bool),
) -> Result<(), GpuError> {
    let shape = |what: String| GpuError::Shape {
        kernel: "matmul",
        what,
    };
    if d.m == 0 || d.n == 0 || d.k == 0 || d.batch == 0 || c.2 {
        return Err(shape(format!("{d:?} with C transposed: {}", c.2)));
    }
    let need = [
        (
            "a",
            extent(d.m, d.k, a.1, a.2, d.batch, d.strides[0]),
            a.0,
            a.1 < if a.2 { d.m } else { d.k },
        ),
        (
            "b",
            extent(d.k, d.n, b.1, b.2, d.batch, d.strides[1]),
            b.0,
            b.1 < if b.2 { d.k } else { d.n },
        ),
        (
            "c",
            extent(d.m, d.n, c.1, false, d.batch, d.strides[2]),
            c.0,
            c.1 < d.n,
        ),
    ];
    for (name, want, got, short_rows) in need {
        if want > got || short_rows {
            return Err(shape(format!("`{name}` holds {got} elements, the product {d:?} reads {want} (or its rows overlap)")));
        }
    }
    Ok(())
}

/// A bias goes with one dense product in C's type: `n` elements.
fn check_bias(d: &Dims, bias_len: usize, ldc: usize, same_type: bool) -> Result<(), GpuError> {
    crate::error::check_len("matmul", "bias", bias_len, d.n)?;
    // A linear layer's output: never batched, C m dense rows of n in the bias's type.
    if d.batch != 1 || ldc != d.n || !same_type {
        return Err(GpuError::Shape {
            kernel: "matmul",
            what: format!(
                "a bias needs one dense product in the activations' type, not {d:?} with rows of {ldc}"
            ),
        });
    }
    Ok(())
}

fn operand<E>(m: &Mat<E>) -> Operand {
    Operand {
        addr: m.view.addr(),
        ld: m.ld,
        trans: m.trans,
    }
}

/// `c = a b (+ c) (+ bias on each row)`, every extent checked against its view; `c` in
/// `T` or f32. The bias goes with the product: one dense product, `c` in `T`.
pub fn matmul<B: Backend, T: Act, O: Act>(
    be: &B,
    c: Mat<O>,
    a: Mat<T>,
    b: Mat<T>,
    d: Dims,
    bias: Option<View<T>>,
    accumulate: bool,
) -> Result<(), GpuError> {
    check_extents(
        &d,
        (a.view.len(), a.ld, a.trans),
        (b.view.len(), b.ld, b.trans),
        (c.view.len(), c.ld, c.trans),
    )?;
    if let Some(v) = bias {
        check_bias(&d, v.len(), c.ld, O::DTYPE == T::DTYPE)?;
    }
    let g = Gemm {
        m: d.m,
        n: d.n,
        k: d.k,
        a: operand(&a),
        b: operand(&b),
        c: c.view.addr(),
        ldc: c.ld,
        batch: d.batch,
        strides: d.strides,
        ab: AbTypes::Act(T::DTYPE),
        scale_inv: [0, 0],
        c_type: O::DTYPE,
        accumulate,
        bias: bias.map(|v| v.addr()),
    };
    // SAFETY: every operand's extent (its last batch entry's last element) lies inside
    // its view and rows do not overlap; a bias holds n elements of C's type and C is dense.
    unsafe { be.gemm(&g) }
}

/// `c = (a b) a_scale_inv b_scale_inv (+ c) (+ bias on each row)` over FP8 operands, as
/// cuBLASLt runs FP8 on Hopper: one product (no batch), both operands with the shared
/// dimension contiguous (`a` stored as is, `b` stored transposed: cuBLASLt's "TN", the
/// only FP8 layout sm_90 runs), `k`, `n` and both leading dimensions multiples of 16, not both
/// E5M2, `c` in bf16 or f32, the bias in `c`'s type. `scale_inv` holds one f32 each, the
/// factor that undoes each operand's delayed scale ([`crate::fp8::Fp8Scalers::scale_inv`]).
/// A layout the device could not run is refused here on every backend, so the host tests
/// catch it.
#[allow(clippy::too_many_arguments)]
pub fn matmul_fp8<B: Backend, TA: Fp8, TB: Fp8, O: Act>(
    be: &B,
    c: Mat<O>,
    a: Mat<TA>,
    b: Mat<TB>,
    scale_inv: [View<f32>; 2],
    d: Dims,
    bias: Option<View<O>>,
    accumulate: bool,
) -> Result<(), GpuError> {
    let refuse = |what: String| {
        Err(GpuError::Shape {
            kernel: "matmul-fp8",
            what,
        })
    };
    check_extents(
        &d,
        (a.view.len(), a.ld, a.trans),
        (b.view.len(), b.ld, b.trans),
        (c.view.len(), c.ld, c.trans),
    )?;
    if a.trans || !b.trans {
        return refuse(format!(
            "FP8 products take A as stored and B transposed (the shared dimension contiguous in both), not A transposed {} and B transposed {}",
            a.trans, b.trans
        ));
    }
    if d.batch != 1 || [d.k, d.n, a.ld, b.ld].iter().any(|x| !x.is_multiple_of(16)) {
        return refuse(format!(
            "FP8 products need one product with k, n and the leading dimensions multiples of 16 (PyTorch's `_scaled_mm` asks the same), not {d:?} with leading dimensions {} and {}",
            a.ld, b.ld
        ));
    }
    if TA::DTYPE == Fp8Dtype::E5m2 && TB::DTYPE == Fp8Dtype::E5m2 {
        return refuse("cuBLASLt has no E5M2 x E5M2 product".into());
    }
    if O::DTYPE == Dtype::F16 {
        return refuse("an FP8 product writes bf16 or f32, not f16".into());
    }
    for (name, v) in ["a_scale_inv", "b_scale_inv"].into_iter().zip(&scale_inv) {
        crate::error::check_len("matmul-fp8", name, v.len(), 1)?;
    }
    if let Some(v) = bias {
        check_bias(&d, v.len(), c.ld, true)?;
    }
    let g = Gemm {
        m: d.m,
        n: d.n,
        k: d.k,
        a: operand(&a),
        b: operand(&b),
        c: c.view.addr(),
        ldc: c.ld,
        batch: 1,
        strides: [0; 3],
        ab: AbTypes::Fp8 {
            a: TA::DTYPE,
            b: TB::DTYPE,
        },
        scale_inv: scale_inv.map(|v| v.addr()),
        c_type: O::DTYPE,
        accumulate,
        bias: bias.map(|v| v.addr()),
    };
    // SAFETY: as `matmul`'s; each scale_inv view holds its one f32.
    unsafe { be.gemm(&g) }
}

/// The host's product: operands widened to f32, the `gemm` crate, C's old value and the
/// bias added in f32, the result rounded once to C's type (as cuBLASLt's epilogue does).
/// Exposed to the host backend only.
///
/// # Safety
/// The [`Gemm`]'s addresses are host pointers with the extents [`matmul`] checks.
pub(crate) unsafe fn host_gemm(g: &Gemm) {
    let load = |addr: Addr, ty: Dtype, i: usize| -> f32 {
        // SAFETY: the caller's contract: i is below the operand's checked extent.
        unsafe {
            match ty {
                Dtype::F32 => *(addr as usize as *const f32).add(i),
                Dtype::Bf16 => (*(addr as usize as *const half::bf16).add(i)).to_f32(),
                Dtype::F16 => (*(addr as usize as *const half::f16).add(i)).to_f32(),
            }
        }
    };
    // FP8 operands are decoded exactly (stoker-precision's tables); their products are
    // exact in f32, so only the sums round, as on the tensor cores.
    let load_ab = |addr: Addr, which: usize, i: usize| -> f32 {
        match g.ab {
            AbTypes::Act(ty) => load(addr, ty, i),
            AbTypes::Fp8 { a, b } => {
                let format = if which == 0 { a } else { b }.format();
                // SAFETY: the caller's contract: i is below the operand's checked extent.
                let bits = unsafe { *(addr as usize as *const u8).add(i) };
                stoker_precision::fp8::fp8_to_f32(bits, format)
            }
        }
    };
    // SAFETY: for FP8 operands `matmul_fp8` checked that each scale_inv holds one f32.
    let factor = match g.ab {
        AbTypes::Act(_) => None,
        AbTypes::Fp8 { .. } => unsafe {
            Some(
                *(g.scale_inv[0] as usize as *const f32) * *(g.scale_inv[1] as usize as *const f32),
            )
        },
    };
    let (m, n, k) = (g.m, g.n, g.k);
    for z in 0..g.batch {
        // A and B widened into dense row-major f32 copies (m x k, k x n).
        let a: Vec<f32> = (0..m * k)
            .map(|x| {
                let (i, l) = (x / k, x % k);
                let at = if g.a.trans {
                    l * g.a.ld + i
                } else {
                    i * g.a.ld + l
                };
                load_ab(g.a.addr, 0, z * g.strides[0] + at)
            })
            .collect();
        let b: Vec<f32> = (0..k * n)
            .map(|x| {
                let (l, j) = (x / n, x % n);
                let at = if g.b.trans {
                    j * g.b.ld + l
                } else {
                    l * g.b.ld + j
                };
                load_ab(g.b.addr, 1, z * g.strides[1] + at)
            })
            .collect();
        let mut c = vec![0f32; m * n];
        // SAFETY: a, b, c are dense row-major buffers of m x k, k x n, m x n.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                c.as_mut_ptr(),
                1,
                n as isize,
                false,
                a.as_ptr(),
                1,
                k as isize,
                b.as_ptr(),
                1,
                n as isize,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
        for i in 0..m {
            for j in 0..n {
                let mut v = match factor {
                    Some(f) => c[i * n + j] * f,
                    None => c[i * n + j],
                };
                let at = z * g.strides[2] + i * g.ldc + j;
                if g.accumulate {
                    v += load(g.c, g.c_type, at);
                }
                if let Some(bias) = g.bias {
                    v += load(bias, g.c_type, j);
                }
                // SAFETY: `at` is below C's checked extent.
                unsafe {
                    match g.c_type {
                        Dtype::F32 => *(g.c as usize as *mut f32).add(at) = v,
                        Dtype::Bf16 => {
                            *(g.c as usize as *mut half::bf16).add(at) = half::bf16::from_f32(v)
                        }
                        Dtype::F16 => {
                            *(g.c as usize as *mut half::f16).add(at) = half::f16::from_f32(v)
                        }
                    }
                }
            }
        }
    }
}
