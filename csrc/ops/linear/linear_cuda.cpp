// CUDA glue for linear_small_m: out [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N]), the weight-streaming GEMV
// of gemv_cuda.cuh (decode rows; correct for any M, fast for a few), and linear_gemv: the same product with the
// kernel chosen by the caller (gemv_split_cuda.cuh's split-K kernel, PDL). pagellm.ops.linear_dispatch sends CUDA
// bf16 / fp16 linears of up to CUDA_GEMV_MAX_M rows to linear_gemv.
#include <torch/library.h>

#include <optional>

#include "ops/cuda_common/torch_glue.h"
#include "ops/linear/gemv_glue_cuda.h"
#include "ops/linear/gemv_launch.h"
#include "ops/linear/linear_checks.h"

namespace pagellm::cuda {

std::optional<GemvArgs> gemv_args(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, GemvInputs& held) {
  check_cuda(out, "out");
  check_cuda(x, "x");
  check_cuda(weight, "weight");
  check_same_device(weight, x, "weight", "x");
  check_same_device(out, x, "out", "x");
  if (bias.has_value() && bias->defined()) {
    check_cuda(*bias, "bias");
    check_same_device(*bias, x, "bias", "x");
  }
  to_dtype(x, "x");
  held.bias = linear::check_linear_args(out, x, weight, bias);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  if (out.numel() == 0) return std::nullopt;
  held.x = x.stride(1) == 1 ? x : x.contiguous();
  held.weight = weight.stride(1) == 1 ? weight : weight.contiguous();
  return GemvArgs{out.data_ptr(), held.x.data_ptr(), held.weight.data_ptr(),
                  held.bias.defined() ? held.bias.data_ptr() : nullptr,
                  M, N, K, held.x.stride(0), held.weight.stride(0), out.stride(0)};
}

namespace {

void linear_small_m(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias) {
  GemvInputs held;
  const std::optional<GemvArgs> a = gemv_args(out, x, weight, bias, held);
  if (!a) return;
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(launch_linear_gemv(*a, to_dtype(x, "x"), current_stream()), "linear_small_m");
}

// kernel 2: the fewest K slices (of >= 64 vectors) that make >= 512 CTAs; kernel 3: >= 1024 CTAs, slices down to
// 32 vectors (one per lane): more, shorter CTAs (on the ~1B model: qkv, o and down get S = 8 instead of 4);
// kernel 4: kernel 2's slices (its bits) with half the vectors in flight per lane at M <= 2, more CTAs per SM.
void linear_gemv(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                 int64_t kernel, bool pdl) {
  TORCH_CHECK(kernel >= 1 && kernel <= 4, "linear_gemv: kernel must be 1, 2, 3 or 4, got ", kernel);
  GemvInputs held;
  const std::optional<GemvArgs> a = gemv_args(out, x, weight, bias, held);
  if (!a) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const DType dt = to_dtype(x, "x");
  const bool more_slices = kernel == 3;
  const cudaError_t err =
      kernel == 1 ? launch_linear_gemv(*a, dt, current_stream())
                  : launch_linear_gemv_split(*a, dt, more_slices ? 1024 : 512, more_slices ? 32 : 64, kernel == 4, pdl,
                                             current_stream());
  check_launch(err, "linear_gemv");
}

}  // namespace
}  // namespace pagellm::cuda

TORCH_LIBRARY_IMPL(pagellm, CUDA, m) {
  m.impl("linear_small_m", &pagellm::cuda::linear_small_m);
  m.impl("linear_gemv", &pagellm::cuda::linear_gemv);
}
