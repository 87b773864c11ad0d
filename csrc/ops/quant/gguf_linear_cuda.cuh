// gguf_linear on the GPU: out[M, N] = x[M, K] @ dequant(qweight)^T (+ bias), qweight in GGUF block layout
// (gguf_blocks.h). Torch-free. A simple dequantize-in-register GEMV/small GEMM: one warp per output column n,
// lanes striding over the row's K / 32 blocks of 32 elements (a k-quant super-block's 8 sub-blocks are taken by
// 8 lanes; each lane expands its 32 elements in registers and multiplies them into kRowsPerCta rows of x), then
// a warp reduction. fp32 accumulation, one rounding into T.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda_common/vec.cuh"
#include "ops/quant/gguf_blocks.h"

namespace pagellm::cuda {

constexpr int kGgufWarpsPerCta = 4;  // output columns per CTA
constexpr int kGgufRowsPerCta = 4;   // rows of x per CTA (grid.y covers M)

// fp16 field at p (2-byte aligned: see gguf_blocks.h).
__device__ __forceinline__ float gguf_half(const uint8_t* p) {
  return __half2float(__ushort_as_half(*reinterpret_cast<const unsigned short*>(p)));
}

// The two fp32 parameters of sub-block s of block `blk`: d and m (Q4_1; m unused by Q4_0 / Q8_0), or the
// k-quants' (a, b) of gguf_blocks.h.
template <int QT>
__device__ __forceinline__ void gguf_sub_params(const uint8_t* blk, int s, float& d, float& m) {
  if constexpr (QT == gguf::kQ4_K) {
    int sc, mn;
    gguf::q4k_scale_min(blk + 4, s, sc, mn);
    d = gguf_half(blk) * static_cast<float>(sc);
    m = -(gguf_half(blk + 2) * static_cast<float>(mn));
  } else if constexpr (QT == gguf::kQ6_K) {
    const float d6 = gguf_half(blk + 208);
    d = d6 * static_cast<float>(static_cast<int8_t>(blk[192 + 2 * s]));
    m = d6 * static_cast<float>(static_cast<int8_t>(blk[193 + 2 * s]));
  } else {
    d = gguf_half(blk);
    m = QT == gguf::kQ4_1 ? gguf_half(blk + 2) : 0.f;
  }
}

// Elements e and e + 16 (e < 16) of sub-block s of a block, exactly as gguf.quants dequantizes them.
template <int QT>
__device__ __forceinline__ void gguf_dequant_pair(const uint8_t* blk, int s, float d, float m, int e, float& w0,
                                                  float& w1) {
  if constexpr (QT == gguf::kQ4_K) {
    const uint8_t* qs = blk + 16 + 32 * (s / 2);
    const int shift = 4 * (s & 1);
    w0 = __fmaf_rn(d, static_cast<float>((qs[e] >> shift) & 0xF), m);  // d*q exact: one rounding, as numpy
    w1 = __fmaf_rn(d, static_cast<float>((qs[e + 16] >> shift) & 0xF), m);
  } else if constexpr (QT == gguf::kQ6_K) {
    const uint8_t* ql = blk + 64 * (s / 4) + 32 * (s % 2);
    const uint8_t* qh = blk + 128 + 32 * (s / 4);
    const int shift_l = 4 * ((s / 2) % 2), shift_h = 2 * (s % 4);
    const int q0 = ((ql[e] >> shift_l) & 0xF) | (((qh[e] >> shift_h) & 3) << 4);
    const int q1 = ((ql[e + 16] >> shift_l) & 0xF) | (((qh[e + 16] >> shift_h) & 3) << 4);
    w0 = d * static_cast<float>(q0 - 32);
    w1 = m * static_cast<float>(q1 - 32);
  } else if constexpr (QT == gguf::kQ8_0) {
    w0 = d * static_cast<float>(static_cast<int8_t>(blk[2 + e]));
    w1 = d * static_cast<float>(static_cast<int8_t>(blk[18 + e]));
  } else if constexpr (QT == gguf::kQ4_0) {
    const int q = blk[2 + e];
    w0 = d * static_cast<float>((q & 0xF) - 8);
    w1 = d * static_cast<float>((q >> 4) - 8);
  } else {
    const int q = blk[4 + e];
    w0 = __fmaf_rn(d, static_cast<float>(q & 0xF), m);
    w1 = __fmaf_rn(d, static_cast<float>(q >> 4), m);
  }
}

// grid (ceil(N / kGgufWarpsPerCta), ceil(M / kGgufRowsPerCta)), block kGgufWarpsPerCta * 32 threads.
template <typename T, int QT>
__global__ void gguf_linear_kernel(T* __restrict__ out, const T* __restrict__ x, const uint8_t* __restrict__ qweight,
                                   const T* __restrict__ bias, int64_t M, int64_t N, int64_t K, int64_t ldx,
                                   int64_t ldo, int64_t row_bytes) {
  constexpr int kBytes = gguf::block_bytes(QT), kSubs = gguf::sub_blocks(QT);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kGgufWarpsPerCta + warp;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kGgufRowsPerCta;
  if (n >= N) return;  // warp-uniform
  const uint8_t* row = qweight + n * row_bytes;
  float acc[kGgufRowsPerCta];
#pragma unroll
  for (int i = 0; i < kGgufRowsPerCta; ++i) acc[i] = 0.f;
  for (int64_t b = lane; b < K / 32; b += 32) {  // b: 32-element (sub-)block
    const uint8_t* blk = row + b / kSubs * kBytes;
    const int s = static_cast<int>(b % kSubs);
    float d, m;
    gguf_sub_params<QT>(blk, s, d, m);
#pragma unroll 4
    for (int e = 0; e < 16; ++e) {
      float w0, w1;
      gguf_dequant_pair<QT>(blk, s, d, m, e, w0, w1);
#pragma unroll
      for (int i = 0; i < kGgufRowsPerCta; ++i) {
        if (m0 + i < M) {
          const T* xb = x + (m0 + i) * ldx + b * 32;
          acc[i] = __fmaf_rn(w1, to_float(xb[e + 16]), __fmaf_rn(w0, to_float(xb[e]), acc[i]));
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kGgufRowsPerCta; ++i) {
    const float s = warp_reduce_sum(acc[i]);
    if (lane == 0 && m0 + i < M) {
      out[(m0 + i) * ldo + n] = from_float<T>(s + (bias != nullptr ? to_float(bias[n]) : 0.f));
    }
  }
}

}  // namespace pagellm::cuda
