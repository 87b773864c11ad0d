// Paged attention for prefill chunks: tiled flash attention with every matrix kept TRANSPOSED so the
// online softmax is vectorized across query rows and the inner loops are pure broadcast-FMA.
//
// Work item = (sequence, kv head, query tile). A query tile holds Mq tokens x G heads (the whole GQA
// group shares each K/V row) = R rows, padded to Rp (multiple of 16). Per item:
//   QT [D][Rp]  = scaled queries, transposed once;            OT [D][Rp] = output accumulator
//   per key tile of kKeyTile tokens (fp32 copies Kf/Vf [n][D], read once per item):
//     ST [n][Rp] = Kf . QT        (8 keys x 32 rows register block, broadcast Kf)
//     mask (causal + window, only on boundary tiles), soft-cap, online softmax over n, column-wise
//     OT += Vf^T . ST             (8 dims x 32 rows register block, broadcast Vf)
// The full [q, k] score matrix never exists; scratch is ~100 KiB per thread (L2 resident).
// Quantized caches (int8 / fp8): Kf / Vf are the dequantized rows (stored * the row's scale), so everything
// after the load is the float-cache kernel.
#pragma once

#include <algorithm>
#include <vector>

#include "ops/paged_attention/attention_cpu_common.h"

namespace pagellm::cpu {

constexpr int64_t kKeyTile = 32;  // multiple of 8

// ST[j0..j0+8][rv..rv+16 NV] = Kf[j0..j0+8] . QT[:, rv..rv+16 NV] (rv: a row offset, a multiple of 16)
template <int NV>
inline void score_block(const float* Kf, const float* QT, float* ST, int64_t D, int64_t Rp, int64_t j0, int64_t rv) {
  VecF acc[8][NV];
  for (int j = 0; j < 8; ++j)
    for (int v = 0; v < NV; ++v) acc[j][v] = vzero();
  const float* k = Kf + j0 * D;
  for (int64_t d = 0; d < D; ++d) {
    VecF q[NV];
    for (int v = 0; v < NV; ++v) q[v] = vload(QT + d * Rp + rv + v * kLanes);
    for (int j = 0; j < 8; ++j) {
      const VecF kb = vset1(k[j * D + d]);
      for (int v = 0; v < NV; ++v) acc[j][v] = vfma(kb, q[v], acc[j][v]);
    }
  }
  for (int j = 0; j < 8; ++j)
    for (int v = 0; v < NV; ++v) vstore(ST + (j0 + j) * Rp + rv + v * kLanes, acc[j][v]);
}

// OT[d0..d0+8][rv..rv+16 NV] += sum_{j<n} Vf[j][d0..d0+8] * P[j][rv..rv+16 NV]
template <int NV>
inline void pv_block(const float* Vf, const float* P, float* OT, int64_t D, int64_t Rp, int64_t n, int64_t d0,
                     int64_t rv) {
  VecF acc[8][NV];
  for (int d = 0; d < 8; ++d)
    for (int v = 0; v < NV; ++v) acc[d][v] = vload(OT + (d0 + d) * Rp + rv + v * kLanes);
  for (int64_t j = 0; j < n; ++j) {
    VecF p[NV];
    for (int v = 0; v < NV; ++v) p[v] = vload(P + j * Rp + rv + v * kLanes);
    for (int d = 0; d < 8; ++d) {
      const VecF vb = vset1(Vf[j * D + d0 + d]);
      for (int v = 0; v < NV; ++v) acc[d][v] = vfma(vb, p[v], acc[d][v]);
    }
  }
  for (int d = 0; d < 8; ++d)
    for (int v = 0; v < NV; ++v) vstore(OT + (d0 + d) * Rp + rv + v * kLanes, acc[d][v]);
}

struct PrefillItem {
  int64_t seq, head, t0, t1, cost;  // kv head; query tokens [t0, t1) of the chunk
};

struct PrefillScratch {
  int64_t D, Rp;
  std::vector<float> QT, OT, Kf, Vf, ST, m, l, corr, pos, row;
  PrefillScratch(int64_t D_, int64_t Rp_)
      : D(D_), Rp(Rp_), QT(D_ * Rp_), OT(D_ * Rp_), Kf(kKeyTile * D_, 0.f), Vf(kKeyTile * D_, 0.f),
        ST(kKeyTile * Rp_), m(Rp_), l(Rp_), corr(Rp_), pos(Rp_), row(D_) {}
};

// Masks ST for keys [start, start + n): key after the row's position or before the row's window.
template <typename T, typename C>
inline void mask_tile(const PagedAttnArgs<T, C>& a, PrefillScratch& w, int64_t start, int64_t n) {
  const VecF ninf = vset1(kNegInf), win = vset1(static_cast<float>(a.window > 0 ? a.window - 1 : 0));
  for (int64_t j = 0; j < n; ++j) {
    const VecF kp = vset1(static_cast<float>(start + j));
    for (int64_t rv = 0; rv < w.Rp; rv += kLanes) {
      float* s = w.ST.data() + j * w.Rp + rv;
      const VecF p = vload(w.pos.data() + rv);
      VecF x = vselect_lt(p, kp, ninf, vload(s));                                  // key after query
      if (a.window > 0) x = vselect_lt(kp, vsub(p, win), ninf, x);                 // key before window
      vstore(s, x);
    }
  }
}

// Online softmax over the tile's n keys, vectorized across rows: ST becomes P, m and l move on, and
// corr[r] is the factor the row's earlier output must be rescaled by. Scores may come unscaled: the
// probabilities are exp(scale * (s - m)) with m the running maximum of the unscaled scores (scale > 0,
// so the maximum is the same). kLowpExp: the probabilities feed a bf16 product (vexp_lowp).
template <bool kLowpExp = false>
inline void softmax_update(PrefillScratch& w, int64_t n, float* corr, float scale = 1.0f) {
  const VecF sv = vset1(scale);
  for (int64_t rv = 0; rv < w.Rp; rv += kLanes) {
    VecF mt = vset1(kNegInf);
    for (int64_t j = 0; j < n; ++j) mt = vmax(mt, vload(w.ST.data() + j * w.Rp + rv));
    const VecF m_old = vload(w.m.data() + rv);
    const VecF m_new = vmax(m_old, mt);
    const VecF c = vexp(vmul(vsub(m_old, m_new), sv));
    VecF sum = vzero();
    for (int64_t j = 0; j < n; ++j) {
      float* s = w.ST.data() + j * w.Rp + rv;
      const VecF x = vmul(vsub(vload(s), m_new), sv);
      const VecF p = kLowpExp ? vexp_lowp(x) : vexp(x);
      vstore(s, p);
      sum = vadd(sum, p);
    }
    vstore(w.l.data() + rv, vfma(vload(w.l.data() + rv), c, sum));
    vstore(w.m.data() + rv, m_new);
    vstore(corr + rv, c);
  }
}

// softmax_update, then the rescale of OT [D][Rp].
inline void softmax_tile(PrefillScratch& w, int64_t n) {
  softmax_update(w, n, w.corr.data());
  for (int64_t rv = 0; rv < w.Rp; rv += kLanes) {
    const VecF c = vload(w.corr.data() + rv);
    for (int64_t d = 0; d < w.D; ++d) vstore(w.OT.data() + d * w.Rp + rv, vmul(vload(w.OT.data() + d * w.Rp + rv), c));
  }
}

template <typename T, typename C>
void prefill_load_queries(const PagedAttnArgs<T, C>& a, const PrefillItem& it, PrefillScratch& w, int64_t q_base,
                          int64_t pos_base) {
  const int64_t G = a.group(), D = a.head_dim, Rp = w.Rp;
  const int64_t rows = (it.t1 - it.t0) * G;
  std::fill(w.QT.begin(), w.QT.end(), 0.f);
  std::fill(w.OT.begin(), w.OT.end(), 0.f);
  std::fill(w.m.begin(), w.m.end(), -1e30f);
  std::fill(w.l.begin(), w.l.end(), 0.f);
  for (int64_t r = 0; r < Rp; ++r) {
    const int64_t t = it.t0 + std::min(r, rows - 1) / G;  // padded rows repeat the last token's position
    w.pos[r] = static_cast<float>(pos_base + t);
    if (r >= rows) continue;
    load_row_f32(a.q_row(q_base + t, it.head * G + r % G), w.row.data(), D, a.scale);
    for (int64_t d = 0; d < D; ++d) w.QT[d * Rp + r] = w.row[d];
  }
}

// Where a work item's queries sit: the chunk's first query row and the absolute positions.
struct PrefillSpan {
  int64_t q_base;    // row of the chunk's first token in query / out
  int64_t pos_base;  // absolute position of the chunk's first token
  int64_t p_first, p_last;  // absolute positions of the item's first and last token
};

template <typename T, typename C>
inline PrefillSpan prefill_span(const PagedAttnArgs<T, C>& a, const PrefillItem& it) {
  const int64_t q_base = a.query_start_loc[it.seq];
  const int64_t pos_base = a.seq_lens[it.seq] - (a.query_start_loc[it.seq + 1] - q_base);
  return {q_base, pos_base, pos_base + it.t0, pos_base + it.t1 - 1};
}

template <typename T, typename C>
void prefill_item(const PagedAttnArgs<T, C>& a, const PrefillItem& it, PrefillScratch& w) {
  const int64_t s = it.seq, G = a.group(), D = a.head_dim, Rp = w.Rp;
  const auto [q_base, pos_base, p_first, p_last] = prefill_span(a, it);
  prefill_load_queries(a, it, w, q_base, pos_base);
  const int64_t kmin = a.window_begin(p_first);
  for (int64_t start = kmin; start <= p_last; start += kKeyTile) {
    const int64_t n = std::min(kKeyTile, p_last + 1 - start);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t idx = a.row_index(s, start + j, it.head);
      load_row_f32(a.key_cache + idx * D, w.Kf.data() + j * D, D, a.row_scale(a.k_scale, idx));
      load_row_f32(a.value_cache + idx * D, w.Vf.data() + j * D, D, a.row_scale(a.v_scale, idx));
    }
    const int64_t n8 = (n + 7) / 8 * 8;
    for (int64_t j0 = 0; j0 < n8; j0 += 8) {
      int64_t rv = 0;
      for (; rv + 2 * kLanes <= Rp; rv += 2 * kLanes) score_block<2>(w.Kf.data(), w.QT.data(), w.ST.data(), D, Rp, j0, rv);
      if (rv < Rp) score_block<1>(w.Kf.data(), w.QT.data(), w.ST.data(), D, Rp, j0, rv);
    }
    if (a.softcap > 0.f) apply_softcap(w.ST.data(), n * Rp, a.softcap);
    const bool boundary = start + n - 1 > p_first || (a.window > 0 && start < a.window_begin(p_last));
    if (boundary) mask_tile(a, w, start, n);
    softmax_tile(w, n);
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
      int64_t rv = 0;
      for (; rv + 2 * kLanes <= Rp; rv += 2 * kLanes) pv_block<2>(w.Vf.data(), w.ST.data(), w.OT.data(), D, Rp, n, d0, rv);
      if (rv < Rp) pv_block<1>(w.Vf.data(), w.ST.data(), w.OT.data(), D, Rp, n, d0, rv);
    }
  }
  for (int64_t r = 0; r < (it.t1 - it.t0) * G; ++r) {
    for (int64_t d = 0; d < D; ++d) w.row[d] = w.OT[d * Rp + r];
    const float l = w.l[r];
    store_row(w.row.data(), a.out_row(q_base + it.t0 + r / G, it.head * G + r % G), D, l > 0.f ? 1.0f / l : 0.f);
  }
}

