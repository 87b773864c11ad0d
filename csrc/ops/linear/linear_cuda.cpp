// CUDA glue for linear_small_m: out [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N]), the weight-streaming GEMV
// of gemv_cuda.cuh (decode rows; correct for any M, fast for a few). pagellm.ops.linear_dispatch sends CUDA
// bf16 / fp16 linears of up to CUDA_GEMV_MAX_M rows here.
#include <torch/library.h>

#include <optional>

#include "ops/cuda_common/torch_glue.h"
#include "ops/linear/gemv_launch.h"

namespace pagellm::cuda {
namespace {

void linear_small_m(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias) {
  check_cuda(out, "out");
  check_cuda(x, "x");
  check_cuda(weight, "weight");
  check_same_device(weight, x, "weight", "x");
  check_same_device(out, x, "out", "x");
  const DType dt = to_dtype(x, "x");
  check_same_dtype(weight, x, "weight", "x");
  check_same_dtype(out, x, "out", "x");
  check_dim(x, 2, "x");
  check_dim(weight, 2, "weight");
  check_dim(out, 2, "out");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "weight must have shape [N, ", K, "] (K of x), got ", weight.sizes());
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "out must have shape [", M, ", ", N, "], got ", out.sizes());
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = *bias;
    check_cuda(b, "bias");
    check_same_device(b, x, "bias", "x");
    check_same_dtype(b, x, "bias", "x");
    TORCH_CHECK(b.dim() == 1 && b.size(0) == N, "bias must have shape [", N, "], got ", b.sizes());
    b = b.contiguous();
  }
  check_last_contiguous(out, "out");
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
