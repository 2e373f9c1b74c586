// The fused classifier (llm.c's): softmax, cross-entropy and the logits' gradient in one
// kernel, one warp per row (a lane's elements by pack, warp.h); the probabilities are
// never stored, the gradient overwrites the logits. The vocabulary is padded to Vp
// columns (GPT-2's 50,257 to 50,304); the padding takes no part and gets gradient 0.
#pragma once
#include "../warp.h"

namespace stoker {

// Row `row`: losses[row] = logsumexp(x[:V]) - x[target] and, with `grad`,
// x[j] = dscale * (softmax(x)[j] - [j == target]) for j < V, 0 for V <= j < Vp. With
// `hits` not null, hits[row] = 1 where the target is the first largest logit (argmax's
// top-1), else 0. A row whose target is `ignore` gets loss 0, no hit and gradient 0.
template <class W, class T>
STOKER_HD void classifier_row(const W& w, int64_t row, T* logits, float* losses, float* hits,
                              const int32_t* targets, int V, int Vp, int grad, float dscale,
                              int ignore) {
  T* x = logits + row * Vp;
  int target = targets[row];
  if (target == ignore) {
    w.each([&](int lane) {
      if (grad) STOKER_LANE_PACKS(i0, lane, Vp) store_pack(x, i0, Vp, Pack{});
      if (lane == 0) {
        losses[row] = 0.0f;
        if (hits) hits[row] = 0.0f;
      }
      return 0;
    });
    return;
  }
  if (hits) {
    auto best = w.each([&](int lane) {
      ArgMax acc{-INFINITY, float(V)};
      STOKER_LANE_PACKS(i0, lane, V) {
        Pack p = load_pack(x, i0, V);
        STOKER_PACK_ELEMENTS(k, i0, V)
          if (p.v[k] > acc.v) acc = ArgMax{p.v[k], float(i0 + k)};
      }
      return acc;
    });
    ArgMax top = w.reduce(best, CombineArgMax{});
    w.each([&](int lane) {
      if (lane == 0) hits[row] = top.i == float(target) ? 1.0f : 0.0f;
      return 0;
    });
  }
  auto stats = w.each([&](int lane) {
    MaxSum acc{-INFINITY, 0.0f};
    STOKER_LANE_PACKS(i0, lane, V) {
      Pack p = load_pack(x, i0, V);
      STOKER_PACK_ELEMENTS(k, i0, V) acc = push(acc, p.v[k]);
    }
    return acc;
  });
  MaxSum all = w.reduce(stats, CombineMaxSum{});
  float lse = all.m + flog(all.s);
  float xt = load(x[target]);
  w.sync();  // every lane has read x[target] before any lane overwrites it
  w.each([&](int lane) {
    if (grad) STOKER_LANE_PACKS(i0, lane, Vp) {
        Pack p = load_pack(x, i0, V);
        for (int k = 0; k < PACK; ++k) {
          int64_t j = i0 + k;
          float q = j < V ? fexp(p.v[k] - lse) : 0.0f;
          p.v[k] = dscale * (j == target ? q - 1.0f : q);
        }
        store_pack(x, i0, Vp, p);
      }
    if (lane == 0) losses[row] = lse - xt;
    return 0;
  });
}

}  // namespace stoker
