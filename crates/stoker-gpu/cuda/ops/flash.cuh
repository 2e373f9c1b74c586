// Causal attention that keeps no scores (FlashAttention-2's algorithm, Dao 2023), on a
// warp's tensor-core products (mma.h): q, k, v and the output per head, `[B*H, T, D]`,
// with D one of 16, 32, 64 (each D its own code in one kernel: a kernel takes the
// registers of its largest case, and D = 128's would halve the others' occupancy). One warp owns a tile of 16 rows of one head:
// - forward: 16 queries against the keys up to the tile's last, 16 at a time: the scores
//   on tensor cores, scaled and masked, a running row maximum and sum (the online
//   softmax), the probabilities rounded to T and multiplied into the output. Writes the
//   output and each row's log-sum-exp (f32), which is all the backward keeps;
// - rowdot: each row's sum of dout * out (f32), the softmax backward's correction;
// - backward_kv: 16 keys against the queries from the tile's first on: the probabilities
//   recomputed from q, k and the log-sum-exp, dv += p^T dout, dp^T = v dout^T, ds = p (dp
//   - rowdot), dk += ds^T q; written once (no atomics: one writer per row);
// - backward_q: 16 queries against their keys again: dq += ds k.
// Rows and keys past T read as zeros and are masked, so T need not be a multiple of 16.
// Grouped-query attention: `group` query heads share one key/value head (k and v are
// `[B*H/group, T, D]`; query head h reads kv head h / group), and the key side's tile
// sums its kv head's gradients over the group's query heads itself.
#pragma once
#include "../mma.h"

