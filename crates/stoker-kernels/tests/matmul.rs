//! The bf16 GEMM: every kernel this CPU runs (AMX, AVX512-BF16, portable) against an f64
//! reference over awkward shapes and all storage orders, and the candle op's forward and
//! backward against the same reference.
//!
//! Tolerance: bf16 products are exact in f32, so the only errors are the f32 additions
//! (at most `(k + 1) 2^-24 sum |a_i b_i|` in any order) and, for bf16 outputs, one final
//! rounding (`2^-8 |c|`).

mod common;

use candle_core::{DType, Device, Tensor, Var};
use half::bf16;
use stoker_kernels::matmul::{gemm_bf16_with, Bf16Kernel, Bf16Matmul, MatRef};
use stoker_kernels::{linear_bf16, matmul_bf16};

/// `m x k`, `k x n` shapes: single elements, odd and prime sizes, sizes one past a tile
/// (32 rows, 16 / 32 columns, 32 inner elements), and a long inner dimension.
const SHAPES: &[(usize, usize, usize)] = &[
    (1, 1, 1),
    (1, 3, 1),
    (2, 1, 5),
    (5, 7, 3),
    (33, 65, 31),
    (31, 33, 17),
    (64, 128, 96),
    (17, 1031, 9),
];

fn bf16s(n: usize, seed: u64) -> Vec<bf16> {
    common::values(n, seed, 2.0)
        .into_iter()
        .map(bf16::from_f32)
        .collect()
}

/// Logical element `(i, j)` of a matrix stored transposed or not.
fn at(m: &MatRef, i: usize, j: usize) -> f64 {
    let idx = if m.transposed {
        j * m.rows + i
    } else {
        i * m.cols + j
    };
    m.data[idx].to_f64()
}

/// f64 reference `A . B` and, per element, `sum |a_i b_i|` for the error bound.
fn reference(a: &MatRef, b: &MatRef) -> (Vec<f64>, Vec<f64>) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    let mut c = vec![0.0; m * n];
    let mut mag = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            for r in 0..k {
                let p = at(a, i, r) * at(b, r, j);
                c[i * n + j] += p;
                mag[i * n + j] += p.abs();
            }
        }
    }
    (c, mag)
}

fn check(got: &[f32], want: &[f64], mag: &[f64], k: usize, out_rounding: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (idx, ((&g, &w), &s)) in got.iter().zip(want).zip(mag).enumerate() {
        let tol = (k as f64 + 1.0) * 2f64.powi(-24) * s + out_rounding * w.abs() + 1e-30;
        assert!(
            (g as f64 - w).abs() <= tol,
            "{what}: element {idx}: got {g}, want {w} (tolerance {tol:e})"
        );
    }
}

#[test]
fn every_kernel_matches_f64_in_every_storage_order() {
    let kernels = Bf16Kernel::available();
    assert_eq!(kernels.last(), Some(&Bf16Kernel::Portable));
    for &(m, k, n) in SHAPES {
        let (av, bv) = (bf16s(m * k, 1 + m as u64), bf16s(k * n, 2 + n as u64));
        for (a_t, b_t) in [(false, false), (false, true), (true, false), (true, true)] {
            let a = MatRef {
                data: &av,
                rows: m,
                cols: k,
                transposed: a_t,
            };
            let b = MatRef {
                data: &bv,
                rows: k,
                cols: n,
                transposed: b_t,
            };
            let (want, mag) = reference(&a, &b);
            for &kernel in &kernels {
                let got = gemm_bf16_with(kernel, &a, &b).unwrap();
                let what = format!("{kernel:?} {m}x{k}x{n} a_t={a_t} b_t={b_t}");
                check(&got, &want, &mag, k, 0.0, &what);
            }
        }
    }
}

/// Whether CPUID names an Intel CPU, whose `vdpbf16ps` order of operations (odd product,
/// then even, each sum rounded) the portable kernel follows.
fn intel() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let r = std::arch::x86_64::__cpuid(0);
        let mut v = Vec::new();
        for w in [r.ebx, r.edx, r.ecx] {
            v.extend_from_slice(&w.to_le_bytes());
        }
        v == b"GenuineIntel"
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The AVX512-BF16 kernel and the portable one do the same additions in the same order
/// (Intel's documented `vdpbf16ps` semantics), so on normal numbers they agree bit for
/// bit. Other vendors' implementations are only held to the f64 bound above.
#[test]
fn avx512_and_portable_kernels_agree_bitwise() {
    if !Bf16Kernel::available().contains(&Bf16Kernel::Avx512Bf16) || !intel() {
        eprintln!("skipped: no Intel AVX512-BF16 on this CPU");
        return;
    }
    for &(m, k, n) in SHAPES {
        let (av, bv) = (bf16s(m * k, 11), bf16s(k * n, 12));
        let a = MatRef {
            data: &av,
            rows: m,
            cols: k,
            transposed: false,
        };
        let b = MatRef {
            data: &bv,
            rows: k,
            cols: n,
            transposed: true,
        };
        let x = gemm_bf16_with(Bf16Kernel::Avx512Bf16, &a, &b).unwrap();
        let y = gemm_bf16_with(Bf16Kernel::Portable, &a, &b).unwrap();
        let same = x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits());
        assert!(same, "{m}x{k}x{n}: AVX512 and portable kernels differ");
    }
}

