// A warp's 16x8x16 matrix product on tensor cores (PTX `mma.sync.aligned.m16n8k16`, bf16
// inputs, f32 accumulators), two ways: on the device one instruction, each lane holding
// its fragment's registers; on the host the same fragments for all 32 lanes, multiplied
// out in f32. The fragments' layouts are PTX ISA's ("Matrix Fragments for mma.m16n8k16"):
// lane l is in group g = l / 4 with thread-in-group t = l % 4, and
// - A (16 x 16, row-major) holds elements i = 0..7, two a register (the lower index in the
//   low half): row g + 8 * ((i / 2) % 2), column 2t + i % 2 + 8 * (i / 4);
// - B (16 x 8, column-major) holds i = 0..3: row (k) 2t + i % 2 + 8 * (i / 2), column g;
// - C (16 x 8, f32) holds i = 0..3: row g + 8 * (i / 2), column 2t + i % 2.
// The kernels only place values by these functions, so the host build checks what the
// kernels do with the fragments; the device check confirms that the device's layout is
// these. The tensor cores' sums are not IEEE's in a fixed order: the two builds agree
// within a tolerance, not bit for bit.
//
// Per-lane state: `PerLane<X>` is X on the device and all lanes' X on the host; `lanes(w,
// f)` runs f(lane) for this lane (device) or each lane (host); `at(x, lane)` is x's value
// for that lane.
#pragma once
#include "warp.h"

namespace stoker {

struct FragA {
  uint32_t r[4];
};
struct FragB {
  uint32_t r[2];
};
struct FragC {
  float x[4];
};

STOKER_HD int frag_a_row(int lane, int i) { return lane / 4 + 8 * ((i / 2) % 2); }
STOKER_HD int frag_a_col(int lane, int i) { return (lane % 4) * 2 + i % 2 + 8 * (i / 4); }
STOKER_HD int frag_b_row(int lane, int i) { return (lane % 4) * 2 + i % 2 + 8 * (i / 2); }
STOKER_HD int frag_b_col(int lane, int) { return lane / 4; }
STOKER_HD int frag_c_row(int lane, int i) { return lane / 4 + 8 * (i / 2); }
STOKER_HD int frag_c_col(int lane, int i) { return (lane % 4) * 2 + i % 2; }

// Two 16-bit values as one register, `lo` in the low half.
STOKER_HD uint32_t pair_bits(uint16_t lo, uint16_t hi) { return uint32_t(lo) | (uint32_t(hi) << 16); }

// Element `half` (0: low) of a register of T values, widened.
template <class T> STOKER_HD float half_of(uint32_t r, int half) {
  T v;
  v.bits = uint16_t(half ? r >> 16 : r & 0xffffu);
  return load(v);
}

// Two f32 values rounded to T, as one register.
template <class T> STOKER_HD uint32_t pair_of(float lo, float hi) {
  return pair_bits(store<T>(lo).bits, store<T>(hi).bits);
}

// An element of a row-major [rows, ld] T matrix, or 0 past its rows.
template <class T> STOKER_HD uint16_t elem_bits(const T* m, int64_t row, int col, int64_t rows, int ld) {
  return row < rows ? m[row * ld + col].bits : uint16_t(0);
}

// Elements col and col + 1 of a row of a row-major [rows, ld] T matrix as one register (0
// past its rows), read as one 32-bit word: col and ld are even and the matrix 4-byte
// aligned (stoker_gpu::flash checks the views), and the low half is element col on both
// sides (little-endian).
template <class T>
STOKER_HD uint32_t pair_bits_at(const T* m, int64_t row, int col, int64_t rows, int ld) {
  if (row >= rows) return 0u;
  const T* p = m + row * ld + col;
#ifdef __CUDA_ARCH__
  return *reinterpret_cast<const uint32_t*>(p);
#else
  uint32_t r;
  memcpy(&r, p, sizeof r);
  return r;
#endif
}

// Lane `lane`'s A fragment of rows r0..r0+15 and columns c0..c0+15 of the row-major
// [rows, ld] matrix m (rows past `rows` read as 0).
template <class T>
STOKER_HD FragA frag_a_rows(const T* m, int64_t r0, int c0, int64_t rows, int ld, int lane) {
  FragA a;
  for (int j = 0; j < 4; ++j) {
    int64_t row = r0 + frag_a_row(lane, 2 * j);
    int col = c0 + frag_a_col(lane, 2 * j);
    a.r[j] = pair_bits_at(m, row, col, rows, ld);
  }
  return a;
}

// Lane `lane`'s B fragment whose column n is row n0 + n of the row-major [rows, ld] matrix
// m from column k0 (B = m[n0.., k0..]^T: keys' rows as the columns of K^T).
template <class T>
STOKER_HD FragB frag_b_cols(const T* m, int64_t n0, int k0, int64_t rows, int ld, int lane) {
  FragB b;
  int64_t row = n0 + frag_b_col(lane, 0);
  for (int j = 0; j < 2; ++j) {
    int col = k0 + frag_b_row(lane, 2 * j);
    b.r[j] = pair_bits_at(m, row, col, rows, ld);
  }
  return b;
}

// Lane `lane`'s B fragment of rows k0..k0+15 and columns n0..n0+7 of the row-major
// [rows, ld] matrix m (B = m[k0.., n0..]: values' rows by key).
template <class T>
STOKER_HD FragB frag_b_rows(const T* m, int64_t k0, int n0, int64_t rows, int ld, int lane) {
  FragB b;
  int col = n0 + frag_b_col(lane, 0);
  for (int j = 0; j < 2; ++j) {
    int64_t row = k0 + frag_b_row(lane, 2 * j);
    b.r[j] = pair_bits(elem_bits(m, row, col, rows, ld), elem_bits(m, row + 1, col, rows, ld));
  }
  return b;
}

// The 16 x 16 tile of two C fragments (columns 0..7, then 8..15) rounded to T as an A
// fragment: what a product's result becomes the next product's left operand.
template <class T> STOKER_HD FragA frag_a_of(const FragC& lo, const FragC& hi) {
  FragA a;
  for (int j = 0; j < 4; ++j) {
    const FragC& c = j / 2 == 0 ? lo : hi;
    a.r[j] = pair_of<T>(c.x[2 * (j % 2)], c.x[2 * (j % 2) + 1]);
  }
  return a;
}

STOKER_HD FragC frag_c_zero() {
  FragC c;
  for (int i = 0; i < 4; ++i) c.x[i] = 0.0f;
  return c;
}

struct Max {
  STOKER_HD float operator()(float a, float b) const { return fmax_(a, b); }
};

#ifdef __CUDA_ARCH__
#if __CUDA_ARCH__ < 800
#error "mma.sync.m16n8k16 with bf16 needs sm_80 or later (build.rs's CUDA_COMPUTE_CAP)"
#endif
template <class X> using PerLane = X;
template <class X> __device__ __forceinline__ X& at(X& x, int) { return x; }
template <class X> __device__ __forceinline__ const X& at(const X& x, int) { return x; }
template <class F> __device__ __forceinline__ void lanes(const DeviceWarp& w, F f) { f(w.lane); }

template <class T> __device__ __forceinline__ void mma_sync(FragC& d, const FragA& a, const FragB& b);
template <> __device__ __forceinline__ void mma_sync<bf16>(FragC& d, const FragA& a, const FragB& b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d.x[0]), "+f"(d.x[1]), "+f"(d.x[2]), "+f"(d.x[3])
      : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[0]), "r"(b.r[1]));
}
// d += a b over the warp.
template <class T>
__device__ __forceinline__ void mma(const DeviceWarp&, FragC& d, const FragA& a, const FragB& b) {
  mma_sync<T>(d, a, b);
}

