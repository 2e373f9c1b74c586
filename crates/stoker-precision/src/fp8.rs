//! FP8 formats (OCP / arXiv 2209.05433): E4M3FN and E5M2, scalar encode and decode.
//!
//! | format | bias | max finite | min normal | min subnormal | infinity | NaN |
//! |---|---|---|---|---|---|---|
//! | E4M3FN | 7 | 448 (`0x7E`) | 2^-6 | 2^-9 | none | `S.1111.111` |
//! | E5M2 | 15 | 57344 (`0x7B`) | 2^-14 | 2^-16 | `S.11111.00` | `S.11111.{01,10,11}` |
//!
//! Encoding rounds to nearest, ties to even, and is bit-exact with ml_dtypes'
//! `float8_e4m3fn` / `float8_e5m2` `astype` in [`Saturation::NonSaturating`] mode (checked over
//! 1.19 million inputs by `tests/fp8_reference.rs`):
//! - overflow (|x| beyond the last tie below the next power): E4M3FN gives NaN (`S.1111.111`),
//!   E5M2 gives ±inf; ±inf likewise;
//! - NaN gives the format's NaN with the input's sign (`0x7F`/`0xFF` for E4M3FN, `0x7E`/`0xFE`
//!   for E5M2; the payload is not kept).
//!
//! [`Saturation::Saturate`] clamps finite overflow **and ±inf** to ±max finite and keeps NaN a
//! NaN (same encoding as above). That is CUDA's `__NV_SATFINITE` conversion, which the
//! `__nv_fp8_e4m3` / `__nv_fp8_e5m2` constructors from float use (CUDA math API docs: "relies
//! on `__NV_SATFINITE` behavior for out-of-range values"), and so Transformer Engine's casts,
//! which `static_cast` to those types; `cuda_fp8.hpp` treats infinity as out of range (it
//! becomes maxnorm). PyTorch 2.15 on CPU (run on this machine) saturates the same way for
//! `float8_e4m3fn` (`inf`, `1e9` -> `0x7E`) but not for `float8_e5m2` (`inf`, `61440` -> `0x7C`,
//! inf). The test data defines saturating as ml_dtypes' `astype(clip(x, -max, max))`, NaN kept.
//!
//! Why not the `float8` crate: it agrees with the saturating mode on every non-NaN input
//! (`tests/fp8_reference.rs` checks it), but it only exposes the saturating mode, keeps NaN
//! payload bits for E5M2 where ml_dtypes does not, and converts through an f64 and a chain of
//! branches per element, which does not vectorize: 0.15 Gelem/s against several times that
//! here (docs/benchmarks.md). The routines here are branch-free bit manipulation (the
//! subnormal range through one float addition that lets the FPU do the rounding), so the bulk
//! loops in [`crate::convert`] vectorize.

/// An FP8 storage format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Fp8Format {
    /// 4 exponent bits, 3 mantissa bits, "FN": finite only, max 448 (forward tensors).
    E4M3,
    /// 5 exponent bits, 2 mantissa bits, IEEE-like, max 57344 (gradients).
    E5M2,
}

/// What a conversion does with values beyond the format's largest finite value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Saturation {
    /// Clamp finite overflow and ±inf to ±max finite; NaN stays NaN (FP8 training, TE casts).
    Saturate,
    /// IEEE-like: overflow becomes inf (E5M2) or NaN (E4M3FN, which has no inf), as ml_dtypes.
    NonSaturating,
}

impl Fp8Format {
    /// Largest finite value.
    pub const fn max(self) -> f32 {
        match self {
            Fp8Format::E4M3 => 448.0,
            Fp8Format::E5M2 => 57344.0,
        }
    }

    /// Smallest positive normal value.
    pub const fn min_normal(self) -> f32 {
        match self {
            Fp8Format::E4M3 => 0.015625,       // 2^-6
            Fp8Format::E5M2 => 6.103_515_6e-5, // 2^-14
        }
    }

    /// Smallest positive subnormal value.
    pub const fn min_subnormal(self) -> f32 {
        match self {
            Fp8Format::E4M3 => 0.001953125,    // 2^-9
            Fp8Format::E5M2 => 1.525_878_9e-5, // 2^-16
        }
    }

    /// Number of explicit mantissa bits.
    pub const fn mantissa_bits(self) -> u32 {
        match self {
            Fp8Format::E4M3 => 3,
            Fp8Format::E5M2 => 2,
        }
    }

    /// Distance from `|x|` (an in-range value) to the next representable value above it:
    /// the spacing that bounds the rounding error (half of it for round-to-nearest).
    pub fn spacing(self, x: f32) -> f32 {
        let a = x.abs();
        if a < self.min_normal() {
            return self.min_subnormal();
        }
        // The binade's exponent from the bits (log2 and exp2 need not be exact).
        let e = ((a.to_bits() >> 23) & 0xff) as i32 - 127;
        pow2(e - self.mantissa_bits() as i32)
    }

    /// Short lowercase name (`"e4m3"`, `"e5m2"`).
    pub const fn name(self) -> &'static str {
        match self {
            Fp8Format::E4M3 => "e4m3",
            Fp8Format::E5M2 => "e5m2",
        }
    }
}

