// CUDA glue for gguf_linear: checks, device guard, stream (kernel in gguf_linear_kernels.cu).
#include <torch/library.h>

#include "ops/cuda_common/torch_glue.h"
#include "ops/quant/gguf_linear_checks.h"
#include "ops/quant/gguf_linear_launch.h"

namespace pagellm::cuda {
namespace {

void gguf_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, int64_t qtype, int64_t in_features,
                 const std::optional<at::Tensor>& bias) {
  check_cuda(out, "out");
  check_cuda(x, "x");
  check_cuda(qweight, "qweight");
  check_same_device(out, x, "out", "x");
  check_same_device(qweight, x, "qweight", "x");
  if (bias.has_value() && bias->defined()) check_same_device(*bias, x, "bias", "x");
  const gguf::GgufLinearInputs in = gguf::check_gguf_linear(out, x, qweight, qtype, in_features, bias);
  TORCH_CHECK(!in.packed, "qtype ", qtype, ": the row-packed GGUF layout is CPU-only; pass the file's layout on CUDA");
  TORCH_CHECK((reinterpret_cast<uintptr_t>(qweight.data_ptr()) & 1u) == 0,
              "qweight must start at an even address (its fp16 scales are read as 2-byte words)");
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(launch_gguf_linear(out.data_ptr(), in.x.data_ptr(), qweight.data_ptr<uint8_t>(),
                                  in.bias.defined() ? in.bias.data_ptr() : nullptr, in.M, in.N, in.K,
                                  in.x.stride(0), out.stride(0), in.row_bytes, in.qtype, to_dtype(x, "x"),
                                  current_stream()),
               "gguf_linear");
}

}  // namespace
}  // namespace pagellm::cuda

TORCH_LIBRARY_IMPL(pagellm, CUDA, m) { m.impl("gguf_linear", &pagellm::cuda::gguf_linear); }
