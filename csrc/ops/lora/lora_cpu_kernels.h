// lora_apply on the CPU (Punica-style shrink then expand, tokens grouped by adapter slot):
//   shrink: tmp[t, r] = lora_a[s_t, r, :] . x[t, :]          (fp32, work items (token, rank row))
//   expand: y[t, n] += scale[s_t] * lora_b[s_t, n, :] . tmp[t, :]  (work items (token, block of 64 outputs))
// Tokens are visited in slot order so that consecutive work items read the same adapter's rows.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops/common/cpu_vec.h"
#include "ops/common/parallel.h"

namespace pagellm::cpu {

// sum_i a[i] * b[i] in fp32, a in the model dtype, b in fp32 or the model dtype.
template <typename A, typename B>
inline float lora_dot(const A* a, const B* b, int64_t len) {
  VecF acc = vzero();
  int64_t i = 0;
  for (; i + kLanes <= len; i += kLanes) acc = vfma(vload(a + i), vload(b + i), acc);
  if (i < len) {
    const int n = static_cast<int>(len - i);
    acc = vfma(vload(a + i, n), vload(b + i, n), acc);
  }
  return vsum(acc);
}

// Token indices with a slot >= 0, stably sorted by slot (the gather-by-adapter order).
inline std::vector<int64_t> lora_tokens_by_slot(const int32_t* token_slots, int64_t T, int64_t S) {
  std::vector<int64_t> counts(S + 1, 0);
  for (int64_t t = 0; t < T; ++t)
    if (token_slots[t] >= 0) ++counts[token_slots[t] + 1];
  for (int64_t s = 0; s < S; ++s) counts[s + 1] += counts[s];
  std::vector<int64_t> order(counts[S]);
  for (int64_t t = 0; t < T; ++t)
    if (token_slots[t] >= 0) order[counts[token_slots[t]]++] = t;
  return order;
}

// y [T, N] (row stride y_stride), x [T, K] (row stride x_stride), lora_a [S, R, K], lora_b [S, N, R] contiguous,
// scales [S], token_slots [T] with values already checked to be in [-1, S).
template <typename T_>
void lora_apply_kernel(T_* y, const T_* x, const T_* lora_a, const T_* lora_b, const float* scales,
                       const int32_t* token_slots, int64_t T, int64_t K, int64_t N, int64_t S, int64_t R,
                       int64_t y_stride, int64_t x_stride) {
  const std::vector<int64_t> order = lora_tokens_by_slot(token_slots, T, S);
  const int64_t M = static_cast<int64_t>(order.size());
  if (M == 0 || R == 0) return;
  std::vector<float> tmp(M * R);  // row i: the shrunk x of token order[i]
  parallel_for(0, M * R, std::max<int64_t>(1, 4096 / std::max<int64_t>(K, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t i = w / R, r = w % R, t = order[i];
      tmp[w] = lora_dot(lora_a + (token_slots[t] * R + r) * K, x + t * x_stride, K);
    }
  });
  constexpr int64_t kBlockN = 64;
  const int64_t num_blocks = (N + kBlockN - 1) / kBlockN;
  parallel_for(0, M * num_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t i = w / num_blocks, n0 = (w % num_blocks) * kBlockN, t = order[i];
      const int64_t s = token_slots[t];
      const T_* b = lora_b + s * N * R;
      T_* yt = y + t * y_stride;
      for (int64_t n = n0; n < std::min(N, n0 + kBlockN); ++n) {
        const float term = scales[s] * lora_dot(b + n * R, tmp.data() + i * R, R);
        yt[n] = static_cast<T_>(static_cast<float>(yt[n]) + term);
      }
    }
  });
}

}  // namespace pagellm::cpu
