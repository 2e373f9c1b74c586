//! A linear layer's bias goes with its product: added to the f32 accumulator and rounded
//! once to the output's type, as cuBLASLt's bias epilogue does on the device. The host
//! build must do the same, or the device check's step would compare two roundings
//! against one.

mod common;

use common::*;
use half::bf16;
use stoker_gpu::gemm::{matmul, Dims, Mat};
use stoker_gpu::Host;

#[test]
fn a_bf16_product_with_a_bias_rounds_once() {
    let (m, n, k) = (33, 24, 40);
    let a = to_bf16(&uniform(m * k, 1, 1.0));
    let w = to_bf16(&uniform(n * k, 2, 1.0));
    let bias = to_bf16(&uniform(n, 3, 0.5));
    let (ab, wb, bb, yb) = (up(&a), up(&w), up(&bias), zeros::<bf16>(m * n));
    // y = a w^T + bias, a linear layer's forward.
    matmul(
        &Host,
        Mat::rows(all(&yb), n),
        Mat::rows(all(&ab), k),
        Mat::t(all(&wb), k),
        Dims::one(m, n, k),
        Some(all(&bb)),
        false,
    )
    .unwrap();
    let y = down(&yb);
    // The reference in f64: the exact product of bf16 inputs plus the bias, rounded once.
    let (mut once_differs_from_twice, mut checked) = (0, 0);
    for i in 0..m {
        for j in 0..n {
            let dot: f64 = (0..k)
                .map(|l| a[i * k + l].to_f64() * w[j * k + l].to_f64())
                .sum();
            let exact = dot + bias[j].to_f64();
            let got = y[i * n + j].to_f64();
            // f32 accumulation of 40 products: the one rounding to bf16 dominates.
            let ulp = (exact.abs().max(1e-3)) * 2f64.powi(-8);
            assert!(
                (got - exact).abs() <= ulp,
                "y[{i}][{j}] = {got}, want {exact} within one bf16 ulp ({ulp})"
            );
            let twice = bf16::from_f32(bf16::from_f32(dot as f32).to_f32() + bias[j].to_f32());
            once_differs_from_twice += (twice.to_bits() != y[i * n + j].to_bits()) as usize;
            checked += 1;
        }
    }
    // Rounding the product first and adding the bias after (the old add_bias pass) gives
    // other bits on some elements: the test tells the two apart.
    assert!(
        once_differs_from_twice > 0,
        "no element of {checked} tells one rounding from two"
    );
}

#[test]
fn a_bias_on_a_batched_or_f32_output_is_refused() {
    let (m, n, k) = (4, 8, 8);
    let a = up(&to_bf16(&uniform(2 * m * k, 4, 1.0)));
    let b = up(&to_bf16(&uniform(2 * k * n, 5, 1.0)));
    let bias = up(&to_bf16(&uniform(n, 6, 1.0)));
    let c = zeros::<bf16>(2 * m * n);
    let batched = Dims {
        batch: 2,
        strides: [m * k, k * n, m * n],
        ..Dims::one(m, n, k)
    };
    let err = matmul(
        &Host,
        Mat::rows(all(&c), n),
        Mat::rows(all(&a), k),
        Mat::rows(all(&b), n),
        batched,
        Some(all(&bias)),
        false,
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("a bias needs one dense product"),
        "{err}"
    );
    let c32 = zeros::<f32>(m * n);
    let err = matmul(
        &Host,
        Mat::rows(all(&c32), n),
        Mat::rows(all(&a), k),
        Mat::rows(all(&b), n),
        Dims::one(m, n, k),
        Some(all(&bias)),
        false,
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("a bias needs one dense product"),
        "{err}"
    );
}
