// LLM.int8() linear on the GPU: three straightforward kernels (torch-free; same math as int8_cpu_kernels.h).
//   outlier_mask_kernel   one thread per column: mask[k] = any_m |x[m, k]| > threshold (0 beyond K)
//   quantize_rows_kernel  one block per row: absmax over non-outlier columns, q = round(x * 127 / absmax); or,
//                         zero_point, min / max (range holding 0), uint8 q = round(x * 255 / (max - min)) + z
//   quantize_groups_kernel  one warp per (row, group of group_size elements of K): the group's absmax rule
//   int8_gemm_kernel      one warp per (m, n): int32 dot products sum (q - z_m) w (dp4a on 4-byte words when
//                         aligned; uint8 codes as dp4a's unsigned operand, minus z_m * sum w) plus the fp32
//                         outlier term, then out = acc * (s_m * w_scale[n]) + outliers + bias; per-token
//                         groups: each lane's dp4a result times its group's s_mg in fp32, out = sum * w_scale[n]
// The scale arithmetic uses the IEEE-rounded intrinsics (__fdiv_rn, __fmul_rn, __float2int_rn) so that
// --use_fast_math cannot change which int8 value an activation rounds to.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda_common/vec.cuh"

namespace pagellm::cuda::int8 {

constexpr int kQuantThreads = 256;
constexpr int kGemmWarps = 8;

template <typename T>
__global__ void outlier_mask_kernel(const T* __restrict__ x, int64_t M, int64_t K, int64_t ldx, int64_t ldq,
                                    float threshold, uint8_t* __restrict__ mask) {
  const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= ldq) return;
  uint8_t hit = 0;
  if (k < K && threshold > 0.f) {
    for (int64_t m = 0; m < M && !hit; ++m) hit = fabsf(to_float(x[m * ldx + k])) > threshold;
  }
  mask[k] = hit;
}

__device__ __forceinline__ float block_max(float v, float* shared) {
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>(blockDim.x / 32) ? shared[lane] : 0.f;
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    if (lane == 0) shared[0] = v;
  }
  __syncthreads();
  return shared[0];
}

// grid: M blocks; block: kQuantThreads. row_zero[m]: the zero point (0 for absmax rows).
template <typename T>
__global__ void quantize_rows_kernel(const T* __restrict__ x, int64_t K, int64_t ldx, int64_t ldq,
                                     const uint8_t* __restrict__ mask, bool zero_point, int8_t* __restrict__ q,
                                     float* __restrict__ row_scale, int* __restrict__ row_zero) {
  __shared__ float shared[32];
  const int64_t m = blockIdx.x;
  const T* xr = x + m * ldx;
  int8_t* qr = q + m * ldq;
  if (zero_point) {
    float hi = 0.f, neg_lo = 0.f;  // the range holds 0, so a zeroed (outlier) column is exactly z
    for (int64_t k = threadIdx.x; k < K; k += blockDim.x) {
      if (!mask[k]) {
        const float v = to_float(xr[k]);
        hi = fmaxf(hi, v);
        neg_lo = fmaxf(neg_lo, -v);
      }
    }
    __shared__ float shared_lo[32];  // its own buffer: block_max's result is still being read from `shared`
    hi = block_max(hi, shared);
    neg_lo = block_max(neg_lo, shared_lo);
    const float span = __fadd_rn(hi, neg_lo);  // hi - lo
    const float inv = span > 0.f ? __fdiv_rn(255.f, span) : 0.f;
    const int z = max(0, min(255, __float2int_rn(__fmul_rn(neg_lo, inv))));
    for (int64_t k = threadIdx.x; k < ldq; k += blockDim.x) {
      int v = z;
      if (k < K && !mask[k]) v = max(0, min(255, __float2int_rn(__fmul_rn(to_float(xr[k]), inv)) + z));
      qr[k] = static_cast<int8_t>(static_cast<uint8_t>(v));
    }
    if (threadIdx.x == 0) {
      row_scale[m] = __fdiv_rn(span, 255.f);
      row_zero[m] = z;
    }
    return;
  }
  float absmax = 0.f;
  for (int64_t k = threadIdx.x; k < K; k += blockDim.x) {
    if (!mask[k]) absmax = fmaxf(absmax, fabsf(to_float(xr[k])));
  }
  absmax = block_max(absmax, shared);
  const float inv = absmax > 0.f ? __fdiv_rn(127.f, absmax) : 0.f;
  for (int64_t k = threadIdx.x; k < ldq; k += blockDim.x) {
    int v = 0;
    if (k < K && !mask[k]) v = max(-127, min(127, __float2int_rn(__fmul_rn(to_float(xr[k]), inv))));
    qr[k] = static_cast<int8_t>(v);
  }
  if (threadIdx.x == 0) {
    row_scale[m] = __fdiv_rn(absmax, 127.f);
    row_zero[m] = 0;
  }
}

// grid: (ceil(G / kGroupWarps), M); block: 32 * kGroupWarps. One warp per group g of row m: absmax over its
// non-outlier columns, int8 codes, row_scale[m * G + g]; the warp of the last group also zeroes q up to ldq.
constexpr int kGroupWarps = 8;

