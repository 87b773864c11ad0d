// CPU glue for awq_linear: out[M, N] = x[M, K] @ W^T (+ bias), W the 4-bit group-quantized weight of
// awq_layout.h (qweight, scales, zeros).
//   M < kGemmMinM: the weight-streaming small-M kernel (awq_cpu_kernels.h), SIMD picked at run time
//   (half-precision x meets the raw nibbles as int8 in VNNI dot products where the CPU has them);
//   larger M (prefill): dequantized tiles of weight rows and torch's GEMM (dequant_gemm_cpu.h).
#include <torch/library.h>

#include "ops/common/checks.h"
#include "ops/quant/awq_cpu_kernels.h"
#include "ops/quant/awq_linear_checks.h"
#include "ops/quant/dequant_gemm_cpu.h"

namespace pagellm::cpu {
namespace {

using awq::Isa;

// From this many rows on, dequantize-then-GEMM (the threshold gguf_linear measured for its streaming kernel,
// which does the same work per weight: past M ~ 16 MKL's blocked GEMM wins).
constexpr int64_t kGemmMinM = 16;

// The SIMD path, chosen once: the best this CPU runs, or a narrower one named by PAGELLM_AWQ_CPU_ISA
// ("vnni" = "avx512_vnni", gguf_linear's name for it).
Isa selected_isa() {
  static const Isa isa = isa_from_env<Isa>("PAGELLM_AWQ_CPU_ISA", awq::best_isa(),
                                          {{"scalar", Isa::kScalar}, {"avx2", Isa::kAvx2}, {"avx512", Isa::kAvx512},
                                           {"vnni", Isa::kAvx512Vnni}, {"avx512_vnni", Isa::kAvx512Vnni}});
  return isa;
}

void gemm_path(at::Tensor& out, const awq::AwqLinearInputs& in, const awq::AwqWeightView& w, Isa isa) {
  dequantized_gemm(out, in.x, in.bias, in.N, in.K, [&](int64_t n0, int64_t rows, at::Tensor& tile) {
    PAGELLM_DISPATCH_FLOAT_TYPES(in.x.scalar_type(), "awq_linear", [&] {
      awq::dequantize_rows<scalar_t>(w.from_row(n0), rows, tile.data_ptr<scalar_t>(), in.K, isa);
    });
  });
}

void awq_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                const at::Tensor& zeros, int64_t group_size, const std::optional<at::Tensor>& bias) {
  check_cpu(out, "out");
  check_cpu(x, "x");
  check_cpu(qweight, "qweight");
  check_cpu(scales, "scales");
  check_cpu(zeros, "zeros");
  if (bias.has_value() && bias->defined()) check_cpu(*bias, "bias");
  const awq::AwqLinearInputs in = awq::check_awq_linear(out, x, qweight, scales, zeros, group_size, bias);
  const Isa isa = selected_isa();
  if (out.numel() == 0) return;
  const awq::AwqWeightView w{qweight.data_ptr<uint8_t>(), scales.data_ptr<float>(), zeros.data_ptr<uint8_t>(), in.K,
                             in.group_size};
  if (in.M >= kGemmMinM) return gemm_path(out, in, w, isa);
  const awq::AwqLinearArgs a{in.M, in.N, in.x.stride(0), out.stride(0)};
  PAGELLM_DISPATCH_FLOAT_TYPES(x.scalar_type(), "awq_linear", [&] {
    awq::awq_linear_small_m<scalar_t>(out.data_ptr<scalar_t>(), in.x.data_ptr<scalar_t>(), w,
                                      in.bias.defined() ? in.bias.data_ptr<scalar_t>() : nullptr, a, isa);
  });
}

}  // namespace
}  // namespace pagellm::cpu

TORCH_LIBRARY_IMPL(pagellm, CPU, m) { m.impl("awq_linear", &pagellm::cpu::awq_linear); }
