// Tree attention on the GPU (Medusa-style verification of a batch of candidate trees). Torch-free.
// One warp per (tree token, query head); grid = (num_tokens, ceil(num_heads / 4)), block = 128 threads. The
// warp's lanes split head_dim (lane owns elements lane, lane + 32, ...); keys are visited in order with a
// scalar online softmax: the committed context [0, ctx) unmasked, then tree token j (position ctx + j) only
// when tree_mask[t][j] is set. Trees are small (tens of tokens) next to the context, so the work is a
// decode per tree token; K/V rows shared by a GQA group and by sibling tokens come from L2.
// Rows with a bad block id (never the case after the glue's checks on CPU; not checked on the device) are skipped.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda_common/vec.cuh"
#include "ops/tree_attention/tree_attention_launch.h"

namespace pagellm::cuda {

constexpr int kTreeThreads = 128;

// Sequence of call token t: the largest s with qsl[s] <= t (binary search; qsl is non-decreasing).
__device__ __forceinline__ int tree_token_seq(const int32_t* __restrict__ qsl, int num_seqs, int t) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (qsl[mid] <= t) lo = mid; else hi = mid - 1;
  }
  return lo;
}

template <typename T, int D>
__global__ void __launch_bounds__(kTreeThreads) paged_tree_attention_kernel(const TreeAttentionArgs p) {
  constexpr int E = (D + 31) / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int t = blockIdx.x;
  const int h = blockIdx.y * (kTreeThreads / 32) + warp;
  if (h >= p.num_heads || t >= p.num_tokens) return;  // warp-uniform; no block barriers below
  const int seq = tree_token_seq(p.query_start_loc, p.num_seqs, t);
  const int q_begin = p.query_start_loc[seq];
  const int q_len = p.query_start_loc[seq + 1] - q_begin;
  if (t < q_begin || t >= q_begin + q_len) return;  // token outside every sequence's range: left untouched
  const int64_t L = p.seq_lens[seq];
  const int64_t ctx = L - q_len;  // committed context; tree token j sits at ctx + j
  const int kvh = h / (p.num_heads / p.num_kv_heads);
  const T* __restrict__ query = static_cast<const T*>(p.query);
  const T* __restrict__ key_cache = static_cast<const T*>(p.key_cache);
  const T* __restrict__ value_cache = static_cast<const T*>(p.value_cache);
  const uint8_t* __restrict__ mask = p.tree_mask + static_cast<int64_t>(t) * p.mask_stride;
  float q[E], acc[E];
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int d = lane + 32 * e;
    q[e] = d < D ? to_float(query[static_cast<int64_t>(t) * p.q_stride_tok + h * p.q_stride_head + d]) * p.scale : 0.f;
    acc[e] = 0.f;
  }
  const int32_t* __restrict__ bt = p.block_tables + seq * p.bt_stride;
  const int64_t block_elems = static_cast<int64_t>(p.num_kv_heads) * p.block_size * D;
  const int64_t head_off = static_cast<int64_t>(kvh) * p.block_size * D;
  float m = -INFINITY, l = 0.f;
  for (int64_t j = 0; j < L; ++j) {
    // A tree token that is not an ancestor, or past the mask's width (uniform over the warp).
    if (j >= ctx && (j - ctx >= p.mask_stride || mask[j - ctx] == 0)) continue;
    const int64_t bi = j / p.block_size;
    if (bi >= p.max_blocks) continue;
    const int64_t blk = bt[bi];
    if (blk < 0 || blk >= p.num_blocks) continue;
    const int64_t off = blk * block_elems + head_off + (j - bi * p.block_size) * D;
    float dot = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const int d = lane + 32 * e;
      if (d < D) dot = fmaf(q[e], to_float(key_cache[off + d]), dot);
    }
    dot = warp_reduce_sum(dot);
    if (p.softcap > 0.f) dot = p.softcap * tanhf(dot / p.softcap);
    const float m_new = fmaxf(m, dot);
    const float alpha = __expf(m - m_new);
    const float pe = __expf(dot - m_new);
    l = l * alpha + pe;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const int d = lane + 32 * e;
      const float v = d < D ? to_float(value_cache[off + d]) : 0.f;
      acc[e] = acc[e] * alpha + pe * v;
    }
    m = m_new;
  }
  const float inv = l > 0.f ? 1.f / l : 0.f;  // nothing visible: zeros
  T* __restrict__ out = static_cast<T*>(p.out);
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int d = lane + 32 * e;
    if (d < D) out[static_cast<int64_t>(t) * p.o_stride_tok + h * p.o_stride_head + d] = from_float<T>(acc[e] * inv);
  }
}

template <typename T, int D>
cudaError_t tree_attention_launch(const TreeAttentionArgs& a, cudaStream_t s) {
  const int warps = kTreeThreads / 32;
  const dim3 grid(static_cast<unsigned>(a.num_tokens), static_cast<unsigned>((a.num_heads + warps - 1) / warps));
  paged_tree_attention_kernel<T, D><<<grid, kTreeThreads, 0, s>>>(a);
  return cudaGetLastError();
}

template <int D>
cudaError_t tree_attention_dim(const TreeAttentionArgs& a, DType dtype, cudaStream_t s) {
  switch (dtype) {
    case DType::kFloat32: return tree_attention_launch<float, D>(a, s);
    case DType::kFloat16: return tree_attention_launch<__half, D>(a, s);
    case DType::kBFloat16: return tree_attention_launch<__nv_bfloat16, D>(a, s);
  }
  return cudaErrorInvalidValue;
}

}  // namespace pagellm::cuda
