// CUDA glue for rotary_embedding_and_cache (kernel: rope_cache_kernels.cu): rotary_embedding's and
// reshape_and_cache's checks (shared with their glue), then one launch. Float caches only (a quantized cache takes
// the two ops). CUDA only: the op has no CPU kernel.
#include <torch/library.h>

#include "ops/cache_ops/cache_glue_cuda.h"
#include "ops/cuda_common/torch_glue.h"
#include "ops/fused/fused_launch.h"
#include "ops/norm_rope/rotary_glue_cuda.h"

namespace pagellm::cuda {
namespace {

// key / value as the [T, H, head_size] views reshape_and_cache takes (aliasing the rows: key is written in place).
at::Tensor head_view(const at::Tensor& t, int64_t head_size) {
  return t.dim() == 3 ? t : t.view({t.size(0), t.size(1) / head_size, head_size});
}

void rotary_embedding_and_cache(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                                const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                                const at::Tensor& slot_mapping, int64_t head_size, const at::Tensor& cos_sin_cache,
                                bool is_neox) {
  at::Tensor pos;
  RotaryArgs r = check_rotary_args(positions, query, key, head_size, cos_sin_cache, pos);
  r.is_neox = is_neox;
  const DType dt = to_dtype(key_cache, "key_cache");
  check_same_dtype(key, key_cache, "key", "key_cache");
  check_cuda(value, "value");
  TORCH_CHECK(value.dim() == key.dim() && value.sizes() == key.sizes(), "value shape ", value.sizes(),
              " must equal key shape ", key.sizes());
  check_last_contiguous(value, "value");
  const c10::cuda::CUDAGuard guard(key_cache.device());
  const at::Tensor slots = slot_mapping.contiguous();
  const ReshapeAndCacheArgs w =
      check_cache_write(key_cache, value_cache, head_view(key, head_size), head_view(value, head_size), slots);
  check_same_device(positions, key_cache, "positions", "key_cache");
  if (r.num_tokens == 0) return;
  check_launch(launch_rotary_embedding_and_cache(r, w, dt, to_dtype(cos_sin_cache, "cos_sin_cache"), current_stream()),
               "rotary_embedding_and_cache");
}

}  // namespace
}  // namespace pagellm::cuda

TORCH_LIBRARY_IMPL(pagellm, CUDA, m) {
  m.impl("rotary_embedding_and_cache", &pagellm::cuda::rotary_embedding_and_cache);
}
