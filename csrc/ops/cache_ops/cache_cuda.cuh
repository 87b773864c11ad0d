// Paged KV-cache writes and block copies on the GPU. Dtype-agnostic byte copies: `U` is the copy unit
// (int4 = 16 bytes when every address and stride allows it, else the element's own size). Quantized caches:
// every written (token, kv head) row is quantized by its absmax (kv_quant.cuh). Torch-free.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cache_ops/kv_quant.cuh"
#include "ops/cuda_common/vec.cuh"

namespace pagellm::cuda {

// grid.x = token; block threads stride over num_kv_heads * units_per_row units of key and value rows.
// All strides and sizes are in units of U.
template <typename U>
__global__ void reshape_and_cache_kernel(U* __restrict__ key_cache, U* __restrict__ value_cache,
                                         const U* __restrict__ key, const U* __restrict__ value,
                                         const int64_t* __restrict__ slot_mapping, int64_t key_tok_stride,
                                         int64_t key_head_stride, int64_t value_tok_stride, int64_t value_head_stride,
                                         int num_kv_heads, int units_per_row, int block_size, int64_t num_slots) {
  const int64_t t = blockIdx.x;
  const int64_t slot = slot_mapping[t];
  if (slot < 0 || slot >= num_slots) return;  // -1 = padding token; out-of-range slots are never written
  const int64_t block = slot / block_size;
  const int64_t offset = slot % block_size;
  const int total = num_kv_heads * units_per_row;
  for (int i = threadIdx.x; i < total; i += blockDim.x) {
    const int h = i / units_per_row;
    const int c = i - h * units_per_row;
    // cache row (block, h, offset): ((block * Hkv + h) * block_size + offset) * row
    const int64_t dst = ((block * num_kv_heads + h) * block_size + offset) * units_per_row + c;
    key_cache[dst] = key[t * key_tok_stride + h * key_head_stride + c];
    value_cache[dst] = value[t * value_tok_stride + h * value_head_stride + c];
  }
}

// grid.x = token; warp w of the block quantizes rows w, w + warps, ... of the token's 2 * num_kv_heads rows (keys,
// then values): absmax over the row (two passes over the L1-resident source row), stored values, the row's scale.
// key/value strides in elements of T; scales [num_blocks, num_kv_heads, block_size] (a row's scale at its row index).
template <typename T, typename C>
__global__ void reshape_and_cache_quantized_kernel(C* __restrict__ key_cache, C* __restrict__ value_cache,
                                                   float* __restrict__ k_scale, float* __restrict__ v_scale,
                                                   const T* __restrict__ key, const T* __restrict__ value,
                                                   const int64_t* __restrict__ slot_mapping, int64_t key_tok_stride,
                                                   int64_t key_head_stride, int64_t value_tok_stride,
                                                   int64_t value_head_stride, int num_kv_heads, int head_dim,
                                                   int block_size, int64_t num_slots) {
  const int64_t t = blockIdx.x;
  const int64_t slot = slot_mapping[t];
  if (slot < 0 || slot >= num_slots) return;  // -1 = padding token; out-of-range slots are never written
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int64_t block = slot / block_size, offset = slot % block_size;
  for (int r = warp; r < 2 * num_kv_heads; r += warps) {  // warp-uniform
    const bool is_value = r >= num_kv_heads;
    const int h = is_value ? r - num_kv_heads : r;
    const T* src = is_value ? value + t * value_tok_stride + h * value_head_stride
                            : key + t * key_tok_stride + h * key_head_stride;
    const int64_t row = (block * num_kv_heads + h) * block_size + offset;
    C* dst = (is_value ? value_cache : key_cache) + row * head_dim;
    float amax = 0.f;
    for (int d = lane; d < head_dim; d += 32) amax = fmaxf(amax, fabsf(to_float(src[d])));
    amax = warp_reduce_max(amax);
    const float inv = amax > 0.f ? __fdiv_rn(KvQuant<C>::kMax, amax) : 0.f;
    for (int d = lane; d < head_dim; d += 32) dst[d] = KvQuant<C>::from_scaled(__fmul_rn(to_float(src[d]), inv));
    if (lane == 0) (is_value ? v_scale : k_scale)[row] = __fdiv_rn(amax, KvQuant<C>::kMax);
  }
}

// grid = (num_pairs, num_layers); each block copies one whole cache block (key and value) of one layer.
template <typename U>
__global__ void copy_blocks_kernel(const int64_t* __restrict__ key_cache_ptrs,
                                   const int64_t* __restrict__ value_cache_ptrs,
                                   const int64_t* __restrict__ block_mapping, int64_t num_blocks,
                                   int64_t units_per_block) {
  const int64_t pair = blockIdx.x;
  const int layer = blockIdx.y;
  const int64_t src = block_mapping[2 * pair];
  const int64_t dst = block_mapping[2 * pair + 1];
  if (src < 0 || src >= num_blocks || dst < 0 || dst >= num_blocks || src == dst) return;
  U* kc = reinterpret_cast<U*>(key_cache_ptrs[layer]);
  U* vc = reinterpret_cast<U*>(value_cache_ptrs[layer]);
  const int64_t s0 = src * units_per_block, d0 = dst * units_per_block;
  for (int64_t i = threadIdx.x; i < units_per_block; i += blockDim.x) {
    kc[d0 + i] = kc[s0 + i];
    vc[d0 + i] = vc[s0 + i];
  }
}

}  // namespace pagellm::cuda
