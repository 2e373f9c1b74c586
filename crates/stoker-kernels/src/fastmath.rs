//! `exp` and `tanh` in plain f32 arithmetic and bit operations, so the row loops that
//! call them vectorize (a libm call per element does not). Accuracy: `exp` within
//! 3e-7 relative on [-87, 88], exactly 0 below -87.3, saturating at e^88.3 above (the
//! kernels only take exp of values <= 0); `tanh` within 2e-7 absolute. The sums keep
//! eight lanes, so they vectorize too (a strict left-to-right f32 sum cannot).
//! The tests at the bottom check both against f64.

/// The widest x86 vector level this CPU runs, for kernels compiled several times with
/// `#[target_feature]` (the crate itself is built for the x86-64 baseline, SSE2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Simd {
    /// AVX-512F and VL, with AVX2 and FMA.
    Avx512,
    /// AVX2 and FMA.
    Avx2,
    /// The baseline.
    Baseline,
}

impl Simd {
    /// Detected once per process.
    pub(crate) fn detect() -> Self {
        static LEVEL: std::sync::OnceLock<Simd> = std::sync::OnceLock::new();
        *LEVEL.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                let avx2 = std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma");
                if avx2
                    && std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                {
                    return Simd::Avx512;
                }
                if avx2 {
                    return Simd::Avx2;
                }
            }
            Simd::Baseline
        })
    }
}

