// The bf16 decode's probabilities and value sums (decode_cpu_kernels.h's decode_softmax / decode_tile_accum take
// them for bf16 queries and cache with head_dim a multiple of 32; decode runs and tree runs call the same two, so
// verify and tree rows keep plain decode's bits). Both libraries: vdot_bf16 and bf16x32_zip are exact on AVX2.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "ops/paged_attention/attention_cpu_common.h"

namespace pagellm::cpu {

#ifdef PAGELLM_BF16_DOT
// softmax_update for the bf16 P.V below: the probabilities are vexp_lowp's rounded to bf16 (stored back as fp32
// values that bf16 holds exactly) and l adds those rounded values, so each output row is an exactly normalised
// average of the values weighted by what P.V multiplies (the prefill bf16 kernel's numerics).
inline float softmax_update_bf16(float* s, int64_t n, float& m, float& l) {
  float corr;
  const float m_new = running_max_update(s, n, m, corr);
  const VecF mv = vset1(m_new);
  c10::BFloat16* const bf16 = nullptr;  // vround's target type
  VecF sum = vzero();
  for (int64_t j = 0; j < n; j += kLanes) {
    const int c = static_cast<int>(std::min<int64_t>(kLanes, n - j));
    const VecF e = vround(vexp_lowp(vsub(vload(s + j, c), mv)), bf16);
    vstore(s + j, e, c);
    sum = vadd(sum, c == kLanes ? e : vselect_lt(vload(kLaneIndex), vset1(static_cast<float>(c)), e, vzero()));
  }
  l = l * corr + vsum(sum);
  m = m_new;
  return corr;
}

// bf16 bits of a probability softmax_update_bf16 left (exact: its low 16 bits are 0).
inline uint32_t bf16_bits_of(float p) {
  uint32_t u;
  std::memcpy(&u, &p, sizeof(u));
  return u >> 16;
}

// acc[g, d : d + 32 NZ] += sum_j p[g * ldp + j] * v_j[d : d + 32 NZ] as bf16 pair dots: two keys' value rows zipped
// (bf16x32_zip: lane k holds both keys' dim k) times the pair (p_j, p_j+1) broadcast, so one vdot_bf16 adds two
// keys' products for 16 dims (acc + p_j+1 v_j+1 + p_j v_j, in that order; an odd last key pairs with p = 0): half
// the instructions of the fp32 FMAs, and no bf16 -> fp32 conversion of value rows.
template <int GN, int NZ>
inline void decode_accum_bf16_cols(float* acc, const float* p, const c10::BFloat16* const* vp, int64_t n, int64_t D,
                                   int64_t g0, int64_t d, int64_t ldp) {
  VecF a[2 * NZ][GN];
  for (int c = 0; c < 2 * NZ; ++c)
    for (int g = 0; g < GN; ++g) a[c][g] = vload(acc + (g0 + g) * D + d + c * kLanes);
  const auto pair = [&](const c10::BFloat16* v0, const c10::BFloat16* v1, int64_t j, bool odd_last) {
    BF16x32 z[2 * NZ];
    for (int c = 0; c < NZ; ++c) bf16x32_zip(bf16x32_load(v0 + d + 32 * c), bf16x32_load(v1 + d + 32 * c), z[2 * c], z[2 * c + 1]);
    for (int g = 0; g < GN; ++g) {
      const float* pg = p + (g0 + g) * ldp + j;
      const BF16x32 pp = bf16x32_set1_pair(bf16_bits_of(pg[0]) | (odd_last ? 0u : bf16_bits_of(pg[1]) << 16));
      for (int c = 0; c < 2 * NZ; ++c) a[c][g] = vdot_bf16(a[c][g], z[c], pp);
    }
  };
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) pair(vp[j], vp[j + 1], j, false);
  if (j < n) pair(vp[j], vp[j], j, true);
  for (int c = 0; c < 2 * NZ; ++c)
    for (int g = 0; g < GN; ++g) vstore(acc + (g0 + g) * D + d + c * kLanes, a[c][g]);
}

template <int GN>
struct AccumBf16K {  // for_head_chunks' kernel: heads g0..g0+GN, D a multiple of 32 (<= 16 accumulators)
  static void run(int64_t g0, float* acc, const float* p, const c10::BFloat16* const* vp, int64_t n, int64_t D,
                  int64_t ldp) {
    constexpr int NZ = GN <= 4 ? 2 : 1;
    int64_t d = 0;
    for (; d + 32 * NZ <= D; d += 32 * NZ) decode_accum_bf16_cols<GN, NZ>(acc, p, vp, n, D, g0, d, ldp);
    for (; d < D; d += 32) decode_accum_bf16_cols<GN, 1>(acc, p, vp, n, D, g0, d, ldp);
  }
};
#endif

}  // namespace pagellm::cpu
