// The LM head of a plain-greedy decode row with its argmax fused in: out[m] = argmax_n of
// T(x[m] . w[n] + bias[n]), exactly argmax_rows(linear_small_m(x, w, bias)) (each logit rounded to the model
// dtype as linear_small_m stores it, compared as fp32; ties and NaNs as torch.argmax: the lowest index of the
// maximum, the first NaN winning).
//
// Why: a greedy row needs one token id, not [1, V] logits: the fused op never writes the logits, never reads
// them back for a second pass, and the engine skips the sampler's call for the row. The weight stream is
// linear_small_m's (the same 4-row tiles, the same per-element bits), so the head's time is the same bytes.
// Each chunk of weight tiles keeps its own best (value, index) per row, merged under a lock at the chunk's end:
// the merge's order is a total order on (value, index), so the answer never depends on how chunks were cut
// or which thread ran them.
#pragma once

#include <cmath>
#include <cstdint>
#include <mutex>
#include <vector>

#include "ops/linear/linear_cpu_kernels.h"

namespace pagellm::cpu {

struct ArgmaxCandidate {
  float value = 0.0f;
  int64_t index = -1;  // -1: none yet
  bool nan = false;
};

// torch.argmax's order: a NaN beats any number (the first NaN wins), then the larger value, then the lower index.
inline bool argmax_better(const ArgmaxCandidate& a, const ArgmaxCandidate& b) {
  if (b.index < 0) return a.index >= 0;
  if (a.index < 0) return false;
  if (a.nan != b.nan) return a.nan;
  if (a.nan || a.value == b.value) return a.index < b.index;
  return a.value > b.value;
}

// Rows [m0, m0 + mb) (mb <= kLinearMBlock) of x against every weight row; best[m] merged into for each row.
template <typename T>
void linear_argmax_block(ArgmaxCandidate* best, const T* x, const T* w, const T* bias, const LinearArgs& a) {
  constexpr int64_t NR = 4;
  const int64_t tiles = (a.N + NR - 1) / NR;
  const int64_t tile_bytes = NR * a.K * static_cast<int64_t>(sizeof(T));
  const int64_t grain = std::max<int64_t>(1, (256 << 10) / std::max<int64_t>(tile_bytes, 1));  // linear_rows_block's
  std::mutex merge;
  pagellm::cpu::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    ArgmaxCandidate local[kLinearMBlock];
    T tile_out[kLinearMBlock * NR];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * NR, nr = std::min<int64_t>(NR, a.N - n0);
      // The tile's outputs land in tile_out [M, NR] (ldo NR): the weight and bias pointers start at row n0.
      LinearArgs ta = a;
      ta.N = nr;
      ta.ldo = NR;
      const T* wt = w + n0 * a.ldw;
      const T* bt = bias ? bias + n0 : nullptr;
      if (nr == NR) {
        linear_ntile<NR>(tile_out, x, wt, bt, ta, 0);
      } else {
        for (int64_t n = 0; n < nr; ++n) linear_ntile<1>(tile_out, x, wt, bt, ta, n);
      }
      for (int64_t m = 0; m < a.M; ++m) {
        for (int64_t j = 0; j < nr; ++j) {  // in index order: a later equal value never replaces an earlier one
          const float v = static_cast<float>(tile_out[m * NR + j]);
          const ArgmaxCandidate c{v, n0 + j, std::isnan(v)};
          if (argmax_better(c, local[m])) local[m] = c;
        }
      }
    }
    std::lock_guard<std::mutex> lock(merge);
    for (int64_t m = 0; m < a.M; ++m) {
      if (argmax_better(local[m], best[m])) best[m] = local[m];
    }
  });
}

// out[m] = argmax over N of the rounded logits of row m, for every row m < M.
template <typename T>
void linear_argmax_kernel(int64_t* out, const T* x, const T* w, const T* bias, const LinearArgs& a) {
  std::vector<ArgmaxCandidate> best(static_cast<size_t>(kLinearMBlock));
  for (int64_t m0 = 0; m0 < a.M; m0 += kLinearMBlock) {
    LinearArgs b = a;
    b.M = std::min(kLinearMBlock, a.M - m0);
    std::fill(best.begin(), best.end(), ArgmaxCandidate{});
    linear_argmax_block(best.data(), x + m0 * a.ldx, w, bias, b);
    for (int64_t m = 0; m < b.M; ++m) out[m0 + m] = best[m].index;
  }
}

}  // namespace pagellm::cpu
