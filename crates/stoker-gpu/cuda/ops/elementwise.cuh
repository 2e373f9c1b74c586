// One element per call: the embedding sum, GELU, the attention layout permutations and
// the bias and partial-sum reductions. `i` is the element's flat index; the device calls
// a body once per thread (grid-stride), the host in a loop.
#pragma once
#include "../portable.h"

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

// dwpe[t, c] += sum over b (in order) of dout[b, t, c], for i over T*C.
template <class T>
STOKER_HD void encoder_backward_wpe_at(int64_t i, float* dwpe, const T* dout, int B, int T_,
                                       int C) {
  float s = 0.0f;
  for (int b = 0; b < B; ++b) s += load(dout[int64_t(b) * T_ * C + i]);
  dwpe[i] += s;
}

// dwte[token u, c] += sum over u's positions (ascending) of dout[position, c], for i over
// U*C: `uniq` holds the batch's U distinct tokens, `starts[u]..starts[u+1]` index
// `positions`, each token's positions grouped and ascending (gpu::TokenGroups). One
// writer per row of dwte: no atomics, the same bits on every run.
template <class T>
STOKER_HD void encoder_backward_wte_at(int64_t i, float* dwte, const T* dout, const int32_t* uniq,
                                       const int32_t* starts, const int32_t* positions, int C) {
  int64_t u = i / C;
  int c = int(i % C);
  float s = 0.0f;
  for (int p = starts[u]; p < starts[u + 1]; ++p) s += load(dout[int64_t(positions[p]) * C + c]);
  dwte[int64_t(uniq[u]) * C + c] += s;
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

// out[i] = x[i] rounded to T (the compute copy of an f32 master).
template <class T> STOKER_HD void from_f32_at(int64_t i, T* out, const float* x) {
  out[i] = store<T>(x[i]);
}

template <class T> STOKER_HD void gelu_forward_at(int64_t i, T* out, const T* inp) {
  out[i] = store<T>(gelu_of(load(inp[i])));
}

// dinp = dout * gelu'(inp); dinp may be dout (in place).
template <class T>
STOKER_HD void gelu_backward_at(int64_t i, T* dinp, const T* inp, const T* dout) {
  dinp[i] = store<T>(load(dout[i]) * gelu_grad_of(load(inp[i])));
}

// out[row, col] += bias[col], for i over rows * cols: a linear layer's bias after its
// matrix product.
template <class T> STOKER_HD void add_bias_at(int64_t i, T* out, const T* bias, int cols) {
  out[i] = store<T>(load(out[i]) + load(bias[i % cols]));
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

template <class T> STOKER_HD void qkv_to_heads_at(int64_t i, T* qkvh, const T* qkv, Heads g) {
  qkvh[i] = qkv[qkv_index(i, g)];
}

template <class T> STOKER_HD void heads_to_qkv_at(int64_t i, T* dqkv, const T* dqkvh, Heads g) {
  dqkv[qkv_index(i, g)] = dqkvh[i];
}

// [B, H, T, D] <-> [B, T, H, D] (= [B, T, C]); i over B*H*T*D in the [B, H, T, D] order.
STOKER_HD int64_t merged_index(int64_t i, Heads g) {
  int d = int(i % g.d);
  int64_t r = i / g.d;
  int t = int(r % g.t);
  r /= g.t;
  int h = int(r % g.h);
  int b = int(r / g.h);
  return ((int64_t(b) * g.t + t) * g.h + h) * g.d + d;
}

template <class T> STOKER_HD void heads_to_merged_at(int64_t i, T* out, const T* heads, Heads g) {
  out[merged_index(i, g)] = heads[i];
}

template <class T> STOKER_HD void merged_to_heads_at(int64_t i, T* dheads, const T* dout, Heads g) {
  dheads[i] = dout[merged_index(i, g)];
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

// dst[col] += sum over p (in order) of partials[p * stride + col], for i over cols.
STOKER_HD void reduce_partials_at(int64_t i, float* dst, const float* partials, int P,
                                  int64_t stride) {
  float s = 0.0f;
  for (int p = 0; p < P; ++p) s += partials[int64_t(p) * stride + i];
  dst[i] += s;
}

}  // namespace stoker
