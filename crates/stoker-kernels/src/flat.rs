//! Whole-buffer passes over the flat FP32 gradient and parameter buffers that the trainer
//! runs every step: the global L2 norm, scaling by the clip coefficient, and zeroing (the
//! finiteness check is stoker-precision's `all_finite`). Parallel over fixed-size chunks,
//! with each chunk's partial result combined in chunk order, so the results do not depend
//! on the thread count.

use rayon::prelude::*;

/// Elements per task: 64 Ki f32 (256 KiB), large enough that scheduling is noise.
const CHUNK: usize = 1 << 16;

/// Sum of squares of `x` in f64, over eight lanes so the loop vectorizes.
fn sum_squares(x: &[f32]) -> f64 {
    let mut lanes = [0f64; 8];
    let mut blocks = x.chunks_exact(8);
    for b in &mut blocks {
        for (l, &v) in lanes.iter_mut().zip(b) {
            *l += (v as f64) * (v as f64);
        }
    }
    let tail: f64 = blocks
        .remainder()
        .iter()
        .map(|&v| (v as f64) * (v as f64))
        .sum();
    lanes.iter().sum::<f64>() + tail
}

/// The sum of squares of `x`, accumulated in f64 over fixed chunks added in chunk order
/// (the same bits at any thread count). Finite exactly when every element is (an f32
/// squared fits f64, and so does any realistic count of them). The partial a sharded
/// strategy sums over ranks.
pub fn sum_of_squares(x: &[f32]) -> f64 {
    let partials: Vec<f64> = x.par_chunks(CHUNK).map(sum_squares).collect();
    partials.iter().sum::<f64>()
}

/// The L2 norm of `x`, accumulated in f64 ([`sum_of_squares`]'s root).
pub fn l2_norm(x: &[f32]) -> f64 {
    sum_of_squares(x).sqrt()
}

/// Torch's `clip_grad_norm_` coefficient for gradients of global norm `norm` clipped at
/// `max_norm`: `max_norm / (norm + 1e-6)` where that is below 1, else None (no clipping).
/// The one definition the CPU trainer and the GPU step both use.
pub fn clip_coefficient(norm: f64, max_norm: f64) -> Option<f64> {
    Some(max_norm / (norm + 1e-6)).filter(|&c| c < 1.0)
}

/// `x *= c`, in parallel.
pub fn scale(x: &mut [f32], c: f32) {
    x.par_chunks_mut(CHUNK)
        .for_each(|x| x.iter_mut().for_each(|v| *v *= c));
}

/// `out = bf16(x)`, rounded to nearest even as the optimizers' bf16 copy-out rounds, in
/// parallel.
pub fn to_bf16(x: &[f32], out: &mut [half::bf16]) {
    assert_eq!(
        x.len(),
        out.len(),
        "to_bf16: input and output lengths differ"
    );
    out.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .for_each(|(o, x)| {
            o.iter_mut()
                .zip(x)
                .for_each(|(o, &v)| *o = crate::fastmath::to_bf16(v))
        });
}

/// `x = 0`, in parallel.
pub fn zero(x: &mut [f32]) {
    x.par_chunks_mut(CHUNK).for_each(|x| x.fill(0.0));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn norm_matches_f64_and_is_independent_of_chunking() {
        let x: Vec<f32> = (0..200_003)
            .map(|i| ((i * 37 % 1001) as f32 - 500.0) / 7.0)
            .collect();
        let exact = x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt();
        let n = l2_norm(&x);
        assert!((n - exact).abs() <= 1e-12 * exact, "{n} vs {exact}");
        let single = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        assert_eq!(single.install(|| l2_norm(&x)).to_bits(), n.to_bits());
    }

    #[test]
    fn non_finite_norm_and_scaling() {
        let mut x = vec![1.5f32; 70_001];
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for at in [0, 65_536, 70_000] {
                let keep = x[at];
                x[at] = bad;
                assert!(!l2_norm(&x).is_finite(), "{bad} at {at}");
                x[at] = keep;
            }
        }
        scale(&mut x, 2.0);
        assert!(x.iter().all(|&v| v == 3.0));
    }
}
