// CPU glue for gguf_linear: out[M, N] = x[M, K] @ dequant(qweight)^T (+ bias), qweight in GGUF block layout.
//   M < kGemmMinM: the weight-streaming small-M kernel (gguf_cpu_kernels.h), SIMD picked at run time
//   (half-precision x meets the blocks as int8 in VNNI dot products where the CPU has them);
//   larger M (prefill): tiles of weight rows dequantized into x's dtype, then torch's GEMM (oneDNN / MKL)
//   per tile, so each weight block is expanded once per call however many rows x has.
#include <torch/library.h>

#include <cstdlib>
#include <string>

#include "ops/common/checks.h"
#include "ops/quant/gguf_cpu_kernels.h"
#include "ops/quant/gguf_linear_checks.h"

namespace pagellm::cpu {
namespace {

using gguf::Isa;

// From this many rows on, dequantize-then-GEMM: measured on an AVX-512 VNNI CPU without AMX (1 thread, 1536x576
// and 4096x4096 Q4_1), the small-M kernel matches or beats torch's GEMM (F.linear, bf16 and fp32) up to
// M ~ 16-32; past that MKL's fp32 GEMM is 2-4x faster, and a CPU with AMX makes the bf16 GEMM faster still.
constexpr int64_t kGemmMinM = 16;
// Dequantized tile: ~1 MiB, so it is still in L2 when the GEMM reads it.
constexpr int64_t kTileBytes = 1 << 20;

// The SIMD path, chosen once: the best this CPU runs, or a narrower one named by PAGELLM_GGUF_CPU_ISA
// (scalar | avx2 | avx512 | avx512_vnni), which the tests use to check the fallbacks on a wide machine.
Isa selected_isa() {
  static const Isa isa = [] {
    const Isa best = gguf::best_isa();
    const char* env = std::getenv("PAGELLM_GGUF_CPU_ISA");
    if (env == nullptr || *env == '\0') return best;
    const std::string s(env);
    Isa want;
    if (s == "scalar") want = Isa::kScalar;
    else if (s == "avx2") want = Isa::kAvx2;
    else if (s == "avx512") want = Isa::kAvx512;
    else if (s == "avx512_vnni") want = Isa::kAvx512Vnni;
    else TORCH_CHECK(false, "PAGELLM_GGUF_CPU_ISA must be scalar, avx2, avx512 or avx512_vnni, got '", s, "'");
    TORCH_CHECK(static_cast<int>(want) <= static_cast<int>(best), "PAGELLM_GGUF_CPU_ISA=", s,
                ", but this CPU runs at most ", gguf::isa_name(best));
    return want;
  }();
  return isa;
}

void gemm_path(at::Tensor& out, const gguf::GgufLinearInputs& in, const uint8_t* w, Isa isa) {
  const int64_t elem = static_cast<int64_t>(in.x.element_size());
  int64_t tile_rows = std::max<int64_t>(16, kTileBytes / (in.K * elem)) / 16 * 16;
  tile_rows = std::min(tile_rows, in.N);
  at::Tensor tile = at::empty({tile_rows, in.K}, in.x.options());
  for (int64_t n0 = 0; n0 < in.N; n0 += tile_rows) {
    const int64_t rows = std::min(tile_rows, in.N - n0);
    at::Tensor wt = tile.narrow(0, 0, rows);
    PAGELLM_DISPATCH_FLOAT_TYPES(in.x.scalar_type(), "gguf_linear", [&] {
      gguf::dequantize_rows<scalar_t>(in.qtype, w + n0 * in.row_bytes, in.row_bytes, rows, in.K,
                                      wt.data_ptr<scalar_t>(), in.K, isa);
    });
    at::Tensor o = out.narrow(1, n0, rows);
    if (in.bias.defined()) at::addmm_out(o, in.bias.narrow(0, n0, rows), in.x, wt.t());
    else at::mm_out(o, in.x, wt.t());
  }
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
  const gguf::GgufLinearArgs a{in.M, in.N, in.K, in.x.stride(0), out.stride(0), in.row_bytes, in.qtype};
  PAGELLM_DISPATCH_FLOAT_TYPES(x.scalar_type(), "gguf_linear", [&] {
    gguf::gguf_linear_small_m<scalar_t>(out.data_ptr<scalar_t>(), in.x.data_ptr<scalar_t>(), w,
                                        in.bias.defined() ? in.bias.data_ptr<scalar_t>() : nullptr, a, isa);
  });
}

}  // namespace
}  // namespace pagellm::cpu

TORCH_LIBRARY_IMPL(pagellm, CPU, m) { m.impl("gguf_linear", &pagellm::cpu::gguf_linear); }
