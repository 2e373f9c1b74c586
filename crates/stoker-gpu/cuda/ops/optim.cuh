// The optimizers over the flat FP32 master, one thread per pack (pack.h): AdamW and SGD with
// momentum, each as stoker-kernels' scalar twin exactly (the same order and the same
// fused multiply-adds), on the gradient times `grad_scale` (unscaling and clipping),
// writing the bf16 compute copy in the same pass when asked. The segmented forms cover
// the whole flat buffer in one launch: each element finds its segment (a tensor, or a run
// of tensors, with its weight-decay flag) by binary search; elements in no segment stay.
#pragma once
#include "../pack.h"

namespace stoker {

// AdamW's scalars for one step, as stoker-kernels' AdamWStep (derived in f64 on the host),
// and how the bf16 copy rounds: to nearest even, or (`stochastic` 1) with element i's
// random bits round_noise(seed, offset + i).
struct AdamW {
  float decay, w1, beta2, w2, step_size, bc2_sqrt, eps;
  uint32_t stochastic;
  uint64_t seed, offset;
};

// One AdamW update of one element's values, stoker-kernels' adamw_update_scalar exactly
// (torch's order; the one fused multiply-add where it has one), on the gradient times
// `grad_scale` (unscaling and clipping, 1 when neither applies).
STOKER_HD void adamw_value(float& p, float& m, float& v, float g, const AdamW& s, int decay,
                           float grad_scale) {
  float gi = g;
  if (grad_scale != 1.0f) gi = gi * grad_scale;
  float pi = p;
  if (decay) pi = pi * s.decay;
  float mi = m + s.w1 * (gi - m);
  float vi = v * s.beta2 + s.w2 * gi * gi;
  float denom = fsqrt(vi) / s.bc2_sqrt + s.eps;
  p = fmaf(-s.step_size, mi / denom, pi);
  m = mi;
  v = vi;
}

// Element i's bf16 copy of p, rounded as `s` says.
STOKER_HD bf16 adamw_copy_of(float p, const AdamW& s, int64_t i) {
  return s.stochastic ? store_stochastic(p, round_noise(s.seed, s.offset + uint64_t(i)))
                      : store<bf16>(p);
}

// AdamW on element i; writes the bf16 copy when `copy` is not null.
STOKER_HD void adamw_at(int64_t i, float* p, const float* g, float* m, float* v, bf16* copy,
                        AdamW s, int decay, float grad_scale) {
  adamw_value(p[i], m[i], v[i], g[i], s, decay, grad_scale);
  if (copy) copy[i] = adamw_copy_of(p[i], s, i);
}

// AdamW on the pack at i0 (of n), one decay flag for all of it (pack.h).
STOKER_HD void adamw_pack(int64_t i0, int64_t n, float* p, const float* g, float* m, float* v,
                          bf16* copy, AdamW s, int decay, float grad_scale) {
  Pack pp = load_pack(p, i0, n), gp = load_pack(g, i0, n), mp = load_pack(m, i0, n),
       vp = load_pack(v, i0, n);
  for (int k = 0; k < PACK; ++k) adamw_value(pp.v[k], mp.v[k], vp.v[k], gp.v[k], s, decay, grad_scale);
  store_pack(p, i0, n, pp);
  store_pack(m, i0, n, mp);
  store_pack(v, i0, n, vp);
  if (copy) {
    alignas(16) bf16 raw[PACK];
    for (int k = 0; k < PACK; ++k) raw[k] = adamw_copy_of(pp.v[k], s, i0 + k);
    store_raw(copy, i0, n, raw);
  }
}

// SGD's scalars for one step, as stoker-kernels' SgdStep.
struct Sgd {
  float lr, momentum, weight_decay;
  int nesterov, first;
};

// One SGD update of one element's values, stoker-kernels' sgd_update_scalar exactly;
// `buf` (its momentum) is unused when momentum is 0.
STOKER_HD void sgd_value(float& p, float& buf, float g, const Sgd& s, int decay,
                         float grad_scale) {
  float d = g;
  if (grad_scale != 1.0f) d = d * grad_scale;
  float pi = p;
  if (decay && s.weight_decay != 0.0f) d = fmaf(s.weight_decay, pi, d);
  if (s.momentum != 0.0f) {
    float b = s.first ? d : buf * s.momentum + d;
    buf = b;
    d = s.nesterov ? fmaf(s.momentum, b, d) : b;
  }
  p = fmaf(-s.lr, d, pi);
}

// SGD on element i; `buf` (the momentum buffer) may be null when momentum is 0.
STOKER_HD void sgd_at(int64_t i, float* p, const float* g, float* buf, bf16* copy, Sgd s,
                      int decay, float grad_scale) {
  bool moments = buf && s.momentum != 0.0f;
  float b = moments ? buf[i] : 0.0f;
  sgd_value(p[i], b, g[i], s, decay, grad_scale);
  if (moments) buf[i] = b;
  if (copy) copy[i] = store<bf16>(p[i]);
}

// SGD on the pack at i0 (of n), one decay flag for all of it.
STOKER_HD void sgd_pack(int64_t i0, int64_t n, float* p, const float* g, float* buf, bf16* copy,
                        Sgd s, int decay, float grad_scale) {
  bool moments = buf && s.momentum != 0.0f;
  Pack pp = load_pack(p, i0, n), gp = load_pack(g, i0, n);
  Pack bp = moments ? load_pack(buf, i0, n) : Pack{};
  for (int k = 0; k < PACK; ++k) sgd_value(pp.v[k], bp.v[k], gp.v[k], s, decay, grad_scale);
  store_pack(p, i0, n, pp);
  if (moments) store_pack(buf, i0, n, bp);
  if (copy) store_pack(copy, i0, n, pp);
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

// The segment holding every element of the pack at i0 (of n), or -1 where the pack
// touches no segment or more than one (then its elements go one by one).
STOKER_HD int pack_segment(int64_t i0, int64_t n, const int64_t* bounds, int S) {
  int k = segment_of(i0, bounds, S);
  int count = pack_count(i0, n);
  return k >= 0 && i0 + count <= bounds[2 * k + 1] ? k : -1;
}

// AdamW over every segment at once, the pack at i0 of the flat buffer's n.
STOKER_HD void adamw_segments_pack(int64_t i0, int64_t n, float* p, const float* g, float* m,
                                   float* v, bf16* copy, AdamW s, const int64_t* bounds,
                                   const int32_t* decay, int S, float grad_scale) {
  int k = pack_segment(i0, n, bounds, S);
  if (k >= 0) {
    adamw_pack(i0, n, p, g, m, v, copy, s, decay[k], grad_scale);
    return;
  }
  for (int64_t i = i0; i < i0 + pack_count(i0, n); ++i) {
    int e = segment_of(i, bounds, S);
    if (e >= 0) adamw_at(i, p, g, m, v, copy, s, decay[e], grad_scale);
  }
}

// SGD over every segment at once, the pack at i0 of the flat buffer's n.
STOKER_HD void sgd_segments_pack(int64_t i0, int64_t n, float* p, const float* g, float* buf,
                                 bf16* copy, Sgd s, const int64_t* bounds, const int32_t* decay,
                                 int S, float grad_scale) {
  int k = pack_segment(i0, n, bounds, S);
  if (k >= 0) {
    sgd_pack(i0, n, p, g, buf, copy, s, decay[k], grad_scale);
    return;
  }
  for (int64_t i = i0; i < i0 + pack_count(i0, n); ++i) {
    int e = segment_of(i, bounds, S);
    if (e >= 0) sgd_at(i, p, g, buf, copy, s, decay[e], grad_scale);
  }
}

}  // namespace stoker
