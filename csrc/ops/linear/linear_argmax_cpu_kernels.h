// The LM head of a plain-greedy decode row with its argmax fused in: out[m] = argmax_n of
// T(x[m] . w[n] + bias[n]), exactly argmax_rows(linear_small_m(x, w, bias)) (each logit rounded to the model
// dtype as linear_small_m stores it, compared as fp32; ties and NaNs as torch.argmax: the lowest index of the
// maximum, the first NaN winning).
//
// Why: a greedy row needs one token id, not [1, V] logits: the fused op keeps them in L1 blocks of 1024 and never
// stores the row, and the engine skips the sampler's call for the row. The weight stream is
// linear_small_m's at one row (the same chunks of 4-row tiles, each row read start to end, the same per-logit
// bits), so the head's time is the same bytes.
// Each chunk of weight tiles keeps its own best (value, index), merged under a lock at the chunk's end: the
// merge's order is a total order on (value, index), so the answer never depends on how chunks were cut or which
// thread ran them. 2-16 rows (a speculative verify step's head, session 18) stream the weight once as linear_small_m
// does at those M (linear_argmax_rows): each chunk's [M, 240] logits in an L1 block, per-row candidates merged the same
// way. More rows share the weight stream in linear_small_m's many-row schedules, whose logits then take one
// argmax_rows pass (linear_cpu.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <mutex>

#include "ops/linear/linear_cpu_few_rows.h"
#include "ops/linear/linear_cpu_kernels.h"
#include "ops/sampling/argmax_cpu_kernels.h"

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

// One row x [1, K] against every weight row: best = the argmax candidate of the N rounded logits. Each chunk
// computes its tiles' logits into an L1 block of kArgmaxBlockTiles tiles exactly as linear_rows_block writes them
// (one weight row after another), then takes the block's argmax with argmax_rows' vector pass: per-logit compares
// inside the tile loop cost ~15 % of the stream on one thread, a vector pass per 1024 logits (~1 MB of weight at
// K = 576) a few hundred cycles.
template <typename T>
void linear_argmax_row(ArgmaxCandidate& best, const T* x, const T* w, const T* bias, const LinearArgs& a) {
  constexpr int64_t NR = 4, kArgmaxBlockTiles = 256;
  const int64_t tiles = (a.N + NR - 1) / NR;
  const int64_t tile_bytes = NR * a.K * static_cast<int64_t>(sizeof(T));
  const int64_t grain = std::max<int64_t>(1, (256 << 10) / std::max<int64_t>(tile_bytes, 1));  // linear_rows_block's
  std::mutex merge;
  pagellm::cpu::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    alignas(64) T block[kArgmaxBlockTiles * NR];
    ArgmaxCandidate local;
    for (int64_t t0 = begin; t0 < end; t0 += kArgmaxBlockTiles) {
      const int64_t t1 = std::min(end, t0 + kArgmaxBlockTiles);
      const int64_t n_begin = t0 * NR, n_end = std::min(a.N, t1 * NR);
      // the block's weight rows and bias from row n_begin, outputs into block[0, n_end - n_begin)
      LinearArgs ba = a;
      ba.N = n_end - n_begin;
      const T* wb = w + n_begin * a.ldw;
      const T* bb = bias ? bias + n_begin : nullptr;
      linear_weight_rows(block, x, wb, bb, ba, 0, ba.N);  // linear_rows_block's one-row stream
      const int64_t i = argmax_row(block, ba.N);
      const float v = static_cast<float>(block[i]);
      const ArgmaxCandidate c{v, n_begin + i, std::isnan(v)};
      if (argmax_better(c, local)) local = c;
    }
    std::lock_guard<std::mutex> lock(merge);
    if (argmax_better(local, best)) best = local;
  });
}

// Rows of x the fused multi-row path takes (a speculative verify step's 1 + k rows); more rows store their logits.
constexpr int64_t kArgmaxMaxRows = 16;
// Weight rows per L1 block of logits: a multiple of the few-row schedule's blocks (24) and of the 4-row tiles; 16
// rows x 240 fp32 logits = 15 KiB.
constexpr int64_t kArgmaxRowsBlock = 240;

