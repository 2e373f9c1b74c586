//! Bulk slice-to-slice conversions between f32 and f16, bf16, FP8 (written for speed).
//!
//! Every function takes a source and a destination slice of equal length (else
//! [`crate::PrecisionError::LengthMismatch`]) and converts element by element, round-to-nearest-even.
//! The per-element kernels are branch-free and the loops are compiled twice: once for the
//! baseline target and once with AVX2 enabled, picked at run time, so the compiler vectorizes
//! them 8 lanes wide. The `par_*` variants split large slices into [`PAR_CHUNK`]-element chunks
//! over rayon's pool; results are identical to the serial ones.
//!
//! - f32 -> bf16: integer rounding on the f32 bits (add `0x7FFF` + the lowest kept bit, keep
//!   the high half); NaN becomes `0x7FC0` with its sign, bit-exact with ml_dtypes.
//! - f32 <-> f16: the `half` crate's slice conversions (F16C instructions when the CPU has them).
//! - f32 <-> FP8: [`crate::fp8`]'s bit routines; decoding is a 256-entry table lookup.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;

use crate::error::{check_len, Result};
use crate::fp8::{self, E4M3Consts, E5M2Consts, Fp8Format, Saturation};

/// Slices at least this long are split across threads by the `par_*` functions, in chunks of
/// this many elements (1 MiB of f32 source: large enough to amortize scheduling).
pub const PAR_CHUNK: usize = 1 << 18;

/// f32 -> bf16 bits, round to nearest even; NaN becomes the canonical quiet NaN `0x7FC0`
/// with the input's sign, as ml_dtypes (`half::bf16::from_f32` keeps payload bits instead;
/// torch drops the sign too).
#[inline(always)]
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16) as u16;
    let nan = (((b >> 16) & 0x8000) | 0x7FC0) as u16;
    if b & 0x7FFF_FFFF > 0x7F80_0000 {
        nan
    } else {
        rounded
    }
}

/// Applies `f` to every element; `#[inline(always)]` so it is compiled inside each
/// target-feature wrapper below and vectorized for that feature set.
#[inline(always)]
fn map<S: Copy, D, F: Fn(S) -> D>(src: &[S], dst: &mut [D], f: F) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = f(s);
    }
}

/// # Safety
/// The CPU must support AVX2 and FMA (checked by the caller).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn map_avx2<S: Copy, D, F: Fn(S) -> D>(src: &[S], dst: &mut [D], f: F) {
    map(src, dst, f)
}

/// Runs `map` with the best instruction set this CPU offers.
#[inline(always)]
fn map_dispatch<S: Copy, D, F: Fn(S) -> D>(src: &[S], dst: &mut [D], f: F) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the features were just detected.
            unsafe { map_avx2(src, dst, f) };
            return;
        }
    }
    map(src, dst, f)
}

/// Splits into [`PAR_CHUNK`]s over rayon when the slice is long enough.
fn par<S: Copy + Sync, D: Send>(src: &[S], dst: &mut [D], kernel: impl Fn(&[S], &mut [D]) + Sync) {
    if src.len() < 2 * PAR_CHUNK {
        kernel(src, dst);
        return;
    }
    dst.par_chunks_mut(PAR_CHUNK)
        .zip(src.par_chunks(PAR_CHUNK))
        .for_each(|(d, s)| kernel(s, d));
}

/// Converts f32 to bf16 (round to nearest even).
pub fn f32_to_bf16(src: &[f32], dst: &mut [bf16]) -> Result<()> {
    check_len("f32_to_bf16", src.len(), dst.len())?;
    bf16_kernel(src, dst);
    Ok(())
}

fn bf16_kernel(src: &[f32], dst: &mut [bf16]) {
    map_dispatch(src, dst, |x| bf16::from_bits(f32_to_bf16_bits(x)));
}

/// [`f32_to_bf16`] split across rayon's threads.
pub fn par_f32_to_bf16(src: &[f32], dst: &mut [bf16]) -> Result<()> {
    check_len("par_f32_to_bf16", src.len(), dst.len())?;
    par(src, dst, bf16_kernel);
    Ok(())
}

/// Converts bf16 to f32 (exact).
pub fn bf16_to_f32(src: &[bf16], dst: &mut [f32]) -> Result<()> {
    check_len("bf16_to_f32", src.len(), dst.len())?;
    map_dispatch(src, dst, |x| f32::from_bits((x.to_bits() as u32) << 16));
    Ok(())
}

/// Converts f32 to f16 (round to nearest even; overflow to ±inf, as IEEE and numpy).
pub fn f32_to_f16(src: &[f32], dst: &mut [f16]) -> Result<()> {
    check_len("f32_to_f16", src.len(), dst.len())?;
    dst.convert_from_f32_slice(src);
    Ok(())
}

/// [`f32_to_f16`] split across rayon's threads.
pub fn par_f32_to_f16(src: &[f32], dst: &mut [f16]) -> Result<()> {
    check_len("par_f32_to_f16", src.len(), dst.len())?;
    par(src, dst, |s, d| d.convert_from_f32_slice(s));
    Ok(())
}

/// Converts f16 to f32 (exact).
pub fn f16_to_f32(src: &[f16], dst: &mut [f32]) -> Result<()> {
    check_len("f16_to_f32", src.len(), dst.len())?;
    src.convert_to_f32_slice(dst);
    Ok(())
}

