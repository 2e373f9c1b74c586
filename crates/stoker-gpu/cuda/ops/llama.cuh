// The Llama's own kernels: RMSNorm (one warp per row, the residual add optionally fused
// in front, as for layer norm) and its backward, rotary embeddings applied in place,
// SwiGLU's gate and its backward, and grouped-query attention's key/value heads repeated
// to the query heads (and their gradients summed back, in order). The CPU twins are
// stoker-kernels' rms_norm, rope, swiglu and LlamaStep's repeat_kv.
#pragma once
#include "../warp.h"
#include "elementwise.cuh"
#include "layernorm.cuh"

namespace stoker {

// Row `row`: out = x * rstd * weight with rstd = 1 / sqrt(mean(x^2) + eps). With `a2`
// not null the row is first a + a2, rounded to T and written to `resid`.
template <class W, class T>
STOKER_HD void rmsnorm_forward_row(const W& w, int64_t row, T* out, float* rstd, T* resid,
                                   const T* a, const T* a2, const T* weight, int C, float eps) {
  const T* x = fused_residual_row(w, row, resid, a, a2, C);
  auto squares = w.each([&](int lane) {
    float s = 0.0f;
    for (int i = lane; i < C; i += WARP) s += load(x[i]) * load(x[i]);
    return s;
  });
  float rs = 1.0f / fsqrt(w.reduce(squares, Sum{}) / float(C) + eps);
  T* o = out + row * C;
  w.each([&](int lane) {
    for (int i = lane; i < C; i += WARP) o[i] = store<T>(load(x[i]) * rs * load(weight[i]));
    if (lane == 0) rstd[row] = rs;
    return 0;
  });
}

// The backward of warp `wid`'s rows (wid, wid + warps, ...): dx added to `dinp`, this
// warp's share of dweight written to partials[wid] (C floats).
template <class W, class T>
STOKER_HD void rmsnorm_backward_warp(const W& w, int wid, int warps, int64_t N, T* dinp,
                                     float* partials, const T* dout, const T* inp, const T* weight,
                                     const float* rstd, int C) {
  float* pw = partials + int64_t(wid) * C;
  w.each([&](int lane) {
    for (int i = lane; i < C; i += WARP) pw[i] = 0.0f;
    return 0;
  });
  for (int64_t row = wid; row < N; row += warps) {
    const T* x = inp + row * C;
    const T* g = dout + row * C;
    T* dx = dinp + row * C;
    float rs = rstd[row];
    auto parts = w.each([&](int lane) {
      float s = 0.0f;
      for (int i = lane; i < C; i += WARP) s += load(x[i]) * rs * (load(g[i]) * load(weight[i]));
      return s;
    });
    float m = w.reduce(parts, Sum{}) / float(C);
    w.each([&](int lane) {
      for (int i = lane; i < C; i += WARP) {
        float xi = load(x[i]), gi = load(g[i]);
        pw[i] += gi * (xi * rs);
        float v = rs * (gi * load(weight[i]) - xi * rs * m);
        dx[i] = store<T>(load(dx[i]) + v);
      }
      return 0;
    });
  }
}

// Rotary embeddings in place on x [B, T, H, D] (transformers' rotate-half: element
// i < D/2 turns with i + D/2 by position t's angle for i), i over B*T*H*(D/2); `cos`,
// `sin` are [T, D/2] (stoker-kernels' rope::tables). `sign` -1 turns back (the backward).
template <class T>
STOKER_HD void rope_at(int64_t i, T* x, const float* cos, const float* sin, int T_, int H, int D,
                       float sign) {
  int half = D / 2;
  int f = int(i % half);
  int64_t head = i / half;  // (b * T + t) * H + h
  int t = int((head / H) % T_);
  T* a = x + head * D + f;
  T* b = a + half;
  float c = cos[int64_t(t) * half + f], s = sign * sin[int64_t(t) * half + f];
  float xa = load(*a), xb = load(*b);
  *a = store<T>(xa * c - xb * s);
  *b = store<T>(xb * c + xa * s);
}

STOKER_HD float sigmoid_of(float x) { return 1.0f / (1.0f + fexp(-x)); }

// y = silu(gate) * up.
template <class T> STOKER_HD void swiglu_forward_at(int64_t i, T* y, const T* gate, const T* up) {
  float g = load(gate[i]);
  y[i] = store<T>(g * sigmoid_of(g) * load(up[i]));
}

// With s = sigmoid(g): dgate = dy * up * s * (1 + g (1 - s)), dup = dy * g * s.
template <class T>
STOKER_HD void swiglu_backward_at(int64_t i, T* dgate, T* dup, const T* gate, const T* up,
                                  const T* dy) {
  float g = load(gate[i]), u = load(up[i]), d = load(dy[i]);
  float s = sigmoid_of(g);
  dgate[i] = store<T>(d * u * s * (1.0f + g * (1.0f - s)));
  dup[i] = store<T>(d * g * s);
}

// Grouped-query attention's keys or values: src [B, T, KV, D] to dst [B, H, T, D], query
// head h reading kv head h / (H / KV) (transformers' repeat_kv); i over B*H*T*D.
template <class T>
STOKER_HD void kv_to_heads_at(int64_t i, T* dst, const T* src, Heads g, int kv) {
  int d = int(i % g.d);
  int64_t r = i / g.d;
  int t = int(r % g.t);
  r /= g.t;
  int h = int(r % g.h);
  int b = int(r / g.h);
  int k = h / (g.h / kv);
  dst[i] = src[((int64_t(b) * g.t + t) * kv + k) * g.d + d];
}

// The backward: dsrc[b, t, k, d] = the sum over k's query heads (in order) of
// dheads[b, h, t, d]; i over B*T*KV*D.
template <class T>
STOKER_HD void heads_to_kv_at(int64_t i, T* dsrc, const T* dheads, Heads g, int kv) {
  int d = int(i % g.d);
  int64_t r = i / g.d;
  int k = int(r % kv);
  r /= kv;
  int t = int(r % g.t);
  int b = int(r / g.t);
  int rep = g.h / kv;
  float s = 0.0f;
  for (int j = 0; j < rep; ++j)
    s += load(dheads[((int64_t(b) * g.h + k * rep + j) * g.t + t) * g.d + d]);
  dsrc[i] = store<T>(s);
}

}  // namespace stoker
