//! Stochastic rounding f32 -> bf16: unbiased, always a neighbour, seeded and reproducible.

use half::bf16;
use stoker_precision::stochastic::{f32_to_bf16_stochastic, StochasticRounder};

fn neighbours(x: f32) -> (u16, u16) {
    let lo = (x.to_bits() >> 16) as u16;
    (lo, lo + 1)
}

#[test]
fn exact_values_are_unchanged_and_others_go_to_a_neighbour() {
    let xs: Vec<f32> = (0..100_000)
        .map(|i| ((i as f32) * 0.37 - 1e4) * 1.001)
        .collect();
    let mut out = vec![bf16::ZERO; xs.len()];
    f32_to_bf16_stochastic(&xs, &mut out, 42, 0).unwrap();
    for (x, y) in xs.iter().zip(&out) {
        let b = x.to_bits();
        if b & 0xFFFF == 0 {
            assert_eq!(y.to_bits() as u32, b >> 16);
        } else {
            let (lo, hi) = neighbours(*x);
            assert!(y.to_bits() == lo || y.to_bits() == hi, "{x}: {y}");
        }
    }
    let mut special = [bf16::ZERO; 4];
    f32_to_bf16_stochastic(
        &[f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -0.0],
        &mut special,
        1,
        0,
    )
    .unwrap();
    assert_eq!(
        special.map(|v| v.to_bits()),
        [0x7F80, 0xFF80, 0x7FC0, 0x8000]
    );
}

#[test]
fn rounding_is_unbiased() {
    // 1 + 2^-9 sits a quarter of the way from 1 to the next bf16 (1 + 2^-7); -(3 + 0.75 * 2^-6)
    // three quarters of the way from -3 to the next bf16 away from zero.
    for (x, p) in [
        (1.0f32 + 2f32.powi(-9), 0.25),
        (-(3.0 + 0.75 * 2f32.powi(-6)), 0.75),
    ] {
        let n = 400_000;
        let mut out = vec![bf16::ZERO; n];
        f32_to_bf16_stochastic(&vec![x; n], &mut out, 2026, 0).unwrap();
        let (lo, _) = neighbours(x);
        let up = out.iter().filter(|v| v.to_bits() != lo).count() as f64 / n as f64;
        assert!((up - p).abs() < 0.004, "{x}: rounded up {up}, want {p}");
        let mean = out.iter().map(|v| v.to_f32() as f64).sum::<f64>() / n as f64;
        let ulp = 2f64.powi(-7) * if x.abs() > 2.0 { 2.0 } else { 1.0 };
        assert!((mean - x as f64).abs() < 0.005 * ulp, "{x}: mean {mean}");
    }
}

#[test]
fn seeded_reproducible_and_split_independent() {
    let xs: Vec<f32> = (0..700_000).map(|i| (i as f32).sin() * 3.3).collect();
    let mut a = vec![bf16::ZERO; xs.len()];
    let mut b = vec![bf16::ZERO; xs.len()];
    // Large slices run in parallel chunks; the result equals a serial pass in pieces.
    f32_to_bf16_stochastic(&xs, &mut a, 9, 0).unwrap();
    let mut r = StochasticRounder::new(9);
    for (s, d) in xs.chunks(1000).zip(b.chunks_mut(1000)) {
        r.round(s, d).unwrap();
    }
    assert_eq!(r.counter, xs.len() as u64);
    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
    let mut c = vec![bf16::ZERO; xs.len()];
    f32_to_bf16_stochastic(&xs, &mut c, 10, 0).unwrap();
    let differ = a
        .iter()
        .zip(&c)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count();
    assert!(
        differ > xs.len() / 10,
        "another seed changes the rounding ({differ})"
    );
    assert!(f32_to_bf16_stochastic(&xs, &mut c[..5], 1, 0).is_err());
}
