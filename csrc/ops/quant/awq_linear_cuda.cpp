// CUDA glue for awq_linear: checks, device guard, stream (kernels in awq_linear_kernels.cu).
//   M < kGemmMinM: the dequantize-in-register GEMV;
//   larger M: tiles of weight rows expanded into x's dtype, then cuBLAS (at::mm on the current stream).
#include <torch/library.h>

#include "ops/cuda_common/torch_glue.h"
#include "ops/quant/awq_linear_checks.h"
#include "ops/quant/awq_linear_launch.h"

namespace pagellm::cuda {
namespace {

constexpr int64_t kGemmMinM = 16;
// Expanded weight tile: bounds the scratch a prefill of a large layer allocates.
constexpr int64_t kTileBytes = int64_t{64} << 20;

void gemm_path(at::Tensor& out, const awq::AwqLinearInputs& in, const at::Tensor& qweight, const at::Tensor& scales,
               const at::Tensor& zeros) {
  const int64_t elem = static_cast<int64_t>(in.x.element_size());
  const int64_t tile_rows = std::min(in.N, std::max<int64_t>(128, kTileBytes / (in.K * elem)));
  const int64_t num_groups = in.K / in.group_size;
  at::Tensor tile = at::empty({tile_rows, in.K}, in.x.options());
  for (int64_t n0 = 0; n0 < in.N; n0 += tile_rows) {
    const int64_t rows = std::min(tile_rows, in.N - n0);
    at::Tensor wt = tile.narrow(0, 0, rows);
    check_launch(launch_awq_dequantize(wt.data_ptr(), qweight.data_ptr<uint8_t>() + n0 * (in.K / 2),
                                       scales.data_ptr<float>() + n0 * num_groups,
                                       zeros.data_ptr<uint8_t>() + n0 * num_groups, rows, in.K, in.group_size, in.K,
                                       to_dtype(in.x, "x"), current_stream()),
                 "awq_linear (dequantize)");
    at::Tensor o = out.narrow(1, n0, rows);
    if (in.bias.defined()) at::addmm_out(o, in.bias.narrow(0, n0, rows), in.x, wt.t());
    else at::mm_out(o, in.x, wt.t());
  }
}

void awq_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                const at::Tensor& zeros, int64_t group_size, const std::optional<at::Tensor>& bias) {
  check_cuda(out, "out");
  check_cuda(x, "x");
  check_cuda(qweight, "qweight");
  check_cuda(scales, "scales");
  check_cuda(zeros, "zeros");
  check_same_device(qweight, x, "qweight", "x");
  check_same_device(scales, x, "scales", "x");
  check_same_device(zeros, x, "zeros", "x");
  check_same_device(out, x, "out", "x");
  if (bias.has_value() && bias->defined()) check_same_device(*bias, x, "bias", "x");
  const awq::AwqLinearInputs in = awq::check_awq_linear(out, x, qweight, scales, zeros, group_size, bias);
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  if (in.M >= kGemmMinM) return gemm_path(out, in, qweight, scales, zeros);
  // The GEMV reads each block as one 16-byte word: a view at an odd offset is copied to a fresh allocation.
  const at::Tensor qw = aligned16(qweight) ? qweight : qweight.clone();
  check_launch(launch_awq_linear(out.data_ptr(), in.x.data_ptr(), qw.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                                 zeros.data_ptr<uint8_t>(), in.bias.defined() ? in.bias.data_ptr() : nullptr, in.M,
                                 in.N, in.K, in.group_size, in.x.stride(0), out.stride(0), to_dtype(x, "x"),
                                 current_stream()),
               "awq_linear");
}

}  // namespace
}  // namespace pagellm::cuda

TORCH_LIBRARY_IMPL(pagellm, CUDA, m) { m.impl("awq_linear", &pagellm::cuda::awq_linear); }
