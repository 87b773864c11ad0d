// Row-wise argmax over logits for greedy sampling: torch.argmax's answer exactly (the first index of the
// maximum; a NaN counts as the maximum, so the first NaN wins), whatever the dtype.
//
// One pass per row: 4 x 16 lanes each keep (largest value seen, index where it first appeared), updated on a
// strict "greater than", so a lane keeps its first maximum; the 64 candidates are merged by value, then
// lowest index. Rows are independent work items on pagellm's pool, so a row's token never depends on the
// other rows (and no OpenMP region is opened: torch's amax / argmax waited milliseconds for a preempted
// OpenMP worker on a loaded machine). Values are compared as fp32, an exact widening of bf16 / fp16.
// NaN: x * 0 is NaN only for NaN / +-inf, so one sum flags rows that may hold a NaN; only those are scanned
// again, one element at a time, for their first NaN.
#pragma once

#include <cmath>
#include <cstdint>

#include "ops/common/cpu_vec.h"
#include "ops/common/parallel.h"

namespace pagellm::cpu {

// Lanes' running (value, index) pairs are indices held as fp32: exact below 2^24, which the glue checks.
constexpr int64_t kArgmaxMaxCols = int64_t{1} << 24;

template <typename T>
int64_t argmax_row(const T* x, int64_t v) {
  constexpr int kAcc = 4;
  constexpr int64_t kStep = kAcc * kLanes;
  int64_t best = 0;
  float best_val = static_cast<float>(x[0]);
  int64_t i = 0;
  bool maybe_nan = std::isnan(best_val);
  if (v >= kStep) {
    VecF val[kAcc], idx[kAcc];
    VecF lane = vzero();
    {
      alignas(64) float iota[kLanes];
      for (int l = 0; l < kLanes; ++l) iota[l] = static_cast<float>(l);
      lane = vload(iota);
    }
    VecF nan_probe = vzero();
    const VecF zero = vzero();
    for (int a = 0; a < kAcc; ++a) {
      val[a] = vload(x + a * kLanes);
      idx[a] = vadd(lane, vset1(static_cast<float>(a * kLanes)));
      nan_probe = vfma(val[a], zero, nan_probe);
    }
    const VecF step = vset1(static_cast<float>(kStep));
    VecF base = lane;
    for (i = kStep; i + kStep <= v; i += kStep) {
      base = vadd(base, step);
      for (int a = 0; a < kAcc; ++a) {
        const VecF xv = vload(x + i + a * kLanes);
        const VecF at = vadd(base, vset1(static_cast<float>(a * kLanes)));
        idx[a] = vselect_lt(val[a], xv, at, idx[a]);  // strictly greater: the lane keeps its first maximum
        val[a] = vselect_lt(val[a], xv, xv, val[a]);
        nan_probe = vfma(xv, zero, nan_probe);
      }
    }
    alignas(64) float vals[kAcc][kLanes], idxs[kAcc][kLanes], probe[kLanes];
    for (int a = 0; a < kAcc; ++a) {
      vstore(vals[a], val[a]);
      vstore(idxs[a], idx[a]);
    }
    vstore(probe, nan_probe);
    best_val = vals[0][0];
    best = static_cast<int64_t>(idxs[0][0]);
    for (int a = 0; a < kAcc; ++a) {
      for (int l = 0; l < kLanes; ++l) {
        const int64_t j = static_cast<int64_t>(idxs[a][l]);
        if (vals[a][l] > best_val || (vals[a][l] == best_val && j < best)) {
          best_val = vals[a][l];
          best = j;
        }
      }
    }
    for (int l = 0; l < kLanes; ++l) maybe_nan |= std::isnan(probe[l]);
  } else {
    i = 1;
  }
  for (; i < v; ++i) {  // the tail (or a short row)
    const float xi = static_cast<float>(x[i]);
    maybe_nan |= std::isnan(xi);
    if (xi > best_val) {
      best_val = xi;
      best = i;
    }
  }
  if (maybe_nan) {
    for (int64_t j = 0; j < v; ++j) {
      if (std::isnan(static_cast<float>(x[j]))) return j;
    }
  }
  return best;
}

// out[r] = argmax of x[r * row_stride : r * row_stride + v], r < n.
template <typename T>
void argmax_rows_kernel(int64_t* out, const T* x, int64_t n, int64_t v, int64_t row_stride) {
  // ~v elements per row: whole rows per chunk, about 64k elements each (a short call stays on one thread).
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(v, 1));
  pagellm::cpu::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) out[r] = argmax_row(x + r * row_stride, v);
  });
}

}  // namespace pagellm::cpu
