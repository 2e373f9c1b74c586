// What every stoker GPU kernel body is written against, so that one source compiles twice:
// by nvcc for the device, and by the host C++ compiler for the CPU, where the tests run it
// (crates/stoker-gpu/tests) and the device check holds the GPU against it.
//
// Rules that make the two builds agree bit for bit:
// - no implicit fused multiply-adds (nvcc runs with --fmad=false, the host build with
//   -ffp-contract=off); where a kernel wants one it says fmaf;
// - exp and tanh are stoker's own polynomial (stoker-kernels' fastmath: the same
//   constants and order), not the platforms' libraries, which differ in the last bits;
// - division and square root are IEEE's correctly rounded ones on both sides;
// - warp reductions are a butterfly (xor 16, 8, 4, 2, 1) that the host replays lane by
//   lane in the same order (warp.h).
#pragma once
#include <math.h>
#include <stdint.h>

#ifdef __CUDACC__
#define STOKER_HD __host__ __device__ __forceinline__
#else
#include <string.h>
#define STOKER_HD inline
#endif

// Unrolls the loop after it on the device, so a small array indexed by its counter stays
// in registers; nothing on the host.
#ifdef __CUDA_ARCH__
#define STOKER_UNROLL _Pragma("unroll")
#else
#define STOKER_UNROLL
#endif

namespace stoker {

// A bf16 value as its 16 bits: the same type on both sides, converted by bit arithmetic.
struct bf16 {
  uint16_t bits;
};

// An IEEE half (fp16) value as its 16 bits, converted by bit arithmetic like bf16.
struct f16 {
  uint16_t bits;
};

STOKER_HD uint32_t bits_of(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
#endif
}

STOKER_HD float float_of(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, 4);
  return f;
#endif
}

// Widening loads: every kernel computes in f32.
STOKER_HD float load(float x) { return x; }
STOKER_HD float load(bf16 x) { return float_of(uint32_t(x.bits) << 16); }
// Exact: a normal half moves its exponent and fraction into place; a subnormal is its
// fraction times 2^-24 (both exact in f32); inf stays inf, NaN becomes quiet.
STOKER_HD float load(f16 x) {
  uint32_t sign = uint32_t(x.bits & 0x8000u) << 16;
  uint32_t exp = (x.bits >> 10) & 0x1fu, frac = x.bits & 0x3ffu;
  if (exp == 0x1fu) return float_of(sign | (frac ? 0x7fc00000u | (frac << 13) : 0x7f800000u));
  if (exp == 0) return float_of(bits_of(float(frac) * 5.9604644775390625e-8f) | sign);
  return float_of(sign | ((exp + 112u) << 23) | (frac << 13));
}

