// Deterministic sums for the step's scalars: the squared gradient norm and the summed
// loss. Warp `wid` of `warps` sums packs (wid * 32 + lane) + k * warps * 32 (pack.h:
// eight elements each, in order) into partials[wid]; one warp then sums the partials.
// The same bracketing on every run and on the host.
#pragma once
#include "../warp.h"

namespace stoker {

// partials[wid] = sum of x^2 (squares) or of x over the warp's grid-stride share.
template <class W>
STOKER_HD void sum_partial_warp(const W& w, int wid, int warps, float* partials, const float* x,
                                int64_t n, int squares) {
  auto parts = w.each([&](int lane) {
    float s = 0.0f;
    for (int64_t i0 = (int64_t(wid) * WARP + lane) * PACK; i0 < n;
         i0 += int64_t(warps) * WARP * PACK) {
      Pack p = load_pack(x, i0, n);
      STOKER_PACK_ELEMENTS(k, i0, n) s += squares ? p.v[k] * p.v[k] : p.v[k];
    }
    return s;
  });
  float total = w.reduce(parts, Sum{});
  w.each([&](int lane) {
    if (lane == 0) partials[wid] = total;
    return 0;
  });
}

// out[0] (+)= the sum of x[0..n] by one warp (lane-strided, then the butterfly).
template <class W>
STOKER_HD void sum_warp(const W& w, float* out, const float* x, int64_t n, int accumulate) {
  auto parts = w.each([&](int lane) {
    float s = 0.0f;
    for (int64_t i = lane; i < n; i += WARP) s += x[i];
    return s;
  });
  float total = w.reduce(parts, Sum{});
  w.each([&](int lane) {
    if (lane == 0) out[0] = accumulate ? out[0] + total : total;
    return 0;
  });
}

}  // namespace stoker
