// A warp of 32 lanes, two ways: on the device each thread is one lane and a reduction is
// a butterfly of shuffles; on the host one call runs all 32 lanes in turn and replays the
// same butterfly over their values. Kernel bodies (ops/*.cuh) are templates over the warp
// type, so the arithmetic and its order are written once:
//
//   auto part = w.each([&](int lane) { ... return partial; });   // per-lane values
//   float total = w.reduce(part, Sum{});                         // the same on every lane
//   w.each([&](int lane) { ... use total ... return 0; });
#pragma once
#include "pack.h"

namespace stoker {

constexpr int WARP = 32;

// A row's elements by lane: lane `lane` owns packs lane, lane + 32, ... (pack.h), so the
// loop runs i0 = lane * 8, then every 256, while i0 < n; a lane sums its elements in that
// order before the butterfly.
#define STOKER_LANE_PACKS(i0, lane, n) \
  for (int64_t i0 = int64_t(lane) * stoker::PACK; i0 < (n); i0 += int64_t(stoker::WARP) * stoker::PACK)

struct Sum {
  STOKER_HD float operator()(float a, float b) const { return a + b; }
};

// A running (max, sum of exp(x - max)) pair, for one-pass softmax statistics.
struct MaxSum {
  float m, s;
};

struct CombineMaxSum {
  STOKER_HD MaxSum operator()(MaxSum a, MaxSum b) const {
    float m = fmax_(a.m, b.m);
    float sa = a.m == m ? a.s : a.s * fexp(a.m - m);
    float sb = b.m == m ? b.s : b.s * fexp(b.m - m);
    return MaxSum{m, sa + sb};
  }
};

// The largest value and its first index (the index kept as a float: exact below 2^24).
struct ArgMax {
  float v, i;
};

struct CombineArgMax {
  STOKER_HD ArgMax operator()(ArgMax a, ArgMax b) const {
    if (a.v > b.v) return a;
    if (b.v > a.v) return b;
    return a.i < b.i ? a : b;
  }
};

STOKER_HD MaxSum push(MaxSum acc, float x) {
  if (x > acc.m) return MaxSum{x, acc.s * fexp(acc.m - x) + 1.0f};
  return MaxSum{acc.m, acc.s + fexp(x - acc.m)};
}

#ifdef __CUDA_ARCH__
__device__ __forceinline__ float shuffle_xor(float v, int mask) {
  return __shfl_xor_sync(0xffffffffu, v, mask);
}
__device__ __forceinline__ MaxSum shuffle_xor(MaxSum v, int mask) {
  return MaxSum{__shfl_xor_sync(0xffffffffu, v.m, mask), __shfl_xor_sync(0xffffffffu, v.s, mask)};
}
__device__ __forceinline__ ArgMax shuffle_xor(ArgMax v, int mask) {
  return ArgMax{__shfl_xor_sync(0xffffffffu, v.v, mask), __shfl_xor_sync(0xffffffffu, v.i, mask)};
}

// The device's warp: this thread's lane.
struct DeviceWarp {
  int lane;
  template <class F> __device__ __forceinline__ auto each(F f) const { return f(lane); }
  template <class T, class Op> __device__ __forceinline__ T reduce(T v, Op op) const {
    for (int mask = WARP / 2; mask > 0; mask >>= 1) v = op(v, shuffle_xor(v, mask));
    return v;
  }
  __device__ __forceinline__ void sync() const { __syncwarp(); }
};
#else
// The lanes' values on the host.
template <class T> struct Lanes {
  T v[WARP];
};

// The host's warp: all lanes, one after another.
struct HostWarp {
  template <class F> auto each(F f) const {
    Lanes<decltype(f(0))> out;
    for (int lane = 0; lane < WARP; ++lane) out.v[lane] = f(lane);
    return out;
  }
  template <class T, class Op> T reduce(Lanes<T> v, Op op) const {
    for (int mask = WARP / 2; mask > 0; mask >>= 1) {
      Lanes<T> next;
      for (int lane = 0; lane < WARP; ++lane) next.v[lane] = op(v.v[lane], v.v[lane ^ mask]);
      v = next;
    }
    return v.v[0];
  }
  void sync() const {}
};
#endif

}  // namespace stoker
