// CPU glue for lora_apply: checks (slot values included, before anything is written), dtype dispatch.
#include <torch/library.h>

#include "ops/common/checks.h"
#include "ops/lora/lora_checks.h"
#include "ops/lora/lora_cpu_kernels.h"

namespace pagellm::cpu {
namespace {

void lora_apply(at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
                const at::Tensor& scales, const at::Tensor& token_slots) {
  check_cpu(y, "y");
  check_cpu(x, "x");
  check_cpu(lora_a, "lora_a");
  check_cpu(lora_b, "lora_b");
  check_cpu(scales, "scales");
  check_cpu(token_slots, "token_slots");
  check_lora_apply_args(y, x, lora_a, lora_b, scales, token_slots);
  const int64_t T = x.size(0), K = x.size(1), N = y.size(1), S = lora_a.size(0), R = lora_a.size(1);
  const int32_t* slots = token_slots.data_ptr<int32_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slots[t] >= -1 && slots[t] < S, "token_slots must be in [-1, ", S, "), got ", slots[t],
                " at token ", t);
  }
  if (T == 0 || N == 0) return;
  PAGELLM_DISPATCH_FLOAT_TYPES(x.scalar_type(), "lora_apply", [&] {
    lora_apply_kernel<scalar_t>(y.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), lora_a.data_ptr<scalar_t>(),
                                lora_b.data_ptr<scalar_t>(), scales.data_ptr<float>(), slots, T, K, N, S, R,
                                y.stride(0), x.stride(0));
  });
}

}  // namespace
}  // namespace pagellm::cpu

TORCH_LIBRARY_IMPL(pagellm, CPU, m) { m.impl("lora_apply", &pagellm::cpu::lora_apply); }