template <typename T>
__global__ void quantize_groups_kernel(const T* __restrict__ x, int64_t K, int64_t ldx, int64_t ldq,
                                       const uint8_t* __restrict__ mask, int64_t group_size, int64_t G,
                                       int8_t* __restrict__ q, float* __restrict__ row_scale) {
  const int lane = threadIdx.x % 32;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kGroupWarps + threadIdx.x / 32;
  const int64_t m = blockIdx.y;
  if (g >= G) return;
  const T* xr = x + m * ldx;
  int8_t* qr = q + m * ldq;
  const int64_t k0 = g * group_size, k1 = min(K, k0 + group_size);
  float absmax = 0.f;
  for (int64_t k = k0 + lane; k < k1; k += 32)
    if (!mask[k]) absmax = fmaxf(absmax, fabsf(to_float(xr[k])));
  for (int off = 16; off > 0; off >>= 1) absmax = fmaxf(absmax, __shfl_xor_sync(0xffffffffu, absmax, off));
  const float inv = absmax > 0.f ? __fdiv_rn(127.f, absmax) : 0.f;
  const int64_t end = g == G - 1 ? ldq : k1;
  for (int64_t k = k0 + lane; k < end; k += 32) {
    int v = 0;
    if (k < K && !mask[k]) v = max(-127, min(127, __float2int_rn(__fmul_rn(to_float(xr[k]), inv))));
    qr[k] = static_cast<int8_t>(v);
  }
  if (lane == 0) row_scale[m * G + g] = __fdiv_rn(absmax, 127.f);
}

// dp4a of four uint8 codes (a) by four int8 weights (b), as PTX's mixed-signedness form.
__device__ __forceinline__ int dp4a_u8s8(int a, int b, int c) {
  int d;
  asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

template <typename T>
__device__ __forceinline__ float outlier_terms(const T* xr, const int8_t* wr, const uint8_t* mask, int64_t k0, int n,
                                               float ws) {
  float s = 0.f;
  for (int i = 0; i < n; ++i)
    if (mask[k0 + i]) s += to_float(xr[k0 + i]) * __fmul_rn(static_cast<float>(wr[k0 + i]), ws);
  return s;
}

// grid: (ceil(N / kGemmWarps), M); block: 32 * kGemmWarps. `words`: rows of w and q are 4-byte aligned and
// K % 4 == 0, so each lane reads 4 int8 at a time and uses dp4a.
template <typename T>
__global__ void int8_gemm_kernel(T* __restrict__ out, const T* __restrict__ x, const int8_t* __restrict__ w,
                                 const float* __restrict__ w_scale, const T* __restrict__ bias,
                                 const uint8_t* __restrict__ mask, const int8_t* __restrict__ q,
                                 const float* __restrict__ row_scale, const int* __restrict__ row_zero,
                                 bool zero_point, int64_t group_size, int64_t G, int64_t N, int64_t K, int64_t ldx,
                                 int64_t ldw, int64_t ldo, int64_t ldq, bool words) {
  const int lane = threadIdx.x % 32;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kGemmWarps + threadIdx.x / 32;
  const int64_t m = blockIdx.y;
  if (n >= N) return;
  const int8_t* wr = w + n * ldw;
  const int8_t* qr = q + m * ldq;
  const T* xr = x + m * ldx;
  const float ws = w_scale[n];
  const int z = row_zero[m];
  int acc = 0, wsum = 0;  // zero_point: acc = sum q w over uint8 codes, wsum = sum w (wrapping int32 sums)
  float outl = 0.f, gacc = 0.f;  // gacc: groups, sum of each word's dp4a times its group's scale
  const float* gscale = row_scale + m * G;
  if (words) {
    const int* w4 = reinterpret_cast<const int*>(wr);
    const int* q4 = reinterpret_cast<const int*>(qr);
    const uint32_t* m4 = reinterpret_cast<const uint32_t*>(mask);
    for (int64_t k4 = lane; k4 < K / 4; k4 += 32) {
      if (group_size > 0) {
        gacc = fmaf(static_cast<float>(__dp4a(w4[k4], q4[k4], 0)), gscale[4 * k4 / group_size], gacc);
      } else if (zero_point) {
        acc = dp4a_u8s8(q4[k4], w4[k4], acc);
        wsum = __dp4a(0x01010101, w4[k4], wsum);
      } else {
        acc = __dp4a(w4[k4], q4[k4], acc);
      }
      if (m4[k4]) outl += outlier_terms(xr, wr, mask, 4 * k4, 4, ws);
    }
  } else {
    for (int64_t k = lane; k < K; k += 32) {
      const int qv = zero_point ? static_cast<int>(static_cast<uint8_t>(qr[k])) : static_cast<int>(qr[k]);
      if (group_size > 0) gacc = fmaf(static_cast<float>(static_cast<int>(wr[k]) * qv), gscale[k / group_size], gacc);
      else acc += static_cast<int>(wr[k]) * qv;
      wsum += static_cast<int>(wr[k]);
      if (mask[k]) outl += outlier_terms(xr, wr, mask, k, 1, ws);
    }
  }
  for (int off = 16; off > 0; off >>= 1) {
    acc += __shfl_xor_sync(0xffffffffu, acc, off);
    wsum += __shfl_xor_sync(0xffffffffu, wsum, off);
    outl += __shfl_xor_sync(0xffffffffu, outl, off);
    gacc += __shfl_xor_sync(0xffffffffu, gacc, off);
  }
  if (zero_point) acc = static_cast<int>(static_cast<unsigned>(acc)
                                        - static_cast<unsigned>(z) * static_cast<unsigned>(wsum));
  if (lane == 0) {
    float y = group_size > 0 ? __fmul_rn(gacc, ws) : __fmul_rn(static_cast<float>(acc), __fmul_rn(row_scale[m], ws));
    y += outl;
    if (bias != nullptr) y += to_float(bias[n]);
    out[m * ldo + n] = from_float<T>(y);
  }
}

}  // namespace pagellm::cuda::int8
