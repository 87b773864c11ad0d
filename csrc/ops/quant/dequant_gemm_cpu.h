// What the CPU glue of the quantized-weight matmuls (gguf_linear, awq_linear) shares:
//   * the SIMD path chosen once from the CPU, narrowed by an environment variable (the tests force each
//     fallback on a wide machine);
//   * the large-M path: tiles of weight rows dequantized into x's dtype (~1 MiB, still in L2 when the GEMM
//     reads them), then torch's GEMM (oneDNN / MKL) per tile, so each weight is expanded once per call
//     however many rows x has.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <initializer_list>
#include <string>
#include <utility>

namespace pagellm::cpu {

// The ISA named by `env_var` (one of `names`, which lists every ISA with its name), or `best` when it is
// unset; an unknown name or one wider than `best` fails with the names allowed. Isa: an enum ordered from
// narrowest to widest.
template <typename Isa>
Isa isa_from_env(const char* env_var, Isa best, std::initializer_list<std::pair<const char*, Isa>> names) {
  const char* env = std::getenv(env_var);
  if (env == nullptr || *env == '\0') return best;
  const std::string s(env);
  std::string allowed, best_name;  // "a, b or c"
  size_t i = 0;
  for (const auto& [name, isa] : names) {
    if (isa == best) best_name = name;
    if (i > 0) allowed += (i + 1 == names.size()) ? " or " : ", ";
    allowed += name;
    ++i;
  }
  for (const auto& [name, isa] : names) {
    if (s != name) continue;
    TORCH_CHECK(static_cast<int>(isa) <= static_cast<int>(best), env_var, "=", s, ", but this CPU runs at most ",
                best_name);
    return isa;
  }
  TORCH_CHECK(false, env_var, " must be ", allowed, ", got '", s, "'");
  return best;
}

// out[M, N] (+)= x[M, K] @ W^T (+ bias) with W dequantized tile by tile: dequantize(n0, rows, tile) fills
// tile [rows, K] (x's dtype, contiguous) with weight rows [n0, n0 + rows).
template <typename DequantizeRows>
void dequantized_gemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& bias, int64_t N, int64_t K,
                      const DequantizeRows& dequantize) {
  constexpr int64_t kTileBytes = 1 << 20;
  const int64_t elem = static_cast<int64_t>(x.element_size());
  const int64_t tile_rows = std::min(std::max<int64_t>(16, kTileBytes / (K * elem)) / 16 * 16, N);
  at::Tensor tile = at::empty({tile_rows, K}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += tile_rows) {
    const int64_t rows = std::min(tile_rows, N - n0);
    at::Tensor wt = tile.narrow(0, 0, rows);
    dequantize(n0, rows, wt);
    at::Tensor o = out.narrow(1, n0, rows);
    if (bias.defined()) at::addmm_out(o, bias.narrow(0, n0, rows), x, wt.t());
    else at::mm_out(o, x, wt.t());
  }
}

}  // namespace pagellm::cpu
