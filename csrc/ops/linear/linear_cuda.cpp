// CUDA glue for linear_small_m: out [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N]), the weight-streaming GEMV
// of gemv_cuda.cuh (decode rows; correct for any M, fast for a few). pagellm.ops.linear_dispatch sends CUDA
// bf16 / fp16 linears of up to CUDA_GEMV_MAX_M rows here.
#include <torch/library.h>

#include <optional>

#include "ops/cuda_common/torch_glue.h"
#include "ops/linear/gemv_launch.h"
#include "ops/linear/linear_checks.h"

namespace pagellm::cuda {
namespace {

void linear_small_m(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias) {
  check_cuda(out, "out");
  check_cuda(x, "x");
  check_cuda(weight, "weight");
  check_same_device(weight, x, "weight", "x");
  check_same_device(out, x, "out", "x");
  if (bias.has_value() && bias->defined()) {
    check_cuda(*bias, "bias");
    check_same_device(*bias, x, "bias", "x");
  }
  const DType dt = to_dtype(x, "x");
  const at::Tensor b = linear::check_linear_args(out, x, weight, bias);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const at::Tensor wc = weight.stride(1) == 1 ? weight : weight.contiguous();
  const GemvArgs a{out.data_ptr(), xc.data_ptr(), wc.data_ptr(), b.defined() ? b.data_ptr() : nullptr,
                   M, N, K, xc.stride(0), wc.stride(0), out.stride(0)};
  check_launch(launch_linear_gemv(a, dt, current_stream()), "linear_small_m");
}

}  // namespace
}  // namespace pagellm::cuda

TORCH_LIBRARY_IMPL(pagellm, CUDA, m) { m.impl("linear_small_m", &pagellm::cuda::linear_small_m); }
