//! Every f16 and bf16 bit pattern to f32 and back.

use half::{bf16, f16};
use stoker_precision::convert;

/// Non-NaN patterns come back identical; NaNs come back NaN with the same sign and payload,
/// possibly with the quiet bit set (signalling NaNs are quieted by the f32 round trip).
fn check_f16(bits: u16, back: u16, quiet: u16, exp_mask: u16) {
    let is_nan = bits & 0x7FFF > exp_mask;
    if is_nan {
        assert_eq!(back | quiet, bits | quiet, "NaN {bits:#06x} -> {back:#06x}");
        assert!(back & 0x7FFF > exp_mask);
    } else {
        assert_eq!(back, bits, "{bits:#06x}");
    }
}

#[test]
fn every_f16_pattern_round_trips() {
    let all: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
    let mut wide = vec![0f32; all.len()];
    convert::f16_to_f32(&all, &mut wide).unwrap();
    let mut back = vec![f16::ZERO; all.len()];
    convert::f32_to_f16(&wide, &mut back).unwrap();
    for i in 0..all.len() {
        let v = all[i];
        // f16 -> f32 is exact: same value, or NaN for NaN.
        assert!(wide[i] == v.to_f32() || (wide[i].is_nan() && v.is_nan()));
        check_f16(all[i].to_bits(), back[i].to_bits(), 0x0200, 0x7C00);
    }
}

#[test]
fn every_bf16_pattern_round_trips() {
    let all: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
    let mut wide = vec![0f32; all.len()];
    convert::bf16_to_f32(&all, &mut wide).unwrap();
    let mut back = vec![bf16::ZERO; all.len()];
    convert::f32_to_bf16(&wide, &mut back).unwrap();
    let mut par = vec![bf16::ZERO; all.len()];
    convert::par_f32_to_bf16(&wide, &mut par).unwrap();
    assert!(
        back.iter()
            .zip(&par)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "parallel != serial"
    );
    for i in 0..all.len() {
        // bf16 -> f32 is the bits shifted up: exact for every pattern, NaNs included.
        assert_eq!(wide[i].to_bits(), (all[i].to_bits() as u32) << 16);
        let (b, r) = (all[i].to_bits(), back[i].to_bits());
        if b & 0x7FFF > 0x7F80 {
            // NaN: the canonical quiet NaN with the same sign (as ml_dtypes).
            assert_eq!(r, (b & 0x8000) | 0x7FC0, "NaN {b:#06x}");
        } else {
            assert_eq!(r, b, "{b:#06x}");
        }
    }
}