/// Encodes one f32 as E4M3FN bits, round-to-nearest-even.
#[inline(always)]
pub fn f32_to_e4m3(x: f32, sat: Saturation) -> u8 {
    encode::<E4M3Consts>(x, sat == Saturation::Saturate)
}

/// Encodes one f32 as E5M2 bits, round-to-nearest-even.
#[inline(always)]
pub fn f32_to_e5m2(x: f32, sat: Saturation) -> u8 {
    encode::<E5M2Consts>(x, sat == Saturation::Saturate)
}

/// Encodes one f32 in `format`.
#[inline]
pub fn f32_to_fp8(x: f32, format: Fp8Format, sat: Saturation) -> u8 {
    match format {
        Fp8Format::E4M3 => f32_to_e4m3(x, sat),
        Fp8Format::E5M2 => f32_to_e5m2(x, sat),
    }
}

/// Decodes E4M3FN bits (exact; NaN decodes to a quiet f32 NaN with the same sign).
#[inline(always)]
pub fn e4m3_to_f32(b: u8) -> f32 {
    f32::from_bits(E4M3_TABLE[b as usize])
}

/// Decodes E5M2 bits (exact; NaN decodes to a quiet f32 NaN with the same sign).
#[inline(always)]
pub fn e5m2_to_f32(b: u8) -> f32 {
    f32::from_bits(E5M2_TABLE[b as usize])
}

/// Decodes one FP8 value of `format`.
#[inline]
pub fn fp8_to_f32(b: u8, format: Fp8Format) -> f32 {
    match format {
        Fp8Format::E4M3 => e4m3_to_f32(b),
        Fp8Format::E5M2 => e5m2_to_f32(b),
    }
}

/// The f32 bit patterns of all 256 values of a format, indexed by FP8 bits.
pub(crate) fn decode_table(format: Fp8Format) -> &'static [u32; 256] {
    match format {
        Fp8Format::E4M3 => &E4M3_TABLE,
        Fp8Format::E5M2 => &E5M2_TABLE,
    }
}

/// Per-format constants of the branch-free encoder (all in f32 bit space).
pub(crate) trait Fp8Consts {
    /// Explicit mantissa bits.
    const MBITS: u32;
    /// 127 - bias, shifted into the f32 exponent field.
    const REBIAS: u32;
    /// f32 bits of the smallest normal value.
    const MIN_NORMAL: u32;
    /// f32 bits of the largest finite value: saturating mode clamps |x| to it before rounding.
    const SAT_CLAMP: u32;
    /// f32 bits of the first power past the range (E4M3FN 480, E5M2 65536): non-saturating
    /// mode clamps |x| to it, and it encodes as the overflow code (NaN `0x7F` for E4M3FN, inf
    /// `0x7C` for E5M2). Values between the last tie and it round up to it on their own.
    const NONSAT_CLAMP: u32;
    /// FP8 bits of NaN (positive).
    const NAN: u8;
    /// f32 bits of 2^(1 - bias - MBITS + 23): adding it to a subnormal-range |x| puts the FP8
    /// subnormal step at the f32 ulp, so the FPU rounds to nearest even for us.
    const MAGIC: u32;
}

pub(crate) struct E4M3Consts;
impl Fp8Consts for E4M3Consts {
    const MBITS: u32 = 3;
    const REBIAS: u32 = (127 - 7) << 23;
    const MIN_NORMAL: u32 = (127 - 6) << 23;
    const SAT_CLAMP: u32 = 0x43E0_0000; // 448
    const NONSAT_CLAMP: u32 = 0x43F0_0000; // 480 -> S.1111.111 (NaN)
    const NAN: u8 = 0x7F;
    const MAGIC: u32 = (127 + 1 - 7 - 3 + 23) << 23;
}

pub(crate) struct E5M2Consts;
impl Fp8Consts for E5M2Consts {
    const MBITS: u32 = 2;
    const REBIAS: u32 = (127 - 15) << 23;
    const MIN_NORMAL: u32 = (127 - 14) << 23;
    const SAT_CLAMP: u32 = 0x4760_0000; // 57344
    const NONSAT_CLAMP: u32 = 0x4780_0000; // 65536 -> S.11111.00 (inf)
    const NAN: u8 = 0x7E;
    const MAGIC: u32 = (127 + 1 - 15 - 2 + 23) << 23;
}

