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
#include <limits>
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
// Whether linear_argmax fuses M rows (else linear_small_m's logits, then argmax_rows). Not at 5-8 bf16 rows on AVX-512
// (few_rows_wide): there the fused op took 1.04-1.14x the two ops' time (one thread, in one process, session 18; the
// cause not found), where at 2-4 and 9-16 rows it took 0.93-0.99x.
inline bool argmax_fuses_rows(bool bf16, int64_t M) {
  if (M > kArgmaxMaxRows) return false;
#ifdef PAGELLM_GEMM_QUAD
  if (bf16 && M >= 5 && M <= 8) return false;
#else
  (void)bf16;
#endif
  return true;
}

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
    few_rows_range(out, x, xq, w, bias, a, 0, a.N);
    return;
  }
#endif
  (void)xq;
  constexpr int64_t NR = 4;
  int64_t n0 = 0;
  for (; n0 + NR <= a.N; n0 += NR) linear_ntile<NR>(out, x, w, bias, a, n0);
  if (n0 < a.N) linear_weight_rows(out, x, w, bias, a, n0, a.N);
}

// One logits row's running argmax over the blocks of a chunk, taken in increasing index order: 16 lanes keep the
// (value, index) of their first maximum (a strictly greater value replaces it), a block that may hold a NaN (its
// probe; an infinity trips it too) is scanned for its first NaN, and a block too short for a vector goes through
// `scalar`. argmax_row's pass without its per-call merge of 64 lanes: with one call per 240 logits that merge and
// the scalar tail cost 9-28 % of a verify step's LM head (session 18); here each row merges its lanes once a chunk.
struct RowArgmax {
  VecF val, idx;
  bool started = false;
  ArgmaxCandidate scalar;  // short blocks and NaNs

  template <typename T>
  void update(const T* x, int64_t nb, int64_t n0) {
    if (scalar.nan) return;  // the chunk's first NaN is found: nothing later can win
    int64_t i = 0;
    if (!started && nb >= kLanes) {
      val = vload(x);
      idx = vadd(iota(), vset1(static_cast<float>(n0)));
      started = true;
      i = kLanes;
    }
    VecF probe = vfma(val, vzero(), vzero());
    if (started) {
      const VecF zero = vzero();
      for (; i + kLanes <= nb; i += kLanes) {
        const VecF xv = vload(x + i);
        const VecF at = vadd(iota(), vset1(static_cast<float>(n0 + i)));
        idx = vselect_lt(val, xv, at, idx);
        val = vselect_lt(val, xv, xv, val);
        probe = vfma(xv, zero, probe);
      }
    }
    for (; i < nb; ++i) {  // a block's last partial vector, or a whole short block
      const float v = static_cast<float>(x[i]);
      const ArgmaxCandidate c{v, n0 + i, std::isnan(v)};
      if (argmax_better(c, scalar)) scalar = c;
    }
    if (!std::isnan(vsum(probe))) return;  // no NaN (nor an infinity: inf x 0) in the vectors
    for (int64_t j = 0; j < nb; ++j)
      if (std::isnan(static_cast<float>(x[j]))) {
        scalar = {std::numeric_limits<float>::quiet_NaN(), n0 + j, true};
        return;
      }
  }

  // The chunk's best over the lanes and `scalar`, in torch.argmax's order.
  ArgmaxCandidate best() const {
    ArgmaxCandidate b = scalar;
    if (!started || b.nan) return b;
    alignas(64) float vals[kLanes], idxs[kLanes];
    vstore(vals, val);
    vstore(idxs, idx);
    for (int l = 0; l < kLanes; ++l) {
      const ArgmaxCandidate c{vals[l], static_cast<int64_t>(idxs[l]), false};
      if (argmax_better(c, b)) b = c;
    }
    return b;
  }

  static VecF iota() {
    alignas(64) static const float lanes[kLanes] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    return vload(lanes);
  }
};

// out[m] = argmax of x[m]'s rounded logits for 2 <= M <= kArgmaxMaxRows rows (a verify step's LM head): the weight
// streams once, as in linear_small_m at these M (the few-row schedule's blocks, or 4-row tiles), each chunk's logits
// [M, 240] kept in an L1 block and folded into each row's running argmax (RowArgmax), the rows' chunk candidates
// merged under a lock in torch.argmax's order (as linear_argmax_row): the [M, N] logits are never stored.
template <typename T>
void linear_argmax_rows(int64_t* out, const T* x, const T* w, const T* bias, const LinearArgs& a) {
  const T* xq = nullptr;
  int64_t unit = 4;  // weight rows per unit of work: linear_rows_block's tiles
#ifdef PAGELLM_GEMM_QUAD
  if constexpr (std::is_same_v<T, c10::BFloat16>) {  // the caller packs x once; the pool's workers read it
    if (few_rows_packs_x(a)) {
      c10::BFloat16* packed = quad_scratch<struct ArgmaxRowsScratch>((a.M + 3) / 4 * quad_stride(a.K));
      few_rows_pack(packed, x, a);
      xq = packed;
    }
    unit = kFewRowsNBlock;
  }
#endif
  const int64_t units = (a.N + unit - 1) / unit;
  const int64_t grain = std::max<int64_t>(1, (256 << 10) / std::max<int64_t>(unit * a.K * int64_t{sizeof(T)}, 1));
  ArgmaxCandidate best[kArgmaxMaxRows];
  std::mutex merge;
  pagellm::cpu::parallel_for(0, units, grain, [&](int64_t begin, int64_t end) {
    alignas(64) T block[kArgmaxMaxRows * kArgmaxRowsBlock];
    RowArgmax rows[kArgmaxMaxRows];
    const int64_t n_end = std::min(a.N, end * unit);
    for (int64_t n0 = begin * unit; n0 < n_end; n0 += kArgmaxRowsBlock) {
      LinearArgs ba = a;  // weight rows [n0, n0 + ba.N) into block [M, kArgmaxRowsBlock]
      ba.N = std::min(kArgmaxRowsBlock, n_end - n0);
      ba.ldo = kArgmaxRowsBlock;
      linear_rows_logits(block, x, xq, w + n0 * a.ldw, bias ? bias + n0 : nullptr, ba);
      for (int64_t m = 0; m < a.M; ++m) rows[m].update(block + m * kArgmaxRowsBlock, ba.N, n0);
    }
    std::lock_guard<std::mutex> lock(merge);
    for (int64_t m = 0; m < a.M; ++m) {
      const ArgmaxCandidate c = rows[m].best();
      if (argmax_better(c, best[m])) best[m] = c;
    }
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
