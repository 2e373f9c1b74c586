//! The kernels' IEEE half (fp16 storage), converted by bit arithmetic on both builds
//! (cuda/portable.h), against the `half` crate: narrowing rounds to nearest even,
//! through half's subnormals and up to inf, NaN kept; widening is exact.

mod common;

use common::*;
use half::f16;
use stoker_gpu::{kernels, Host};

/// Bits of `x`, with every NaN folded to one pattern (NaN payloads aside, both sides
/// must agree that it is NaN).
fn bits(x: f16) -> u16 {
    match x.is_nan() {
        true => 0x7e00,
        false => x.to_bits(),
    }
}

#[test]
fn narrowing_to_f16_is_half_crates_rounding_bit_for_bit() {
    let mut xs: Vec<f32> = vec![
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        65504.0,
        65519.99,
        65520.0,
        -65520.0,
        1e9,
        6.1035156e-5,       // 2^-14, the least normal
        6.1035152e-5,       // just below it
        5.9604645e-8,       // 2^-24, the least subnormal
        2.9802322e-8,       // 2^-25: a tie, to zero
        2.9802326e-8,       // just above the tie: up
        8.940697e-8,        // 1.5 x 2^-24: a tie, to even (2 x 2^-24)
        1e-45,              // an f32 subnormal
        1.0 + 1.0 / 2048.0, // a tie between normals, to even
        1.0 + 3.0 / 2048.0,
    ];
    // Every exponent, with random fractions: a fixed LCG keeps it deterministic.
    let mut s = 0x9e3779b97f4a7c15u64;
    for _ in 0..200_000 {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        xs.push(f32::from_bits((s >> 32) as u32));
    }
    let out = zeros::<f16>(xs.len());
    kernels::from_f32(&Host, all(&out), all(&up(&xs))).unwrap();
    for (x, got) in xs.iter().zip(down(&out)) {
        let want = f16::from_f32(*x);
        assert_eq!(
            bits(got),
            bits(want),
            "{x:e} ({:#010x}) narrowed to {:#06x}, half gives {:#06x}",
            x.to_bits(),
            got.to_bits(),
            want.to_bits()
        );
    }
}

#[test]
fn widening_every_f16_is_exact() {
    let all_f16: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
    // The wpe gradient of one sequence adds each element to a zero: the widened value
    // itself (0 + -0 is +0, compared by value below).
    let dwpe = zeros::<f32>(all_f16.len());
    kernels::encoder_backward_wpe(&Host, all(&dwpe), all(&up(&all_f16)), 1, 1, all_f16.len())
        .unwrap();
    for (h, got) in all_f16.iter().zip(down(&dwpe)) {
        let want = h.to_f32();
        let same = match want.is_nan() {
            true => got.is_nan(),
            false => got == want,
        };
        assert!(
            same,
            "f16 {:#06x} widened to {got:e}, half gives {want:e}",
            h.to_bits()
        );
    }
}
