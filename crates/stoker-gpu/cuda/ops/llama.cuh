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
    STOKER_LANE_PACKS(i0, lane, C) {
      Pack p = load_pack(x, i0, C);
      STOKER_PACK_ELEMENTS(k, i0, C) s += p.v[k] * p.v[k];
    }
    return s;
  });
  float rs = 1.0f / fsqrt(w.reduce(squares, Sum{}) / float(C) + eps);
  T* o = out + row * C;
  w.each([&](int lane) {
    STOKER_LANE_PACKS(i0, lane, C) {
      Pack p = load_pack(x, i0, C), g = load_pack(weight, i0, C);
      for (int k = 0; k < PACK; ++k) p.v[k] = p.v[k] * rs * g.v[k];
      store_pack(o, i0, C, p);
    }
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
    STOKER_LANE_PACKS(i0, lane, C) store_pack(pw, i0, C, Pack{});
    return 0;
  });
  for (int64_t row = wid; row < N; row += warps) {
    const T* x = inp + row * C;
    const T* g = dout + row * C;
    T* dx = dinp + row * C;
    float rs = rstd[row];
    auto parts = w.each([&](int lane) {
      float s = 0.0f;
      STOKER_LANE_PACKS(i0, lane, C) {
        Pack xp = load_pack(x, i0, C), gp = load_pack(g, i0, C), wp = load_pack(weight, i0, C);
        STOKER_PACK_ELEMENTS(k, i0, C) s += xp.v[k] * rs * (gp.v[k] * wp.v[k]);
      }
      return s;
    });
    float m = w.reduce(parts, Sum{}) / float(C);
    w.each([&](int lane) {
      STOKER_LANE_PACKS(i0, lane, C) {
        Pack xp = load_pack(x, i0, C), gp = load_pack(g, i0, C), wp = load_pack(weight, i0, C);
        Pack d = load_pack(dx, i0, C), dw = load_pack(pw, i0, C);
        for (int k = 0; k < PACK; ++k) {
          float xi = xp.v[k], gi = gp.v[k];
          dw.v[k] += gi * (xi * rs);
          float v = rs * (gi * wp.v[k] - xi * rs * m);
          d.v[k] = d.v[k] + v;
        }
        store_pack(pw, i0, C, dw);
        store_pack(dx, i0, C, d);
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

// y = silu(gate) * up, pack i0 of n.
template <class T>
STOKER_HD void swiglu_forward_pack(int64_t i0, int64_t n, T* y, const T* gate, const T* up) {
  Pack g = load_pack(gate, i0, n), u = load_pack(up, i0, n);
  for (int k = 0; k < PACK; ++k) u.v[k] = g.v[k] * sigmoid_of(g.v[k]) * u.v[k];
  store_pack(y, i0, n, u);
}

// With s = sigmoid(g): dgate = dy * up * s * (1 + g (1 - s)), dup = dy * g * s.
template <class T>
STOKER_HD void swiglu_backward_pack(int64_t i0, int64_t n, T* dgate, T* dup, const T* gate,
                                    const T* up, const T* dy) {
  Pack g = load_pack(gate, i0, n), u = load_pack(up, i0, n), d = load_pack(dy, i0, n);
  Pack dg, du;
  for (int k = 0; k < PACK; ++k) {
    float s = sigmoid_of(g.v[k]);
    dg.v[k] = d.v[k] * u.v[k] * s * (1.0f + g.v[k] * (1.0f - s));
    du.v[k] = d.v[k] * g.v[k] * s;
  }
  store_pack(dgate, i0, n, dg);
  store_pack(dup, i0, n, du);
}

// Grouped-query attention's keys or values: src [B, T, KV, D] to dst [B, H, T, D], query
// head h reading kv head h / (H / KV) (transformers' repeat_kv); i over B*H*T*D.
template <class T>
STOKER_HD void kv_to_heads_pack(int64_t i0, T* dst, const T* src, Heads g, int kv) {
  int64_t n = int64_t(g.b) * g.h * g.t * g.d;
  auto from = [&](int64_t i) {
    HeadsAt p = heads_at(i, g);
    int k = p.h / (g.h / kv);
    return ((int64_t(p.b) * g.t + p.t) * kv + k) * g.d + p.d;
  };
  permute_pack(i0, n, g, dst, SameIndex{}, src, from);
}

// The backward: dsrc[b, t, k, d] = the sum over k's query heads (in order) of
// dheads[b, h, t, d]; i over B*T*KV*D.
// (Pack i0 of the n = B*T*KV*D sums: eight of one row's d where d is a multiple of 8,
// else element by element.)
template <class T>
STOKER_HD void heads_to_kv_pack(int64_t i0, T* dsrc, const T* dheads, Heads g, int kv) {
  int64_t n = int64_t(g.b) * g.t * kv * g.d;
  int rep = g.h / kv;
  // The first query head's element of flat index i (the others follow g.t * g.d apart).
  auto first = [&](int64_t i) {
    int d = int(i % g.d);
    int64_t r = i / g.d;
    int k = int(r % kv);
    r /= kv;
    int t = int(r % g.t);
    int b = int(r / g.t);
    return ((int64_t(b) * g.h + k * rep) * g.t + t) * g.d + d;
  };
  int count = pack_count(i0, n);
  int64_t head_stride = int64_t(g.t) * g.d;
  if (g.d % PACK == 0) {
    int64_t j0 = first(i0);
    Pack s = {};
    for (int j = 0; j < rep; ++j) {
      Pack v = load_pack(dheads + j0 + j * head_stride, 0, count);
      for (int k = 0; k < PACK; ++k) s.v[k] += v.v[k];
    }
    store_pack(dsrc, i0, n, s);
    return;
  }
  for (int k = 0; k < count; ++k) {
    int64_t j0 = first(i0 + k);
    float s = 0.0f;
    for (int j = 0; j < rep; ++j) s += load(dheads[j0 + j * head_stride]);
    dsrc[i0 + k] = store<T>(s);
  }
}

}  // namespace stoker
