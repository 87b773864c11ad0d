// CPU glue for gguf_linear: out[M, N] = x[M, K] @ dequant(qweight)^T (+ bias), qweight in GGUF block layout.
//   M < kGemmMinM: the weight-streaming small-M kernel (gguf_cpu_kernels.h), SIMD picked at run time
//   (half-precision x meets the blocks as int8 in VNNI dot products where the CPU has them);
//   larger M (prefill): dequantized tiles of weight rows and torch's GEMM (dequant_gemm_cpu.h).
#include <torch/library.h>

#include "ops/common/checks.h"
#include "ops/quant/gguf_cpu_kernels.h"
#include "ops/quant/dequant_gemm_cpu.h"
#include "ops/quant/gguf_linear_checks.h"

namespace pagellm::cpu {
namespace {

using gguf::Isa;

// From this many rows on, dequantize-then-GEMM: measured on an AVX-512 VNNI CPU without AMX (1 thread, 1536x576
// and 4096x4096 Q4_1), the small-M kernel matches or beats torch's GEMM (F.linear, bf16 and fp32) up to
// M ~ 16-32; past that MKL's fp32 GEMM is 2-4x faster, and a CPU with AMX makes the bf16 GEMM faster still.
constexpr int64_t kGemmMinM = 16;

// The SIMD path, chosen once: the best this CPU runs, or a narrower one named by PAGELLM_GGUF_CPU_ISA.
Isa selected_isa() {
  static const Isa isa = isa_from_env<Isa>("PAGELLM_GGUF_CPU_ISA", gguf::best_isa(),
                                          {{"scalar", Isa::kScalar}, {"avx2", Isa::kAvx2}, {"avx512", Isa::kAvx512},
                                           {"avx512_vnni", Isa::kAvx512Vnni}});
  return isa;
}

void gemm_path(at::Tensor& out, const gguf::GgufLinearInputs& in, const uint8_t* w, Isa isa) {
  dequantized_gemm(out, in.x, in.bias, in.N, in.K, [&](int64_t n0, int64_t rows, at::Tensor& tile) {
    PAGELLM_DISPATCH_FLOAT_TYPES(in.x.scalar_type(), "gguf_linear", [&] {
      if (in.packed) {  // rows are found by index in their 16-row group
        gguf::dequantize_rows<scalar_t>(in.qtype, w, in.row_bytes, rows, in.K, tile.data_ptr<scalar_t>(), in.K, isa,
                                        true, in.N, n0);
      } else {
        gguf::dequantize_rows<scalar_t>(in.qtype, w + n0 * in.row_bytes, in.row_bytes, rows, in.K,
                                        tile.data_ptr<scalar_t>(), in.K, isa);
      }
    });
  });
}

void gguf_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, int64_t qtype, int64_t in_features,
                 const std::optional<at::Tensor>& bias) {
  check_cpu(out, "out");
  check_cpu(x, "x");
  check_cpu(qweight, "qweight");
  if (bias.has_value() && bias->defined()) check_cpu(*bias, "bias");
  const gguf::GgufLinearInputs in = gguf::check_gguf_linear(out, x, qweight, qtype, in_features, bias);
  if (out.numel() == 0) return;
  const auto* w = qweight.data_ptr<uint8_t>();
  const Isa isa = selected_isa();
  if (in.M >= kGemmMinM) return gemm_path(out, in, w, isa);
  const gguf::GgufLinearArgs a{in.M, in.N, in.K, in.x.stride(0), out.stride(0), in.row_bytes, in.qtype, in.packed};
  PAGELLM_DISPATCH_FLOAT_TYPES(x.scalar_type(), "gguf_linear", [&] {
    gguf::gguf_linear_small_m<scalar_t>(out.data_ptr<scalar_t>(), in.x.data_ptr<scalar_t>(), w,
                                        in.bias.defined() ? in.bias.data_ptr<scalar_t>() : nullptr, a, isa);
  });
}

}  // namespace
}  // namespace pagellm::cpu

TORCH_LIBRARY_IMPL(pagellm, CPU, m) { m.impl("gguf_linear", &pagellm::cpu::gguf_linear); }
