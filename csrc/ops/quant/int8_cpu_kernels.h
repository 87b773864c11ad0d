// LLM.int8() linear on the CPU (Dettmers et al. 2022), math over raw pointers:
//   1. outlier columns: every j with |x[m, j]| > threshold in some row m of the batch (threshold 0: none);
//   2. every row of x, its outlier columns zeroed, quantized to 8 bits:
//      absmax (bitsandbytes): s_m = absmax_m / 127, q[m, k] = clamp(round_half_even(x[m, k] * (127 / absmax_m)),
//        -127, 127), z_m = 0 (a row with absmax 0 gets s_m = 0 and q = 0);
//      zero point: over [lo_m, hi_m] = [min(min_k x, 0), max(max_k x, 0)], inv = 255 / (hi_m - lo_m),
//        s_m = (hi_m - lo_m) / 255, z_m = round_half_even(-lo_m * inv), q[m, k] = clamp(round_half_even(x * inv)
//        + z_m, 0, 255) as uint8 (a zeroed column is exactly z_m; a row of zeros gets s_m = 0, z_m = 0, q = 0);
//      per token group (group_size > 0): absmax as above per group g of group_size elements of K, s_mg;
//   3. sum_k (q[m, k] - z_m) * w[n, k] -> int32 against the int8 weight [N, K] (int8_dot_tiles.h, ISA chosen by
//      the caller);
//      (groups: int8_group_tiles.h, each group's int32 sums times s_mg accumulated in fp32 into facc[m, n]);
//   4. out[m, n] = T( float(acc[m, n]) * (s_m * w_scale[n])     (groups: facc[m, n] * w_scale[n])
//                     + sum_{j outlier} x[m, j] * (float(w[n, j]) * w_scale[n])     (fp32 FMA, outliers only)
//                     + bias[n] ).
// pagellm.ops.reference.int8_linear is the same computation in torch; only the fp32 sums of the outlier
// term (and where the compiler fuses a multiply-add) round differently.
#pragma once

#include "ops/common/parallel.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "ops/common/cpu_vec.h"
#include "ops/quant/int8_dot_tiles.h"
#include "ops/quant/int8_group_quant.h"
#include "ops/quant/int8_group_tiles.h"

