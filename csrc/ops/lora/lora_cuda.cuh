// lora_apply on the GPU, Punica's BGMV form (each token reads its own adapter slot's rows; the tokens of one
// adapter share them through L2), in two kernels:
//   shrink: tmp[t, r] = lora_a[s_t, r, :] . x[t, :]            one warp per (token, rank row), fp32
//   expand: y[t, n] += scale[s_t] * lora_b[s_t, n, :] . tmp[t, :]  one thread per (token, output)
// Tokens with slot -1 (or out of range: the Python wrapper refuses those) are skipped. Torch-free.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda_common/vec.cuh"

namespace pagellm::cuda {

constexpr int kLoraWarpsPerBlock = 8;
constexpr int kLoraExpandThreads = 256;

// grid (T, ceil(R / kLoraWarpsPerBlock)), block 32 * kLoraWarpsPerBlock.
template <typename T>
__global__ void lora_shrink_kernel(float* __restrict__ tmp, const T* __restrict__ x, const T* __restrict__ lora_a,
                                   const int32_t* __restrict__ token_slots, int64_t K, int64_t S, int64_t R,
                                   int64_t x_stride) {
  const int64_t t = blockIdx.x;
  const int64_t r = static_cast<int64_t>(blockIdx.y) * kLoraWarpsPerBlock + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  const int32_t s = token_slots[t];
  if (s < 0 || s >= S || r >= R) return;
  const T* a = lora_a + (static_cast<int64_t>(s) * R + r) * K;
  const T* xt = x + t * x_stride;
  float acc = 0.f;
  for (int64_t k = lane; k < K; k += 32) acc += to_float(a[k]) * to_float(xt[k]);
  acc = warp_reduce_sum(acc);
  if (lane == 0) tmp[t * R + r] = acc;
}

// grid (T, ceil(N / kLoraExpandThreads)), block kLoraExpandThreads.
template <typename T>
__global__ void lora_expand_kernel(T* __restrict__ y, const float* __restrict__ tmp, const T* __restrict__ lora_b,
                                   const float* __restrict__ scales, const int32_t* __restrict__ token_slots,
                                   int64_t N, int64_t S, int64_t R, int64_t y_stride) {
  const int64_t t = blockIdx.x;
  const int64_t n = static_cast<int64_t>(blockIdx.y) * kLoraExpandThreads + threadIdx.x;
  const int32_t s = token_slots[t];
  if (s < 0 || s >= S || n >= N) return;
  const T* b = lora_b + (static_cast<int64_t>(s) * N + n) * R;
  const float* tt = tmp + t * R;
  float acc = 0.f;
  for (int64_t r = 0; r < R; ++r) acc += to_float(b[r]) * tt[r];
  T* out = y + t * y_stride + n;
  *out = from_float<T>(to_float(*out) + scales[s] * acc);
}

}  // namespace pagellm::cuda
