// CUDA glue for int8_linear (kernels in int8_linear_kernels.cu): checks, scratch buffers, launch.
#include <torch/library.h>

#include <optional>

#include "ops/cuda_common/torch_glue.h"
#include "ops/quant/int8_linear_checks.h"
#include "ops/quant/int8_linear_launch.h"

namespace pagellm::cuda {
namespace {

void int8_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                 const std::optional<at::Tensor>& bias, double threshold, bool zero_point, int64_t group_size) {
  check_cuda(x, "x");
  check_cuda(out, "out");
  check_same_device(out, x, "out", "x");
  check_cuda(weight, "weight");
  check_same_device(weight, x, "weight", "x");
  check_cuda(weight_scale, "weight_scale");
  check_same_device(weight_scale, x, "weight_scale", "x");
  if (bias.has_value() && bias->defined()) {
    check_cuda(*bias, "bias");
    check_same_device(*bias, x, "bias", "x");
  }
  const DType dt = to_dtype(x, "x");
  const auto [M, N, K, has_bias] =
      ::pagellm::int8::check_int8_linear_args(out, x, weight, weight_scale, bias, threshold, zero_point, group_size);
  TORCH_CHECK(M <= 65535, "x: at most 65535 rows per call, got ", M);
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  if (K == 0) {
    if (has_bias) out.copy_(bias->unsqueeze(0).expand_as(out));
    else out.zero_();
    return;
  }
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const at::Tensor wc = weight.stride(1) == 1 ? weight : weight.contiguous();
  const at::Tensor sc = weight_scale.contiguous();
  const at::Tensor bc = has_bias ? bias->contiguous() : at::Tensor();
  const int64_t ldq = (K + 15) / 16 * 16;
  at::Tensor mask = at::empty({ldq}, x.options().dtype(at::kByte));
  at::Tensor q = at::empty({M, ldq}, x.options().dtype(at::kChar));
  const int64_t num_groups = group_size > 0 ? (K + group_size - 1) / group_size : 1;
  at::Tensor row_scale = at::empty({M, num_groups}, x.options().dtype(at::kFloat));
  at::Tensor row_zero = at::empty({M}, x.options().dtype(at::kInt));
  Int8LinearCudaArgs a{out.data_ptr(), xc.data_ptr(), wc.data_ptr<int8_t>(), sc.data_ptr<float>(),
                       has_bias ? bc.data_ptr() : nullptr, M, N, K, xc.stride(0), wc.stride(0), out.stride(0),
                       static_cast<float>(threshold), zero_point, group_size, num_groups, mask.data_ptr<uint8_t>(),
                       q.data_ptr<int8_t>(),
                       row_scale.data_ptr<float>(), row_zero.data_ptr<int32_t>(), ldq};
  check_launch(launch_int8_linear(a, dt, current_stream()), "int8_linear");
}

}  // namespace
}  // namespace pagellm::cuda

TORCH_LIBRARY_IMPL(pagellm, CUDA, m) { m.impl("int8_linear", &pagellm::cuda::int8_linear); }