fn fp8_kernel(src: &[f32], dst: &mut [u8], format: Fp8Format, sat: Saturation) {
    let s = sat == Saturation::Saturate;
    // Four monomorphized loops, so the saturation choice is a constant inside each.
    match (format, s) {
        (Fp8Format::E4M3, true) => map_dispatch(src, dst, |x| fp8::encode::<E4M3Consts>(x, true)),
        (Fp8Format::E4M3, false) => map_dispatch(src, dst, |x| fp8::encode::<E4M3Consts>(x, false)),
        (Fp8Format::E5M2, true) => map_dispatch(src, dst, |x| fp8::encode::<E5M2Consts>(x, true)),
        (Fp8Format::E5M2, false) => map_dispatch(src, dst, |x| fp8::encode::<E5M2Consts>(x, false)),
    }
}

/// Converts f32 to FP8 bits of `format` (round to nearest even, `sat` for overflow).
pub fn f32_to_fp8(src: &[f32], dst: &mut [u8], format: Fp8Format, sat: Saturation) -> Result<()> {
    check_len("f32_to_fp8", src.len(), dst.len())?;
    fp8_kernel(src, dst, format, sat);
    Ok(())
}

/// [`f32_to_fp8`] split across rayon's threads.
pub fn par_f32_to_fp8(
    src: &[f32],
    dst: &mut [u8],
    format: Fp8Format,
    sat: Saturation,
) -> Result<()> {
    check_len("par_f32_to_fp8", src.len(), dst.len())?;
    par(src, dst, |s, d| fp8_kernel(s, d, format, sat));
    Ok(())
}

/// Converts FP8 bits of `format` to f32 (exact, table lookup).
pub fn fp8_to_f32(src: &[u8], dst: &mut [f32], format: Fp8Format) -> Result<()> {
    check_len("fp8_to_f32", src.len(), dst.len())?;
    let t = fp8::decode_table(format);
    map_dispatch(src, dst, |b| f32::from_bits(t[b as usize]));
    Ok(())
}

/// Multiplies by `scale`, then converts to FP8 (the scaled cast FP8 training uses); returns the
/// largest |x| of the unscaled input (NaN ignored, inf counted), for the amax history.
pub(crate) fn f32_to_fp8_scaled(
    src: &[f32],
    dst: &mut [u8],
    scale: f32,
    format: Fp8Format,
    sat: Saturation,
) -> Result<f32> {
    check_len("f32_to_fp8_scaled", src.len(), dst.len())?;
    let mut buf = [0f32; 1024];
    for (s, d) in src.chunks(1024).zip(dst.chunks_mut(1024)) {
        let b = &mut buf[..s.len()];
        map_dispatch(s, b, |x| x * scale);
        fp8_kernel(b, d, format, sat);
    }
    Ok(amax(src))
}

/// Largest |x| in `xs` (0 for an empty slice); NaN is ignored (like `fmaxf`), inf counts.
pub fn amax(xs: &[f32]) -> f32 {
    // On the bits: for non-negative floats the integer order is the value order, and an
    // integer max is associative, so this reduction vectorizes (a float max would not).
    #[inline(always)]
    fn chunk_max(xs: &[f32]) -> u32 {
        let mut m = 0u32;
        for &x in xs {
            let a = x.to_bits() & 0x7FFF_FFFF;
            let a = if a > 0x7F80_0000 { 0 } else { a };
            m = m.max(a);
        }
        m
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn chunk_max_avx2(xs: &[f32]) -> u32 {
        chunk_max(xs)
    }
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the feature was just detected.
            return f32::from_bits(unsafe { chunk_max_avx2(xs) });
        }
    }
    f32::from_bits(chunk_max(xs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_kernel_matches_half_except_nan_payload() {
        let mut s = 0x1234_5678_9abc_def0u64;
        let xs: Vec<f32> = (0..100_000)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                f32::from_bits((s >> 32) as u32)
            })
            .collect();
        let mut a = vec![bf16::ZERO; xs.len()];
        par_f32_to_bf16(&xs, &mut a).unwrap();
        for (x, y) in xs.iter().zip(&a) {
            if x.is_nan() {
                assert_eq!(
                    y.to_bits(),
                    if x.is_sign_negative() { 0xFFC0 } else { 0x7FC0 }
                );
            } else {
                assert_eq!(y.to_bits(), bf16::from_f32(*x).to_bits(), "{x:e}");
            }
        }
    }

    #[test]
    fn length_mismatch_is_an_error() {
        let mut d = [0u8; 3];
        let e = f32_to_fp8(&[1.0; 4], &mut d, Fp8Format::E4M3, Saturation::Saturate);
        assert!(matches!(
            e,
            Err(crate::PrecisionError::LengthMismatch { src: 4, dst: 3, .. })
        ));
    }

    #[test]
    fn amax_ignores_nan_counts_inf() {
        assert_eq!(amax(&[]), 0.0);
        assert_eq!(amax(&[1.0, -3.0, f32::NAN, 2.0]), 3.0);
        assert_eq!(amax(&[1.0, f32::NEG_INFINITY]), f32::INFINITY);
    }

    #[test]
    fn parallel_equals_serial() {
        let xs: Vec<f32> = (0..(3 * PAR_CHUNK + 17))
            .map(|i| (i as f32 - 4e5) * 1e-3)
            .collect();
        for f in [Fp8Format::E4M3, Fp8Format::E5M2] {
            let mut a = vec![0u8; xs.len()];
            let mut b = vec![0u8; xs.len()];
            f32_to_fp8(&xs, &mut a, f, Saturation::Saturate).unwrap();
            par_f32_to_fp8(&xs, &mut b, f, Saturation::Saturate).unwrap();
            assert_eq!(a, b);
        }
        let mut a = vec![f16::ZERO; xs.len()];
        let mut b = vec![f16::ZERO; xs.len()];
        f32_to_f16(&xs, &mut a).unwrap();
        par_f32_to_f16(&xs, &mut b).unwrap();
        assert_eq!(a, b);
    }
}
