// Causal attention's softmax, one warp per row of the [B*H, T, T] score matrix: the
// forward scales, masks (keys after the query get probability 0) and normalizes in one
// pass of statistics and one of writes; the backward is softmax's Jacobian-vector
// product. The matrix products around them are cuBLAS's (the CPU twins' in tests).
//
// Queries come in chunks of `chunk` rows, and the products around these kernels cover
// only the keys up to each chunk's last query: a row t is written up to its chunk's
// width, min((t / chunk + 1) * chunk, T), zeros after the query, and nothing beyond (no
// product reads there). chunk = T writes every row whole.
#pragma once
#include "../warp.h"

namespace stoker {

// The columns written in row t: up to the last query of t's chunk.
STOKER_HD int chunk_width(int t, int T_, int chunk) {
  int w = (t / chunk + 1) * chunk;
  return w < T_ ? w : T_;
}

// Row `row` (query t = row % T): att[j] = softmax_j(scale * pre[j]) for j <= t, 0 after,
// up to the chunk's width. att may be pre (in place): each lane reads its packs before
// writing them.
template <class W, class T>
STOKER_HD void attention_softmax_forward_row(const W& w, int64_t row, T* att, const T* pre,
                                             int T_, int chunk, float scale) {
  int t = int(row % T_);
  int width = chunk_width(t, T_, chunk);
  const T* x = pre + row * T_;
  T* y = att + row * T_;
  auto stats = w.each([&](int lane) {
    MaxSum acc{-INFINITY, 0.0f};
    STOKER_LANE_PACKS(i0, lane, t + 1) {
      Pack p = load_pack(x, i0, t + 1);
      STOKER_PACK_ELEMENTS(k, i0, t + 1) acc = push(acc, scale * p.v[k]);
    }
    return acc;
  });
  MaxSum all = w.reduce(stats, CombineMaxSum{});
  float inv = 1.0f / all.s;
  w.each([&](int lane) {
    STOKER_LANE_PACKS(i0, lane, width) {
      Pack p = load_pack(x, i0, t + 1);
      for (int k = 0; k < PACK; ++k)
        p.v[k] = i0 + k <= t ? fexp(scale * p.v[k] - all.m) * inv : 0.0f;
      store_pack(y, i0, width, p);
    }
    return 0;
  });
}

// Row `row` of the backward: dpre[j] = scale * att[j] * (datt[j] - sum_k att[k] datt[k])
// for j <= t, 0 after, up to the chunk's width. dpre may be datt (in place).
template <class W, class T>
STOKER_HD void attention_softmax_backward_row(const W& w, int64_t row, T* dpre, const T* datt,
                                              const T* att, int T_, int chunk, float scale) {
  int t = int(row % T_);
  int width = chunk_width(t, T_, chunk);
  const T* a = att + row * T_;
  const T* g = datt + row * T_;
  T* d = dpre + row * T_;
  auto dots = w.each([&](int lane) {
    float s = 0.0f;
    STOKER_LANE_PACKS(i0, lane, t + 1) {
      Pack ap = load_pack(a, i0, t + 1), gp = load_pack(g, i0, t + 1);
      STOKER_PACK_ELEMENTS(k, i0, t + 1) s += ap.v[k] * gp.v[k];
    }
    return s;
  });
  float dot = w.reduce(dots, Sum{});
  w.each([&](int lane) {
    STOKER_LANE_PACKS(i0, lane, width) {
      Pack ap = load_pack(a, i0, t + 1), gp = load_pack(g, i0, t + 1);
      for (int k = 0; k < PACK; ++k)
        ap.v[k] = i0 + k <= t ? scale * ap.v[k] * (gp.v[k] - dot) : 0.0f;
      store_pack(d, i0, width, ap);
    }
    return 0;
  });
}

}  // namespace stoker
