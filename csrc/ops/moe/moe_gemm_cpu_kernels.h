// The grouped GEMM of fused_moe for busy experts (more pairs than the weight-streaming tiles of
// moe_cpu_kernels.h are meant for): out[p, n] = x[p, :K] . w[e, n, :K] for the pairs p of each listed expert e,
// fp32 results, weights read in their own dtype.
//
// Pairs run along the vector lanes. Each expert's x rows are packed once per call, K-major, in blocks of
// kPairBlock = 32 pairs (a block of <= 16 runs on one vector): fp32 [K][32], or for bf16 x bf16
// [ceil(K/2)][32][2] (the pair layout of `vdpbf16ps`). The register tile is NR weight rows x 32 pairs (2 * NR accumulators); each step broadcasts
// one weight value (bf16: one (k, k + 1) pair as 32 bits) to every lane, so the weight needs no transposed
// copy: bf16 x bf16 reads it straight from the expert tensor; other weight dtypes widen one chunk of
// kMoeChunkRows rows at a time into a per-thread fp32 buffer that stays in L2 (never the whole tensor).
// Work items are (expert, chunk of weight rows); inside one, the pair blocks go outermost so a block's
// packed x (<= 32 x K) stays in L1/L2 while the chunk's rows stream past it.
// Each output is one accumulator summed over k in order (pairs of k for vdpbf16ps), so a pair's result
// depends neither on the other pairs of its expert nor on the thread count nor on the kernel library (the
// register tile's shape does not change any output's arithmetic).
#pragma once

#include <cstring>
#include <type_traits>
#include <vector>

#include "ops/common/cpu_vec.h"
#include "ops/common/parallel.h"
#include "ops/moe/moe_cpu_kernels.h"

namespace pagellm::cpu {

constexpr int64_t kPairBlock = 32;
#ifdef PAGELLM_AVX512
constexpr int kMoeGemmNR = 6;  // 12 accumulators + 2 x vectors + 1 broadcast of 32 zmm
#else
constexpr int kMoeGemmNR = 2;  // VecF is two ymm on AVX2: 8 accumulators + 4 + 1 of 16 ymm
#endif
constexpr int64_t kMoeChunkRows = 48;  // weight rows per work item (a multiple of both NRs): 96 KiB bf16 at K = 1024

// Packed x of all busy experts: expert experts[i]'s blocks start at block first_block[i].
struct PackedPairs {
  std::vector<int64_t> first_block;  // [experts.size() + 1]
  int64_t block_elems = 0;           // elements per block (fp32 or bf16)
};

inline PackedPairs plan_packed_pairs(const int64_t* offsets, const std::vector<int32_t>& experts, int64_t K,
                                     bool bf16_pairs) {
  PackedPairs pp;
  pp.first_block.assign(experts.size() + 1, 0);
  for (size_t i = 0; i < experts.size(); ++i) {
    const int64_t M = offsets[experts[i] + 1] - offsets[experts[i]];
    pp.first_block[i + 1] = pp.first_block[i] + (M + kPairBlock - 1) / kPairBlock;
  }
  pp.block_elems = bf16_pairs ? (K + 1) / 2 * kPairBlock * 2 : K * kPairBlock;
  return pp;
}

// One block of m <= 32 rows of x (row stride ldx) into fp32 [K][32]; rows m..31 are zero.
template <typename TX>
inline void pack_block_f32(float* xp, const TX* x, int64_t ldx, int64_t m, int64_t K) {
  std::memset(static_cast<void*>(xp), 0, sizeof(float) * K * kPairBlock);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t k = 0; k < K; ++k) xp[k * kPairBlock + i] = static_cast<float>(x[i * ldx + k]);
}

// One block into bf16 pairs [ceil(K/2)][32][2]: element (kp, i, r) = x[i, 2 kp + r]; padding is zero.
inline void pack_block_bf16(c10::BFloat16* xp, const c10::BFloat16* x, int64_t ldx, int64_t m, int64_t K) {
  const int64_t kp_count = (K + 1) / 2;
  std::memset(static_cast<void*>(xp), 0, sizeof(c10::BFloat16) * kp_count * kPairBlock * 2);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t k = 0; k < K; ++k) xp[((k / 2) * kPairBlock + i) * 2 + (k & 1)] = x[i * ldx + k];
}

