// Packs: eight consecutive elements that one thread moves together, as 16-byte words
// where the address allows (llm.c's x128). A memory-bound kernel that loads one 2-byte
// element per thread keeps too few bytes in flight to fill HBM (Little's law: about
// 3.35 TB/s x 600 ns, some 15 KiB per SM, against 4 KiB from 2,048 threads' one bf16
// each); a pack per thread keeps eight times as many.
//
// Which elements a thread owns, and so the order it sums them in, is the pack layout's
// alone: element j is in pack j / 8. Whether a pack moves as words or element by element
// (a pack past the end, or an address not 16-byte aligned) changes no value, so the
// results do not depend on how a buffer happens to be aligned, and the host build, which
// runs the same branches with memcpy, gives the device's bits.
#pragma once
#include "portable.h"

namespace stoker {

constexpr int PACK = 8;

// A pack's elements widened to f32, in order.
struct Pack {
  float v[PACK];
};

// How many of the pack starting at element i0 lie below n (0 to 8).
STOKER_HD int pack_count(int64_t i0, int64_t n) {
  int64_t r = n - i0;
  return r >= PACK ? PACK : (r > 0 ? int(r) : 0);
}

// Whether the pack at x + i0 is whole below n and may move as 16-byte words.
template <class T> STOKER_HD bool pack_words(const T* x, int64_t i0, int64_t n) {
  return pack_count(i0, n) == PACK && (reinterpret_cast<uintptr_t>(x + i0) & 15u) == 0;
}

// Element k of a pack held as 32-bit words (little-endian: a 16-bit type's element 0 is
// word 0's low half).
template <class T> STOKER_HD T element_of(const uint32_t* w, int k);
template <> STOKER_HD float element_of<float>(const uint32_t* w, int k) { return float_of(w[k]); }
template <> STOKER_HD bf16 element_of<bf16>(const uint32_t* w, int k) {
  return bf16{uint16_t(w[k / 2] >> (16 * (k % 2)))};
}
template <> STOKER_HD f16 element_of<f16>(const uint32_t* w, int k) {
  return f16{uint16_t(w[k / 2] >> (16 * (k % 2)))};
}

// Element k's bits as a 32-bit word's share (its half, for a 16-bit type, in place).
STOKER_HD uint32_t word_of(float x, int) { return bits_of(x); }
STOKER_HD uint32_t word_of(bf16 x, int k) { return uint32_t(x.bits) << (16 * (k % 2)); }
STOKER_HD uint32_t word_of(f16 x, int k) { return uint32_t(x.bits) << (16 * (k % 2)); }

// The 32-bit words at p (16-byte aligned: checked by the caller), loaded as 16-byte words
// into registers on the device (no address of `w` is taken, so it stays in registers).
template <int N> STOKER_HD void load_words(uint32_t (&w)[N], const void* p) {
#ifdef __CUDA_ARCH__
  const uint4* s = reinterpret_cast<const uint4*>(p);
STOKER_UNROLL
  for (int j = 0; j < N / 4; ++j) {
    uint4 q = s[j];
    w[4 * j] = q.x;
    w[4 * j + 1] = q.y;
    w[4 * j + 2] = q.z;
    w[4 * j + 3] = q.w;
  }
#else
  memcpy(w, p, sizeof(w));
#endif
}

template <int N> STOKER_HD void store_words(void* p, const uint32_t (&w)[N]) {
#ifdef __CUDA_ARCH__
  uint4* d = reinterpret_cast<uint4*>(p);
STOKER_UNROLL
  for (int j = 0; j < N / 4; ++j) d[j] = make_uint4(w[4 * j], w[4 * j + 1], w[4 * j + 2], w[4 * j + 3]);
#else
  memcpy(p, w, sizeof(w));
#endif
}

// Elements x[i0 .. i0 + 8) as stored: those below n, the rest zero bits.
template <class T> STOKER_HD void load_raw(T (&raw)[PACK], const T* x, int64_t i0, int64_t n) {
  if (pack_words(x, i0, n)) {
    uint32_t w[sizeof(T) * PACK / 4];
    load_words(w, x + i0);
STOKER_UNROLL
    for (int k = 0; k < PACK; ++k) raw[k] = element_of<T>(w, k);
    return;
  }
  int c = pack_count(i0, n);
STOKER_UNROLL
  for (int k = 0; k < PACK; ++k) raw[k] = k < c ? x[i0 + k] : T{};
}

// Writes raw's elements to y[i0 ..], those below n.
template <class T>
STOKER_HD void store_raw(T* y, int64_t i0, int64_t n, const T (&raw)[PACK]) {
  if (pack_words(y, i0, n)) {
    uint32_t w[sizeof(T) * PACK / 4] = {};
    STOKER_UNROLL
    for (int k = 0; k < PACK; ++k) w[k * int(sizeof(T)) / 4] |= word_of(raw[k], k);
    store_words(y + i0, w);
    return;
  }
  int c = pack_count(i0, n);
STOKER_UNROLL
  for (int k = 0; k < PACK; ++k)
    if (k < c) y[i0 + k] = raw[k];
}

// The pack at i0's elements below n, k = 0 .. 7 (unrolled on the device: a pack indexed
// by k stays in registers).
#define STOKER_PACK_ELEMENTS(k, i0, n) \
  STOKER_UNROLL for (int k = 0; k < stoker::PACK; ++k) if (k < stoker::pack_count((i0), (n)))

// x[i0 .. i0 + 8) widened to f32 (0 past n).
template <class T> STOKER_HD Pack load_pack(const T* x, int64_t i0, int64_t n) {
  alignas(16) T raw[PACK];
  load_raw(raw, x, i0, n);
  Pack p;
  for (int k = 0; k < PACK; ++k) p.v[k] = load(raw[k]);
  return p;
}

// p rounded to T into y[i0 ..], the elements below n.
template <class T> STOKER_HD void store_pack(T* y, int64_t i0, int64_t n, const Pack& p) {
  alignas(16) T raw[PACK];
  for (int k = 0; k < PACK; ++k) raw[k] = store<T>(p.v[k]);
  store_raw(y, i0, n, raw);
}

// Copies src[si ..] to dst[di ..], `count` (at most 8) elements as stored: as words
// where both ends allow.
template <class T>
STOKER_HD void copy_pack(T* dst, int64_t di, const T* src, int64_t si, int count) {
  alignas(16) T raw[PACK];
  load_raw(raw, src + si, 0, count);
  store_raw(dst + di, 0, count, raw);
}

}  // namespace stoker
