// awq_linear on the GPU: out[M, N] = x[M, K] @ W^T (+ bias), W the 4-bit group-quantized weight of awq_layout.h.
// Torch-free. Two kernels:
//   awq_gemv_kernel: small M (decode). One warp per output column n; each lane takes whole 32-weight blocks
//     (one 16-byte load: a warp reads 512 contiguous bytes of the row), expands them in registers exactly,
//     (q - z) * s, and multiplies them into kAwqRowsPerCta rows of x; then a warp reduction. fp32
//     accumulation, one rounding into T.
//   awq_dequantize_kernel: large M (prefill). Rows of W expanded into T, one byte (two weights) per thread,
//     for the glue's cuBLAS GEMM.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda_common/vec.cuh"
#include "ops/quant/awq_layout.h"

namespace pagellm::cuda {

constexpr int kAwqWarpsPerCta = 4;  // output columns per CTA
constexpr int kAwqRowsPerCta = 4;   // rows of x per CTA (grid.y covers M)
constexpr int kAwqDequantThreads = 256;

// grid (ceil(N / kAwqWarpsPerCta), ceil(M / kAwqRowsPerCta)), block kAwqWarpsPerCta * 32 threads.
// qweight 16-byte aligned (every row is: K / 2 is a multiple of 16).
template <typename T>
__global__ void awq_gemv_kernel(T* __restrict__ out, const T* __restrict__ x, const uint8_t* __restrict__ qweight,
                                const float* __restrict__ scales, const uint8_t* __restrict__ zeros,
                                const T* __restrict__ bias, int64_t M, int64_t N, int64_t K, int64_t group_size,
                                int64_t ldx, int64_t ldo) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kAwqWarpsPerCta + warp;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kAwqRowsPerCta;
  if (n >= N) return;  // warp-uniform
  const int64_t num_groups = K / group_size, blocks_per_group = group_size / awq::kBlockElems;
  const uint4* row = reinterpret_cast<const uint4*>(qweight + n * (K / 2));
  float acc[kAwqRowsPerCta];
#pragma unroll
  for (int i = 0; i < kAwqRowsPerCta; ++i) acc[i] = 0.f;
  for (int64_t b = lane; b < K / awq::kBlockElems; b += 32) {
    const int64_t g = b / blocks_per_group;
    const float s = scales[n * num_groups + g];
    const int z = zeros[n * num_groups + g];
    const uint4 packed = row[b];
    const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
    for (int e = 0; e < awq::kBlockBytes; ++e) {
      const int byte = (words[e >> 2] >> (8 * (e & 3))) & 0xFF;  // byte e of the block (little-endian words)
      const float w0 = static_cast<float>((byte & 0xF) - z) * s, w1 = static_cast<float>((byte >> 4) - z) * s;
#pragma unroll
      for (int i = 0; i < kAwqRowsPerCta; ++i) {
        if (m0 + i < M) {
          const T* xb = x + (m0 + i) * ldx + b * awq::kBlockElems;
          acc[i] = __fmaf_rn(w1, to_float(xb[e + 16]), __fmaf_rn(w0, to_float(xb[e]), acc[i]));
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kAwqRowsPerCta; ++i) {
    const float sum = warp_reduce_sum(acc[i]);
    if (lane == 0 && m0 + i < M) {
      out[(m0 + i) * ldo + n] = from_float<T>(sum + (bias != nullptr ? to_float(bias[n]) : 0.f));
    }
  }
}

// dst[r, k] (row stride ldd) = W[r, k] rounded to T, for r < rows; one thread per qweight byte.
template <typename T>
__global__ void awq_dequantize_kernel(T* __restrict__ dst, const uint8_t* __restrict__ qweight,
                                      const float* __restrict__ scales, const uint8_t* __restrict__ zeros,
                                      int64_t rows, int64_t K, int64_t group_size, int64_t ldd) {
  const int64_t row_bytes = K / 2;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= rows * row_bytes) return;
  const int64_t r = t / row_bytes, j = t % row_bytes;
  const int64_t k0 = j / awq::kBlockBytes * awq::kBlockElems + j % awq::kBlockBytes;  // k1 = k0 + 16: same group
  const int64_t idx = r * (K / group_size) + k0 / group_size;
  const float s = scales[idx];
  const int z = zeros[idx];
  const int byte = qweight[t];
  dst[r * ldd + k0] = from_float<T>(static_cast<float>((byte & 0xF) - z) * s);
  dst[r * ldd + k0 + 16] = from_float<T>(static_cast<float>((byte >> 4) - z) * s);
}

}  // namespace pagellm::cuda
