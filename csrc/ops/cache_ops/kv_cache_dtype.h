// The storage types of a quantized paged KV cache, named without torch (the CUDA glue maps at::ScalarType to
// these). Values are stored per row with one fp32 scale per (token, kv head): docs/kv_cache_layout.md.
#pragma once

namespace pagellm::cuda {
enum class KvCacheDType { kInt8, kFp8E4M3 };
}  // namespace pagellm::cuda
