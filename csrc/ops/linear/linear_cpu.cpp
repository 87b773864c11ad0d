// CPU glue for linear_small_m: out[M, N] = x[M, K] @ weight[N, K]^T (+ bias[N]); designed for small M
// (decode), correct for any M.
#include <torch/library.h>

#include "ops/common/checks.h"
#include "ops/linear/linear_cpu_kernels.h"

namespace pagellm::cpu {
namespace {

void linear_small_m(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias) {
  check_cpu(out, "out");
  check_cpu(x, "x");
  check_cpu(weight, "weight");
  check_float(x, "x");
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
    check_cpu(b, "bias");
    check_same_dtype(b, x, "bias", "x");
    TORCH_CHECK(b.dim() == 1 && b.size(0) == N, "bias must have shape [", N, "], got ", b.sizes());
    b = b.contiguous();
  }
  check_last_contiguous(out, "out");
  if (out.numel() == 0) return;
  if (K == 0) {
    if (b.defined()) out.copy_(b.unsqueeze(0).expand({M, N}));
    else out.zero_();
    return;
  }
  at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor wc = weight.stride(1) == 1 ? weight : weight.contiguous();
  LinearArgs a{M, N, K, xc.stride(0), wc.stride(0), out.stride(0)};
  PAGELLM_DISPATCH_FLOAT_TYPES(x.scalar_type(), "linear_small_m", [&] {
    linear_small_m_kernel<scalar_t>(out.data_ptr<scalar_t>(), xc.data_ptr<scalar_t>(), wc.data_ptr<scalar_t>(),
                                    b.defined() ? b.data_ptr<scalar_t>() : nullptr, a);
  });
}

}  // namespace
}  // namespace pagellm::cpu

TORCH_LIBRARY_IMPL(pagellm, CPU, m) { m.impl("linear_small_m", &pagellm::cpu::linear_small_m); }
