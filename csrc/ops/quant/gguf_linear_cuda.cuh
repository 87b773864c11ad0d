// gguf_linear on the GPU: out[M, N] = x[M, K] @ dequant(qweight)^T (+ bias), qweight in GGUF block layout
// (gguf_blocks.h). Torch-free. A simple dequantize-in-register GEMV/small GEMM: one warp per output column n,
// lanes striding over the row's K / 32 blocks (each lane expands its block in registers and multiplies it
// into kRowsPerCta rows of x), then a warp reduction. fp32 accumulation, one rounding into T.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda_common/vec.cuh"
#include "ops/quant/gguf_blocks.h"

namespace pagellm::cuda {

constexpr int kGgufWarpsPerCta = 4;  // output columns per CTA
constexpr int kGgufRowsPerCta = 4;   // rows of x per CTA (grid.y covers M)

template <int QT>
struct GgufBlockBytes {
  static constexpr int value = QT == gguf::kQ8_0   ? static_cast<int>(sizeof(gguf::BlockQ8_0))
                               : QT == gguf::kQ4_0 ? static_cast<int>(sizeof(gguf::BlockQ4_0))
                                                   : static_cast<int>(sizeof(gguf::BlockQ4_1));
};

// fp16 field at p (2-byte aligned: see gguf_blocks.h).
__device__ __forceinline__ float gguf_half(const uint8_t* p) {
  return __half2float(__ushort_as_half(*reinterpret_cast<const unsigned short*>(p)));
}

// Elements e and e + 16 (e < 16) of a block, exactly as gguf.quants dequantizes them.
template <int QT>
__device__ __forceinline__ void gguf_dequant_pair(const uint8_t* blk, float d, float m, int e, float& w0, float& w1) {
  if constexpr (QT == gguf::kQ8_0) {
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
  constexpr int kBytes = GgufBlockBytes<QT>::value;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kGgufWarpsPerCta + warp;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kGgufRowsPerCta;
  if (n >= N) return;  // warp-uniform
  const uint8_t* row = qweight + n * row_bytes;
  float acc[kGgufRowsPerCta];
#pragma unroll
  for (int i = 0; i < kGgufRowsPerCta; ++i) acc[i] = 0.f;
  for (int64_t b = lane; b < K / 32; b += 32) {
    const uint8_t* blk = row + b * kBytes;
    const float d = gguf_half(blk);
    const float m = QT == gguf::kQ4_1 ? gguf_half(blk + 2) : 0.f;
#pragma unroll 4
    for (int e = 0; e < 16; ++e) {
      float w0, w1;
      gguf_dequant_pair<QT>(blk, d, m, e, w0, w1);
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