// The work items of a prefill call (query tiles of about `rows` rows), most expensive first (dynamic
// scheduling then balances the threads, LPT); returns Rp, the padded row count of a query tile.
template <typename T, typename C>
int64_t prefill_items(const PagedAttnArgs<T, C>& a, std::vector<PrefillItem>& items, int64_t rows = 32) {
  const int64_t G = a.group();
  const int64_t Mq = std::max<int64_t>(1, rows / G);
  const int64_t Rp = (Mq * G + kLanes - 1) / kLanes * kLanes;
  items.clear();
  for (int64_t s = 0; s < a.num_seqs; ++s) {
    const int64_t q_len = a.query_start_loc[s + 1] - a.query_start_loc[s];
    const int64_t pos_base = a.seq_lens[s] - q_len;
    for (int64_t t0 = 0; t0 < q_len; t0 += Mq) {
      const int64_t t1 = std::min(q_len, t0 + Mq);
      const int64_t cost = pos_base + t1 - a.window_begin(pos_base + t0) + 64;
      for (int64_t h = 0; h < a.num_kv_heads; ++h) items.push_back({s, h, t0, t1, cost});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const PrefillItem& x, const PrefillItem& y) { return x.cost > y.cost; });
  return Rp;
}

template <typename T, typename C>
void paged_attention_prefill_kernel(const PagedAttnArgs<T, C>& a) {
  std::vector<PrefillItem> items;
  const int64_t Rp = prefill_items(a, items);
  const int64_t n_items = static_cast<int64_t>(items.size());
  parallel_dynamic(n_items, [&](auto claim) {
    PrefillScratch w(a.head_dim, Rp);
    for (int64_t i = claim(); i < n_items; i = claim()) prefill_item(a, items[i], w);
  });
}

}  // namespace pagellm::cpu
