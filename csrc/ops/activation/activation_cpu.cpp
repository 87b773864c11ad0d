// CPU glue for silu_and_mul / gelu_and_mul: input [..., 2d] -> out [..., d].
#include <torch/library.h>

#include <string>

#include "ops/activation/activation_cpu_kernels.h"
#include "ops/common/checks.h"

namespace pagellm::cpu {
namespace {

template <GateAct A>
void run_gated(at::Tensor& out, const at::Tensor& input) {
  check_cpu(out, "out");
  check_cpu(input, "input");
  check_float(input, "input");
  check_same_dtype(out, input, "out", "input");
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) % 2 == 0, "input's last dimension must be even (2*d), got shape ",
              input.sizes());
  const int64_t d = input.size(-1) / 2;
  std::vector<int64_t> expect(input.sizes().begin(), input.sizes().end());
  expect.back() = d;
  TORCH_CHECK(out.sizes() == at::IntArrayRef(expect), "out must have shape ", at::IntArrayRef(expect), ", got ",
              out.sizes());
  if (out.numel() == 0) return;
  at::Tensor x2 = input.reshape({-1, 2 * d});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  at::Tensor o2 = out.view({-1, d});  // throws if out cannot be viewed as [rows, d]
  check_last_contiguous(o2, "out");
  PAGELLM_DISPATCH_FLOAT_TYPES(input.scalar_type(), "gated_activation", [&] {
    gated_activation_kernel<A, scalar_t>(o2.data_ptr<scalar_t>(), x2.data_ptr<scalar_t>(), x2.size(0), d,
                                         o2.stride(0), x2.stride(0));
  });
}

void silu_and_mul(at::Tensor& out, const at::Tensor& input) { run_gated<GateAct::kSilu>(out, input); }

void gelu_and_mul(at::Tensor& out, const at::Tensor& input, c10::string_view approximate) {
  if (approximate == "none") {
    run_gated<GateAct::kGeluErf>(out, input);
  } else if (approximate == "tanh") {
    run_gated<GateAct::kGeluTanh>(out, input);
  } else {
    TORCH_CHECK(false, "approximate must be 'none' or 'tanh', got '", std::string(approximate), "'");
  }
}

}  // namespace
}  // namespace pagellm::cpu

TORCH_LIBRARY_IMPL(pagellm, CPU, m) {
  m.impl("silu_and_mul", &pagellm::cpu::silu_and_mul);
  m.impl("gelu_and_mul", &pagellm::cpu::gelu_and_mul);
}