namespace pagellm::cpu::int8 {

enum class Isa { kScalar, kAvx2, kAvx512Vnni };

// Activations prepared for the int8 dot products (step 1 and 2), owned by one call.
struct QuantizedActivations {
  bool zero_point = false;            // q holds uint8 codes with zero points `zero` (else int8, zero 0)
  int64_t group_size = 0;             // > 0: one absmax scale per (row, group of group_size elements of K)
  int64_t num_groups = 1;             // scales per row: ceil(K / group_size), or 1
  int64_t ldq = 0;                    // row stride of q: K rounded up to 64
  std::vector<int8_t> q;              // [M, ldq], 0 beyond K; in outlier columns 0 (int8) or the zero point
  std::vector<float> scale;           // [M, num_groups] s_m (s_mg)
  std::vector<int32_t> sum;           // [M] int8: row sums of q (the VNNI offset correction); zero point: z_m
  std::vector<int32_t> lane_corr;     // groups on VNNI: [M, num_groups, 16] (int8_group_tiles.h)
  std::vector<int64_t> outlier_cols;  // [P] ascending
  std::vector<float> outlier_x;       // [M, P] x at the outlier columns, in fp32
};

template <typename T>
struct Int8LinearArgs {
  int64_t M, N, K;
  const T* x;
  int64_t ldx;
  const int8_t* w;
  int64_t ldw;
  const float* w_scale;  // [N]
  const T* bias;         // [N] or nullptr
  T* out;
  int64_t ldo;
  float threshold;     // > 0: outlier threshold; 0: no outlier columns
  bool zero_point;     // asymmetric uint8 rows with a zero point (K < 65536) instead of absmax int8
  int64_t group_size;  // > 0 (a multiple of 64): absmax int8 per group of K instead of per row (zero_point false)
};

// Rows of x (M * K elements) below this are prepared on the calling thread.
constexpr int64_t kInt8SerialElems = 1 << 15;

// Step 1: the ascending outlier columns of x [M, K].
template <typename T>
std::vector<int64_t> find_outlier_columns(const Int8LinearArgs<T>& a) {
  std::vector<int64_t> cols;
  if (!(a.threshold > 0.f)) return cols;
  std::vector<uint8_t> is_outlier(a.K, 0);
  const int64_t grain = std::max<int64_t>(64, kInt8SerialElems / std::max<int64_t>(a.M, 1));
  pagellm::cpu::parallel_for(0, a.K, grain, [&](int64_t begin, int64_t end) {
    for (int64_t m = 0; m < a.M; ++m) {
      const T* xr = a.x + m * a.ldx;
      for (int64_t k = begin; k < end; ++k) is_outlier[k] |= std::fabs(static_cast<float>(xr[k])) > a.threshold;
    }
  });
  for (int64_t k = 0; k < a.K; ++k)
    if (is_outlier[k]) cols.push_back(k);
  return cols;
}

// The range statistic of one row over its non-outlier columns (zero_col empty: none), written to stat:
// zero point: {lo, hi} of the range holding 0; absmax: {absmax} per row, or per group under group_size.
// Returns max |x| over those columns, which tells whether the row has an outlier (> threshold) at all.
template <typename T>
float row_stats(const Int8LinearArgs<T>& a, const std::vector<uint8_t>& zero_col, int64_t m, float* stat) {
  const T* xr = a.x + m * a.ldx;
  const bool skip = !zero_col.empty();
  const int64_t span = a.group_size > 0 ? a.group_size : a.K;
  float row_max = 0.f;
  for (int64_t k0 = 0, g = 0; k0 < a.K; k0 += span, ++g) {
    float lo = 0.f, hi = 0.f;  // the range always holds 0, so a zeroed column is exact
    const int64_t k1 = std::min(a.K, k0 + span);
    for (int64_t k = k0; k < k1; ++k) {
      const float v = (skip && zero_col[k]) ? 0.f : static_cast<float>(xr[k]);
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
    if (a.zero_point) stat[0] = lo, stat[1] = hi;
    else stat[g] = std::max(hi, -lo);
    row_max = std::max(row_max, std::max(hi, -lo));
  }
  return row_max;
}

// Step 2 for one row, absmax (per row, or per group): q (pre-zeroed, outlier columns left 0), the scales from
// the absmaxes in `stat`, the row sum.
template <typename T>
void quantize_row_absmax(const Int8LinearArgs<T>& a, const std::vector<uint8_t>& zero_col, int64_t m,
                         const float* stat, QuantizedActivations& qa) {
  const T* xr = a.x + m * a.ldx;
  const bool skip = !zero_col.empty();
  const int64_t span = a.group_size > 0 ? a.group_size : a.K;
  int8_t* qr = qa.q.data() + m * qa.ldq;
  int32_t sum = 0;
  for (int64_t k0 = 0, g = 0; k0 < a.K; k0 += span, ++g) {
    const float absmax = stat[g];
    const float inv = absmax > 0.f ? 127.f / absmax : 0.f;
    const int64_t k1 = std::min(a.K, k0 + span);
    for (int64_t k = k0; k < k1; ++k) {
      if (skip && zero_col[k]) continue;
      const float r = std::nearbyint(static_cast<float>(xr[k]) * inv);  // the default rounding mode: half to even
      const int32_t v = static_cast<int32_t>(std::min(127.f, std::max(-127.f, r)));
      qr[k] = static_cast<int8_t>(v);
      sum += v;
    }
    qa.scale[m * qa.num_groups + g] = absmax / 127.f;
  }
  qa.sum[m] = sum;
}

// Step 2 for one row, zero point: uint8 codes over the range {lo, hi} in `stat` (stored in q's bytes; outlier
// columns get the zero point), the scale and the zero point.
template <typename T>
void quantize_row_zero_point(const Int8LinearArgs<T>& a, const std::vector<uint8_t>& zero_col, int64_t m,
                             const float* stat, QuantizedActivations& qa) {
  const T* xr = a.x + m * a.ldx;
  const bool skip = !zero_col.empty();
  const float lo = stat[0], hi = stat[1];
  const float span = hi - lo;
  const float inv = span > 0.f ? 255.f / span : 0.f;
  const float z = std::min(255.f, std::max(0.f, std::nearbyint(-lo * inv)));
  uint8_t* qr = reinterpret_cast<uint8_t*>(qa.q.data() + m * qa.ldq);
  for (int64_t k = 0; k < a.K; ++k) {
    const float v = (skip && zero_col[k]) ? 0.f : static_cast<float>(xr[k]);
    qr[k] = static_cast<uint8_t>(std::min(255.f, std::max(0.f, std::nearbyint(v * inv) + z)));
  }
  qa.scale[m] = span / 255.f;
  qa.sum[m] = static_cast<int32_t>(z);
}

// Step 2 for one row: the scheme's quantization, then the row's outlier values (and the group lane sums).
template <typename T>
void quantize_row(const Int8LinearArgs<T>& a, const std::vector<uint8_t>& zero_col, int64_t m, const float* stat,
                  QuantizedActivations& qa) {
  if (qa.zero_point) quantize_row_zero_point(a, zero_col, m, stat, qa);
  else quantize_row_absmax(a, zero_col, m, stat, qa);
#ifdef PAGELLM_INT8_X86
  if (!qa.lane_corr.empty())  // only VNNI tiles take lane corrections
    group_lane_corrections_vnni(qa.q.data() + m * qa.ldq, a.K, qa.group_size, qa.num_groups,
                                qa.lane_corr.data() + m * qa.num_groups * kGroupLanes);
#endif
  const T* xr = a.x + m * a.ldx;
  const int64_t P = static_cast<int64_t>(qa.outlier_cols.size());
  for (int64_t p = 0; p < P; ++p) qa.outlier_x[m * P + p] = static_cast<float>(xr[qa.outlier_cols[p]]);
}

// Steps 1 and 2 of the group scheme on VNNI when no activation is over the threshold (int8_group_quant.h: one
// pass over x, the same bytes as the general path). False: some row has one; qa's codes are then partly written.
template <typename T>
bool quantize_groups_vnni(const Int8LinearArgs<T>& a, QuantizedActivations& qa, int64_t grain) {
#ifdef PAGELLM_INT8_X86
  std::atomic<bool> no_outlier{true};
  pagellm::cpu::parallel_for(0, a.M, grain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end && no_outlier.load(std::memory_order_relaxed); ++m) {
      if (!quantize_group_row_vnni(a.x + m * a.ldx, a.K, a.group_size, a.threshold, qa.q.data() + m * qa.ldq,
                                   qa.scale.data() + m * qa.num_groups,
                                   qa.lane_corr.data() + m * qa.num_groups * kGroupLanes))
        no_outlier.store(false, std::memory_order_relaxed);
    }
  });
  return no_outlier.load();
#else
  (void)a, (void)qa, (void)grain;
  return false;
#endif
}

