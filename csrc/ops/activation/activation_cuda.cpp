// CUDA glue for silu_and_mul / gelu_and_mul: input [..., 2d] -> out [..., d] (kernels in activation_kernels.cu).
#include <torch/library.h>

#include <string>
#include <vector>

#include "ops/activation/activation_launch.h"
#include "ops/cuda_common/torch_glue.h"

namespace pagellm::cuda {
namespace {

void run_gated(at::Tensor& out, const at::Tensor& input, GateActKind act, const char* op) {
  check_cuda(out, "out");
  check_cuda(input, "input");
  check_same_device(input, out, "input", "out");
  const DType dt = to_dtype(input, "input");
  check_same_dtype(out, input, "out", "input");
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) % 2 == 0, "input's last dimension must be even (2*d), got shape ",
              input.sizes());
  const int64_t d = input.size(-1) / 2;
  std::vector<int64_t> expect(input.sizes().begin(), input.sizes().end());
  expect.back() = d;
  TORCH_CHECK(out.sizes() == at::IntArrayRef(expect), "out must have shape ", at::IntArrayRef(expect), ", got ",
              out.sizes());
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(input.device());
  at::Tensor x2 = input.reshape({-1, 2 * d});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  at::Tensor o2 = out.view({-1, d});  // throws if out cannot be viewed as [rows, d]
  check_last_contiguous(o2, "out");
  check_launch(launch_act_and_mul(o2.data_ptr(), x2.data_ptr(), x2.size(0), d, o2.stride(0), x2.stride(0), dt, act,
                                  current_stream()),
               op);
}

void silu_and_mul(at::Tensor& out, const at::Tensor& input) {
  run_gated(out, input, GateActKind::kSilu, "silu_and_mul");
}

void gelu_and_mul(at::Tensor& out, const at::Tensor& input, c10::string_view approximate) {
  if (approximate == "none") {
    run_gated(out, input, GateActKind::kGelu, "gelu_and_mul");
  } else if (approximate == "tanh") {
    run_gated(out, input, GateActKind::kGeluTanh, "gelu_and_mul");
  } else {
    TORCH_CHECK(false, "approximate must be 'none' or 'tanh', got '", std::string(approximate), "'");
  }
}

}  // namespace
}  // namespace pagellm::cuda

TORCH_LIBRARY_IMPL(pagellm, CUDA, m) {
  m.impl("silu_and_mul", &pagellm::cuda::silu_and_mul);
  m.impl("gelu_and_mul", &pagellm::cuda::gelu_and_mul);
}
