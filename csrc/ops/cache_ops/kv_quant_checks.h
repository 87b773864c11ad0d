// Device-independent checks of a quantized paged KV cache (int8 / fp8-e4m3 values + per-row fp32 scales),
// shared by the cache_ops and paged_attention glue on CPU and CUDA. Layout: docs/kv_cache_layout.md.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include "ops/common/arg_checks.h"

// int8 / float8_e4m3fn cache dispatch (scalar_t inside the lambda: int8_t or c10::Float8_e4m3fn).
#define PAGELLM_DISPATCH_KV_QUANT_TYPES(TYPE, NAME, ...) \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kChar, __VA_ARGS__) AT_DISPATCH_CASE(at::kFloat8_e4m3fn, __VA_ARGS__))

namespace pagellm {

inline bool is_quantized_cache_dtype(at::ScalarType dt) { return dt == at::kChar || dt == at::kFloat8_e4m3fn; }

// key_cache / value_cache: the same int8 or float8_e4m3fn dtype (shapes are checked by the caller);
// k_scale / v_scale: contiguous float32 [num_blocks, num_kv_heads, block_size] of the cache's first three dims.
inline void check_quantized_kv_cache(const at::Tensor& key_cache, const at::Tensor& value_cache,
                                     const at::Tensor& k_scale, const at::Tensor& v_scale) {
  TORCH_CHECK(is_quantized_cache_dtype(key_cache.scalar_type()),
              "key_cache must be int8 or float8_e4m3fn (a quantized cache), got ", key_cache.scalar_type());
  check_same_dtype(value_cache, key_cache, "value_cache", "key_cache");
  check_dim(key_cache, 4, "key_cache");
  for (auto [t, name] : {std::pair<const at::Tensor*, const char*>{&k_scale, "k_scale"}, {&v_scale, "v_scale"}}) {
    check_dtype(*t, at::kFloat, name);
    check_contiguous(*t, name);
    TORCH_CHECK(t->dim() == 3 && t->size(0) == key_cache.size(0) && t->size(1) == key_cache.size(1) &&
                    t->size(2) == key_cache.size(2),
                name, " must have shape [num_blocks, num_kv_heads, block_size] = [", key_cache.size(0), ", ",
                key_cache.size(1), ", ", key_cache.size(2), "] (one scale per cached row), got ", t->sizes());
    TORCH_CHECK(t->device() == key_cache.device(), name, " must be on the device of key_cache (", key_cache.device(),
                "), got ", t->device());
  }
}

}  // namespace pagellm
