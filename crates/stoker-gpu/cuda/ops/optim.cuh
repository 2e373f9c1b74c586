// The optimizers over the flat FP32 master, one thread per element: AdamW and SGD with
// momentum, each as stoker-kernels' scalar twin exactly (the same order and the same
// fused multiply-adds), on the gradient times `grad_scale` (unscaling and clipping),
// writing the bf16 compute copy in the same pass when asked. The segmented forms cover
// the whole flat buffer in one launch: each element finds its segment (a tensor, or a run
// of tensors, with its weight-decay flag) by binary search; elements in no segment stay.
#pragma once
#include "../portable.h"

namespace stoker {

// AdamW's scalars for one step, as stoker-kernels' AdamWStep (derived in f64 on the host),
// and how the bf16 copy rounds: to nearest even, or (`stochastic` 1) with element i's
// random bits round_noise(seed, offset + i).
struct AdamW {
  float decay, w1, beta2, w2, step_size, bc2_sqrt, eps;
  uint32_t stochastic;
  uint64_t seed, offset;
};

// One AdamW update of element i, stoker-kernels' adamw_update_scalar exactly (torch's
// order; the one fused multiply-add where it has one), on the gradient times
// `grad_scale` (unscaling and clipping, 1 when neither applies). Writes the bf16 copy
// when `copy` is not null, rounded as `s` says.
STOKER_HD void adamw_at(int64_t i, float* p, const float* g, float* m, float* v, bf16* copy,
                        AdamW s, int decay, float grad_scale) {
  float gi = g[i];
  if (grad_scale != 1.0f) gi = gi * grad_scale;
  float pi = p[i];
  if (decay) pi = pi * s.decay;
  float mi = m[i] + s.w1 * (gi - m[i]);
  float vi = v[i] * s.beta2 + s.w2 * gi * gi;
  float denom = fsqrt(vi) / s.bc2_sqrt + s.eps;
  pi = fmaf(-s.step_size, mi / denom, pi);
  p[i] = pi;
  m[i] = mi;
  v[i] = vi;
  if (copy)
    copy[i] = s.stochastic ? store_stochastic(pi, round_noise(s.seed, s.offset + uint64_t(i)))
                           : store<bf16>(pi);
}

// SGD's scalars for one step, as stoker-kernels' SgdStep.
struct Sgd {
  float lr, momentum, weight_decay;
  int nesterov, first;
};

// One SGD update of element i, stoker-kernels' sgd_update_scalar exactly; `buf` (the
// momentum buffer) may be null when momentum is 0.
STOKER_HD void sgd_at(int64_t i, float* p, const float* g, float* buf, bf16* copy, Sgd s,
                      int decay, float grad_scale) {
  float d = g[i];
  if (grad_scale != 1.0f) d = d * grad_scale;
  float pi = p[i];
  if (decay && s.weight_decay != 0.0f) d = fmaf(s.weight_decay, pi, d);
  if (s.momentum != 0.0f) {
    float b = s.first ? d : buf[i] * s.momentum + d;
    buf[i] = b;
    d = s.nesterov ? fmaf(s.momentum, b, d) : b;
  }
  pi = fmaf(-s.lr, d, pi);
  p[i] = pi;
  if (copy) copy[i] = store<bf16>(pi);
}

// The segment holding flat element i: k with bounds[2k] <= i < bounds[2k + 1] (S sorted,
// disjoint segments as start, end pairs), or -1 where i falls in no segment.
STOKER_HD int segment_of(int64_t i, const int64_t* bounds, int S) {
  int lo = 0, hi = S - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (bounds[2 * mid] <= i)
      lo = mid;
    else
      hi = mid - 1;
  }
  return (bounds[2 * lo] <= i && i < bounds[2 * lo + 1]) ? lo : -1;
}

// AdamW over every segment at once, i over the flat buffer.
STOKER_HD void adamw_segments_at(int64_t i, float* p, const float* g, float* m, float* v,
                                 bf16* copy, AdamW s, const int64_t* bounds,
                                 const int32_t* decay, int S, float grad_scale) {
  int k = segment_of(i, bounds, S);
  if (k >= 0) adamw_at(i, p, g, m, v, copy, s, decay[k], grad_scale);
}

// SGD over every segment at once, i over the flat buffer.
STOKER_HD void sgd_segments_at(int64_t i, float* p, const float* g, float* buf, bf16* copy,
                               Sgd s, const int64_t* bounds, const int32_t* decay, int S,
                               float grad_scale) {
  int k = segment_of(i, bounds, S);
  if (k >= 0) sgd_at(i, p, g, buf, copy, s, decay[k], grad_scale);
}

}  // namespace stoker
