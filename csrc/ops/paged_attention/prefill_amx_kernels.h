// Prefill attention for a bf16 KV cache on Intel AMX tiles: the tiled flash attention of
// prefill_cpu_kernels.h (same work items, same transposed fp32 scores ST [keys][rows], same masks and
// online softmax) with its two inner products on tiles instead of broadcast-FMA:
//   ST [keys][rows] = K . Q^T   A = the key tile's rows (bf16, straight from the cache blocks where 16 keys
//                               are contiguous), B = the item's queries packed once into VNNI pairs (QB);
//                               `scale` is applied inside the softmax
//   O [rows][dims] += P^T . V   A = the probabilities transposed and rounded to bf16 (PT, 16x16 register
//                               transposes of ST), B = the value tile in VNNI pairs of keys (VB)
// Probabilities enter the PV product in bf16 (as flash attention does on GPUs), so they come from the
// cheaper vexp_lowp; scores, softmax sums and the output accumulate in fp32. Used when the cache is bf16,
// head_dim is a multiple of 32 and AMX is usable (PAGELLM_PREFILL_AMX=0 turns it off); everything else runs
// the other kernels prefill_dispatch_cpu.h picks; quantized (int8 / fp8) caches are dequantized into the
// FMA kernel's fp32 tiles (a tile path for them would need the dequantized keys repacked to bf16 per item).
#pragma once

#include <cstdlib>
#include <cstring>
#include <string>

#include "ops/linear/linear_amx_kernels.h"
#include "ops/linear/amx_support.h"
#include "ops/paged_attention/prefill_cpu_kernels.h"

namespace pagellm::cpu {

#ifdef PAGELLM_HAVE_AMX

// Query rows per work item: each key tile's packing and softmax bookkeeping is shared by this many rows.
constexpr int64_t kPrefillAmxRows = 64;
// Keys per tile step (a multiple of 32): the output tiles make one load/store round trip per step.
constexpr int64_t kAmxKeys = 64;

struct PrefillAmxScratch : PrefillScratch {
  std::vector<c10::BFloat16> Kb;  // [kAmxKeys][D] key rows copied where a tile cannot load from the cache
  std::vector<uint32_t> VB;       // [kAmxKeys/2][D] value pairs (key 2p, 2p+1) per dim (past n zero)
  std::vector<uint32_t> QB;       // [D/2][Rp] query pairs (d, d+1) per row, rows past the item zero
  std::vector<c10::BFloat16> PT;  // [Rp][kAmxKeys] probabilities, rows = query rows (keys past n zero)
  std::vector<float> O;           // [Rp][D] output accumulator
  PrefillAmxScratch(int64_t D_, int64_t Rp_)
      : PrefillScratch(D_, Rp_), Kb(kAmxKeys * D_), VB(kAmxKeys / 2 * D_), QB(D_ / 2 * Rp_), PT(Rp_ * kAmxKeys),
        O(Rp_ * D_) {
    ST.assign(kAmxKeys * Rp_, 0.f);  // [kAmxKeys][Rp] scores (the FMA kernel's tiles are kKeyTile)
  }
};

// 16 bf16 of `lo` and `hi` -> 16 dwords (lo[i] | hi[i] << 16).
inline __m512i bf16_pairs(__m256i lo, __m256i hi) {
  return _mm512_or_si512(_mm512_cvtepu16_epi32(lo), _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
}

// prefill_load_queries for the tile path: positions and state as there, queries packed into QB (unscaled).
inline void prefill_amx_load_queries(const PagedAttnArgs<c10::BFloat16>& a, const PrefillItem& it,
                                     PrefillAmxScratch& w, int64_t q_base, int64_t pos_base) {
  const int64_t G = a.group(), D = a.head_dim, Rp = w.Rp;
  const int64_t rows = (it.t1 - it.t0) * G;
  std::fill(w.O.begin(), w.O.end(), 0.f);
  std::fill(w.m.begin(), w.m.end(), -1e30f);
  std::fill(w.l.begin(), w.l.end(), 0.f);
  std::fill(w.QB.begin(), w.QB.end(), 0u);
  for (int64_t r = 0; r < Rp; ++r) {
    const int64_t t = it.t0 + std::min(r, rows - 1) / G;  // padded rows repeat the last token's position
    w.pos[r] = static_cast<float>(pos_base + t);
    if (r >= rows) continue;
    const c10::BFloat16* q = a.q_row(q_base + t, it.head * G + r % G);
    for (int64_t p = 0; p < D / 2; ++p) w.QB[p * Rp + r] = static_cast<uint32_t>(q[2 * p].x) | (static_cast<uint32_t>(q[2 * p + 1].x) << 16);
  }
}

// Keys [start, start + n) of the item's sequence and kv head -> VB pairs (zeros past n), and the
// 16-key A tiles of K in kt: straight from the cache where 16 keys are one block's contiguous rows
// (block_size >= 16, start a multiple of 16), else rows copied into Kb (zeros past n).
inline void prefill_amx_load_kv(const PagedAttnArgs<c10::BFloat16>& a, const PrefillItem& it, PrefillAmxScratch& w,
                                int64_t start, int64_t n, const c10::BFloat16* kt[kAmxKeys / 16]) {
  const int64_t D = a.head_dim;
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t p = 0; p < kAmxKeys / 2; ++p) {
    const int64_t j = 2 * p;
    const c10::BFloat16* v0 = j < n ? a.row(a.value_cache, it.seq, start + j, it.head) : nullptr;
    const c10::BFloat16* v1 = j + 1 < n ? a.row(a.value_cache, it.seq, start + j + 1, it.head) : nullptr;
    for (int64_t d = 0; d < D; d += 16) {
      const __m256i lo = v0 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + d)) : zero;
      const __m256i hi = v1 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + d)) : zero;
      _mm512_storeu_si512(w.VB.data() + p * D + d, bf16_pairs(lo, hi));
    }
  }
  for (int64_t t = 0; t < kAmxKeys / 16; ++t) {
    const int64_t j0 = 16 * t;
    kt[t] = w.Kb.data() + j0 * D;
    if (j0 >= n) continue;  // not computed (prefill_amx_scores stops at n)
    if (a.block_size >= 16 && (start + j0) % 16 == 0 && j0 + 16 <= n) {
      kt[t] = a.row(a.key_cache, it.seq, start + j0, it.head);
      continue;
    }
    for (int64_t j = j0; j < j0 + 16; ++j) {
      c10::BFloat16* kb = w.Kb.data() + j * D;
      if (j < n) std::memcpy(kb, a.row(a.key_cache, it.seq, start + j, it.head), D * sizeof(c10::BFloat16));
      else std::memset(kb, 0, D * sizeof(c10::BFloat16));
    }
  }
}