fn mat(data: &[bf16], rows: usize, cols: usize, transposed: bool) -> MatRef<'_> {
    MatRef {
        data,
        rows,
        cols,
        transposed,
    }
}

fn tensor(v: &[bf16], shape: (usize, usize)) -> Tensor {
    Tensor::from_slice(v, shape, &Device::Cpu).unwrap()
}

fn to_f32(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// `y = x W^T` and its gradients against f64 references: `dx = G W`, `dW = G^T x`, with
/// `G` the gradient of `sum(y * R)`, i.e. `R`.
#[test]
fn linear_forward_and_backward_match_f64() {
    for &(m, k, n) in SHAPES {
        let (xv, wv, rv) = (bf16s(m * k, 21), bf16s(n * k, 22), bf16s(m * n, 23));
        let x = Var::from_tensor(&tensor(&xv, (m, k))).unwrap();
        let w = Var::from_tensor(&tensor(&wv, (n, k))).unwrap();
        let r = tensor(&rv, (m, n));
        let y = linear_bf16(x.as_tensor(), w.as_tensor()).unwrap();
        assert_eq!(y.dtype(), DType::BF16);
        let loss = (y.clone() * &r).unwrap().sum_all().unwrap();
        let grads = loss.backward().unwrap();
        let what = format!("{m}x{k}x{n}");
        let (want, mag) = reference(&mat(&xv, m, k, false), &mat(&wv, k, n, true));
        check(
            &to_f32(&y),
            &want,
            &mag,
            k,
            2f64.powi(-8),
            &format!("{what} y"),
        );
        let (want, mag) = reference(&mat(&rv, m, n, false), &mat(&wv, n, k, false));
        let dx = grads.get(x.as_tensor()).expect("dx");
        check(
            &to_f32(dx),
            &want,
            &mag,
            n,
            2f64.powi(-8),
            &format!("{what} dx"),
        );
        let (want, mag) = reference(&mat(&rv, n, m, true), &mat(&xv, m, k, false));
        let dw = grads.get(w.as_tensor()).expect("dW");
        check(
            &to_f32(dw),
            &want,
            &mag,
            m,
            2f64.powi(-8),
            &format!("{what} dW"),
        );
    }
}

/// The op with operands stored transposed: forward and both gradients equal those of
/// the plain product of explicitly transposed copies.
#[test]
fn transposed_operands_differentiate_like_plain_ones() {
    let (m, k, n) = (9, 37, 19);
    for (a_t, b_t) in [(false, true), (true, false), (true, true)] {
        let a_shape = if a_t { (k, m) } else { (m, k) };
        let b_shape = if b_t { (n, k) } else { (k, n) };
        let a = Var::from_tensor(&tensor(&bf16s(m * k, 31), a_shape)).unwrap();
        let b = Var::from_tensor(&tensor(&bf16s(k * n, 32), b_shape)).unwrap();
        let r = tensor(&bf16s(m * n, 33), (m, n));
        let y = a
            .as_tensor()
            .apply_op2(b.as_tensor(), Bf16Matmul { a_t, b_t })
            .unwrap();
        let g = (y.clone() * &r)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        // The same product from plain operands, made contiguous.
        let ap = Var::from_tensor(&if a_t {
            a.as_tensor().t().unwrap().contiguous().unwrap()
        } else {
            a.as_tensor().clone()
        })
        .unwrap();
        let bp = Var::from_tensor(&if b_t {
            b.as_tensor().t().unwrap().contiguous().unwrap()
        } else {
            b.as_tensor().clone()
        })
        .unwrap();
        let yp = matmul_bf16(ap.as_tensor(), bp.as_tensor()).unwrap();
        let gp = (yp.clone() * &r)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let what = format!("a_t={a_t} b_t={b_t}");
        assert_eq!(to_f32(&y), to_f32(&yp), "{what}: forward");
        let back = |t: &Tensor, flip: bool| {
            if flip {
                t.t().unwrap().contiguous().unwrap()
            } else {
                t.clone()
            }
        };
        let da = back(g.get(a.as_tensor()).unwrap(), a_t);
        let db = back(g.get(b.as_tensor()).unwrap(), b_t);
        assert_eq!(
            to_f32(&da),
            to_f32(gp.get(ap.as_tensor()).unwrap()),
            "{what}: dA"
        );
        assert_eq!(
            to_f32(&db),
            to_f32(gp.get(bp.as_tensor()).unwrap()),
            "{what}: dB"
        );
    }
}

#[test]
fn bad_inputs_name_the_op() {
    let x = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap();
    let w = Tensor::zeros((4, 3), DType::BF16, &Device::Cpu).unwrap();
    let e = linear_bf16(&x, &w).unwrap_err().to_string();
    assert!(e.contains("bf16-linear") && e.contains("F32"), "{e}");
    let x = Tensor::zeros((2, 5), DType::BF16, &Device::Cpu).unwrap();
    let e = linear_bf16(&x, &w).unwrap_err().to_string();
    assert!(e.contains("5 features") && e.contains("expects 3"), "{e}");
    let b = Tensor::zeros((4, 2), DType::BF16, &Device::Cpu).unwrap();
    let e = matmul_bf16(&x, &b).unwrap_err().to_string();
    assert!(e.contains("inner dimensions differ"), "{e}");
}