// Steps 1 and 2. The statistics pass decides whether any column is an outlier (a row's max |x| over the
// threshold), so without outliers x is read twice (statistics, codes), as without outlier handling; only
// a batch with outliers pays the column search and a second statistics pass.
template <typename T>
QuantizedActivations quantize_activations(const Int8LinearArgs<T>& a, bool lane_corr) {
  QuantizedActivations qa;
  qa.zero_point = a.zero_point;
  qa.group_size = a.group_size;
  qa.num_groups = a.group_size > 0 ? (a.K + a.group_size - 1) / a.group_size : 1;
  qa.ldq = (a.K + 63) / 64 * 64;
  qa.q.assign(a.M * qa.ldq, 0);
  qa.scale.resize(a.M * qa.num_groups);
  qa.sum.resize(a.M);
  if (lane_corr && a.group_size > 0) qa.lane_corr.resize(a.M * qa.num_groups * 16);
  const int64_t grain = std::max<int64_t>(1, kInt8SerialElems / std::max<int64_t>(a.K, 1));
  if (!qa.lane_corr.empty()) {
    if (quantize_groups_vnni(a, qa, grain)) return qa;
    std::fill(qa.q.begin(), qa.q.end(), int8_t{0});  // the general path leaves outlier columns as they are: 0
  }
  const int64_t per_row = a.zero_point ? 2 : qa.num_groups;
  std::vector<float> stats(a.M * per_row);
  std::vector<float> row_max(a.M);
  std::vector<uint8_t> zero_col;
  auto all_stats = [&] {
    pagellm::cpu::parallel_for(0, a.M, grain, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) row_max[m] = row_stats(a, zero_col, m, stats.data() + m * per_row);
    });
  };
  all_stats();
  if (a.threshold > 0.f && *std::max_element(row_max.begin(), row_max.end()) > a.threshold) {
    qa.outlier_cols = find_outlier_columns(a);
    zero_col.assign(a.K, 0);
    for (int64_t c : qa.outlier_cols) zero_col[c] = 1;
    all_stats();
  }
  qa.outlier_x.resize(a.M * qa.outlier_cols.size());
  pagellm::cpu::parallel_for(0, a.M, grain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) quantize_row(a, zero_col, m, stats.data() + m * per_row, qa);
  });
  return qa;
}

