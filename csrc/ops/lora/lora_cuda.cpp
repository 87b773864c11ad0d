// CUDA glue for lora_apply: checks, the fp32 scratch, stream (kernels in lora_kernels.cu). Slot values are not
// read back to the host (that would synchronize): out-of-range slots are skipped by the kernels and refused by
// the Python wrapper.
#include <torch/library.h>

#include "ops/cuda_common/torch_glue.h"
#include "ops/lora/lora_checks.h"
#include "ops/lora/lora_launch.h"

namespace pagellm::cuda {
namespace {

void lora_apply(at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
                const at::Tensor& scales, const at::Tensor& token_slots) {
  check_cuda(y, "y");
  check_cuda(x, "x");
  check_same_device(y, x, "y", "x");
  check_same_device(lora_a, x, "lora_a", "x");
  check_same_device(lora_b, x, "lora_b", "x");
  check_same_device(scales, x, "scales", "x");
  check_same_device(token_slots, x, "token_slots", "x");
  check_lora_apply_args(y, x, lora_a, lora_b, scales, token_slots);
  const DType dt = to_dtype(x, "x");
  const int64_t T = x.size(0), K = x.size(1), N = y.size(1), S = lora_a.size(0), R = lora_a.size(1);
  if (T == 0 || N == 0 || R == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor tmp = at::empty({T, R}, x.options().dtype(at::kFloat));
  check_launch(launch_lora_apply(y.data_ptr(), x.data_ptr(), lora_a.data_ptr(), lora_b.data_ptr(),
                                 scales.data_ptr<float>(), token_slots.data_ptr<int32_t>(), tmp.data_ptr<float>(), T, K,
                                 N, S, R, y.stride(0), x.stride(0), dt, current_stream()),
               "lora_apply");
}

}  // namespace
}  // namespace pagellm::cuda

TORCH_LIBRARY_IMPL(pagellm, CUDA, m) { m.impl("lora_apply", &pagellm::cuda::lora_apply); }