// The logits of x's M rows against weight rows [0, a.N) of w (bias: their N values), into out with stride a.ldo,
// exactly as linear_small_m writes them: the few-row schedule for bf16 (AVX-512, xq: x packed in quads), else the
// weight-streaming tiles (linear_rows_block's body; every schedule gives each element the one-row kernel's bits).
template <typename T>
inline void linear_rows_logits(T* out, const T* x, const T* xq, const T* w, const T* bias, const LinearArgs& a) {
#ifdef PAGELLM_GEMM_QUAD
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    few_rows_range(out, xq, w, bias, a, 0, a.N);
    return;
  }
#endif
  (void)xq;
  constexpr int64_t NR = 4;
  int64_t n0 = 0;
  for (; n0 + NR <= a.N; n0 += NR) linear_ntile<NR>(out, x, w, bias, a, n0);
  if (n0 < a.N) linear_weight_rows(out, x, w, bias, a, n0, a.N);
}

// out[m] = argmax of x[m]'s rounded logits for 2 <= M <= kArgmaxMaxRows rows (a verify step's LM head): the weight
// streams once, as in linear_small_m at these M (the few-row schedule's blocks, or 4-row tiles), each chunk's logits
// [M, 240] kept in an L1 block, each block row's argmax by argmax_rows' vector pass, the rows' candidates merged
// under a lock in torch.argmax's order (as linear_argmax_row): the [M, N] logits are never stored.
template <typename T>
void linear_argmax_rows(int64_t* out, const T* x, const T* w, const T* bias, const LinearArgs& a) {
  const T* xq = nullptr;
  int64_t unit = 4;  // weight rows per unit of work: linear_rows_block's tiles
#ifdef PAGELLM_GEMM_QUAD
  if constexpr (std::is_same_v<T, c10::BFloat16>) {  // the caller packs x once; the pool's workers read it
    c10::BFloat16* packed = quad_scratch<struct ArgmaxRowsScratch>((a.M + 3) / 4 * quad_stride(a.K));
    few_rows_pack(packed, x, a);
    xq = packed;
    unit = kFewRowsNBlock;
  }
#endif
  const int64_t units = (a.N + unit - 1) / unit;
  const int64_t grain = std::max<int64_t>(1, (256 << 10) / std::max<int64_t>(unit * a.K * int64_t{sizeof(T)}, 1));
  ArgmaxCandidate best[kArgmaxMaxRows];
  std::mutex merge;
  pagellm::cpu::parallel_for(0, units, grain, [&](int64_t begin, int64_t end) {
    alignas(64) T block[kArgmaxMaxRows * kArgmaxRowsBlock];
    ArgmaxCandidate local[kArgmaxMaxRows];
    const int64_t n_end = std::min(a.N, end * unit);
    for (int64_t n0 = begin * unit; n0 < n_end; n0 += kArgmaxRowsBlock) {
      LinearArgs ba = a;  // weight rows [n0, n0 + ba.N) into block [M, kArgmaxRowsBlock]
      ba.N = std::min(kArgmaxRowsBlock, n_end - n0);
      ba.ldo = kArgmaxRowsBlock;
      linear_rows_logits(block, x, xq, w + n0 * a.ldw, bias ? bias + n0 : nullptr, ba);
      for (int64_t m = 0; m < a.M; ++m) {
        const T* row = block + m * kArgmaxRowsBlock;
        const int64_t i = argmax_row(row, ba.N);
        const float v = static_cast<float>(row[i]);
        const ArgmaxCandidate c{v, n0 + i, std::isnan(v)};
        if (argmax_better(c, local[m])) local[m] = c;
      }
    }
    std::lock_guard<std::mutex> lock(merge);
    for (int64_t m = 0; m < a.M; ++m)
      if (argmax_better(local[m], best[m])) best[m] = local[m];
  });
  for (int64_t m = 0; m < a.M; ++m) out[m] = best[m].index;
}

// out[m] = the index of the maximum of x[m]'s rounded logits, M <= kArgmaxMaxRows (the glue sends more rows through
// linear_small_m's many-row schedules and argmax_rows).
template <typename T>
void linear_argmax_kernel(int64_t* out, const T* x, const T* w, const T* bias, const LinearArgs& a) {
  if (a.M > 1) {
    linear_argmax_rows(out, x, w, bias, a);
    return;
  }
  ArgmaxCandidate best;
  linear_argmax_row(best, x, w, bias, a);
  out[0] = best.index;
}

}  // namespace pagellm::cpu