// s[j] = x . w[j] for j < NR (w rows of length P, stride P), fp32: the outlier term of one activation row
// against a weight tile. One register accumulator per weight row (NR is a constant so that they stay in
// registers), x loaded once for all of them.
template <int NR>
inline void outlier_dots(const float* x, const float* w, int64_t P, float* s) {
  VecF acc[NR];
#pragma GCC unroll 4
  for (int j = 0; j < NR; ++j) acc[j] = vzero();
  int64_t p = 0;
  for (; p + kLanes <= P; p += kLanes) {
    const VecF xv = vload(x + p);
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[j] = vfma(xv, vload(w + j * P + p), acc[j]);
  }
  if (p < P) {
    const int n = static_cast<int>(P - p);
    const VecF xv = vload(x + p, n);
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[j] = vfma(xv, vload(w + j * P + p, n), acc[j]);
  }
#pragma GCC unroll 4
  for (int j = 0; j < NR; ++j) s[j] = vsum(acc[j]);
}

inline void outlier_dots(const float* x, const float* w, int64_t P, int nr, float* s) {
  if (nr == kInt8NR) return outlier_dots<kInt8NR>(x, w, P, s);
  for (int j = 0; j < nr; ++j) outlier_dots<1>(x, w + j * P, P, s + j);
}

// The dequantized weight at the outlier columns for weight rows n0 .. n0 + nr: w_out [nr, P] (row stride P).
template <typename T>
void gather_outlier_weights(const Int8LinearArgs<T>& a, const QuantizedActivations& qa, int64_t n0, int nr,
                            float* w_out) {
  const int64_t P = static_cast<int64_t>(qa.outlier_cols.size());
  for (int j = 0; j < nr; ++j) {
    const int8_t* wr = a.w + (n0 + j) * a.ldw;
    const float ws = a.w_scale[n0 + j];
    for (int64_t p = 0; p < P; ++p) w_out[j * P + p] = static_cast<float>(wr[qa.outlier_cols[p]]) * ws;
  }
}

// Step 4 for one register tile: acc [mr, kInt8NR] of rows m0.., weight rows n0.. (int32 sums of per-row
// schemes, or the group scheme's fp32 sums already times s_mg); w_out as gathered above.
template <typename T, typename Acc>
void store_tile(const Int8LinearArgs<T>& a, const QuantizedActivations& qa, int64_t m0, int64_t n0, int mr, int nr,
                const Acc* acc, const float* w_out) {
  const int64_t P = static_cast<int64_t>(qa.outlier_cols.size());
  float outlier[kInt8NR];
  for (int i = 0; i < mr; ++i) {
    const int64_t m = m0 + i;
    if (P > 0) outlier_dots(qa.outlier_x.data() + m * P, w_out, P, nr, outlier);
    for (int j = 0; j < nr; ++j) {
      const int64_t n = n0 + j;
      float y;
      if constexpr (std::is_same_v<Acc, float>) y = acc[i * kInt8NR + j] * a.w_scale[n];
      else y = static_cast<float>(acc[i * kInt8NR + j]) * (qa.scale[m] * a.w_scale[n]);
      if (P > 0) y += outlier[j];
      if (a.bias != nullptr) y += static_cast<float>(a.bias[n]);
      a.out[m * a.ldo + n] = static_cast<T>(y);
    }
  }
}

using DotBlockFn = void (*)(const int8_t*, int64_t, const int8_t*, int64_t, const int32_t*, int64_t, int, int,
                            int32_t*, bool);

