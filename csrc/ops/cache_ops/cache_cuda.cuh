// Paged KV-cache writes and block copies on the GPU. Dtype-agnostic byte copies: `U` is the copy unit
// (int4 = 16 bytes when every address and stride allows it, else the element's own size). Torch-free.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

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