// ST[j][r] = k_j . q_r (unscaled) for the step's n keys (16-key A tiles kt) and all Rp rows.
inline void prefill_amx_scores(PrefillAmxScratch& w, int64_t D, int64_t n, const c10::BFloat16* const kt[]) {
  const int64_t Rp = w.Rp, rstride = Rp * 4;
  for (int64_t jt = 0; jt < n; jt += 16) {
    for (int64_t rt = 0; rt < Rp; rt += 16) {
      _tile_zero(0);
      for (int64_t c = 0; c < D; c += 32) {
        _tile_loadd(4, kt[jt / 16] + c, D * 2);
        _tile_loadd(6, w.QB.data() + c / 2 * Rp + rt, rstride);
        _tile_dpbf16ps(0, 4, 6);
      }
      _tile_stored(0, w.ST.data() + jt * Rp + rt, rstride);
    }
  }
}

// O[r][d] = corr[r] * O[r][d] + sum_j P[j][r] * V[j][d] over the step's keys (32 per tile product).
inline void prefill_amx_pv(PrefillAmxScratch& w, int64_t D, int64_t n) {
  const int64_t Rp = w.Rp;
  const int64_t n32 = (n + 31) / 32 * 32;  // keys in whole 32-key products; the zero pad past n
  for (int64_t j = n; j < n32; ++j) std::fill(w.ST.begin() + j * Rp, w.ST.begin() + (j + 1) * Rp, 0.f);
  for (int64_t jb = 0; jb < n32; jb += 16) {  // PT[r][j] = bf16(ST[j][r]), 16x16 blocks
    for (int64_t rb = 0; rb < Rp; rb += 16) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(w.ST.data() + (jb + i) * Rp + rb);
      amx::transpose16(r);
      for (int i = 0; i < 16; ++i)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(w.PT.data() + (rb + i) * kAmxKeys + jb),
                            (__m256i)_mm512_cvtneps_pbh(r[i]));
    }
  }
  for (int64_t r = 0; r < Rp; ++r) {
    if (w.corr[r] == 1.0f) continue;  // the row's running max did not move (the common case)
    const VecF c = vset1(w.corr[r]);
    for (int64_t d = 0; d < D; d += kLanes) vstore(w.O.data() + r * D + d, vmul(vload(w.O.data() + r * D + d), c));
  }
  for (int64_t rt = 0; rt < Rp; rt += 16) {
    for (int64_t dt = 0; dt < D; dt += 16) {
      float* o = w.O.data() + rt * D + dt;
      _tile_loadd(0, o, D * 4);
      for (int64_t kc = 0; kc < n32; kc += 32) {
        _tile_loadd(4, w.PT.data() + rt * kAmxKeys + kc, kAmxKeys * 2);
        _tile_loadd(6, w.VB.data() + kc / 2 * D + dt, D * 4);
        _tile_dpbf16ps(0, 4, 6);
      }
      _tile_stored(0, o, D * 4);
    }
  }
}