// tile[j][0..16 NX) = sum_k w[j, k] * xp[k][0..16 NX), j < NR (w: fp32 rows of stride ldw). NX = 1: a block's
// last <= 16 pairs alone (the other half of the block is padding).
template <int NR, int NX>
inline void moe_panel_fma(float* tile, const float* xp, const float* w, int64_t ldw, int64_t K) {
  VecF acc[NR][NX];
  _Pragma("GCC unroll 16") for (int j = 0; j < NR; ++j)
    _Pragma("GCC unroll 2") for (int v = 0; v < NX; ++v) acc[j][v] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    VecF xv[NX];
    _Pragma("GCC unroll 2") for (int v = 0; v < NX; ++v) xv[v] = vload(xp + k * kPairBlock + v * kLanes);
    _Pragma("GCC unroll 16") for (int j = 0; j < NR; ++j) {
      const VecF wv = vset1(w[j * ldw + k]);
      _Pragma("GCC unroll 2") for (int v = 0; v < NX; ++v) acc[j][v] = vfma(wv, xv[v], acc[j][v]);
    }
  }
  _Pragma("GCC unroll 16") for (int j = 0; j < NR; ++j)
    _Pragma("GCC unroll 2") for (int v = 0; v < NX; ++v) vstore(tile + j * kPairBlock + v * kLanes, acc[j][v]);
}

#ifdef PAGELLM_BF16_DOT
// The same over bf16 pairs with vdpbf16ps (products exact in fp32); w: bf16 rows of stride ldw, read in place.
template <int NR, int NX>
inline void moe_panel_bf16(float* tile, const c10::BFloat16* xp, const c10::BFloat16* w, int64_t ldw, int64_t K) {
  VecF acc[NR][NX];
  _Pragma("GCC unroll 16") for (int j = 0; j < NR; ++j)
    _Pragma("GCC unroll 2") for (int v = 0; v < NX; ++v) acc[j][v] = vzero();
  // One k pair: bits(j) = weight row j's (k, k + 1) values as the 32 bits of one pair.
  auto step = [&](int64_t kp, auto bits) __attribute__((always_inline)) {
    BF16x32 xv[NX];
    _Pragma("GCC unroll 2") for (int v = 0; v < NX; ++v) xv[v] = bf16x32_load(xp + (kp * kPairBlock + v * kLanes) * 2);
    _Pragma("GCC unroll 16") for (int j = 0; j < NR; ++j) {
      const BF16x32 wv = bf16x32_set1_pair(bits(j));
      _Pragma("GCC unroll 2") for (int v = 0; v < NX; ++v) acc[j][v] = vdot_bf16(acc[j][v], wv, xv[v]);
    }
  };
  const int64_t full = K / 2;
  for (int64_t kp = 0; kp < full; ++kp) {
    step(kp, [&](int j) __attribute__((always_inline)) {
      uint32_t b;
      std::memcpy(&b, w + j * ldw + 2 * kp, sizeof(b));
      return b;
    });
  }
  // odd K: the last k alone, the pair's high half 0 on both sides (never a read past the row)
  if (K & 1) step(full, [&](int j) { return static_cast<uint32_t>(w[j * ldw + K - 1].x); });
  _Pragma("GCC unroll 16") for (int j = 0; j < NR; ++j)
    _Pragma("GCC unroll 2") for (int v = 0; v < NX; ++v) vstore(tile + j * kPairBlock + v * kLanes, acc[j][v]);
}
#endif

// out[i, j] (row stride ldo) = tile[j][i] for i < m, j < nr.
inline void scatter_tile(float* out, int64_t ldo, const float* tile, int64_t m, int nr) {
  for (int64_t i = 0; i < m; ++i)
    for (int j = 0; j < nr; ++j) out[i * ldo + j] = tile[j * kPairBlock + i];
}

// Weight rows [n0, n1) (w points at row n0; fp32, or bf16 with bf16 pairs in xp) against one packed block
// of m pairs; out points at [first pair of the block, column 0].
template <typename TP, typename TWK>
inline void moe_panel_rows(float* out, int64_t ldo, const TP* xp, const TWK* w, int64_t ldw, int64_t K, int64_t m,
                           int64_t n0, int64_t n1) {
  alignas(64) float tile[kMoeGemmNR * kPairBlock];
  auto panel = [&](auto nr_const, auto nx_const, int64_t n) {
    constexpr int NR = decltype(nr_const)::value, NX = decltype(nx_const)::value;
    if constexpr (std::is_same_v<TP, float>) moe_panel_fma<NR, NX>(tile, xp, w + (n - n0) * ldw, ldw, K);
#ifdef PAGELLM_BF16_DOT
    else moe_panel_bf16<NR, NX>(tile, xp, w + (n - n0) * ldw, ldw, K);
#endif
    scatter_tile(out + n, ldo, tile, m, NR);
  };
  auto run = [&](auto nr_const, int64_t n) {
    if (m > kLanes) panel(nr_const, std::integral_constant<int, 2>{}, n);
    else panel(nr_const, std::integral_constant<int, 1>{}, n);
  };
  int64_t n = n0;
  for (; n + kMoeGemmNR <= n1; n += kMoeGemmNR) run(std::integral_constant<int, kMoeGemmNR>{}, n);
  for (; n < n1; ++n) run(std::integral_constant<int, 1>{}, n);
}

