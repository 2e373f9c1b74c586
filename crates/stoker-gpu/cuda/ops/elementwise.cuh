// The element kernels: the embedding sum, GELU, the attention layout permutations and
// the bias and partial-sum reductions. Each `_pack` body is one thread's pack of eight
// consecutive elements from flat index i0 (pack.h); the device runs a pack per thread
// (grid-stride), the host in a loop. An `_at` body is one element's, the packs' fallback
// where a pack straddles a row the layout needs whole.
#pragma once
#include "../pack.h"

namespace stoker {

// out[b, t, :] = wte[tokens[b, t], :] + wpe[t, :], for i over B*T*C; without wpe (null,
// the Llama) the token's row alone.
template <class T>
STOKER_HD void encoder_forward_at(int64_t i, T* out, const int32_t* tokens, const T* wte,
                                  const T* wpe, int T_, int C) {
  int64_t bt = i / C;
  int c = int(i % C);
  int t = int(bt % T_);
  int64_t tok = tokens[bt];
  out[i] = wpe ? store<T>(load(wte[tok * C + c]) + load(wpe[int64_t(t) * C + c])) : wte[tok * C + c];
}

// The pack at i0 of encoder_forward_at's n = B*T*C elements: one position's channels
// where the pack lies in one row.
template <class T>
STOKER_HD void encoder_forward_pack(int64_t i0, int64_t n, T* out, const int32_t* tokens,
                                    const T* wte, const T* wpe, int T_, int C) {
  int c0 = int(i0 % C);
  int count = pack_count(i0, n);
  if (c0 + count > C) {
    for (int k = 0; k < count; ++k) encoder_forward_at(i0 + k, out, tokens, wte, wpe, T_, C);
    return;
  }
  int64_t bt = i0 / C;
  int t = int(bt % T_);
  const T* row = wte + int64_t(tokens[bt]) * C;
  if (!wpe) {
    copy_pack(out, i0, row, c0, count);
    return;
  }
  Pack a = load_pack(row, c0, c0 + count);
  Pack b = load_pack(wpe + int64_t(t) * C, c0, c0 + count);
  for (int k = 0; k < PACK; ++k) a.v[k] = a.v[k] + b.v[k];
  store_pack(out, i0, n, a);
}

// dwpe[t, c] += sum over b (in order) of dout[b, t, c], for i over T*C.
template <class T>
STOKER_HD void encoder_backward_wpe_pack(int64_t i0, float* dwpe, const T* dout, int B, int T_,
                                         int C) {
  int64_t n = int64_t(T_) * C;
  Pack s = {};
  for (int b = 0; b < B; ++b) {
    Pack d = load_pack(dout + int64_t(b) * n, i0, n);
    for (int k = 0; k < PACK; ++k) s.v[k] += d.v[k];
  }
  Pack acc = load_pack(dwpe, i0, n);
  for (int k = 0; k < PACK; ++k) acc.v[k] += s.v[k];
  store_pack(dwpe, i0, n, acc);
}

// dwte[token u, c] += sum over u's positions (ascending) of dout[position, c], for i over
// U*C: `uniq` holds the batch's U distinct tokens, `starts[u]..starts[u+1]` index
// `positions`, each token's positions grouped and ascending (gpu::TokenGroups). One
// writer per row of dwte: no atomics, the same bits on every run. A group with no
// positions (the padding past U) leaves every row alone, so a launch over as many groups
// as the batch has positions, whatever U is, does what one over U does: the same
// arguments for every batch, as a captured graph needs.
template <class T>
STOKER_HD void encoder_backward_wte_at(int64_t i, float* dwte, const T* dout, const int32_t* uniq,
                                       const int32_t* starts, const int32_t* positions, int C) {
  int64_t u = i / C;
  int c = int(i % C);
  if (starts[u] == starts[u + 1]) return;  // a padding group: its row is not touched
  float s = 0.0f;
  for (int p = starts[u]; p < starts[u + 1]; ++p) s += load(dout[int64_t(positions[p]) * C + c]);
  dwte[int64_t(uniq[u]) * C + c] += s;
}

// The pack at i0 of encoder_backward_wte_at's n = U*C elements: eight channels of one
// token's row where the pack lies in one row.
template <class T>
STOKER_HD void encoder_backward_wte_pack(int64_t i0, int64_t n, float* dwte, const T* dout,
                                         const int32_t* uniq, const int32_t* starts,
                                         const int32_t* positions, int C) {
  int c0 = int(i0 % C);
  int count = pack_count(i0, n);
  if (c0 + count > C) {
    for (int k = 0; k < count; ++k)
      encoder_backward_wte_at(i0 + k, dwte, dout, uniq, starts, positions, C);
    return;
  }
  int64_t u = i0 / C;
  if (starts[u] == starts[u + 1]) return;  // a padding group: its row is not touched
  Pack s = {};
  for (int p = starts[u]; p < starts[u + 1]; ++p) {
    Pack d = load_pack(dout + int64_t(positions[p]) * C, c0, c0 + count);
    for (int k = 0; k < PACK; ++k) s.v[k] += d.v[k];
  }
  float* row = dwte + int64_t(uniq[u]) * C;
  Pack acc = load_pack(row, c0, c0 + count);
  for (int k = 0; k < PACK; ++k) acc.v[k] += s.v[k];
  store_pack(row, c0, c0 + count, acc);
}

// GELU, tanh approximation (GPT-2's), as stoker-kernels' gelu.
STOKER_HD float gelu_of(float x) {
  const float s2pi = 0.7978846f, coef = 0.044715f;
  float u = s2pi * (x + coef * x * x * x);
  return 0.5f * x * (1.0f + ftanh(u));
}

STOKER_HD float gelu_grad_of(float x) {
  const float s2pi = 0.7978846f, coef = 0.044715f;
  float x2 = x * x;
  float t = ftanh(s2pi * (x + coef * x2 * x));
  float du = s2pi * (1.0f + 3.0f * coef * x2);
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du;
}

// out = x rounded to T (the compute copy of an f32 master).
template <class T> STOKER_HD void from_f32_pack(int64_t i0, int64_t n, T* out, const float* x) {
  store_pack(out, i0, n, load_pack(x, i0, n));
}

template <class T> STOKER_HD void gelu_forward_pack(int64_t i0, int64_t n, T* out, const T* inp) {
  Pack x = load_pack(inp, i0, n);
  for (int k = 0; k < PACK; ++k) x.v[k] = gelu_of(x.v[k]);
  store_pack(out, i0, n, x);
}

// dinp = dout * gelu'(inp); dinp may be dout (in place).
template <class T>
STOKER_HD void gelu_backward_pack(int64_t i0, int64_t n, T* dinp, const T* inp, const T* dout) {
  Pack x = load_pack(inp, i0, n), d = load_pack(dout, i0, n);
  for (int k = 0; k < PACK; ++k) d.v[k] = d.v[k] * gelu_grad_of(x.v[k]);
  store_pack(dinp, i0, n, d);
}

// out[row, col] += bias[col], over n = rows * cols: a linear layer's bias after its
// matrix product (where cuBLASLt's epilogue cannot add it).
template <class T>
STOKER_HD void add_bias_pack(int64_t i0, int64_t n, T* out, const T* bias, int cols) {
  Pack x = load_pack(out, i0, n);
  STOKER_PACK_ELEMENTS(k, i0, n) x.v[k] = x.v[k] + load(bias[(i0 + k) % cols]);
  store_pack(out, i0, n, x);
}

// Attention's layouts: qkv [B, T, 3, H, D] (the QKV projection's output) and q, k, v
// each [B, H, T, D], one after another in `qkvh` [3, B, H, T, D]; i over 3*B*H*T*D.
struct Heads {
  int b, t, h, d;  // batch, sequence, heads, head width
};

STOKER_HD int64_t qkv_index(int64_t i, Heads g) {
  int d = int(i % g.d);
  int64_t r = i / g.d;
  int t = int(r % g.t);
  r /= g.t;
  int h = int(r % g.h);
  r /= g.h;
  int b = int(r % g.b);
  int s = int(r / g.b);
  return ((((int64_t(b) * g.t + t) * 3 + s) * g.h + h) * g.d) + d;
}

// A permutation's pack at i0 (of n): dst[to(i)] = src[from(i)] for the pack's elements,
// as one copy of eight where the head width allows (d a multiple of 8: both sides
// contiguous), else element by element.
template <class T, class To, class From>
STOKER_HD void permute_pack(int64_t i0, int64_t n, Heads g, T* dst, To to, const T* src,
                            From from) {
  int count = pack_count(i0, n);
  if (g.d % PACK == 0) {
    copy_pack(dst, to(i0), src, from(i0), count);
    return;
  }
  for (int k = 0; k < count; ++k) dst[to(i0 + k)] = src[from(i0 + k)];
}

// The identity index: the heads' side of a permutation.
struct SameIndex {
  STOKER_HD int64_t operator()(int64_t i) const { return i; }
};

template <class T>
STOKER_HD void qkv_to_heads_pack(int64_t i0, T* qkvh, const T* qkv, Heads g) {
  int64_t n = int64_t(3) * g.b * g.h * g.t * g.d;
  permute_pack(i0, n, g, qkvh, SameIndex{}, qkv, [&](int64_t i) { return qkv_index(i, g); });
}

template <class T>
STOKER_HD void heads_to_qkv_pack(int64_t i0, T* dqkv, const T* dqkvh, Heads g) {
  int64_t n = int64_t(3) * g.b * g.h * g.t * g.d;
  permute_pack(i0, n, g, dqkv, [&](int64_t i) { return qkv_index(i, g); }, dqkvh, SameIndex{});
}

// Flat index i of a [B, H, T, D] tensor as its coordinates.
struct HeadsAt {
  int b, h, t, d;
};

STOKER_HD HeadsAt heads_at(int64_t i, Heads g) {
  int d = int(i % g.d);
  int64_t r = i / g.d;
  int t = int(r % g.t);
  r /= g.t;
  return HeadsAt{int(r / g.h), int(r % g.h), t, d};
}

// [B, H, T, D] <-> [B, T, H, D] (= [B, T, C]); i over B*H*T*D in the [B, H, T, D] order.
STOKER_HD int64_t merged_index(int64_t i, Heads g) {
  HeadsAt p = heads_at(i, g);
  return ((int64_t(p.b) * g.t + p.t) * g.h + p.h) * g.d + p.d;
}

template <class T>
STOKER_HD void heads_to_merged_pack(int64_t i0, T* out, const T* heads, Heads g) {
  int64_t n = int64_t(g.b) * g.h * g.t * g.d;
  permute_pack(i0, n, g, out, [&](int64_t i) { return merged_index(i, g); }, heads, SameIndex{});
}

template <class T>
STOKER_HD void merged_to_heads_pack(int64_t i0, T* dheads, const T* dout, Heads g) {
  int64_t n = int64_t(g.b) * g.h * g.t * g.d;
  permute_pack(i0, n, g, dheads, SameIndex{}, dout, [&](int64_t i) { return merged_index(i, g); });
}

// partials[r, col] = sum over rows r*chunk .. min((r+1)*chunk, N) of x[row, col], for i
// over R*cols: the first pass of a bias gradient (column sums of dout), coalesced across
// columns. reduce_partials_at finishes it.
template <class T>
STOKER_HD void column_partials_at(int64_t i, float* partials, const T* x, int64_t N, int cols,
                                  int64_t chunk) {
  int64_t r = i / cols;
  int col = int(i % cols);
  int64_t end = (r + 1) * chunk < N ? (r + 1) * chunk : N;
  float s = 0.0f;
  for (int64_t row = r * chunk; row < end; ++row) s += load(x[row * cols + col]);
  partials[i] = s;
}

// The pack at i0 of column_partials_at's n = R*cols elements: eight columns of one
// partial row where the pack lies in one row.
template <class T>
STOKER_HD void column_partials_pack(int64_t i0, int64_t n, float* partials, const T* x, int64_t N,
                                    int cols, int64_t chunk) {
  int col0 = int(i0 % cols);
  int count = pack_count(i0, n);
  if (col0 + count > cols) {
    for (int k = 0; k < count; ++k) column_partials_at(i0 + k, partials, x, N, cols, chunk);
    return;
  }
  int64_t r = i0 / cols;
  int64_t end = (r + 1) * chunk < N ? (r + 1) * chunk : N;
  Pack s = {};
  for (int64_t row = r * chunk; row < end; ++row) {
    Pack v = load_pack(x + row * cols, col0, col0 + count);
    for (int k = 0; k < PACK; ++k) s.v[k] += v.v[k];
  }
  store_pack(partials, i0, n, s);
}

// dst[col] += sum over p (in order) of partials[p * stride + col], over n = cols.
STOKER_HD void reduce_partials_pack(int64_t i0, int64_t n, float* dst, const float* partials,
                                    int P, int64_t stride) {
  Pack s = {};
  for (int p = 0; p < P; ++p) {
    Pack v = load_pack(partials + int64_t(p) * stride, i0, n);
    for (int k = 0; k < PACK; ++k) s.v[k] += v.v[k];
  }
  Pack acc = load_pack(dst, i0, n);
  for (int k = 0; k < PACK; ++k) acc.v[k] += s.v[k];
  store_pack(dst, i0, n, acc);
}

}  // namespace stoker
