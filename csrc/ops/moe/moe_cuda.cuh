// fused_moe on the GPU, torch-free. A simple, correct design with no host synchronisation (so a step can be
// captured in a CUDA graph):
//   moe_route_kernel       - one CTA: counts per expert, prefix sum, then each thread places its expert's
//                            pairs in token order (stable, deterministic); O(E * P) reads, fine for decode;
//   moe_expert_gemv_kernel - grid (row tiles, E): a CTA serves expert blockIdx.y (or exits when it has no pairs),
//                            one warp per weight row, kMoeRowsPerPass pairs per pass, fp32 results. Used for
//                            gate_up (x = hidden rows via pair_token) and the down projection (x = act rows);
//   moe_act_kernel         - act(gate) * up in fp32;
//   moe_combine_kernel     - out[t] = sum_j weights[t, j] * expert_out[position of (t, j)] in slot order, one rounding.
// Large batches re-read each weight row once per kMoeRowsPerPass pairs (from L2); a grouped tensor-core GEMM for
// prefill is left to a later change.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda_common/vec.cuh"
#include "ops/moe/moe_activation.h"

namespace pagellm::cuda {

constexpr int kMoeRouteThreads = 1024;
constexpr int kMoeWarpsPerCta = 4;   // weight rows per CTA
constexpr int kMoeRowsPerPass = 4;   // pairs per pass over a weight row
constexpr int kMoeElementwiseThreads = 256;

// One CTA of kMoeRouteThreads threads; ids [num_pairs] (t * k + j order).
__global__ void moe_route_kernel(const int32_t* __restrict__ ids, int32_t num_pairs, int32_t k, int32_t E,
                                 int32_t* __restrict__ offsets, int32_t* __restrict__ pair_token,
                                 int32_t* __restrict__ pair_position) {
  for (int32_t e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t count = 0;
    for (int32_t i = 0; i < num_pairs; ++i) count += ids[i] == e;
    offsets[e + 1] = count;
  }
  for (int32_t i = threadIdx.x; i < num_pairs; i += blockDim.x)
    if (ids[i] < 0 || ids[i] >= E) pair_position[i] = -1;
  __syncthreads();
  if (threadIdx.x == 0) {
    offsets[0] = 0;
    for (int32_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  }
  __syncthreads();
  for (int32_t e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t p = offsets[e];
    for (int32_t i = 0; i < num_pairs; ++i) {
      if (ids[i] == e) {
        pair_token[p] = i / k;
        pair_position[i] = p++;
      }
    }
  }
}

// For expert e = blockIdx.y and its pairs p in [offsets[e], offsets[e + 1]):
//   out[p * ldo + n] = sum_c x[row(p) * ldx + c] * w[e * N * K + n * K + c],  row(p) = x_token ? x_token[p] : p.
// grid (ceil(N / kMoeWarpsPerCta), E), block kMoeWarpsPerCta * 32.
template <typename TX, typename TW>
__global__ void moe_expert_gemv_kernel(float* __restrict__ out, const TX* __restrict__ x,
                                       const int32_t* __restrict__ x_token, const TW* __restrict__ w,
                                       const int32_t* __restrict__ offsets, int64_t N, int64_t K, int64_t ldx,
                                       int64_t ldo) {
  const int64_t e = blockIdx.y;
  const int32_t p_begin = offsets[e], p_end = offsets[e + 1];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kMoeWarpsPerCta + warp;
  if (p_begin == p_end || n >= N) return;  // warp-uniform
  const TW* wr = w + (e * N + n) * K;
  for (int32_t p0 = p_begin; p0 < p_end; p0 += kMoeRowsPerPass) {
    const TX* xr[kMoeRowsPerPass];
    float acc[kMoeRowsPerPass];
#pragma unroll
    for (int i = 0; i < kMoeRowsPerPass; ++i) {
      const int32_t p = min(p0 + i, p_end - 1);  // tail rows repeat the last pair, never stored
      xr[i] = x + static_cast<int64_t>(x_token != nullptr ? x_token[p] : p) * ldx;
      acc[i] = 0.f;
    }
    for (int64_t c = lane; c < K; c += 32) {
      const float wv = to_float(wr[c]);
#pragma unroll
      for (int i = 0; i < kMoeRowsPerPass; ++i) acc[i] = __fmaf_rn(to_float(xr[i][c]), wv, acc[i]);
    }
#pragma unroll
    for (int i = 0; i < kMoeRowsPerPass; ++i) {
      const float sum = warp_reduce_sum(acc[i]);
      if (lane == 0 && p0 + i < p_end) out[static_cast<int64_t>(p0 + i) * ldo + n] = sum;
    }
  }
}

__device__ __forceinline__ float moe_gate_act(float g, MoeActivation activation) {
  if (activation == MoeActivation::kSilu) return g / (1.0f + expf(-g));
  const float inner = 0.7978845608028654f * (g + 0.044715f * g * g * g);
  return 0.5f * g * (1.0f + tanhf(inner));
}

// act[p, i] = act(gate_up[p, i]) * gate_up[p, I + i] for p < num_pairs (rows of unplaced pairs are never read).
__global__ void moe_act_kernel(float* __restrict__ act, const float* __restrict__ gate_up, int64_t num_pairs,
                               int64_t I, MoeActivation activation) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= num_pairs * I) return;
  const int64_t p = idx / I, i = idx % I;
  act[idx] = moe_gate_act(gate_up[p * 2 * I + i], activation) * gate_up[p * 2 * I + I + i];
}

// out[t * ldo + h] = sum_{j < k} weights[t * k + j] * expert_out[position(t, j) * H + h], positions -1 skipped.
template <typename T>
__global__ void moe_combine_kernel(T* __restrict__ out, const float* __restrict__ expert_out,
                                   const float* __restrict__ weights, const int32_t* __restrict__ pair_position,
                                   int64_t num_tokens, int64_t H, int64_t k, int64_t ldo) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= num_tokens * H) return;
  const int64_t t = idx / H, h = idx % H;
  float acc = 0.f;
  for (int64_t j = 0; j < k; ++j) {
    const int32_t p = pair_position[t * k + j];
    if (p >= 0) acc = __fmaf_rn(weights[t * k + j], expert_out[static_cast<int64_t>(p) * H + h], acc);
  }
  out[t * ldo + h] = from_float<T>(acc);
}

}  // namespace pagellm::cuda
