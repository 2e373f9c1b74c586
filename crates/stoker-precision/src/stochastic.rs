//! Stochastic rounding f32 -> bf16, as llm.c does when it writes bf16 parameters in AdamW.
//!
//! Each element rounds up to the next bf16 with probability equal to its distance from the
//! lower neighbour, in units of that bf16's spacing, so the rounding is unbiased in
//! expectation: small updates to bf16 weights survive on average instead of being rounded
//! away. Implementation: add 16 random bits to the f32 bits and keep the high half (a carry out
//! of the low 16 bits happens with probability `low16 / 65536`). NaN becomes the canonical NaN
//! (`0x7FC0` with its sign) as in round-to-nearest; ±inf stays ±inf; a finite value above the largest bf16 may round up to inf
//! (llm.c's version does the same).
//!
//! The random bits of element `i` are a hash of `(seed, offset + i)`: counter-based, so a
//! result does not depend on how the slice is split across threads, and a run restarted from a
//! saved [`StochasticRounder`] state reproduces the same bits.

use half::bf16;
use rayon::prelude::*;

use crate::convert::PAR_CHUNK;
use crate::error::{check_len, Result};

/// 32-bit integer hash with good avalanche (Chris Wellons' "lowbias32").
#[inline(always)]
fn hash32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^= x >> 16;
    x
}

/// The 16 random bits used for element `index` under `seed`.
#[inline(always)]
fn noise(seed: u64, index: u64) -> u32 {
    let k0 = seed as u32;
    let k1 = (seed >> 32) as u32;
    let hi = hash32((index >> 32) as u32 ^ k1);
    hash32((index as u32) ^ k0 ^ hi.rotate_left(7)) & 0xFFFF
}

/// Rounds one f32 to bf16 stochastically with the given 16 random bits (`r < 65536`).
#[inline(always)]
pub fn f32_to_bf16_stochastic_with(x: f32, r: u32) -> bf16 {
    let b = x.to_bits();
    let up = (b.wrapping_add(r & 0xFFFF) >> 16) as u16;
    let nan = (((b >> 16) & 0x8000) | 0x7FC0) as u16;
    bf16::from_bits(if b & 0x7FFF_FFFF > 0x7F80_0000 {
        nan
    } else {
        up
    })
}

fn kernel(src: &[f32], dst: &mut [bf16], seed: u64, offset: u64) {
    for (i, (d, &x)) in dst.iter_mut().zip(src).enumerate() {
        *d = f32_to_bf16_stochastic_with(x, noise(seed, offset + i as u64));
    }
}

/// Stochastically rounds `src` into `dst`; element `i` uses the random bits of
/// `(seed, offset + i)`.
pub fn f32_to_bf16_stochastic(src: &[f32], dst: &mut [bf16], seed: u64, offset: u64) -> Result<()> {
    check_len("f32_to_bf16_stochastic", src.len(), dst.len())?;
    if src.len() < 2 * PAR_CHUNK {
        kernel(src, dst, seed, offset);
    } else {
        dst.par_chunks_mut(PAR_CHUNK)
            .zip(src.par_chunks(PAR_CHUNK))
            .enumerate()
            .for_each(|(c, (d, s))| kernel(s, d, seed, offset + (c * PAR_CHUNK) as u64));
    }
    Ok(())
}

/// A seeded stochastic rounder that advances its counter by the number of elements it rounds,
/// so successive calls (steps) draw fresh bits. Its state is two integers: save it with the
/// checkpoint for bit-identical resumption.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StochasticRounder {
    /// The seed.
    pub seed: u64,
    /// Elements rounded so far (the counter of the next element).
    pub counter: u64,
}

impl StochasticRounder {
    /// A rounder at the start of its stream.
    pub fn new(seed: u64) -> Self {
        Self { seed, counter: 0 }
    }

    /// Rounds `src` into `dst` and advances the counter by `src.len()`.
    pub fn round(&mut self, src: &[f32], dst: &mut [bf16]) -> Result<()> {
        f32_to_bf16_stochastic(src, dst, self.seed, self.counter)?;
        self.counter = self.counter.wrapping_add(src.len() as u64);
        Ok(())
    }
}
