// CPU glue for rms_norm, fused_add_rms_norm and rotary_embedding.
#include <torch/library.h>

#include "ops/common/checks.h"
#include "ops/norm_rope/norm_rope_cpu_kernels.h"

namespace pagellm::cpu {
namespace {

void check_weight(const at::Tensor& weight, const at::Tensor& input, const char* input_name) {
  check_cpu(weight, "weight");
  check_same_dtype(weight, input, "weight", input_name);
  TORCH_CHECK(weight.dim() == 1 && input.dim() >= 1 && weight.size(0) == input.size(-1),
              "weight must have shape [hidden] = [", input.dim() ? input.size(-1) : 0, "], got ", weight.sizes());
  check_contiguous(weight, "weight");
}

// A [rows, hidden] view of t that aliases it (in-place outputs must not be copied).
at::Tensor rows_view(const at::Tensor& t, const char* name) {
  const int64_t n = t.size(-1);
  auto v = t.view({-1, n});
  check_last_contiguous(v, name);
  return v;
}

void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double epsilon) {
  check_cpu(out, "out");
  check_cpu(input, "input");
  check_float(input, "input");
  check_same_dtype(out, input, "out", "input");
  check_weight(weight, input, "input");
  TORCH_CHECK(out.sizes() == input.sizes(), "out shape ", out.sizes(), " must equal input shape ", input.sizes());
  if (input.numel() == 0) return;
  at::Tensor x = input.reshape({-1, input.size(-1)});
  if (x.stride(1) != 1) x = x.contiguous();
  at::Tensor o = rows_view(out, "out");
  PAGELLM_DISPATCH_FLOAT_TYPES(input.scalar_type(), "rms_norm", [&] {
    rms_norm_kernel<scalar_t>(o.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), x.size(0),
                              x.size(1), o.stride(0), x.stride(0), static_cast<float>(epsilon));
  });
}

void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double epsilon) {
  check_cpu(input, "input");
  check_cpu(residual, "residual");
  check_float(input, "input");
  check_same_dtype(residual, input, "residual", "input");
  check_weight(weight, input, "input");
  TORCH_CHECK(residual.sizes() == input.sizes(), "residual shape ", residual.sizes(), " must equal input shape ",
              input.sizes());
  if (input.numel() == 0) return;
  at::Tensor x = rows_view(input, "input");
  at::Tensor r = rows_view(residual, "residual");
  PAGELLM_DISPATCH_FLOAT_TYPES(input.scalar_type(), "fused_add_rms_norm", [&] {
    fused_add_rms_norm_kernel<scalar_t>(x.data_ptr<scalar_t>(), r.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                                        x.size(0), x.size(1), x.stride(0), r.stride(0), static_cast<float>(epsilon));
  });
}

// (num_heads, token stride, head stride) of a [T, H*D] or [T, H, D] query/key.
std::array<int64_t, 3> head_geometry(const at::Tensor& t, int64_t T, int64_t head_size, const char* name) {
  check_cpu(t, name);
  check_last_contiguous(t, name);
  TORCH_CHECK((t.dim() == 2 || t.dim() == 3) && t.size(0) == T, name,
              " must be [num_tokens, num_heads * head_size] or [num_tokens, num_heads, head_size] with num_tokens = ",
              T, " (from positions), got ", t.sizes());
  if (t.dim() == 3) {
    TORCH_CHECK(t.size(2) == head_size, name, ".size(2) must equal head_size = ", head_size, ", got ", t.size(2));
    return {t.size(1), t.stride(0), t.stride(1)};
  }
  TORCH_CHECK(t.size(1) % head_size == 0, name, ".size(1) = ", t.size(1), " must be a multiple of head_size = ",
              head_size);
  return {t.size(1) / head_size, t.stride(0), head_size};
}

void rotary_embedding(const at::Tensor& positions, at::Tensor& query, at::Tensor& key, int64_t head_size,
                      const at::Tensor& cos_sin_cache, bool is_neox) {
  check_cpu(positions, "positions");
  check_dtype(positions, at::kLong, "positions");
  check_float(query, "query");
  check_same_dtype(key, query, "key", "query");
  check_cpu(cos_sin_cache, "cos_sin_cache");
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
  auto q = head_geometry(query, T, head_size, "query");
  auto k = head_geometry(key, T, head_size, "key");
  auto pos = positions.reshape({-1}).contiguous();
  const int64_t* p = pos.data_ptr<int64_t>();
  const int64_t max_pos = cos_sin_cache.size(0);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(p[t] >= 0 && p[t] < max_pos, "positions[", t, "] = ", p[t], " is out of range [0, ", max_pos,
                ") of cos_sin_cache");
  }
  RopeArgs a{p, T, q[0], k[0], rot, q[1], q[2], k[1], k[2], cos_sin_cache.stride(0), is_neox};
  PAGELLM_DISPATCH_FLOAT_TYPES(query.scalar_type(), "rotary_embedding", [&] {
    if (cos_sin_cache.scalar_type() == at::kFloat) {
      rotary_embedding_kernel(a, query.data_ptr<scalar_t>(), key.data_ptr<scalar_t>(), cos_sin_cache.data_ptr<float>());
    } else {
      rotary_embedding_kernel(a, query.data_ptr<scalar_t>(), key.data_ptr<scalar_t>(),
                              cos_sin_cache.data_ptr<scalar_t>());
    }
  });
}

}  // namespace
}  // namespace pagellm::cpu

TORCH_LIBRARY_IMPL(pagellm, CPU, m) {
  m.impl("rms_norm", &pagellm::cpu::rms_norm);
  m.impl("fused_add_rms_norm", &pagellm::cpu::fused_add_rms_norm);
  m.impl("rotary_embedding", &pagellm::cpu::rotary_embedding);
}
