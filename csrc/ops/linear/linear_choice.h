// Which kernel a bf16 CPU linear of M rows runs; pagellm/layers/linear.py mirrors this rule (keep the
// two in sync). Measured on the 2-core AMX dev machine (benchmarks/bench_ops.py, linear section):
//   - the weight-streaming small-M kernel wins at M = 1-2 everywhere, and up to M = 4 without AMX;
//   - the AMX tile kernel wins from M = 3 to 64 (1.2-2x oneDNN's bf16 GEMM on model shapes), by 1.1-1.4x
//     at 128-256 rows on the wide shapes (gate/up, the LM head) and is about even on the others;
//   - beyond that (prefill chunks) oneDNN (at::linear) is as fast or faster.
#pragma once

#include <cstdint>

namespace pagellm::cpu {

namespace amx {
// Whether torch.ops.pagellm.linear_amx can run: built with AMX-BF16, the CPU has it (CPUID), and the OS
// granted the tile state (Linux arch_prctl). Checked once; defined in linear_cpu.cpp.
bool amx_bf16_usable();
}  // namespace amx

enum class LinearPath { kSmallM, kAmx, kAten };

constexpr int64_t kSmallMMax = 4;     // small-M kernel limit on CPUs without AMX
constexpr int64_t kSmallMMaxAmx = 2;  // ... and with AMX
constexpr int64_t kAmxMaxM = 256;     // AMX tile kernel up to this many rows

inline LinearPath choose_bf16_linear(int64_t m, bool amx) {
  if (m <= 0) return LinearPath::kAten;
  if (m <= (amx ? kSmallMMaxAmx : kSmallMMax)) return LinearPath::kSmallM;
  if (amx && m <= kAmxMaxM) return LinearPath::kAmx;
  return LinearPath::kAten;
}

}  // namespace pagellm::cpu
