// Layer norm, one warp per row of C: the forward (optionally with the residual add fused
// in front of it, llm.c's fusion) and the backward, whose weight and bias gradients go
// to per-warp partial rows that reduce_partials_at sums in a fixed order.
#pragma once
#include "../warp.h"

namespace stoker {

// The input of a norm's row `row`: `a`'s row, or with `a2` not null a + a2 (the residual
// add fused in front), rounded to T and written to `resid`'s row, which it then is.
template <class W, class T>
STOKER_HD const T* fused_residual_row(const W& w, int64_t row, T* resid, const T* a,
                                      const T* a2, int C) {
  const T* x = a + row * C;
  if (!a2) return x;
  T* r = resid + row * C;
  const T* y = a2 + row * C;
  w.each([&](int lane) {
    for (int i = lane; i < C; i += WARP) r[i] = store<T>(load(x[i]) + load(y[i]));
    return 0;
  });
  return r;
}

// Row `row` of the forward. With `a2` not null the row's input is a + a2, rounded to T
// and written to `resid` (the residual stream the next block reads); otherwise the input
// is `a`. Writes out = (x - mean) * rstd * weight + bias and the row's mean and rstd.
template <class W, class T>
STOKER_HD void layernorm_forward_row(const W& w, int64_t row, T* out, float* mean, float* rstd,
                                     T* resid, const T* a, const T* a2, const T* weight,
                                     const T* bias, int C, float eps) {
  const T* x = fused_residual_row(w, row, resid, a, a2, C);
  auto sums = w.each([&](int lane) {
    float s = 0.0f;
    for (int i = lane; i < C; i += WARP) s += load(x[i]);
    return s;
  });
  float mu = w.reduce(sums, Sum{}) / float(C);
  auto squares = w.each([&](int lane) {
    float s = 0.0f;
    for (int i = lane; i < C; i += WARP) {
      float d = load(x[i]) - mu;
      s += d * d;
    }
    return s;
  });
  float var = w.reduce(squares, Sum{}) / float(C);
  float rs = 1.0f / fsqrt(var + eps);
  T* o = out + row * C;
  w.each([&](int lane) {
    for (int i = lane; i < C; i += WARP)
      o[i] = store<T>((load(x[i]) - mu) * rs * load(weight[i]) + load(bias[i]));
    if (lane == 0) {
      mean[row] = mu;
      rstd[row] = rs;
    }
    return 0;
  });
}

// The backward of the rows warp `wid` of `warps` owns (wid, wid + warps, ...): dx is
// added to `dinp` (the residual stream's gradient), and this warp's share of the weight
// and bias gradients is written to partials[wid] = [dweight C | dbias C].
template <class W, class T>
STOKER_HD void layernorm_backward_warp(const W& w, int wid, int warps, int64_t N, T* dinp,
                                       float* partials, const T* dout, const T* inp,
                                       const T* weight, const float* mean, const float* rstd,
                                       int C) {
  float* pw = partials + int64_t(wid) * 2 * C;
  float* pb = pw + C;
  w.each([&](int lane) {
    for (int i = lane; i < C; i += WARP) pw[i] = pb[i] = 0.0f;
    return 0;
  });
  for (int64_t row = wid; row < N; row += warps) {
    const T* x = inp + row * C;
    const T* g = dout + row * C;
    T* dx = dinp + row * C;
    float mu = mean[row], rs = rstd[row];
    auto s1 = w.each([&](int lane) {
      float s = 0.0f;
      for (int i = lane; i < C; i += WARP) s += load(g[i]) * load(weight[i]);
      return s;
    });
    auto s2 = w.each([&](int lane) {
      float s = 0.0f;
      for (int i = lane; i < C; i += WARP)
        s += (load(x[i]) - mu) * rs * (load(g[i]) * load(weight[i]));
      return s;
    });
    float m1 = w.reduce(s1, Sum{}) / float(C);
    float m2 = w.reduce(s2, Sum{}) / float(C);
    w.each([&](int lane) {
      for (int i = lane; i < C; i += WARP) {
        float gi = load(g[i]);
        float xh = (load(x[i]) - mu) * rs;
        pw[i] += gi * xh;
        pb[i] += gi;
        float v = rs * (gi * load(weight[i]) - m1 - xh * m2);
        dx[i] = store<T>(load(dx[i]) + v);
      }
      return 0;
    });
  }
}

}  // namespace stoker
