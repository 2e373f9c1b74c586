//! A tiny deterministic RNG for per-sample augmentation.
//!
//! Each sample seeds its own generator from `SampleContext::sample_seed()`, so the draws depend on
//! (seed, epoch, index) alone, never on which worker ran the sample or in what order. splitmix64
//! is enough here: a handful of draws per sample, good equidistribution, one `u64` of state.

use crate::dataset::mix64;

/// splitmix64: a counter stepped by the golden-ratio increment, finalized by [`mix64`].
#[derive(Debug, Clone)]
pub struct SampleRng {
    state: u64,
}

impl SampleRng {
    /// A generator whose whole stream is fixed by `seed`.
    pub fn new(seed: u64) -> Self {
        SampleRng { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        // mix64 adds the increment itself; stepping the state by it gives the splitmix64 stream.
        let out = mix64(self.state);
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        out
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.next_f64()
    }

    /// Uniform integer in [0, n) (n > 0), by the multiply-shift method; the bias is below 2^-32
    /// for any n that fits an image dimension.
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
}
