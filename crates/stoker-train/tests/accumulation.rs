//! Gradient accumulation: 8 micro-batches of 1 give the gradient of one batch of 8 when the
//! loss is normalized by the window's valid targets, and not when it is normalized by the
//! step count.

mod common;

use candle_core::{Device, Tensor};
use common::*;
use stoker_train::accumulate::{MicroBatch, Normalization};
use stoker_train::precision::Precision;

/// Eight sequences with 0..7 masked (padded) trailing targets: different valid-token counts.
const MASKED: [usize; 8] = [0, 5, 1, 4, 2, 3, 5, 0];

fn token_window(rows: &[usize]) -> Vec<MicroBatch> {
    // Micro-batch `k` holds rows[k] sequences; all eight sequences are the same ones.
    let t = 6;
    let full = token_batch(11, 8, t, 11, &MASKED);
    let input = full.input.to_vec2::<i64>().unwrap();
    let mut out = Vec::new();
    let mut r0 = 0;
    for &n in rows {
        let inp: Vec<i64> = input[r0..r0 + n].concat();
        out.push(MicroBatch {
            input: Tensor::from_vec(inp, (n, t), &Device::Cpu).unwrap(),
            targets: full.targets[r0 * t..(r0 + n) * t].to_vec(),
        });
        r0 += n;
    }
    out
}

#[test]
fn token_loss_eight_micro_batches_equal_one_batch_of_eight() {
    let model = tiny_gpt(Precision::Fp32);
    let (one, loss_one) = window_grads(
        &model,
        Precision::Fp32,
        &token_window(&[8]),
        Normalization::WindowCount,
    );
    let (eight, loss_eight) = window_grads(
        &model,
        Precision::Fp32,
        &token_window(&[1; 8]),
        Normalization::WindowCount,
    );
    let rel = rel_l2(&eight, &one);
    assert!(
        rel < 1e-5,
        "window-count normalization: relative difference {rel:e}"
    );
    assert!((loss_one - loss_eight).abs() < 1e-5 * loss_one);

    // The step-count rule (mean per micro-batch / 8) weights the tokens of short
    // micro-batches more: it does not reproduce the batch of 8.
    let (wrong, _) = window_grads(
        &model,
        Precision::Fp32,
        &token_window(&[1; 8]),
        Normalization::StepCount,
    );
    let rel_wrong = rel_l2(&wrong, &one);
    assert!(
        rel_wrong > 1e-2,
        "step-count normalization should differ, got {rel_wrong:e}"
    );
}

fn class_window(sizes: &[usize]) -> Vec<MicroBatch> {
    let x = floats(21, 8 * 6);
    let y = ints(22, 8, 3);
    let mut out = Vec::new();
    let mut r0 = 0;
    for &n in sizes {
        out.push(MicroBatch {
            input: Tensor::from_vec(x[r0 * 6..(r0 + n) * 6].to_vec(), (n, 6), &Device::Cpu)
                .unwrap(),
            targets: y[r0..r0 + n].to_vec(),
        });
        r0 += n;
    }
    out
}

#[test]
fn classification_micro_batches_equal_one_batch_mean_per_sample() {
    let model = tiny_mlp(Precision::Fp32);
    let (one, _) = window_grads(
        &model,
        Precision::Fp32,
        &class_window(&[8]),
        Normalization::WindowCount,
    );
    for sizes in [&[1usize; 8][..], &[3, 1, 4][..]] {
        let (acc, _) = window_grads(
            &model,
            Precision::Fp32,
            &class_window(sizes),
            Normalization::WindowCount,
        );
        let rel = rel_l2(&acc, &one);
        assert!(rel < 1e-5, "{sizes:?}: relative difference {rel:e}");
    }
    // With equal micro-batches of one sample both rules agree; with uneven ones (a short
    // last micro-batch) the step-count rule is wrong.
    let (uneven, _) = window_grads(
        &model,
        Precision::Fp32,
        &class_window(&[3, 1, 4]),
        Normalization::StepCount,
    );
    assert!(rel_l2(&uneven, &one) > 1e-2);
}

#[test]
fn cnn_micro_batches_equal_one_batch() {
    let model = tiny_cnn(Precision::Fp32);
    let x = floats(31, 8 * 64);
    let y = ints(32, 8, 4);
    let window = |n: usize| -> Vec<MicroBatch> {
        (0..8 / n)
            .map(|k| MicroBatch {
                input: Tensor::from_vec(
                    x[k * n * 64..(k + 1) * n * 64].to_vec(),
                    (n, 1, 8, 8),
                    &Device::Cpu,
                )
                .unwrap(),
                targets: y[k * n..(k + 1) * n].to_vec(),
            })
            .collect()
    };
    let (one, _) = window_grads(
        &model,
        Precision::Fp32,
        &window(8),
        Normalization::WindowCount,
    );
    let (eight, _) = window_grads(
        &model,
        Precision::Fp32,
        &window(1),
        Normalization::WindowCount,
    );
    assert!(rel_l2(&eight, &one) < 1e-5);
}
