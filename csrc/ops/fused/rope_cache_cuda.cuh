// Rotary embedding fused with the paged KV-cache write (rotary_cuda.cuh + cache_cuda.cuh in one kernel). Torch-free.
// grid.x = token, block = 128..512 threads, dynamic shared memory rot_dim floats (the token's cos | sin row). Each
// thread takes (head, pair) items: query pairs are rotated in place; key pairs are rotated in place and stored into
// the cache row of the token's slot; then the key dims past rot_dim (partial rotary) and the value rows are copied
// (the value in 16-byte units when kVecValue). A position outside [0, max_position) leaves the token unrotated and
// a slot outside [0, num_blocks * block_size) unwritten, as the two ops do. The rotation is rotary_cuda.cuh's
// rope_rotate, the copy a copy: the bits of rotary_embedding then reshape_and_cache.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cache_ops/cache_launch.h"
#include "ops/cuda_common/vec.cuh"
#include "ops/norm_rope/norm_launch.h"
#include "ops/norm_rope/rotary_cuda.cuh"

namespace pagellm::cuda {

template <typename T, typename C, bool kVecValue>
__global__ void rotary_cache_kernel(const RotaryArgs r, const ReshapeAndCacheArgs w) {
  extern __shared__ float cs[];  // [rot_dim]: cos | sin
  const int64_t t = blockIdx.x;
  const int64_t pos = r.positions[t];
  const bool rotate = pos >= 0 && pos < r.max_position;
  const int64_t slot = w.slot_mapping[t];
  const bool write = slot >= 0 && slot < w.num_blocks * w.block_size;
  const int half = r.rot_dim / 2, D = w.head_dim, Hkv = w.num_kv_heads;
  if (rotate) {  // uniform over the block
    const C* row = static_cast<const C*>(r.cos_sin_cache) + pos * r.cache_stride;
    for (int i = threadIdx.x; i < r.rot_dim; i += blockDim.x) cs[i] = to_float(row[i]);
    __syncthreads();
    T* q = static_cast<T*>(r.query) + t * r.query_stride;
    for (int j = threadIdx.x; j < r.num_q_heads * half; j += blockDim.x) {
      const int h = j / half, i = j - h * half;
      T* x = q + h * r.query_head_stride;
      int i1, i2;
      rope_pair(i, half, r.is_neox, i1, i2);
      float y1, y2;
      rope_rotate(to_float(x[i1]), to_float(x[i2]), cs[i], cs[half + i], y1, y2);
      x[i1] = from_float<T>(y1);
      x[i2] = from_float<T>(y2);
    }
  }
  if (!write && !rotate) return;
  // cache row (block, h, offset) starts at ((block * Hkv + h) * block_size + offset) * D
  const int64_t row0 = write ? ((slot / w.block_size) * Hkv * w.block_size + slot % w.block_size) * D : 0;
  const int64_t head_step = static_cast<int64_t>(w.block_size) * D;
  T* __restrict__ key_cache = static_cast<T*>(w.key_cache);
  T* k = static_cast<T*>(r.key) + t * r.key_stride;
  for (int j = threadIdx.x; j < Hkv * half; j += blockDim.x) {
    const int h = j / half, i = j - h * half;
    T* x = k + h * r.key_head_stride;
    int i1, i2;
    rope_pair(i, half, r.is_neox, i1, i2);
    T o1 = x[i1], o2 = x[i2];
    if (rotate) {
      float y1, y2;
      rope_rotate(to_float(o1), to_float(o2), cs[i], cs[half + i], y1, y2);
      o1 = from_float<T>(y1);
      o2 = from_float<T>(y2);
      x[i1] = o1;
      x[i2] = o2;
    }
    if (write) {
      key_cache[row0 + h * head_step + i1] = o1;
      key_cache[row0 + h * head_step + i2] = o2;
    }
  }
  if (!write) return;
  const int tail = D - r.rot_dim;  // key dims past rot_dim: copied as they are
  for (int j = threadIdx.x; j < Hkv * tail; j += blockDim.x) {
    const int h = j / tail, d = r.rot_dim + (j - h * tail);
    key_cache[row0 + h * head_step + d] = k[h * r.key_head_stride + d];
  }
  const T* v = static_cast<const T*>(w.value) + t * w.value_tok_stride;
  T* __restrict__ value_cache = static_cast<T*>(w.value_cache);
  if constexpr (kVecValue) {
    constexpr int kVec = VecTraits<T>::kElems;
    const int units = D / kVec;
    for (int j = threadIdx.x; j < Hkv * units; j += blockDim.x) {
      const int h = j / units, c = (j - h * units) * kVec;
      store16<T>(value_cache + row0 + h * head_step + c, load16<T>(v + h * w.value_head_stride + c));
    }
  } else {
    for (int j = threadIdx.x; j < Hkv * D; j += blockDim.x) {
      const int h = j / D, d = j - h * D;
      value_cache[row0 + h * head_step + d] = v[h * w.value_head_stride + d];
    }
  }
}

}  // namespace pagellm::cuda
