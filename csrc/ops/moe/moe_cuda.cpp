// CUDA glue for fused_moe: checks, contiguous operands, the workspace, device guard and stream (kernels in
// moe_kernels.cu). Ids outside [0, E) are not checked here (that would synchronise with the host); the kernels
// skip them, and the Python wrapper pagellm.ops.fused_moe refuses them.
#include <torch/library.h>

#include "ops/cuda_common/torch_glue.h"
#include "ops/moe/moe_checks.h"
#include "ops/moe/moe_launch.h"

namespace pagellm::cuda {
namespace {

at::Tensor fused_moe(const at::Tensor& hidden, const at::Tensor& w13, const at::Tensor& w2,
                     const at::Tensor& topk_weights, const at::Tensor& topk_ids, c10::string_view activation) {
  check_cuda(hidden, "hidden");
  check_same_device(w13, hidden, "w13", "hidden");
  check_same_device(w2, hidden, "w2", "hidden");
  check_same_device(topk_weights, hidden, "topk_weights", "hidden");
  check_same_device(topk_ids, hidden, "topk_ids", "hidden");
  const moe::MoeShape s = moe::check_fused_moe(hidden, w13, w2, topk_weights, topk_ids);
  const MoeActivation act = moe::parse_moe_activation(std::string(activation));
  TORCH_CHECK(s.T * s.k <= 0x7fffffffLL, "fused_moe: T * k = ", s.T * s.k, " pairs is beyond int32");
  at::Tensor out = at::empty({s.T, s.H}, hidden.options());
  if (out.numel() == 0) return out;
  if (s.k == 0 || s.I == 0) return out.zero_();
  const c10::cuda::CUDAGuard guard(hidden.device());
  const at::Tensor x = hidden.stride(1) == 1 ? hidden : hidden.contiguous();
  const at::Tensor w13c = w13.contiguous(), w2c = w2.contiguous();
  const at::Tensor weights = topk_weights.contiguous(), ids = topk_ids.contiguous();
  const int64_t P = s.T * s.k;
  const auto i32 = hidden.options().dtype(at::kInt), f32 = hidden.options().dtype(at::kFloat);
  at::Tensor offsets = at::empty({s.E + 1}, i32), pair_token = at::empty({P}, i32), pair_position = at::empty({P}, i32);
  at::Tensor gate_up = at::empty({P, 2 * s.I}, f32), act_rows = at::empty({P, s.I}, f32);
  at::Tensor expert_out = at::empty({P, s.H}, f32);
  const MoeWorkspace ws{offsets.data_ptr<int32_t>(), pair_token.data_ptr<int32_t>(), pair_position.data_ptr<int32_t>(),
                        gate_up.data_ptr<float>(),   act_rows.data_ptr<float>(),    expert_out.data_ptr<float>()};
  const MoeProblem problem{s.T, s.H, s.E, s.I, s.k, x.stride(0), out.stride(0)};
  check_launch(launch_fused_moe(out.data_ptr(), x.data_ptr(), w13c.data_ptr(), w2c.data_ptr(),
                                weights.data_ptr<float>(), ids.data_ptr<int32_t>(), problem, act, ws,
                                to_dtype(hidden, "hidden"), current_stream()),
               "fused_moe");
  return out;
}

}  // namespace
}  // namespace pagellm::cuda

TORCH_LIBRARY_IMPL(pagellm, CUDA, m) { m.impl("fused_moe", &pagellm::cuda::fused_moe); }
