// fused_moe on the CPU, as raw-pointer pieces the glue (moe_cpu.cpp) strings together:
//   route_pairs            - counting sort of the (token, slot) pairs by expert (stable: token order);
//   grouped_expert_gemm    - out[p, n] = x[p, :] . w[e, n, :] for the pairs p of each listed expert e, fp32
//                            results; work items are (expert, tile of kMoeTileRows weight rows) pairs, so a
//                            decode streams each chosen expert's weight once with every thread busy;
//   combine_expert_outputs - out[t] = sum_j weights[t, j] * y[position of (t, j)], j = 0..k-1, in fp32, one rounding.
// Each (pair, row) dot product is one 16-lane accumulator over K (bf16 x bf16: AVX512-BF16 `vdpbf16ps`
// on pairs), reduced at the end: a pair's result does not depend on which other pairs share its expert.
#pragma once

#include <cstring>
#include <type_traits>
#include <vector>

#include "ops/activation/activation_cpu_kernels.h"
#include "ops/common/cpu_vec.h"
#include "ops/common/parallel.h"
#include "ops/moe/moe_activation.h"

namespace pagellm::cpu {

// Weight rows per work item (and per register tile).
constexpr int64_t kMoeTileRows = 4;

// The (token, slot) pairs grouped by expert.
struct ExpertRouting {
  std::vector<int64_t> offsets;        // [E + 1]: expert e's pairs sit at positions [offsets[e], offsets[e + 1])
  std::vector<int32_t> pair_token;     // [T * k]: the token of the pair at each position
  std::vector<int64_t> pair_position;  // [T * k]: the position of pair (t, j), at index t * k + j
};

// Index (t * k + j) of the first id outside [0, E), or -1 when all are valid. ids: [T * k], contiguous.
inline int64_t first_invalid_expert_id(const int32_t* ids, int64_t num_pairs, int64_t E) {
  for (int64_t i = 0; i < num_pairs; ++i)
    if (ids[i] < 0 || ids[i] >= E) return i;
  return -1;
}

// Counting sort of the pairs of T tokens by expert; ids [T * k] contiguous, all in [0, E).
inline ExpertRouting route_pairs(const int32_t* ids, int64_t T, int64_t k, int64_t E) {
  ExpertRouting r;
  const int64_t num_pairs = T * k;
  r.offsets.assign(E + 1, 0);
  for (int64_t i = 0; i < num_pairs; ++i) ++r.offsets[ids[i] + 1];
  for (int64_t e = 0; e < E; ++e) r.offsets[e + 1] += r.offsets[e];
  std::vector<int64_t> next(r.offsets.begin(), r.offsets.end() - 1);
  r.pair_token.resize(num_pairs);
  r.pair_position.resize(num_pairs);
  for (int64_t i = 0; i < num_pairs; ++i) {
    const int64_t p = next[ids[i]]++;
    r.pair_token[p] = static_cast<int32_t>(i / k);
    r.pair_position[i] = p;
  }
  return r;
}

// xs[p, :] = hidden[pair_token[p], :] (row strides ldh / H).
template <typename T>
void gather_pair_rows(T* xs, const T* hidden, int64_t ldh, const std::vector<int32_t>& pair_token, int64_t H) {
  const int64_t num_pairs = static_cast<int64_t>(pair_token.size());
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(H * sizeof(T), 1));
  pagellm::cpu::parallel_for(0, num_pairs, grain, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) std::memcpy(xs + p * H, hidden + pair_token[p] * ldh, H * sizeof(T));
  });
}

// One expert GEMM: out[m, n] (row stride ldo) = x[m, :] (row stride ldx) . w[n, :] (row stride K).
struct ExpertGemmArgs {
  int64_t N, K;           // weight rows per expert, shared dimension
  int64_t ldx, ldo;       // row strides of x and out, elements
  int64_t expert_stride;  // elements from one expert's weight to the next
};

// acc[i][j] over K for MR rows of x and NR rows of w, stored as fp32 into out.
template <int MR, int NR, typename TX, typename TW>
inline void moe_tile_fma(float* out, const TX* x, const TW* w, const ExpertGemmArgs& a) {
  VecF acc[MR][NR];
  _Pragma("GCC unroll 16") for (int i = 0; i < MR; ++i)
    _Pragma("GCC unroll 16") for (int j = 0; j < NR; ++j) acc[i][j] = vzero();
  int64_t k = 0;
  for (; k + kLanes <= a.K; k += kLanes) {
    VecF wv[NR];
    _Pragma("GCC unroll 16") for (int j = 0; j < NR; ++j) wv[j] = vload(w + j * a.K + k);
    _Pragma("GCC unroll 16") for (int i = 0; i < MR; ++i) {
      const VecF xv = vload(x + i * a.ldx + k);
      _Pragma("GCC unroll 16") for (int j = 0; j < NR; ++j) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
    }
  }
  if (k < a.K) {
    const int n = static_cast<int>(a.K - k);
    VecF wv[NR];
    _Pragma("GCC unroll 16") for (int j = 0; j < NR; ++j) wv[j] = vload(w + j * a.K + k, n);
    _Pragma("GCC unroll 16") for (int i = 0; i < MR; ++i) {
      const VecF xv = vload(x + i * a.ldx + k, n);
      _Pragma("GCC unroll 16") for (int j = 0; j < NR; ++j) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
    }
  }
  _Pragma("GCC unroll 16") for (int i = 0; i < MR; ++i)
    _Pragma("GCC unroll 16") for (int j = 0; j < NR; ++j) out[i * a.ldo + j] = vsum(acc[i][j]);
}

