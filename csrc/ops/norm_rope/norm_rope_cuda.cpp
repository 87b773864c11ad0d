// CUDA glue for rms_norm / fused_add_rms_norm / rotary_embedding (kernels in norm_kernels.cu, rotary_kernels.cu).
#include <torch/library.h>

#include <tuple>

#include "ops/cuda_common/torch_glue.h"
#include "ops/norm_rope/norm_launch.h"
#include "ops/norm_rope/rotary_glue_cuda.h"

namespace pagellm::cuda {
namespace {

void check_weight(const at::Tensor& weight, const at::Tensor& input, const char* input_name) {
  check_cuda(weight, "weight");
  check_same_device(weight, input, "weight", input_name);
  check_same_dtype(weight, input, "weight", input_name);
  TORCH_CHECK(weight.dim() == 1 && input.dim() >= 1 && weight.size(0) == input.size(-1),
              "weight must have shape [hidden] = [", input.dim() ? input.size(-1) : 0, "], got ", weight.sizes());
  check_contiguous(weight, "weight");
}

// A [rows, hidden] view of t that aliases it (in-place outputs must not be copied).
at::Tensor rows_view(const at::Tensor& t, const char* name) {
  auto v = t.view({-1, t.size(-1)});
  check_last_contiguous(v, name);
  return v;
}

void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double epsilon) {
  check_cuda(out, "out");
  check_cuda(input, "input");
  check_same_device(input, out, "input", "out");
  const DType dt = to_dtype(input, "input");
  check_same_dtype(out, input, "out", "input");
  check_weight(weight, input, "input");
  TORCH_CHECK(out.sizes() == input.sizes(), "out shape ", out.sizes(), " must equal input shape ", input.sizes());
  if (input.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(input.device());
  at::Tensor x = input.reshape({-1, input.size(-1)});
  if (x.stride(1) != 1) x = x.contiguous();
  at::Tensor o = rows_view(out, "out");
  check_launch(launch_rms_norm(o.data_ptr(), x.data_ptr(), weight.data_ptr(), x.size(0), x.size(1), x.stride(0),
                               o.stride(0), static_cast<float>(epsilon), dt, current_stream()),
               "rms_norm");
}

void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double epsilon) {
  check_cuda(input, "input");
  check_cuda(residual, "residual");
  check_same_device(residual, input, "residual", "input");
  const DType dt = to_dtype(input, "input");
  check_same_dtype(residual, input, "residual", "input");
  check_weight(weight, input, "input");
  TORCH_CHECK(residual.sizes() == input.sizes(), "residual shape ", residual.sizes(), " must equal input shape ",
              input.sizes());
  if (input.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(input.device());
  at::Tensor x = rows_view(input, "input");
  at::Tensor r = rows_view(residual, "residual");
  check_launch(launch_fused_add_rms_norm(x.data_ptr(), r.data_ptr(), weight.data_ptr(), x.size(0), x.size(1),
                                         x.stride(0), r.stride(0), static_cast<float>(epsilon), dt, current_stream()),
               "fused_add_rms_norm");
}

}  // namespace

// (num_heads, token stride, head stride) of a [T, H*D] or [T, H, D] query/key.
std::tuple<int64_t, int64_t, int64_t> head_geometry(const at::Tensor& t, int64_t T, int64_t head_size,
                                                    const char* name) {
  check_cuda(t, name);
  check_last_contiguous(t, name);
  TORCH_CHECK((t.dim() == 2 || t.dim() == 3) && t.size(0) == T, name,
              " must have shape [num_tokens, num_heads * head_size] or [num_tokens, num_heads, head_size] with "
              "num_tokens = ",
              T, ", got ", t.sizes());
  if (t.dim() == 3) {
    TORCH_CHECK(t.size(2) == head_size, name, ".size(2) must equal head_size = ", head_size, ", got ", t.size(2));
    return {t.size(1), t.stride(0), t.stride(1)};
  }
  TORCH_CHECK(t.size(1) % head_size == 0, name, ".size(1) = ", t.size(1), " must be a multiple of head_size = ",
              head_size);
  return {t.size(1) / head_size, t.stride(0), head_size};
}

RotaryArgs check_rotary_args(const at::Tensor& positions, at::Tensor& query, at::Tensor& key, int64_t head_size,
                             const at::Tensor& cos_sin_cache, at::Tensor& positions_held) {
  check_cuda(positions, "positions");
  check_dtype(positions, at::kLong, "positions");
  to_dtype(query, "query");
  check_same_dtype(key, query, "key", "query");
  check_cuda(cos_sin_cache, "cos_sin_cache");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat || cos_sin_cache.scalar_type() == query.scalar_type(),
              "cos_sin_cache must be float32 or the query dtype (", query.scalar_type(), "), got ",
              cos_sin_cache.scalar_type());
  check_dim(cos_sin_cache, 2, "cos_sin_cache");
  check_last_contiguous(cos_sin_cache, "cos_sin_cache");
  const int64_t rot = cos_sin_cache.size(1);
  TORCH_CHECK(head_size > 0 && head_size <= 1024, "head_size must be in [1, 1024], got ", head_size);
  TORCH_CHECK(rot % 2 == 0 && rot > 0 && rot <= head_size && rot <= 512, "cos_sin_cache.size(1) (rotary_dim) = ", rot,
              " must be even, positive, <= 512 and <= head_size = ", head_size);
  const int64_t T = positions.numel();
  const auto [qh, qst, qsh] = head_geometry(query, T, head_size, "query");
  const auto [kh, kst, ksh] = head_geometry(key, T, head_size, "key");
  check_same_device(query, positions, "query", "positions");
  check_same_device(key, positions, "key", "positions");
  check_same_device(cos_sin_cache, positions, "cos_sin_cache", "positions");
  // Positions outside [0, max_position) are not checked here (that would need a device sync); the kernels leave
  // such tokens unrotated instead of reading out of bounds.
  positions_held = positions.reshape({-1}).contiguous();
  RotaryArgs a{};
  a.positions = positions_held.data_ptr<int64_t>();
  a.query = query.data_ptr();
  a.key = key.data_ptr();
  a.cos_sin_cache = cos_sin_cache.data_ptr();
  a.num_tokens = T;
  a.query_stride = qst;
  a.query_head_stride = qsh;
  a.key_stride = kst;
  a.key_head_stride = ksh;
  a.cache_stride = cos_sin_cache.stride(0);
  a.num_q_heads = static_cast<int>(qh);
  a.num_k_heads = static_cast<int>(kh);
  a.head_size = static_cast<int>(head_size);
  a.rot_dim = static_cast<int>(rot);
  a.max_position = cos_sin_cache.size(0);
  a.is_neox = false;
  return a;
}

namespace {

void rotary_embedding(const at::Tensor& positions, at::Tensor& query, at::Tensor& key, int64_t head_size,
                      const at::Tensor& cos_sin_cache, bool is_neox) {
  at::Tensor pos;
  RotaryArgs a = check_rotary_args(positions, query, key, head_size, cos_sin_cache, pos);
  if (a.num_tokens == 0) return;
  const c10::cuda::CUDAGuard guard(positions.device());
  a.is_neox = is_neox;
  check_launch(launch_rotary_embedding(a, to_dtype(query, "query"), to_dtype(cos_sin_cache, "cos_sin_cache"),
                                       current_stream()),
               "rotary_embedding");
}

}  // namespace
}  // namespace pagellm::cuda

TORCH_LIBRARY_IMPL(pagellm, CUDA, m) {
  m.impl("rms_norm", &pagellm::cuda::rms_norm);
  m.impl("fused_add_rms_norm", &pagellm::cuda::fused_add_rms_norm);
  m.impl("rotary_embedding", &pagellm::cuda::rotary_embedding);
}