// Narrowing stores: round to nearest even, NaN kept quiet (half's and stoker-kernels'
// to_bf16 exactly).
template <class T> STOKER_HD T store(float x);
template <> STOKER_HD float store<float>(float x) { return x; }
template <> STOKER_HD bf16 store<bf16>(float x) {
  uint32_t b = bits_of(x);
  if ((b & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t((b >> 16) | 0x40u)};
  return bf16{uint16_t((b + 0x7fffu + ((b >> 16) & 1u)) >> 16)};
}

// To half, round to nearest even (half's f16::from_f32 exactly): beyond 65504 to inf,
// below half's normals to its subnormals (and to zero under 2^-25), NaN kept quiet.
template <> STOKER_HD f16 store<f16>(float x) {
  uint32_t b = bits_of(x);
  uint16_t sign = uint16_t((b >> 16) & 0x8000u);
  uint32_t exp = (b >> 23) & 0xffu, frac = b & 0x7fffffu;
  if (exp == 0xffu) return f16{uint16_t(sign | 0x7c00u | (frac ? 0x200u | (frac >> 13) : 0u))};
  int e = int(exp) - 112;  // the half's biased exponent
  if (e >= 0x1f) return f16{uint16_t(sign | 0x7c00u)};
  if (e <= 0) {
    // Subnormal: the implicit bit made explicit, shifted down by 14 - e, rounded.
    if (e < -10) return f16{sign};
    uint32_t m = frac | 0x800000u;
    uint32_t shift = uint32_t(14 - e);
    uint32_t half_frac = m >> shift, rest = m & ((1u << shift) - 1u), mid = 1u << (shift - 1u);
    if (rest > mid || (rest == mid && (half_frac & 1u))) half_frac += 1u;
    return f16{uint16_t(sign | half_frac)};
  }
  // Normal: a carry out of the fraction lands in the exponent (up to inf), as it should.
  uint32_t h = (uint32_t(e) << 10) | (frac >> 13), rest = frac & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h += 1u;
  return f16{uint16_t(sign | h)};
}

// Stochastic rounding to bf16 as llm.c writes its parameters, stoker-precision's
// stochastic.rs exactly: element `index`'s 16 random bits under `seed` (counter-based:
// lowbias32 hashes of the index's halves and the seed's) added to the f32's bits, the high
// half kept, so x rounds up with probability equal to its distance from the bf16 below;
// NaN becomes the quiet NaN with its sign.
STOKER_HD uint32_t hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

STOKER_HD uint32_t round_noise(uint64_t seed, uint64_t index) {
  uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
  uint32_t hi = hash32(uint32_t(index >> 32) ^ k1);
  uint32_t rot = (hi << 7) | (hi >> 25);
  return hash32(uint32_t(index) ^ k0 ^ rot) & 0xffffu;
}

STOKER_HD bf16 store_stochastic(float x, uint32_t r) {
  uint32_t b = bits_of(x);
  if ((b & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t(((b >> 16) & 0x8000u) | 0x7fc0u)};
  return bf16{uint16_t((b + (r & 0xffffu)) >> 16)};
}

STOKER_HD float fsqrt(float x) { return sqrtf(x); }

// e^x as stoker-kernels' fastmath::exp: Cody-Waite range reduction and a degree-6
// polynomial, within 3e-7 relative; 0 below -87.3, NaN kept.
STOKER_HD float fexp(float x) {
  const float log2e = 1.44269504088896340736f;
  const float ln2_hi = 0.69314575f, ln2_lo = 1.4286068e-6f, round = 12582912.0f;
  float xc = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
  float t = xc * log2e + round;
  int32_t k = int32_t(bits_of(t)) - int32_t(bits_of(round));
  float kf = t - round;
  float r = (xc - kf * ln2_hi) - kf * ln2_lo;
  float p = 1.0f +
            r * (1.0f + r * (1.0f / 2.0f +
                             r * (1.0f / 6.0f +
                                  r * (1.0f / 24.0f + r * (1.0f / 120.0f + r * (1.0f / 720.0f))))));
  float scale = float_of(uint32_t(k + 127) << 23);
  return x < -87.3f ? 0.0f : p * scale;
}

// ln x for finite x > 0 (what softmax's sum of exponentials is): x = 2^e m with m in
// [sqrt(1/2), sqrt(2)), ln m = 2 atanh((m - 1) / (m + 1)) as an odd series to f^11
// (|f| <= 0.172: the next term is below 1e-10), within 2e-7 relative of f64.
STOKER_HD float flog(float x) {
  uint32_t b = bits_of(x);
  int32_t e = int32_t((b >> 23) & 0xffu) - 127;
  float m = float_of((b & 0x007fffffu) | 0x3f800000u);
  if (m > 1.41421356f) {
    m = m * 0.5f;
    e += 1;
  }
  float f = (m - 1.0f) / (m + 1.0f);
  float f2 = f * f;
  float series =
      f * (2.0f + f2 * (2.0f / 3.0f + f2 * (2.0f / 5.0f + f2 * (2.0f / 7.0f +
                                                          f2 * (2.0f / 9.0f + f2 * (2.0f / 11.0f))))));
  const float ln2_hi = 0.69314575f, ln2_lo = 1.4286068e-6f;
  float ef = float(e);
  return ef * ln2_hi + (ef * ln2_lo + series);
}

STOKER_HD float fabs_(float x) { return float_of(bits_of(x) & 0x7fffffffu); }
STOKER_HD float copysign_(float mag, float sign) {
  return float_of((bits_of(mag) & 0x7fffffffu) | (bits_of(sign) & 0x80000000u));
}

// tanh from fexp, as fastmath::tanh.
STOKER_HD float ftanh(float u) {
  float e = fexp(-2.0f * fabs_(u));
  return copysign_((1.0f - e) / (1.0f + e), u);
}

// The larger of a and b; NaN if either is (whichever argument order: every lane of a
// butterfly then agrees, as the host's replay does).
STOKER_HD float fmax_(float a, float b) { return (a != a || a > b) ? a : b; }

}  // namespace stoker
