// The merge of a paged decode's flash-decoding splits (decode_cuda.cuh), shared by the reduce kernel and the
// in-kernel merge so that both give the same bits. Torch-free.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda_common/vec.cuh"
#include "ops/paged_attention/attention_launch.h"

namespace pagellm::cuda {

// The merge of a (sequence, head)'s S > 1 splits, whose rows start at row0 of the scratch: out = sum_s w_s acc_s
// / sum_s w_s l_s, w_s = exp(m_s - max m) (splits with sum 0 ignored). The scratch is read through the L2 (__ldcg):
// in the in-kernel merge other CTAs wrote it during this launch.
// decode_split_weights: one warp writes w_s to w[0, S) (shared memory) and returns 1 / sum_s w_s l_s (0 if none).
__device__ __forceinline__ float decode_split_weights(const DecodeArgs& p, int64_t row0, int S, float* w, int lane) {
  float mx = -INFINITY;
  for (int s = lane; s < S; s += 32)
    if (__ldcg(p.tmp_sum + row0 + s) > 0.f) mx = fmaxf(mx, __ldcg(p.tmp_max + row0 + s));
  mx = warp_reduce_max(mx);
  float denom = 0.f;
  for (int s = lane; s < S; s += 32) {
    const float l = __ldcg(p.tmp_sum + row0 + s);
    const float ws = l > 0.f ? __expf(__ldcg(p.tmp_max + row0 + s) - mx) : 0.f;
    w[s] = ws;
    denom = fmaf(ws, l, denom);
  }
  denom = warp_reduce_sum(denom);
  return denom > 0.f ? 1.f / denom : 0.f;
}
// Element d of the merged output row (DV wide), given the weights and the inverse above.
__device__ __forceinline__ float decode_split_combine(const DecodeArgs& p, int64_t row0, int S, const float* w,
                                                      int DV, int d, float inv) {
  float a = 0.f;
  for (int s = 0; s < S; ++s) {
    const float ws = w[s];
    if (ws > 0.f) a = fmaf(ws, __ldcg(p.tmp_out + (row0 + s) * DV + d), a);
  }
  return a * inv;
}

// The in-kernel merge (DecodeArgs::split_counters), run by every thread of a CTA once its splits of sequence seq,
// heads h0 .. h0 + gc - 1, are in the scratch: the CTA whose count completes its (sequence, head-group) column
// merges the S splits and resets the counter for the next launch. w: gc rows of >= S floats of shared memory,
// inv: gc floats (the kernel's logit_s and alpha_s, free by then); merge: a shared flag. Head g's weights at
// w + g * w_stride.
template <typename T, int DV>
__device__ __forceinline__ void merge_splits_in_kernel(const DecodeArgs& p, int seq, int S, int h0, int gc,
                                                       int& merge, float* w, int w_stride, float* inv) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
  __threadfence();  // this CTA's scratch rows reach the device before it is counted
  __syncthreads();
  if (tid == 0) {
    int32_t* counter = p.split_counters + static_cast<int64_t>(seq) * gridDim.y + blockIdx.y;
    const int ctas = min(static_cast<int>(gridDim.z), S);  // the CTAs z >= S had no split and did not count
    merge = atomicAdd(counter, 1) == ctas - 1;
    if (merge) atomicExch(counter, 0);  // every other CTA of the column has counted already
  }
  __syncthreads();
  if (!merge) return;
  __threadfence();
  const int64_t rows = static_cast<int64_t>(seq) * p.num_heads + h0;
  for (int g = warp; g < gc; g += warps) {
    const float v = decode_split_weights(p, (rows + g) * p.num_splits, S, w + g * w_stride, lane);
    if (lane == 0) inv[g] = v;
  }
  __syncthreads();
  T* __restrict__ out = static_cast<T*>(p.out);
  for (int i = tid; i < gc * DV; i += blockDim.x) {
    const int g = i / DV, d = i - g * DV;
    out[seq * p.o_stride_tok + (h0 + g) * p.o_stride_head + d] =
        from_float<T>(decode_split_combine(p, (rows + g) * p.num_splits, S, w + g * w_stride, DV, d, inv[g]));
  }
}

}  // namespace pagellm::cuda