namespace stoker {

// A tile's head and first row: tile = head * ceil(T / 16) + (first row / 16).
STOKER_HD void flash_tile_at(int64_t tile, int T_, int64_t& head, int& r0) {
  int64_t per = (T_ + 15) / 16;
  head = tile / per;
  r0 = int(tile % per) * 16;
}

// The lowest float: the running maximum before any key.
constexpr float FLASH_LOWEST = -3.402823466e38f;

template <int D, class T, class W>
STOKER_HD void flash_forward_tile_d(const W& w, int64_t tile, T* out, float* lse, const T* q,
                                    const T* k, const T* v, int T_, int group, float scale) {
  constexpr int KS = D / 16, NT = D / 8;
  int64_t head;
  int q0;
  flash_tile_at(tile, T_, head, q0);
  const int64_t base = head * T_ * D, kv_base = head / group * T_ * D;
  const T *Q = q + base, *K = k + kv_base, *V = v + kv_base;
  PerLane<FragA> qa[KS];
  PerLane<FragC> o[NT];
  PerLane<float> m[2], l[2];
  lanes(w, [&](int lane) {
    for (int ks = 0; ks < KS; ++ks) at(qa[ks], lane) = frag_a_rows(Q, q0, ks * 16, T_, D, lane);
    for (int nt = 0; nt < NT; ++nt) at(o[nt], lane) = frag_c_zero();
    for (int r = 0; r < 2; ++r) at(m[r], lane) = FLASH_LOWEST, at(l[r], lane) = 0.0f;
  });
  for (int k0 = 0; k0 <= q0 + 15 && k0 < T_; k0 += 16) {
    PerLane<FragC> s[2];
    lanes(w, [&](int lane) { at(s[0], lane) = frag_c_zero(), at(s[1], lane) = frag_c_zero(); });
    for (int ks = 0; ks < KS; ++ks)
      for (int nt = 0; nt < 2; ++nt) {
        PerLane<FragB> b;
        lanes(w, [&](int lane) { at(b, lane) = frag_b_cols(K, k0 + nt * 8, ks * 16, T_, D, lane); });
        mma<T>(w, s[nt], qa[ks], b);
      }
    // Scaled and masked (a key after its query, or past T, is out), each row's largest.
    PerLane<float> mx[2];
    lanes(w, [&](int lane) {
      for (int r = 0; r < 2; ++r) at(mx[r], lane) = FLASH_LOWEST;
      for (int nt = 0; nt < 2; ++nt)
        for (int i = 0; i < 4; ++i) {
          int row = q0 + frag_c_row(lane, i), key = k0 + nt * 8 + frag_c_col(lane, i);
          float& x = at(s[nt], lane).x[i];
          x = (key <= row && key < T_) ? x * scale : FLASH_LOWEST;
          at(mx[i / 2], lane) = fmax_(at(mx[i / 2], lane), x);
        }
    });
    for (int r = 0; r < 2; ++r) mx[r] = quad_reduce(w, mx[r], Max{});
    lanes(w, [&](int lane) {
      float corr[2];
      for (int r = 0; r < 2; ++r) {
        float m_new = fmax_(at(m[r], lane), at(mx[r], lane));
        corr[r] = fexp(at(m[r], lane) - m_new);
        at(m[r], lane) = m_new;
        at(l[r], lane) *= corr[r];
      }
      for (int nt = 0; nt < 2; ++nt)
        for (int i = 0; i < 4; ++i) {
          float& x = at(s[nt], lane).x[i];
          x = x == FLASH_LOWEST ? 0.0f : fexp(x - at(m[i / 2], lane));
          at(l[i / 2], lane) += x;
        }
      for (int nt = 0; nt < NT; ++nt)
        for (int i = 0; i < 4; ++i) at(o[nt], lane).x[i] *= corr[i / 2];
    });
    PerLane<FragA> p;
    lanes(w, [&](int lane) { at(p, lane) = frag_a_of<T>(at(s[0], lane), at(s[1], lane)); });
    for (int nt = 0; nt < NT; ++nt) {
      PerLane<FragB> b;
      lanes(w, [&](int lane) { at(b, lane) = frag_b_rows(V, k0, nt * 8, T_, D, lane); });
      mma<T>(w, o[nt], p, b);
    }
  }
  for (int r = 0; r < 2; ++r) l[r] = quad_reduce(w, l[r], Sum{});
  lanes(w, [&](int lane) {
    for (int nt = 0; nt < NT; ++nt)
      for (int i = 0; i < 4; ++i) {
        int row = q0 + frag_c_row(lane, i);
        if (row < T_)
          out[base + int64_t(row) * D + nt * 8 + frag_c_col(lane, i)] =
              store<T>(at(o[nt], lane).x[i] / at(l[i / 2], lane));
      }
    for (int r = 0; r < 2; ++r) {
      int row = q0 + lane / 4 + 8 * r;
      if (lane % 4 == 0 && row < T_) lse[head * T_ + row] = at(m[r], lane) + flog(at(l[r], lane));
    }
  });
}

template <class T, class W>
STOKER_HD void flash_forward_tile(const W& w, int64_t tile, T* out, float* lse, const T* q,
                                  const T* k, const T* v, int T_, int D, int group, float scale) {
  switch (D) {
    case 16: return flash_forward_tile_d<16>(w, tile, out, lse, q, k, v, T_, group, scale);
    case 32: return flash_forward_tile_d<32>(w, tile, out, lse, q, k, v, T_, group, scale);
    case 64: return flash_forward_tile_d<64>(w, tile, out, lse, q, k, v, T_, group, scale);
  }
}

// dsum[row] = sum over d of dout[row, d] * out[row, d], lane l over d = l, l + 32, ...
template <class T, class W>
STOKER_HD void flash_rowdot_row(const W& w, int64_t row, float* dsum, const T* dout, const T* out,
                                int D) {
  auto part = w.each([&](int lane) {
    float s = 0.0f;
    for (int d = lane; d < D; d += WARP) s += load(dout[row * D + d]) * load(out[row * D + d]);
    return s;
  });
  float total = w.reduce(part, Sum{});
  w.each([&](int lane) {
    if (lane == 0) dsum[row] = total;
    return 0;
  });
}

// The backward's two products over one pair of 16-row blocks, from zero: s = x m1^T
// (the scores) and dp = y m2^T, with x and y the tile's own A fragments over the head
// width and m1, m2 row-major [T, D] matrices whose rows n0 .. n0 + 15 are the other
// side's (q and dout against a key tile, k and v against a query tile).
template <int KS, class T, class W>
STOKER_HD void flash_block_products(const W& w, PerLane<FragC>* s, PerLane<FragC>* dp,
                                    const PerLane<FragA>* x, const PerLane<FragA>* y,
                                    const T* m1, const T* m2, int n0, int T_, int D) {
  lanes(w, [&](int lane) {
    for (int nt = 0; nt < 2; ++nt) at(s[nt], lane) = frag_c_zero(), at(dp[nt], lane) = frag_c_zero();
  });
  for (int ks = 0; ks < KS; ++ks)
    for (int nt = 0; nt < 2; ++nt) {
      PerLane<FragB> b1, b2;
      lanes(w, [&](int lane) {
        at(b1, lane) = frag_b_cols(m1, n0 + nt * 8, ks * 16, T_, D, lane);
        at(b2, lane) = frag_b_cols(m2, n0 + nt * 8, ks * 16, T_, D, lane);
      });
      mma<T>(w, s[nt], x[ks], b1);
      mma<T>(w, dp[nt], y[ks], b2);
    }
}

// One lane's part of a 16 x 16 block of C fragments whose rows are `rows0 + frag_c_row`
// and columns `cols0 + nt * 8 + frag_c_col`: the scores `s` become the probabilities p =
// exp(s * scale - lse[query]) where the key is at most the query and both are below T,
// else 0, and `ds` = p (dp - dsum[query]), the scores' gradient. `keys_are_rows`: the
// rows are keys and the columns queries (the backward over keys), else the other way.
STOKER_HD void flash_block_gradient(FragC* s, const FragC* dp, FragC* ds, int rows0, int cols0,
                                    bool keys_are_rows, const float* lse, const float* dsum,
                                    int T_, float scale, int lane) {
  for (int nt = 0; nt < 2; ++nt)
    for (int i = 0; i < 4; ++i) {
      int row = rows0 + frag_c_row(lane, i), col = cols0 + nt * 8 + frag_c_col(lane, i);
      int key = keys_are_rows ? row : col, query = keys_are_rows ? col : row;
      float& x = s[nt].x[i];
      x = (key <= query && query < T_ && key < T_) ? fexp(x * scale - lse[query]) : 0.0f;
      float corr = query < T_ ? dsum[query] : 0.0f;
      ds[nt].x[i] = x * (dp[nt].x[i] - corr);
    }
}

template <int D, class T, class W>
STOKER_HD void flash_backward_kv_tile_d(const W& w, int64_t tile, T* dk, T* dv, const T* q,
                                        const T* k, const T* v, const T* dout, const float* lse,
                                        const float* dsum, int T_, int group, float scale) {
  constexpr int KS = D / 16, NT = D / 8;
  int64_t kv_head;
  int k0;
  flash_tile_at(tile, T_, kv_head, k0);
  const int64_t kv_base = kv_head * T_ * D;
  const T *K = k + kv_base, *V = v + kv_base;
  PerLane<FragA> ka[KS], va[KS];
  PerLane<FragC> gk[NT], gv[NT];
  lanes(w, [&](int lane) {
    for (int ks = 0; ks < KS; ++ks) {
      at(ka[ks], lane) = frag_a_rows(K, k0, ks * 16, T_, D, lane);
      at(va[ks], lane) = frag_a_rows(V, k0, ks * 16, T_, D, lane);
    }
    for (int nt = 0; nt < NT; ++nt) at(gk[nt], lane) = frag_c_zero(), at(gv[nt], lane) = frag_c_zero();
  });
  // The group's query heads in turn, their gradients summed in the same registers.
  for (int g = 0; g < group; ++g) {
    const int64_t head = kv_head * group + g, base = head * T_ * D;
    const T *Q = q + base, *DO = dout + base;
    const float *L = lse + head * T_, *DS = dsum + head * T_;
    for (int q0 = k0; q0 < T_; q0 += 16) {
      // s^T = k q^T and dp^T = v dout^T: keys as rows, queries as columns.
      PerLane<FragC> s[2], dp[2];
      flash_block_products<KS, T>(w, s, dp, ka, va, Q, DO, q0, T_, D);
      PerLane<FragA> pa, dsa;
      lanes(w, [&](int lane) {
        FragC ps[2] = {at(s[0], lane), at(s[1], lane)}, dps[2] = {at(dp[0], lane), at(dp[1], lane)};
        FragC ds[2];
        flash_block_gradient(ps, dps, ds, k0, q0, true, L, DS, T_, scale, lane);
        at(pa, lane) = frag_a_of<T>(ps[0], ps[1]);
        at(dsa, lane) = frag_a_of<T>(ds[0], ds[1]);
      });
      // dv += p^T dout, dk += ds^T q: queries as the products' k.
      for (int nt = 0; nt < NT; ++nt) {
        PerLane<FragB> bo, bq;
        lanes(w, [&](int lane) {
          at(bo, lane) = frag_b_rows(DO, q0, nt * 8, T_, D, lane);
          at(bq, lane) = frag_b_rows(Q, q0, nt * 8, T_, D, lane);
        });
        mma<T>(w, gv[nt], pa, bo);
        mma<T>(w, gk[nt], dsa, bq);
      }
    }
  }
  lanes(w, [&](int lane) {
    for (int nt = 0; nt < NT; ++nt)
      for (int i = 0; i < 4; ++i) {
        int row = k0 + frag_c_row(lane, i);
        if (row >= T_) continue;
        int64_t at_ = kv_base + int64_t(row) * D + nt * 8 + frag_c_col(lane, i);
        dk[at_] = store<T>(at(gk[nt], lane).x[i] * scale);
        dv[at_] = store<T>(at(gv[nt], lane).x[i]);
      }
  });
}

template <class T, class W>
STOKER_HD void flash_backward_kv_tile(const W& w, int64_t tile, T* dk, T* dv, const T* q,
                                      const T* k, const T* v, const T* dout, const float* lse,
                                      const float* dsum, int T_, int D, int group, float scale) {
  switch (D) {
    case 16: return flash_backward_kv_tile_d<16>(w, tile, dk, dv, q, k, v, dout, lse, dsum, T_, group, scale);
    case 32: return flash_backward_kv_tile_d<32>(w, tile, dk, dv, q, k, v, dout, lse, dsum, T_, group, scale);
    case 64: return flash_backward_kv_tile_d<64>(w, tile, dk, dv, q, k, v, dout, lse, dsum, T_, group, scale);
  }
}

template <int D, class T, class W>
STOKER_HD void flash_backward_q_tile_d(const W& w, int64_t tile, T* dq, const T* q, const T* k,
                                       const T* v, const T* dout, const float* lse,
                                       const float* dsum, int T_, int group, float scale) {
  constexpr int KS = D / 16, NT = D / 8;
  int64_t head;
  int q0;
  flash_tile_at(tile, T_, head, q0);
  const int64_t base = head * T_ * D, kv_base = head / group * T_ * D;
  const T *Q = q + base, *K = k + kv_base, *V = v + kv_base, *DO = dout + base;
  const float *L = lse + head * T_, *DS = dsum + head * T_;
  PerLane<FragA> qa[KS], oa[KS];
  PerLane<FragC> gq[NT];
  lanes(w, [&](int lane) {
    for (int ks = 0; ks < KS; ++ks) {
      at(qa[ks], lane) = frag_a_rows(Q, q0, ks * 16, T_, D, lane);
      at(oa[ks], lane) = frag_a_rows(DO, q0, ks * 16, T_, D, lane);
    }
    for (int nt = 0; nt < NT; ++nt) at(gq[nt], lane) = frag_c_zero();
  });
  for (int k0 = 0; k0 <= q0 + 15 && k0 < T_; k0 += 16) {
    // s = q k^T and dp = dout v^T: queries as rows, keys as columns.
    PerLane<FragC> s[2], dp[2];
    flash_block_products<KS, T>(w, s, dp, qa, oa, K, V, k0, T_, D);
    PerLane<FragA> dsa;
    lanes(w, [&](int lane) {
      FragC ps[2] = {at(s[0], lane), at(s[1], lane)}, dps[2] = {at(dp[0], lane), at(dp[1], lane)};
      FragC ds[2];
      flash_block_gradient(ps, dps, ds, q0, k0, false, L, DS, T_, scale, lane);
      at(dsa, lane) = frag_a_of<T>(ds[0], ds[1]);
    });
    // dq += ds k: keys as the product's k.
    for (int nt = 0; nt < NT; ++nt) {
      PerLane<FragB> bk;
      lanes(w, [&](int lane) { at(bk, lane) = frag_b_rows(K, k0, nt * 8, T_, D, lane); });
      mma<T>(w, gq[nt], dsa, bk);
    }
  }
  lanes(w, [&](int lane) {
    for (int nt = 0; nt < NT; ++nt)
      for (int i = 0; i < 4; ++i) {
        int row = q0 + frag_c_row(lane, i);
        if (row < T_)
          dq[base + int64_t(row) * D + nt * 8 + frag_c_col(lane, i)] =
              store<T>(at(gq[nt], lane).x[i] * scale);
      }
  });
}

template <class T, class W>
STOKER_HD void flash_backward_q_tile(const W& w, int64_t tile, T* dq, const T* q, const T* k,
                                     const T* v, const T* dout, const float* lse,
                                     const float* dsum, int T_, int D, int group, float scale) {
  switch (D) {
    case 16: return flash_backward_q_tile_d<16>(w, tile, dq, q, k, v, dout, lse, dsum, T_, group, scale);
    case 32: return flash_backward_q_tile_d<32>(w, tile, dq, q, k, v, dout, lse, dsum, T_, group, scale);
    case 64: return flash_backward_q_tile_d<64>(w, tile, dq, q, k, v, dout, lse, dsum, T_, group, scale);
  }
}

}  // namespace stoker
