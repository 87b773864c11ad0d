// Host-side, torch-free entry point of the tree-attention CUDA kernel (tree_attention_kernels.cu).
// KV cache: key_cache, value_cache [num_blocks, num_kv_heads, block_size, head_dim] contiguous, of `dtype` (float
// caches only). GQA: query head h reads kv head h / (num_heads / num_kv_heads).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda_common/dtype.h"

namespace pagellm::cuda {

// Sequence s's q_len = qsl[s+1] - qsl[s] tree tokens are the LAST q_len of its seq_lens[s] positions; token t of
// the call sees every committed position [0, seq_len - q_len) and tree token j iff j < mask_stride and
// tree_mask[t * mask_stride + j] (the mask is contiguous: its row stride is its width).
// query/out element (t, h, d) at t * stride_tok + h * stride_head + d (d contiguous).
struct TreeAttentionArgs {
  void* out;
  const void* query;
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;     // [num_seqs, max_blocks], row stride bt_stride
  const int32_t* query_start_loc;  // [num_seqs + 1]
  const int32_t* seq_lens;         // [num_seqs]
  const uint8_t* tree_mask;        // [num_tokens, mask_stride] bytes (bool / uint8)
  int64_t q_stride_tok, q_stride_head, o_stride_tok, o_stride_head, bt_stride, mask_stride;
  int num_seqs, num_tokens, num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int64_t num_blocks;
  float scale;
  float softcap;  // > 0: s = softcap * tanh(s / softcap)
};

// Head dims with a compiled kernel (the paged-attention set).
inline bool tree_attention_head_dim_supported(int d) {
  return d == 64 || d == 80 || d == 96 || d == 112 || d == 128 || d == 256;
}

cudaError_t launch_paged_tree_attention(const TreeAttentionArgs& args, DType dtype, cudaStream_t stream);

}  // namespace pagellm::cuda
