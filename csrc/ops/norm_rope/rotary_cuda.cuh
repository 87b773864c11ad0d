// Rotary position embedding on the GPU, in place on query and key. Torch-free.
// grid.x = token, block = 128..512 threads. The token's cos|sin row (rotary_dim fp32 values, as the CPU kernel
// uses them) is staged in dynamic shared memory; then every thread rotates (head, pair) items:
//   neox (halves):      x[i], x[i + rot/2]      gptj (interleaved): x[2i], x[2i + 1]
//   o1 = fma(x1, cos[i], -(x2 * sin[i]));  o2 = fma(x2, cos[i], x1 * sin[i])   (fp32, one rounding to T)
// Elements at and past rotary_dim are left untouched (partial rotary).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda_common/vec.cuh"

namespace pagellm::cuda {

// The element pair i of a head row (neox: i, i + half; gptj: 2i, 2i + 1) and its rotation by (cos, sin) = (c, s),
// with the arithmetic pinned (no contraction choice left to the compiler), so every kernel that rotates (this one,
// the rope + cache-write fusion) gives the same bits.
__device__ __forceinline__ void rope_pair(int i, int half, bool is_neox, int& i1, int& i2) {
  i1 = is_neox ? i : 2 * i;
  i2 = is_neox ? i + half : 2 * i + 1;
}
__device__ __forceinline__ void rope_rotate(float x1, float x2, float c, float s, float& y1, float& y2) {
  y1 = __fmaf_rn(x1, c, -__fmul_rn(x2, s));
  y2 = __fmaf_rn(x2, c, __fmul_rn(x1, s));
}

template <typename T, typename C>
__global__ void rotary_embedding_kernel(const int64_t* __restrict__ positions, T* __restrict__ query,
                                        T* __restrict__ key, const C* __restrict__ cos_sin_cache,
                                        int64_t query_stride, int64_t query_head_stride, int64_t key_stride,
                                        int64_t key_head_stride, int64_t cache_stride, int num_q_heads,
                                        int num_k_heads, int rot_dim, int64_t max_position, bool is_neox) {
  extern __shared__ float cs[];  // [rot_dim]: cos | sin
  const int64_t t = blockIdx.x;
  const int64_t pos = positions[t];
  if (pos < 0 || pos >= max_position) return;  // uniform over the block; out-of-range positions are left as is
  const int half = rot_dim / 2;
  const C* row = cos_sin_cache + pos * cache_stride;
  for (int i = threadIdx.x; i < rot_dim; i += blockDim.x) cs[i] = to_float(row[i]);
  __syncthreads();
  const int total = (num_q_heads + num_k_heads) * half;
  for (int w = threadIdx.x; w < total; w += blockDim.x) {
    const int hsel = w / half;
    const int i = w - hsel * half;
    T* x = hsel < num_q_heads ? query + t * query_stride + hsel * query_head_stride
                              : key + t * key_stride + (hsel - num_q_heads) * key_head_stride;
    int i1, i2;
    rope_pair(i, half, is_neox, i1, i2);
    float y1, y2;
    rope_rotate(to_float(x[i1]), to_float(x[i2]), cs[i], cs[half + i], y1, y2);
    x[i1] = from_float<T>(y1);
    x[i2] = from_float<T>(y2);
  }
}

}  // namespace pagellm::cuda
