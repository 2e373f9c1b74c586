// Layer norm, one warp per row of C: the forward (optionally with the residual add fused
// in front of it, llm.c's fusion) and the backward, whose weight and bias gradients go
// to per-warp partial rows that reduce_partials_pack sums in a fixed order. A row's
// lane `lane` owns packs lane, lane + 32, ... (pack.h): elements lane * 8 .. lane * 8 + 7,
// then 256 on; it sums them in that order.
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
    STOKER_LANE_PACKS(i0, lane, C) {
      Pack p = load_pack(x, i0, C), q = load_pack(y, i0, C);
      for (int k = 0; k < PACK; ++k) p.v[k] = p.v[k] + q.v[k];
      store_pack(r, i0, C, p);
    }
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
    STOKER_LANE_PACKS(i0, lane, C) {
      Pack p = load_pack(x, i0, C);
      STOKER_PACK_ELEMENTS(k, i0, C) s += p.v[k];
    }
    return s;
  });
  float mu = w.reduce(sums, Sum{}) / float(C);
  auto squares = w.each([&](int lane) {
    float s = 0.0f;
    STOKER_LANE_PACKS(i0, lane, C) {
      Pack p = load_pack(x, i0, C);
      STOKER_PACK_ELEMENTS(k, i0, C) {
        float d = p.v[k] - mu;
        s += d * d;
      }
    }
    return s;
  });
  float var = w.reduce(squares, Sum{}) / float(C);
  float rs = 1.0f / fsqrt(var + eps);
  T* o = out + row * C;
  w.each([&](int lane) {
    STOKER_LANE_PACKS(i0, lane, C) {
      Pack p = load_pack(x, i0, C), g = load_pack(weight, i0, C), b = load_pack(bias, i0, C);
      for (int k = 0; k < PACK; ++k) p.v[k] = (p.v[k] - mu) * rs * g.v[k] + b.v[k];
      store_pack(o, i0, C, p);
    }
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
    STOKER_LANE_PACKS(i0, lane, C) {
      store_pack(pw, i0, C, Pack{});
      store_pack(pb, i0, C, Pack{});
    }
    return 0;
  });
  for (int64_t row = wid; row < N; row += warps) {
    const T* x = inp + row * C;
    const T* g = dout + row * C;
    T* dx = dinp + row * C;
    float mu = mean[row], rs = rstd[row];
    auto s1 = w.each([&](int lane) {
      float s = 0.0f;
      STOKER_LANE_PACKS(i0, lane, C) {
        Pack gp = load_pack(g, i0, C), wp = load_pack(weight, i0, C);
        STOKER_PACK_ELEMENTS(k, i0, C) s += gp.v[k] * wp.v[k];
      }
      return s;
    });
    auto s2 = w.each([&](int lane) {
      float s = 0.0f;
      STOKER_LANE_PACKS(i0, lane, C) {
        Pack xp = load_pack(x, i0, C), gp = load_pack(g, i0, C), wp = load_pack(weight, i0, C);
        STOKER_PACK_ELEMENTS(k, i0, C)
          s += (xp.v[k] - mu) * rs * (gp.v[k] * wp.v[k]);
      }
      return s;
    });
    float m1 = w.reduce(s1, Sum{}) / float(C);
    float m2 = w.reduce(s2, Sum{}) / float(C);
    w.each([&](int lane) {
      STOKER_LANE_PACKS(i0, lane, C) {
        Pack xp = load_pack(x, i0, C), gp = load_pack(g, i0, C), wp = load_pack(weight, i0, C);
        Pack d = load_pack(dx, i0, C), dw = load_pack(pw, i0, C), db = load_pack(pb, i0, C);
        for (int k = 0; k < PACK; ++k) {
          float gi = gp.v[k];
          float xh = (xp.v[k] - mu) * rs;
          dw.v[k] += gi * xh;
          db.v[k] += gi;
          float v = rs * (gi * wp.v[k] - m1 - xh * m2);
          d.v[k] = d.v[k] + v;
        }
        store_pack(pw, i0, C, dw);
        store_pack(pb, i0, C, db);
        store_pack(dx, i0, C, d);
      }
      return 0;
    });
  }
}

}  // namespace stoker