// The dot products of `isa` for int8 rows (zero_point false) or uint8 rows with zero points (true).
inline DotBlockFn dot_block_for(Isa isa, bool zero_point) {
#ifdef PAGELLM_INT8_X86
  if (isa == Isa::kAvx512Vnni) return zero_point ? &dot_block_vnni<true> : &dot_block_vnni<false>;
  if (isa == Isa::kAvx2) return zero_point ? &dot_block_avx2<true> : &dot_block_avx2<false>;
#endif
  return zero_point ? &dot_block_scalar<true> : &dot_block_scalar<false>;
}

using GroupBlockFn = void (*)(const int8_t*, int64_t, const int8_t*, int64_t, const float*, const int32_t*, int64_t,
                              int64_t, int64_t, int, int, float*, bool);

// The group scheme's dot products: VNNI, else plain C++ (the AVX2 path has no group kernel: same results).
inline GroupBlockFn group_block_for(Isa isa) {
#ifdef PAGELLM_INT8_X86
  if (isa == Isa::kAvx512Vnni) return &group_block_vnni;
#endif
  (void)isa;
  return &group_block_scalar;
}

// Rows of x whose quantized and outlier values stay in cache while a thread's weight tiles pass (prefill).
constexpr int64_t kInt8RowChunk = 64;

// The whole op on the ISA `isa` (which the caller has checked this CPU runs). Threads split N in whole
// weight tiles; for each chunk of rows of x, a tile's kInt8NR weight rows stay in cache while the chunk's
// row blocks pass.
template <typename T>
void int8_linear_kernel(const Int8LinearArgs<T>& a, Isa isa) {
  const bool grouped = a.group_size > 0;
  const QuantizedActivations qa = quantize_activations(a, grouped && isa == Isa::kAvx512Vnni);
  const DotBlockFn dot_block = dot_block_for(isa, a.zero_point);
  const GroupBlockFn group_block = group_block_for(isa);
  const int64_t G = qa.num_groups;
  const int64_t num_tiles = (a.N + kInt8NR - 1) / kInt8NR;
  // >= 256 KiB of weight per task (as linear_small_m): small layers run inline, where waking threads would
  // cost more than the work; big ones split across threads.
  const int64_t grain = std::max<int64_t>(1, (int64_t{256} << 10) / (kInt8NR * a.K));
  pagellm::cpu::parallel_for(0, num_tiles, grain, [&](int64_t begin, int64_t end) {
    int32_t acc[kInt8MR * kInt8NR];
    float facc[kInt8MR * kInt8NR];
    std::vector<float> w_out(kInt8NR * qa.outlier_cols.size());
    for (int64_t m_begin = 0; m_begin < a.M; m_begin += kInt8RowChunk) {
      const int64_t m_end = std::min(a.M, m_begin + kInt8RowChunk);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n0 = t * kInt8NR;
        const int nr = static_cast<int>(std::min<int64_t>(kInt8NR, a.N - n0));
        if (!w_out.empty()) gather_outlier_weights(a, qa, n0, nr, w_out.data());
        for (int64_t m0 = m_begin; m0 < m_end; m0 += kInt8MR) {
          const int mr = static_cast<int>(std::min<int64_t>(kInt8MR, m_end - m0));
          const int8_t* w = a.w + n0 * a.ldw;
          const int8_t* q = qa.q.data() + m0 * qa.ldq;
          const bool prefetch = m0 == m_begin;  // the chunk's first pass; the others re-read the tile from L1
          if (grouped) {
            const int32_t* corr = qa.lane_corr.empty() ? nullptr : qa.lane_corr.data() + m0 * G * kGroupLanes;
            group_block(w, a.ldw, q, qa.ldq, qa.scale.data() + m0 * G, corr, G, a.group_size, a.K, mr, nr, facc,
                        prefetch);
            store_tile(a, qa, m0, n0, mr, nr, facc, w_out.data());
          } else {
            dot_block(w, a.ldw, q, qa.ldq, qa.sum.data() + m0, a.K, mr, nr, acc, prefetch);
            store_tile(a, qa, m0, n0, mr, nr, acc, w_out.data());
          }
        }
      }
    }
  });
}

}  // namespace pagellm::cpu::int8
