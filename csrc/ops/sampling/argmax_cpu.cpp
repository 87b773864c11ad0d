// CPU glue for argmax_rows: logits [N, V] (float32 / bfloat16 / float16, unit column stride) -> out int64 [N].
#include <torch/library.h>

#include "ops/common/checks.h"
#include "ops/sampling/argmax_cpu_kernels.h"

namespace pagellm::cpu {
namespace {

void argmax_rows(at::Tensor& out, const at::Tensor& logits) {
  check_cpu(out, "out");
  check_cpu(logits, "logits");
  check_float(logits, "logits");
  check_dim(logits, 2, "logits");
  check_dtype(out, at::kLong, "out");
  const int64_t n = logits.size(0), v = logits.size(1);
  TORCH_CHECK(out.dim() == 1 && out.size(0) == n, "out must have shape [", n, "], got ", out.sizes());
  TORCH_CHECK(out.stride(0) == 1 || n <= 1, "out must be contiguous");
  TORCH_CHECK(v > 0 || n == 0, "logits must have at least one column, got shape ", logits.sizes());
  TORCH_CHECK(v < kArgmaxMaxCols, "logits may have at most ", kArgmaxMaxCols - 1, " columns, got ", v);
  if (n == 0) return;
  at::Tensor x = logits.stride(1) == 1 ? logits : logits.contiguous();
  PAGELLM_DISPATCH_FLOAT_TYPES(x.scalar_type(), "argmax_rows", [&] {
    argmax_rows_kernel<scalar_t>(out.data_ptr<int64_t>(), x.data_ptr<scalar_t>(), n, v, x.stride(0));
  });
}

}  // namespace
}  // namespace pagellm::cpu

TORCH_LIBRARY_IMPL(pagellm, CPU, m) { m.impl("argmax_rows", &pagellm::cpu::argmax_rows); }
