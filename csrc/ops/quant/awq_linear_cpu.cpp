// CPU glue for awq_linear: out[M, N] = x[M, K] @ W^T (+ bias), W the 4-bit group-quantized weight of
// awq_layout.h (qweight, scales, zeros).
//   M < kGemmMinM: the weight-streaming small-M kernel (awq_cpu_kernels.h), SIMD picked at run time;
//   larger M (prefill): tiles of weight rows dequantized into x's dtype, then torch's GEMM (oneDNN / MKL)
//   per tile, so each weight is expanded once per call however many rows x has.
#include <torch/library.h>

#include <cstdlib>
#include <string>

#include "ops/common/checks.h"
#include "ops/quant/awq_cpu_kernels.h"
#include "ops/quant/awq_linear_checks.h"

namespace pagellm::cpu {
namespace {

using awq::Isa;

// From this many rows on, dequantize-then-GEMM (the threshold gguf_linear measured for its streaming kernel,
// which does the same work per weight: past M ~ 16 MKL's blocked GEMM wins).
constexpr int64_t kGemmMinM = 16;
// Dequantized tile: ~1 MiB, so it is still in L2 when the GEMM reads it.
constexpr int64_t kTileBytes = 1 << 20;

// The SIMD path, chosen once: the best this CPU runs, or a narrower one named by PAGELLM_AWQ_CPU_ISA
// (scalar | avx2 | avx512), which the tests use to check the fallbacks on a wide machine.
Isa selected_isa() {
  static const Isa isa = [] {
    const Isa best = awq::best_isa();
    const char* env = std::getenv("PAGELLM_AWQ_CPU_ISA");
    if (env == nullptr || *env == '\0') return best;
    const std::string s(env);
    Isa want;
    if (s == "scalar") want = Isa::kScalar;
    else if (s == "avx2") want = Isa::kAvx2;
    else if (s == "avx512") want = Isa::kAvx512;
    else TORCH_CHECK(false, "PAGELLM_AWQ_CPU_ISA must be scalar, avx2 or avx512, got '", s, "'");
    TORCH_CHECK(static_cast<int>(want) <= static_cast<int>(best), "PAGELLM_AWQ_CPU_ISA=", s,
                ", but this CPU runs at most ", awq::isa_name(best));
    return want;
  }();
  return isa;
}

void gemm_path(at::Tensor& out, const awq::AwqLinearInputs& in, const awq::AwqWeightView& w, Isa isa) {
  const int64_t elem = static_cast<int64_t>(in.x.element_size());
  int64_t tile_rows = std::max<int64_t>(16, kTileBytes / (in.K * elem)) / 16 * 16;
  tile_rows = std::min(tile_rows, in.N);
  at::Tensor tile = at::empty({tile_rows, in.K}, in.x.options());
  for (int64_t n0 = 0; n0 < in.N; n0 += tile_rows) {
    const int64_t rows = std::min(tile_rows, in.N - n0);
    at::Tensor wt = tile.narrow(0, 0, rows);
    PAGELLM_DISPATCH_FLOAT_TYPES(in.x.scalar_type(), "awq_linear", [&] {
      awq::dequantize_rows<scalar_t>(w.from_row(n0), rows, wt.data_ptr<scalar_t>(), in.K, isa);
    });
    at::Tensor o = out.narrow(1, n0, rows);
    if (in.bias.defined()) at::addmm_out(o, in.bias.narrow(0, n0, rows), in.x, wt.t());
    else at::mm_out(o, in.x, wt.t());
  }
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
