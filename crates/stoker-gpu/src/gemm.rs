//! Matrix products: [`matmul`] checks every operand's extent against its view, then hands
//! the backend a [`Gemm`] (one batched, strided product as data, row-major, A and B in the
//! activations' type, C in it or in f32: weight gradients accumulate in f32; a linear
//! layer's bias added before C is rounded). The host runs products with the `gemm` crate
//! in f32 (`host_gemm`), the device with cuBLASLt (the bias in its epilogue), or cuBLAS.

use crate::backend::{Backend, View};
use crate::call::{Addr, Gemm, Operand};
use crate::elem::{Act, Dtype};
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
    const K: &str = "matmul";
    let shape = |what: String| GpuError::Shape { kernel: K, what };
    if d.m == 0 || d.n == 0 || d.k == 0 || d.batch == 0 || c.trans {
        return Err(shape(format!("{d:?} with C transposed: {}", c.trans)));
    }
    let need = [
        (
            "a",
            extent(d.m, d.k, a.ld, a.trans, d.batch, d.strides[0]),
            a.view.len(),
            a.ld < if a.trans { d.m } else { d.k },
        ),
        (
            "b",
            extent(d.k, d.n, b.ld, b.trans, d.batch, d.strides[1]),
            b.view.len(),
            b.ld < if b.trans { d.k } else { d.n },
        ),
        (
            "c",
            extent(d.m, d.n, c.ld, false, d.batch, d.strides[2]),
            c.view.len(),
            c.ld < d.n,
        ),
    ];
    for (name, want, got, short_rows) in need {
        if want > got || short_rows {
            return Err(shape(format!("`{name}` holds {got} elements, the product {d:?} reads {want} (or its rows overlap)")));
        }
    }
    if let Some(v) = bias {
        crate::error::check_len(K, "bias", v.len(), d.n)?;
        // A linear layer's output: never batched, C m dense rows of n in the bias's type.
        if d.batch != 1 || c.ld != d.n || O::DTYPE != T::DTYPE {
            return Err(shape(format!(
                "a bias needs one dense product in the activations' type, not {d:?} with rows of {}",
                c.ld
            )));
        }
    }
    let g = Gemm {
        m: d.m,
        n: d.n,
        k: d.k,
        a: Operand {
            addr: a.view.addr(),
            ld: a.ld,
            trans: a.trans,
        },
        b: Operand {
            addr: b.view.addr(),
            ld: b.ld,
            trans: b.trans,
        },
        c: c.view.addr(),
        ldc: c.ld,
        batch: d.batch,
        strides: d.strides,
        ab: T::DTYPE,
        c_type: O::DTYPE,
        accumulate,
        bias: bias.map(|v| v.addr()),
    };
    // SAFETY: every operand's extent (its last batch entry's last element) lies inside
    // its view and rows do not overlap; a bias holds n elements of C's type and C is dense.
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
                load(g.a.addr, g.ab, z * g.strides[0] + at)
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
                load(g.b.addr, g.ab, z * g.strides[1] + at)
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
                let mut v = c[i * n + j];
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
