// FP8 with delayed scaling (Transformer Engine's recipe, stoker-precision's DelayedScaler):
// the cast of a tensor to E4M3 or E5M2 with the scale of earlier steps, which also folds
// the tensor's amax into per-warp partials, and the end of step that turns the partials
// into each scaler's next scale. The FP8 products themselves are cuBLASLt's (src/device/
// lt.rs); the host build's twin is src/gemm.rs.
//
// Every value here is the CPU's bit for bit (tests/fp8.rs): the cast is stoker-precision's
// saturating encode (round to nearest even, overflow and infinity to the largest finite
// value, NaN kept), ported line by line; an amax is a max, exact in any order.
#pragma once
#include "../pack.h"
#include "../warp.h"

namespace stoker {

// The two formats' constants (stoker-precision's fp8.rs: E4M3Consts, E5M2Consts).
struct Fp8Consts {
  uint32_t mbits, rebias, min_normal, sat_clamp, nan, magic;
};

STOKER_HD Fp8Consts fp8_consts(int e5m2) {
  return e5m2 ? Fp8Consts{2u, (127u - 15u) << 23, (127u - 14u) << 23, 0x47600000u, 0x7Eu,
                          (127u + 1u - 15u - 2u + 23u) << 23}
              : Fp8Consts{3u, (127u - 7u) << 23, (127u - 6u) << 23, 0x43E00000u, 0x7Fu,
                          (127u + 1u - 7u - 3u + 23u) << 23};
}

// x in FP8, saturating: |x| clamped to the largest finite value before rounding (infinity
// too), the normal range rounded to nearest even on the bits, the subnormal range by one
// float addition (the FPU rounds), NaN the format's NaN with x's sign.
STOKER_HD uint8_t fp8_encode(float x, const Fp8Consts& c) {
  const uint32_t bits = bits_of(x);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t abs = bits & 0x7FFFFFFFu;
  const uint32_t a = abs < c.sat_clamp ? abs : c.sat_clamp;
  const uint32_t shift = 23u - c.mbits;
  const uint32_t v = a - c.rebias;
  const uint32_t odd = (v >> shift) & 1u;
  const uint32_t normal = (v + ((1u << (shift - 1u)) - 1u) + odd) >> shift;
  const uint32_t sub = bits_of(float_of(a) + float_of(c.magic)) - c.magic;
  const uint32_t finite = a >= c.min_normal ? normal : sub;
  const uint32_t mag = abs > 0x7F800000u ? c.nan : finite;
  return uint8_t(mag | sign);
}

// x * scale in FP8. A NaN keeps x's sign: the CPU's multiply keeps a NaN's sign, a GPU's
// may give its canonical NaN, so the sign comes from x, not from the product.
STOKER_HD uint8_t fp8_cast(float x, float scale, const Fp8Consts& c) {
  const uint32_t bits = bits_of(x);
  const uint8_t q = fp8_encode(x * scale, c);
  return (bits & 0x7FFFFFFFu) > 0x7F800000u ? uint8_t(c.nan | ((bits >> 24) & 0x80u)) : q;
}

// |x| for an amax: NaN counts as 0 (stoker-precision's amax ignores it, as fmaxf does),
// infinity counts.
STOKER_HD float amax_of(float x) {
  const uint32_t a = bits_of(x) & 0x7FFFFFFFu;
  return a > 0x7F800000u ? 0.0f : float_of(a);
}

struct MaxOf {
  STOKER_HD float operator()(float a, float b) const { return a > b ? a : b; }
};

// out[i] = fp8(x[i] * scale[0]) for i below rows * cols (row-major) where out is given,
// and where out_t is given the transpose (out_t[c * rows + r]: cuBLASLt's FP8 products on Hopper take
// both operands with the shared dimension contiguous). Warp `wid` of `warps` takes packs
// (wid * 32 + lane) + k * warps * 32, as sum_partial_warp; where amax is given, the
// largest |x| of its share is folded into amax[wid] (a max with what is there, so the
// micro-batches of a step add up, as DelayedScaler::record_amax).
template <class W, class T>
STOKER_HD void fp8_quantize_warp(const W& w, int wid, int warps, uint8_t* out, uint8_t* out_t,
                                 float* amax, const T* x, const float* scale, int64_t rows,
                                 int cols, int e5m2) {
  const Fp8Consts c = fp8_consts(e5m2);
  const int64_t n = rows * cols;
  auto parts = w.each([&](int lane) {
    const float s = scale[0];
    float m = 0.0f;
    for (int64_t i0 = (int64_t(wid) * WARP + lane) * PACK; i0 < n;
         i0 += int64_t(warps) * WARP * PACK) {
      Pack p = load_pack(x, i0, n);
      STOKER_PACK_ELEMENTS(k, i0, n) {
        const int64_t i = i0 + k;
        const uint8_t q = fp8_cast(p.v[k], s, c);
        if (out) out[i] = q;
        if (out_t) out_t[(i % cols) * rows + i / cols] = q;
        m = MaxOf{}(m, amax_of(p.v[k]));
      }
    }
    return m;
  });
  const float total = w.reduce(parts, MaxOf{});
  w.each([&](int lane) {
    if (lane == 0 && amax) amax[wid] = MaxOf{}(amax[wid], total);
    return 0;
  });
}

// A step's amax for scaler `s` of a set, one warp each: the largest of its casts'
// per-warp partials (partials[s * parts ..]) and its history slot `pos` (history
// [s * len ..]) into amax[s], the partials cleared. amax is what data-parallel ranks
// reduce (a max) before fp8_scale_update; a max is exact in any order.
template <class W>
STOKER_HD void fp8_amax_fold_row(const W& w, int64_t s, float* amax, const float* history,
                                 float* partials, int len, int pos, int parts) {
  float* part = partials + s * parts;
  auto steps = w.each([&](int lane) {
    float m = 0.0f;
    for (int p = lane; p < parts; p += WARP) m = MaxOf{}(m, part[p]);
    return m;
  });
  const float now = MaxOf{}(history[s * len + pos], w.reduce(steps, MaxOf{}));
  w.sync();
  w.each([&](int lane) {
    for (int p = lane; p < parts; p += WARP) part[p] = 0.0f;
    if (lane == 0) amax[s] = now;
    return 0;
  });
}

// The end of a step for scaler `s` of a set (DelayedScaler::update), one warp each:
// state[3s ..] holds (scale, scale_inv, the format's largest value x 2^-margin), history
// [s * len ..] the amax ring with this step's slot at `pos`, amax[s] the step's amax
// (fp8_amax_fold's, reduced over ranks where there are several). It is recorded in the
// slot; the amax (the window's largest, or this step's) gives scale = scaled_max / amax
// where it is finite and positive (else the scale stays; an infinite one becomes
// FLT_MAX); the ring moves on and its new slot starts at 0. Every step is a max or one
// division, so the lanes' order changes no bit.
template <class W>
STOKER_HD void fp8_scale_update_row(const W& w, int64_t s, float* state, float* history,
                                    const float* amax_of_step, int len, int pos,
                                    int most_recent) {
  float* ring = history + s * len;
  const float now = amax_of_step[s];
  auto windows = w.each([&](int lane) {
    float m = 0.0f;
    for (int k = lane; k < len; k += WARP) m = MaxOf{}(m, k == pos ? now : ring[k]);
    return m;
  });
  const float amax = most_recent ? now : w.reduce(windows, MaxOf{});
  w.sync();
  w.each([&](int lane) {
    if (lane == 0) {
      float scale = state[3 * s];
      if (amax > 0.0f && amax <= 3.40282347e38f) scale = state[3 * s + 2] / amax;
      if (scale > 3.40282347e38f) scale = 3.40282347e38f;
      state[3 * s] = scale;
      state[3 * s + 1] = 1.0f / scale;
      ring[pos] = now;
      ring[(pos + 1) % len] = 0.0f;
    }
    return 0;
  });
}

}  // namespace stoker