#ifdef PAGELLM_BF16_DOT  // vdpbf16ps, or its exact AVX2 emulation (cpu_vec_avx2.h)
#define PAGELLM_MOE_DPBF16 1
// bf16 x bf16: products exact in fp32, two per lane per `vdpbf16ps`.
template <int MR, int NR>
inline void moe_tile_bf16(float* out, const c10::BFloat16* x, const c10::BFloat16* w, const ExpertGemmArgs& a) {
  VecF acc[MR][NR];
  _Pragma("GCC unroll 16") for (int i = 0; i < MR; ++i)
    _Pragma("GCC unroll 16") for (int j = 0; j < NR; ++j) acc[i][j] = vzero();
  for (int64_t k = 0; k < a.K; k += 32) {
    BF16x32 wv[NR];
    _Pragma("GCC unroll 16") for (int j = 0; j < NR; ++j) wv[j] = bf16x32_load(w + j * a.K + k, a.K - k);
    _Pragma("GCC unroll 16") for (int i = 0; i < MR; ++i) {
      const BF16x32 xv = bf16x32_load(x + i * a.ldx + k, a.K - k);
      _Pragma("GCC unroll 16") for (int j = 0; j < NR; ++j) acc[i][j] = vdot_bf16(acc[i][j], wv[j], xv);
    }
  }
  _Pragma("GCC unroll 16") for (int i = 0; i < MR; ++i)
    _Pragma("GCC unroll 16") for (int j = 0; j < NR; ++j) out[i * a.ldo + j] = vsum(acc[i][j]);
}
#endif

template <int MR, int NR, typename TX, typename TW>
inline void moe_tile(float* out, const TX* x, const TW* w, const ExpertGemmArgs& a) {
#ifdef PAGELLM_MOE_DPBF16
  if constexpr (std::is_same_v<TX, c10::BFloat16> && std::is_same_v<TW, c10::BFloat16>) {
    moe_tile_bf16<MR, NR>(out, x, w, a);
    return;
  } else
#endif
  {
    moe_tile_fma<MR, NR>(out, x, w, a);
  }
}

// All M rows of x against NR weight rows (w points at the first); out points at [row 0, first weight row].
template <int NR, typename TX, typename TW>
inline void moe_rows(float* out, const TX* x, const TW* w, int64_t M, const ExpertGemmArgs& a) {
  constexpr int MR = NR >= 4 ? 3 : 4;  // MR * NR <= 16 accumulators
  int64_t m = 0;
  for (; m + MR <= M; m += MR) moe_tile<MR, NR>(out + m * a.ldo, x + m * a.ldx, w, a);
  switch (M - m) {
    case 3: moe_tile<3, NR>(out + m * a.ldo, x + m * a.ldx, w, a); break;
    case 2: moe_tile<2, NR>(out + m * a.ldo, x + m * a.ldx, w, a); break;
    case 1: moe_tile<1, NR>(out + m * a.ldo, x + m * a.ldx, w, a); break;
    default: break;
  }
}

// For each expert e in `experts`: out[p, :N] = x[p, :K] . w[e]^T for p in [offsets[e], offsets[e + 1]).
// Parallel over (expert, weight-row tile) items, ~256 KiB of weight per task.
template <typename TX, typename TW>
void grouped_expert_gemm(float* out, const TX* x, const TW* w, const ExpertGemmArgs& a, const int64_t* offsets,
                         const std::vector<int32_t>& experts) {
  const int64_t tiles = (a.N + kMoeTileRows - 1) / kMoeTileRows;
  const int64_t items = static_cast<int64_t>(experts.size()) * tiles;
  const int64_t tile_bytes = kMoeTileRows * a.K * static_cast<int64_t>(sizeof(TW));
  const int64_t grain = std::max<int64_t>(1, (256 << 10) / std::max<int64_t>(tile_bytes, 1));
  pagellm::cpu::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t e = experts[item / tiles], n0 = (item % tiles) * kMoeTileRows;
      const int64_t p0 = offsets[e], M = offsets[e + 1] - p0;
      const TW* we = w + e * a.expert_stride;
      float* o = out + p0 * a.ldo;
      const TX* xe = x + p0 * a.ldx;
      if (n0 + kMoeTileRows <= a.N) {
        moe_rows<kMoeTileRows>(o + n0, xe, we + n0 * a.K, M, a);
      } else {
        for (int64_t n = n0; n < a.N; ++n) moe_rows<1>(o + n, xe, we + n * a.K, M, a);
      }
    }
  });
}

// act[p, :I] = act(gu[p, :I]) * gu[p, I:2I], fp32 rows.
inline void gated_expert_activation(float* act, const float* gu, int64_t num_pairs, int64_t I,
                                    MoeActivation activation) {
  if (activation == MoeActivation::kSilu)
    gated_activation_kernel<GateAct::kSilu, float>(act, gu, num_pairs, I, I, 2 * I);
  else
    gated_activation_kernel<GateAct::kGeluTanh, float>(act, gu, num_pairs, I, I, 2 * I);
}

// out[t, :] (row stride ldo) = sum_{j < k} weights[t, j] * y[pair_position[t * k + j], :], fp32, one rounding.
template <typename T>
void combine_expert_outputs(T* out, int64_t ldo, const float* y, const float* weights,
                            const std::vector<int64_t>& pair_position, int64_t num_tokens, int64_t k, int64_t H) {
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / std::max<int64_t>(H * k, 1));
  pagellm::cpu::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < H; h += kLanes) {
        const int n = static_cast<int>(std::min<int64_t>(kLanes, H - h));
        VecF acc = vzero();
        for (int64_t j = 0; j < k; ++j)
          acc = vfma(vset1(weights[t * k + j]), vload(y + pair_position[t * k + j] * H + h, n), acc);
        vstore(out + t * ldo + h, acc, n);
      }
    }
  });
}

}  // namespace pagellm::cpu
