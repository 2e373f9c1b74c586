//! A linear layer's bias gradient in bf16 and f16 on candle's graph (the composed ops,
//! and bf16 on a CPU without bf16 hardware): a sum over every row, which candle would
//! take in the half type itself and which stagnates there (2,048 rows of about 0.75 sum
//! to 256 in bf16, a sixth of the truth). The layer sums it in f32: within the half
//! type's rounding of the f32 layer's gradient, and the output bit for bit the same.

use candle_core::{DType, Device, Tensor, Var};

use stoker_train::ops::linear;
use stoker_train::precision::{Fx, Kernels, Precision};

const ROWS: usize = 2048;
const IN: usize = 16;
const OUT: usize = 8;

/// Seeded values in `lo..lo + 0.5`.
fn values(n: usize, seed: usize, lo: f32) -> Vec<f32> {
    (0..n)
        .map(|i| lo + ((i * 7919 + seed * 104_729) % 1000) as f32 / 2000.0)
        .collect()
}

/// The bias gradient and the output of `linear` at `precision` on the composed ops, for
/// a loss that weights each output by a positive value (the bias gradient then sums
/// 2,048 positive terms per column).
fn bias_grad(precision: Precision) -> (Vec<f32>, Vec<f32>) {
    let dev = Device::Cpu;
    let fx = Fx::new(precision, None).with_kernels(Kernels::Composed);
    let dt = fx.compute;
    let t = |v: Vec<f32>, shape: &[usize]| {
        Tensor::from_vec(v, shape, &dev)
            .unwrap()
            .to_dtype(dt)
            .unwrap()
    };
    let x = t(values(ROWS * IN, 1, -0.25), &[ROWS, IN]);
    let w = t(values(OUT * IN, 2, -0.25), &[OUT, IN]);
    let b = Var::from_tensor(&t(values(OUT, 3, 0.0), &[OUT])).unwrap();
    let weights = Tensor::from_vec(values(ROWS * OUT, 4, 0.5), (ROWS, OUT), &dev).unwrap();
    let y = linear(&fx, "l", &x, &w, Some(b.as_tensor())).unwrap();
    let loss = (y.to_dtype(DType::F32).unwrap() * &weights)
        .unwrap()
        .sum_all()
        .unwrap();
    let grads = loss.backward().unwrap();
    let f32s = |t: &Tensor| -> Vec<f32> {
        t.to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    (f32s(grads.get(b.as_tensor()).unwrap()), f32s(&y))
}

#[test]
fn half_precision_bias_gradients_are_summed_in_f32() {
    let (want, _) = bias_grad(Precision::Fp32);
    for (precision, tol) in [(Precision::Bf16, 1e-2), (Precision::Fp16, 2e-3)] {
        let (got, y) = bias_grad(precision);
        stoker_testkit::assert_close(&got, &want, tol, &format!("{precision:?}: bias gradient"));
        // The forward: the product in the half type, the bias added and rounded once.
        let fx = Fx::new(precision, None).with_kernels(Kernels::Composed);
        let dev = Device::Cpu;
        let t = |v: Vec<f32>, shape: &[usize]| {
            Tensor::from_vec(v, shape, &dev)
                .unwrap()
                .to_dtype(fx.compute)
                .unwrap()
        };
        let x = t(values(ROWS * IN, 1, -0.25), &[ROWS, IN]);
        let w = t(values(OUT * IN, 2, -0.25), &[OUT, IN]);
        let b = t(values(OUT, 3, 0.0), &[OUT]);
        let plain = x
            .matmul(&w.t().unwrap())
            .unwrap()
            .broadcast_add(&b)
            .unwrap();
        let plain: Vec<f32> = plain
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        stoker_testkit::assert_bits_eq(&y, &plain, &format!("{precision:?}: the output"));
    }
}
