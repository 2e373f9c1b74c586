// The fused classifier (llm.c's): softmax, cross-entropy and the logits' gradient in one
// kernel, one warp per row; the probabilities are never stored, the gradient overwrites
// the logits. The vocabulary is padded to Vp columns (GPT-2's 50,257 to 50,304); the
// padding takes no part and gets gradient 0.
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
      if (grad)
        for (int j = lane; j < Vp; j += WARP) x[j] = store<T>(0.0f);
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
      for (int j = lane; j < V; j += WARP) {
        float v = load(x[j]);
        if (v > acc.v) acc = ArgMax{v, float(j)};
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
    for (int j = lane; j < V; j += WARP) acc = push(acc, load(x[j]));
    return acc;
  });
  MaxSum all = w.reduce(stats, CombineMaxSum{});
  float lse = all.m + flog(all.s);
  float xt = load(x[target]);
  w.sync();  // every lane has read x[target] before any lane overwrites it
  w.each([&](int lane) {
    if (grad)
      for (int j = lane; j < Vp; j += WARP) {
        float p = j < V ? fexp(load(x[j]) - lse) : 0.0f;
        x[j] = store<T>(dscale * (j == target ? p - 1.0f : p));
      }
    if (lane == 0) losses[row] = lse - xt;
    return 0;
  });
}

}  // namespace stoker