// op over the four lanes of each group (lanes 4g .. 4g + 3), the result on each of them.
template <class Op> __device__ __forceinline__ float quad_reduce(const DeviceWarp&, float v, Op op) {
  v = op(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return op(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
#else
template <class X> using PerLane = Lanes<X>;
template <class X> X& at(Lanes<X>& x, int lane) { return x.v[lane]; }
template <class X> const X& at(const Lanes<X>& x, int lane) { return x.v[lane]; }
template <class F> void lanes(const HostWarp&, F f) {
  for (int lane = 0; lane < WARP; ++lane) f(lane);
}

// d += a b over the warp: the fragments placed as the layouts say, each element of d the
// f32 sum over k in order of exact products (bf16 and f16 products are exact in f32).
template <class T>
void mma(const HostWarp&, Lanes<FragC>& d, const Lanes<FragA>& a, const Lanes<FragB>& b) {
  float am[16][16], bm[16][8];
  for (int lane = 0; lane < WARP; ++lane) {
    for (int i = 0; i < 8; ++i)
      am[frag_a_row(lane, i)][frag_a_col(lane, i)] = half_of<T>(a.v[lane].r[i / 2], i % 2);
    for (int i = 0; i < 4; ++i)
      bm[frag_b_row(lane, i)][frag_b_col(lane, i)] = half_of<T>(b.v[lane].r[i / 2], i % 2);
  }
  for (int lane = 0; lane < WARP; ++lane)
    for (int i = 0; i < 4; ++i) {
      int row = frag_c_row(lane, i), col = frag_c_col(lane, i);
      float s = 0.0f;
      for (int k = 0; k < 16; ++k) s += am[row][k] * bm[k][col];
      d.v[lane].x[i] += s;
    }
}

template <class Op> Lanes<float> quad_reduce(const HostWarp&, Lanes<float> v, Op op) {
  for (int mask = 1; mask <= 2; mask <<= 1) {
    Lanes<float> next;
    for (int lane = 0; lane < WARP; ++lane) next.v[lane] = op(v.v[lane], v.v[lane ^ mask]);
    v = next;
  }
  return v;
}
#endif

}  // namespace stoker