/// Defines `$name(args..)`: runs `$inner(args..)` compiled for the widest vector level
/// this CPU has ([`Simd::detect`]): AVX-512F/VL with AVX2 and FMA, AVX2 with FMA, or the
/// crate's SSE2 baseline. `$inner` must be `#[inline(always)]`, so that each level gets its
/// own copy for the compiler to vectorize; it returns nothing.
macro_rules! simd_dispatch {
    ($(#[$doc:meta])* $vis:vis fn $name:ident <$($g:ident : $b:path),*> ($($arg:ident : $ty:ty),* $(,)?) => $inner:ident) => {
        $(#[$doc])*
        $vis fn $name<$($g: $b),*>($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
            unsafe fn avx512<$($g: $b),*>($($arg: $ty),*) {
                $inner($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2<$($g: $b),*>($($arg: $ty),*) {
                $inner($($arg),*)
            }
            match $crate::fastmath::Simd::detect() {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `Simd::detect` found AVX-512F, AVX-512VL, AVX2 and FMA on this CPU.
                $crate::fastmath::Simd::Avx512 => unsafe { avx512($($arg),*) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `Simd::detect` found AVX2 and FMA on this CPU.
                $crate::fastmath::Simd::Avx2 => unsafe { avx2($($arg),*) },
                _ => $inner($($arg),*),
            }
        }
    };
}
pub(crate) use simd_dispatch;

const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split in two so `k * LN2_HI` is exact for the k that occur (Cody-Waite).
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
/// 1.5 * 2^23: adding it rounds to an integer, which lands in the low mantissa bits.
const ROUND: f32 = 12_582_912.0;

/// `e^x` for f32: `2^k * p(r)` with `x = k ln2 + r`, `|r| <= ln2 / 2`, `p` a degree-6
/// Taylor polynomial.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    let xc = x.clamp(-87.3, 88.3);
    let t = xc * LOG2E + ROUND;
    let k = t.to_bits() as i32 - ROUND.to_bits() as i32;
    let kf = t - ROUND;
    let r = (xc - kf * LN2_HI) - kf * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (1.0 / 2.0
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    let scale = f32::from_bits(((k + 127) as u32) << 23);
    // NaN compares false, so NaN stays NaN through `p`.
    if x < -87.3 {
        0.0
    } else {
        p * scale
    }
}

/// `tanh(u)` for f32: `(1 - e) / (1 + e)` with `e = exp(-2|u|)`, sign restored.
#[inline(always)]
pub(crate) fn tanh(u: f32) -> f32 {
    let e = exp(-2.0 * u.abs());
    ((1.0 - e) / (1.0 + e)).copysign(u)
}

/// `sum(f(x))` over eight lanes, then the tail.
#[inline(always)]
pub(crate) fn sum_map<T: Copy>(xs: &[T], f: impl Fn(T) -> f32) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut chunks = xs.chunks_exact(8);
    for c in &mut chunks {
        for i in 0..8 {
            acc[i] += f(c[i]);
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for &x in chunks.remainder() {
        s += f(x);
    }
    s
}

/// `sum(f(a, b))` over eight lanes, then the tail (dot products).
#[inline(always)]
pub(crate) fn sum_map2<A: Copy, B: Copy>(a: &[A], b: &[B], f: impl Fn(A, B) -> f32) -> f32 {
    let mut acc = [0.0f32; 8];
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let (mut ca, mut cb) = (a.chunks_exact(8), b.chunks_exact(8));
    for (x, y) in (&mut ca).zip(&mut cb) {
        for i in 0..8 {
            acc[i] += f(x[i], y[i]);
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (&x, &y) in ca.remainder().iter().zip(cb.remainder()) {
        s += f(x, y);
    }
    s
}

/// `sum(f(a, b, c))` over eight lanes, then the tail.
#[inline(always)]
pub(crate) fn sum_map3<A: Copy, B: Copy, C: Copy>(
    a: &[A],
    b: &[B],
    c: &[C],
    f: impl Fn(A, B, C) -> f32,
) -> f32 {
    let n = a.len().min(b.len()).min(c.len());
    let (a, b, c) = (&a[..n], &b[..n], &c[..n]);
    let mut acc = [0.0f32; 8];
    let full = n / 8 * 8;
    for j in (0..full).step_by(8) {
        let (x, y, z) = (&a[j..j + 8], &b[j..j + 8], &c[j..j + 8]);
        for i in 0..8 {
            acc[i] += f(x[i], y[i], z[i]);
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for j in full..n {
        s += f(a[j], b[j], c[j]);
    }
    s
}

/// `max(f(x))` over eight lanes, then the tail; `-inf` for an empty slice.
#[inline(always)]
pub(crate) fn max_map<T: Copy>(xs: &[T], f: impl Fn(T) -> f32) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let mut chunks = xs.chunks_exact(8);
    for c in &mut chunks {
        for i in 0..8 {
            acc[i] = acc[i].max(f(c[i]));
        }
    }
    let mut m = acc.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    for &x in chunks.remainder() {
        m = m.max(f(x));
    }
    m
}

/// f32 to bf16, round to nearest even, NaN kept quiet with its sign: the same bits
/// as `half::bf16::from_f32`, written branch-free so a loop of it vectorizes.
#[inline(always)]
pub(crate) fn to_bf16(x: f32) -> half::bf16 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16;
    let nan = (b >> 16) | 0x40;
    let is_nan = (b & 0x7FFF_FFFF) > 0x7F80_0000;
    half::bf16::from_bits(if is_nan { nan } else { rounded } as u16)
}

#[cfg(test)]
mod tests {
    /// exp within 3e-7 relative of f64 over [-87, 88]; 0 below -87.3; inf and NaN kept.
    #[test]
    fn exp_is_accurate() {
        let mut worst = 0.0f64;
        for i in 0..=350_000 {
            let x = -87.0 + i as f32 * (175.0 / 350_000.0);
            let want = (x as f64).exp();
            worst = stoker_testkit::nan_max(worst, ((super::exp(x) as f64) - want).abs() / want);
        }
        assert!(worst <= 3e-7, "{worst}");
        assert_eq!(super::exp(-100.0), 0.0);
        assert_eq!(super::exp(f32::NEG_INFINITY), 0.0);
        assert!(super::exp(f32::NAN).is_nan());
        assert_eq!(super::exp(0.0), 1.0);
    }

    /// to_bf16 gives half's bits for every f32 with a 16-bit stride plus the edges.
    #[test]
    fn to_bf16_matches_half() {
        let edge = [
            0.0f32,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MAX,
            f32::MIN_POSITIVE,
        ];
        let strided = (0..=u32::MAX / 251).map(|i| f32::from_bits(i * 251));
        for x in edge.into_iter().chain(strided) {
            assert_eq!(
                super::to_bf16(x).to_bits(),
                half::bf16::from_f32(x).to_bits(),
                "{x:e}"
            );
        }
    }

    /// tanh within 2e-7 absolute of f64 over [-10, 10].
    #[test]
    fn tanh_is_accurate() {
        let mut worst = 0.0f64;
        for i in 0..=200_000 {
            let u = -10.0 + i as f32 * (20.0 / 200_000.0);
            worst =
                stoker_testkit::nan_max(worst, ((super::tanh(u) as f64) - (u as f64).tanh()).abs());
        }
        assert!(worst <= 2e-7, "{worst}");
        assert_eq!(super::tanh(0.0), 0.0);
        assert_eq!(super::tanh(100.0), 1.0);
    }
}