inline void prefill_amx_item(const PagedAttnArgs<c10::BFloat16>& a, const PrefillItem& it, PrefillAmxScratch& w) {
  const int64_t G = a.group(), D = a.head_dim, Rp = w.Rp;
  const auto [q_base, pos_base, p_first, p_last] = prefill_span(a, it);
  prefill_amx_load_queries(a, it, w, q_base, pos_base);
  // Key steps start at multiples of 16 (so whole 16-key runs come straight from cache blocks); with a
  // window, keys before it in the first step are masked like any key outside a row's window.
  const int64_t kmin = a.window_begin(p_first) / 16 * 16;
  const c10::BFloat16* kt[kAmxKeys / 16];
  for (int64_t start = kmin; start <= p_last; start += kAmxKeys) {
    const int64_t n = std::min(kAmxKeys, p_last + 1 - start);
    prefill_amx_load_kv(a, it, w, start, n, kt);
    prefill_amx_scores(w, D, n, kt);
    float softmax_scale = a.scale;  // folded into the softmax, or into the soft-cap when there is one
    if (a.softcap > 0.f) {
      apply_softcap(w.ST.data(), n * Rp, a.softcap, a.scale);
      softmax_scale = 1.0f;
    }
    const bool boundary = start + n - 1 > p_first || (a.window > 0 && start < a.window_begin(p_last));
    if (boundary) mask_tile(a, w, start, n);
    softmax_update</*kLowpExp=*/true>(w, n, w.corr.data(), softmax_scale);
    prefill_amx_pv(w, D, n);
  }
  for (int64_t r = 0; r < (it.t1 - it.t0) * G; ++r) {
    const float l = w.l[r];
    store_row(w.O.data() + r * D, a.out_row(q_base + it.t0 + r / G, it.head * G + r % G), D, l > 0.f ? 1.0f / l : 0.f);
  }
}

// The same items and scheduling as paged_attention_prefill_kernel; each worker holds the tile state.
inline void paged_attention_prefill_amx(const PagedAttnArgs<c10::BFloat16>& a) {
  std::vector<PrefillItem> items;
  const int64_t Rp = prefill_items(a, items, kPrefillAmxRows);
  const int64_t n_items = static_cast<int64_t>(items.size());
  parallel_dynamic(n_items, [&](auto claim) {
    amx::load_tile_config();
    PrefillAmxScratch w(a.head_dim, Rp);
    for (int64_t i = claim(); i < n_items; i = claim()) prefill_amx_item(a, items[i], w);
    _tile_release();
  });
}

#endif  // PAGELLM_HAVE_AMX

// PAGELLM_PREFILL_AMX=0 keeps bf16 prefill on the FMA kernel (for comparisons); read once.
inline bool prefill_amx_disabled() {
  static const bool off = [] {
    const char* v = std::getenv("PAGELLM_PREFILL_AMX");
    return v != nullptr && std::string(v) == "0";
  }();
  return off;
}

// Whether the tile path can run: bf16 queries and cache, head_dim a multiple of 32, AMX usable.
template <typename T, typename C>
inline bool prefill_amx_applies(const PagedAttnArgs<T, C>& a) {
#ifdef PAGELLM_HAVE_AMX
  return std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, T> && a.head_dim % 32 == 0 && amx::amx_bf16_usable();
#else
  return false;
#endif
}

}  // namespace pagellm::cpu