/// Branch-free f32 -> FP8 (round to nearest even); every path is computed and one selected,
/// which is what lets the bulk loops in [`crate::convert`] vectorize.
#[inline(always)]
pub(crate) fn encode<C: Fp8Consts>(x: f32, saturate: bool) -> u8 {
    // Overflow and infinity are handled by clamping |x| before rounding (one integer min), NaN
    // by one select; all selects stay 32 bits wide and the result is narrowed once at the end
    // (vectorized: one pack per 8 lanes).
    let bits = x.to_bits();
    let sign = (bits >> 24) & 0x80;
    let abs = bits & 0x7FFF_FFFF;
    let a = abs.min(if saturate {
        C::SAT_CLAMP
    } else {
        C::NONSAT_CLAMP
    });
    let shift = 23 - C::MBITS;
    // Normal range: rebias the exponent, round the dropped bits to nearest even.
    let v = a.wrapping_sub(C::REBIAS);
    let odd = (v >> shift) & 1;
    let normal = v.wrapping_add((1 << (shift - 1)) - 1 + odd) >> shift;
    // Subnormal range (and the rounding up into the smallest normal).
    let magic = f32::from_bits(C::MAGIC);
    let sub = (f32::from_bits(a) + magic).to_bits().wrapping_sub(C::MAGIC);
    let finite = if a >= C::MIN_NORMAL { normal } else { sub };
    let mag = if abs > 0x7F80_0000 {
        C::NAN as u32
    } else {
        finite
    };
    (mag | sign) as u8
}

/// f32 bits of an FP8 value, computed at compile time for the decode tables.
const fn decode_bits(b: u8, mbits: u32, bias: u32, has_inf: bool) -> u32 {
    let sign = ((b as u32) & 0x80) << 24;
    let ebits = 7 - mbits;
    let e = ((b as u32) >> mbits) & ((1 << ebits) - 1);
    let m = (b as u32) & ((1 << mbits) - 1);
    let emax = (1 << ebits) - 1;
    if has_inf && e == emax {
        return if m == 0 {
            sign | 0x7F80_0000
        } else {
            sign | 0x7FC0_0000
        };
    }
    if !has_inf && e == emax && m == (1 << mbits) - 1 {
        return sign | 0x7FC0_0000;
    }
    if e == 0 {
        if m == 0 {
            return sign;
        }
        // Subnormal: normalize into an f32 normal.
        let mut e32 = 127 + 1 - bias;
        let mut mm = m;
        while mm & (1 << mbits) == 0 {
            mm <<= 1;
            e32 -= 1;
        }
        mm &= (1 << mbits) - 1;
        return sign | (e32 << 23) | (mm << (23 - mbits));
    }
    sign | ((e + 127 - bias) << 23) | (m << (23 - mbits))
}

const fn table(mbits: u32, bias: u32, has_inf: bool) -> [u32; 256] {
    let mut t = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = decode_bits(i as u8, mbits, bias, has_inf);
        i += 1;
    }
    t
}

static E4M3_TABLE: [u32; 256] = table(3, 7, false);
static E5M2_TABLE: [u32; 256] = table(2, 15, true);

/// `2^e` exactly, for `e` in `-149..=127` (f32's range, subnormals included), built from
/// the bits: `powi` and `exp2` are not required to be exact.
pub(crate) fn pow2(e: i32) -> f32 {
    assert!((-149..=127).contains(&e), "2^{e} is outside f32");
    match e >= -126 {
        true => f32::from_bits(((e + 127) as u32) << 23),
        false => f32::from_bits(1u32 << (e + 149)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn landmarks() {
        let s = Saturation::NonSaturating;
        assert_eq!(f32_to_e4m3(448.0, s), 0x7E);
        assert_eq!(f32_to_e4m3(464.0, s), 0x7E);
        assert_eq!(f32_to_e4m3(464.1, s), 0x7F);
        assert_eq!(f32_to_e4m3(-1e9, Saturation::Saturate), 0xFE);
        assert_eq!(f32_to_e4m3(f32::INFINITY, Saturation::Saturate), 0x7E);
        assert_eq!(f32_to_e5m2(61440.0, s), 0x7C);
        assert_eq!(f32_to_e5m2(61439.996, s), 0x7B);
        assert_eq!(f32_to_e5m2(f32::NEG_INFINITY, s), 0xFC);
        assert_eq!(f32_to_e5m2(f32::NAN, Saturation::Saturate), 0x7E);
        assert_eq!(f32_to_e4m3(pow2(-10), s), 0x00); // tie to even zero
        assert_eq!(f32_to_e4m3(3.0 * pow2(-10), s), 0x02); // tie to even 2
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0x01), pow2(-9));
        assert_eq!(e5m2_to_f32(0x7B), 57344.0);
        assert_eq!(e5m2_to_f32(0x01), pow2(-16));
        assert!(e4m3_to_f32(0xFF).is_nan());
        assert_eq!(Fp8Format::E4M3.min_normal(), pow2(-6));
        assert_eq!(Fp8Format::E5M2.min_normal(), pow2(-14));
        assert_eq!(Fp8Format::E4M3.min_subnormal(), pow2(-9));
        assert_eq!(Fp8Format::E5M2.min_subnormal(), pow2(-16));
    }

    #[test]
    fn every_finite_value_round_trips() {
        for f in [Fp8Format::E4M3, Fp8Format::E5M2] {
            for b in 0..=255u8 {
                let x = fp8_to_f32(b, f);
                if x.is_finite() {
                    assert_eq!(
                        f32_to_fp8(x, f, Saturation::NonSaturating),
                        b,
                        "{f:?} {b:#04x}"
                    );
                    assert_eq!(f32_to_fp8(x, f, Saturation::Saturate), b, "{f:?} {b:#04x}");
                }
            }
        }
    }
}