// For each e in `experts`: out[p, :N] = x[p, :K] . w[e]^T for p in [offsets[e], offsets[e + 1]) (a: see
// ExpertGemmArgs). TX / TW: the dtypes of x and w; bf16 x bf16 runs on vdpbf16ps, the rest in fp32 FMA.
template <typename TX, typename TW>
void packed_expert_gemm(float* out, const TX* x, const TW* w, const ExpertGemmArgs& a, const int64_t* offsets,
                        const std::vector<int32_t>& experts) {
  if (experts.empty()) return;
#ifdef PAGELLM_BF16_DOT
  constexpr bool kPairs = std::is_same_v<TX, c10::BFloat16> && std::is_same_v<TW, c10::BFloat16>;
#else
  constexpr bool kPairs = false;
#endif
  using TP = std::conditional_t<kPairs, c10::BFloat16, float>;
  const int64_t K = a.K, N = a.N;
  const PackedPairs pp = plan_packed_pairs(offsets, experts, K, kPairs);
  const int64_t num_blocks = pp.first_block.back();
  std::vector<TP> packed(static_cast<size_t>(num_blocks * pp.block_elems));
  std::vector<int32_t> block_expert(static_cast<size_t>(num_blocks));  // index into `experts`
  for (size_t i = 0; i < experts.size(); ++i)
    for (int64_t b = pp.first_block[i]; b < pp.first_block[i + 1]; ++b) block_expert[b] = static_cast<int32_t>(i);
  pagellm::cpu::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int32_t i = block_expert[b];
      const int64_t p0 = offsets[experts[i]] + (b - pp.first_block[i]) * kPairBlock;
      const int64_t m = std::min<int64_t>(kPairBlock, offsets[experts[i] + 1] - p0);
      if constexpr (kPairs) pack_block_bf16(packed.data() + b * pp.block_elems, x + p0 * a.ldx, a.ldx, m, K);
      else pack_block_f32(packed.data() + b * pp.block_elems, x + p0 * a.ldx, a.ldx, m, K);
    }
  });
  const int64_t chunks = (N + kMoeChunkRows - 1) / kMoeChunkRows;
  const int64_t items = static_cast<int64_t>(experts.size()) * chunks;
  pagellm::cpu::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> wide;  // this thread's fp32 copy of one weight chunk (weights not bf16 x bf16)
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / chunks, n0 = (item % chunks) * kMoeChunkRows, n1 = std::min(N, n0 + kMoeChunkRows);
      const int32_t e = experts[i];
      const TW* we = w + e * a.expert_stride;
      const void* wk = we + n0 * K;  // row n0 of the chunk
      if constexpr (!kPairs && !std::is_same_v<TW, float>) {
        wide.resize(static_cast<size_t>((n1 - n0) * K));
        for (int64_t n = n0; n < n1; ++n) load_row_f32(we + n * K, wide.data() + (n - n0) * K, K);
        wk = wide.data();
      }
      for (int64_t b = pp.first_block[i]; b < pp.first_block[i + 1]; ++b) {
        const int64_t p0 = offsets[e] + (b - pp.first_block[i]) * kPairBlock;
        const int64_t m = std::min<int64_t>(kPairBlock, offsets[e + 1] - p0);
        const TP* xp = packed.data() + b * pp.block_elems;
        float* o = out + p0 * a.ldo;
        if constexpr (kPairs)
          moe_panel_rows(o, a.ldo, xp, static_cast<const c10::BFloat16*>(wk), K, K, m, n0, n1);
        else
          moe_panel_rows(o, a.ldo, xp, static_cast<const float*>(wk), K, K, m, n0, n1);
      }
    }
  });
}

}  // namespace pagellm::cpu
