// Host-side, torch-free entry points of the paged-attention CUDA kernels (decode_kernels.cu, prefill_kernels.cu).
// KV cache (every device): key_cache, value_cache [num_blocks, num_kv_heads, block_size, head_dim], contiguous.
// GQA: query head h reads kv head h / (num_heads / num_kv_heads).
// Quantized caches (int8 / fp8-e4m3 values, *_quantized launchers): k_scale / v_scale [num_blocks, num_kv_heads,
// block_size] fp32, one per row (value = stored * scale); queries and outputs stay of `dtype`.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cache_ops/kv_cache_dtype.h"
#include "ops/cuda_common/dtype.h"

namespace pagellm::cuda {

// Head dims with a compiled kernel.
inline bool attention_head_dim_supported(int d) { return d == 64 || d == 80 || d == 96 || d == 112 || d == 128 || d == 256; }

// Decode: one query token per sequence, at position seq_lens[s] - 1.
// query/out element (s, h, d) at s * stride_tok + h * stride_head + d (d contiguous).
struct DecodeArgs {
  void* out;
  const void* query;
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;  // [num_seqs, max_blocks], row stride bt_stride
  const int32_t* seq_lens;      // [num_seqs]
  // Split-context (flash-decoding) scratch, fp32, needed when num_splits > 1:
  // tmp_out [num_seqs, num_heads, num_splits, v_head_dim or head_dim], tmp_max / tmp_sum [num_seqs, num_heads, num_splits].
  float* tmp_out;
  float* tmp_max;
  float* tmp_sum;
  int64_t q_stride_tok, q_stride_head, o_stride_tok, o_stride_head, bt_stride;
  int num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int64_t num_blocks;
  int num_splits;  // the scratch's split capacity, from decode_num_splits()
  int window;      // keys a query sees, itself included; <= 0: all
  float scale;
  float softcap;   // > 0: s = softcap * tanh(s / softcap)
  const float* k_scale = nullptr;  // quantized caches only
  const float* v_scale = nullptr;
  // Output / value width when smaller than head_dim (MLA: the first v_head_dim dims of the value rows; out and
  // tmp_out rows are v_head_dim wide); 0 = head_dim.
  int v_head_dim = 0;
  // Tokens a split covers at least (the flash-decoding rule's grain); 0 = kDecodeSplitGrain (64). The glue takes
  // it from PAGELLM_CUDA_DECODE_SPLIT_GRAIN (a benchmark sweep's knob).
  int split_grain = 0;
  // Non-null: the splits are merged inside the decode kernel, by the last CTA of each (sequence, kv head, head
  // group) to finish, found with an atomic counter per such column: num_seqs * num_kv_heads * ceil(G / 8)
  // int32 counters, zero before the launch and left zero after it (decode_split_counter_count). Null: a second
  // kernel merges them. Both give the same bits.
  int32_t* split_counters = nullptr;
};

// Query heads (of one kv head) a decode CTA serves.
constexpr int kDecodeMaxHeads = 8;

// The counters an in-kernel merge needs (DecodeArgs::split_counters): one per (sequence, kv head, head group).
inline int64_t decode_split_counter_count(int num_seqs, int num_heads, int num_kv_heads) {
  const int group = num_heads / num_kv_heads;
  return static_cast<int64_t>(num_seqs) * num_kv_heads * ((group + kDecodeMaxHeads - 1) / kDecodeMaxHeads);
}

// The scratch's split capacity: the most context splits a sequence of this launch can have (1 = none, no
// scratch). max_context is an upper bound of every seq_len (e.g. max_blocks * block_size). A sequence's splits
// depend on its own length only (decode_cuda.cuh), so the result does not depend on the batch.
int decode_num_splits(int num_seqs, int num_heads, int num_kv_heads, int64_t max_context, int window,
                      int split_grain = 0);
// CTAs per (sequence, head group) along the split axis: enough to fill the GPU (about four CTAs per SM), at most
// num_splits; each takes splits z, z + ctas, ... Queries the current device's SM count (cached per device).
int decode_split_ctas(int num_seqs, int heads_ctas, int num_splits);

cudaError_t launch_paged_attention_decode(const DecodeArgs& args, DType dtype, cudaStream_t stream);
// The same over a quantized cache of `cache_dtype` (decode_quant_kernels.cu); needs k_scale / v_scale.
cudaError_t launch_paged_attention_decode_quantized(const DecodeArgs& args, DType dtype, KvCacheDType cache_dtype,
                                                    cudaStream_t stream);

// MLA decode over DeepSeek-V2/V3's latent cache: one KV head whose key and value rows are the same latent
// rows, kMlaLatentDim wide for QK (kv_lora_rank 512 + rope 64), the first kMlaKvLoraRank of them the value.
// Needs num_kv_heads == 1, head_dim == kMlaLatentDim, v_head_dim == kMlaKvLoraRank (mla_decode_kernels.cu).
constexpr int kMlaLatentDim = 576;
constexpr int kMlaKvLoraRank = 512;
cudaError_t launch_paged_mla_decode(const DecodeArgs& args, DType dtype, cudaStream_t stream);

// Prefill / chunked prefill / prefix hits: sequence s has query tokens [qsl[s], qsl[s+1]) which are its LAST
// q_len positions of seq_lens[s] keys; causal (and windowed) masking by absolute position.
struct PrefillArgs {
  void* out;
  const void* query;
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;
  const int32_t* query_start_loc;  // [num_seqs + 1]
  const int32_t* seq_lens;         // [num_seqs]
  int64_t q_stride_tok, q_stride_head, o_stride_tok, o_stride_head, bt_stride;
  int num_seqs, num_tokens, num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int64_t num_blocks;
  int window;
  float scale;
  float softcap;
  const float* k_scale = nullptr;  // quantized caches only
  const float* v_scale = nullptr;
};

// Half/bfloat16 use tensor cores (mma.sync m16n8k16, sm_80+) and need 16-byte aligned query/out rows
// (strides multiples of 8 elements, base 16-byte aligned); fp32 uses a scalar path without that requirement.
cudaError_t launch_paged_attention_prefill(const PrefillArgs& args, DType dtype, cudaStream_t stream);
// The same over a quantized cache (prefill_quant_kernels.cu): K/V tiles are dequantized (stored * row scale) into
// the tensor-core kernel's shared-memory tiles of `dtype`, or read as fp32 by the scalar fp32 kernel.
cudaError_t launch_paged_attention_prefill_quantized(const PrefillArgs& args, DType dtype, KvCacheDType cache_dtype,
                                                     cudaStream_t stream);

}  // namespace pagellm::cuda
