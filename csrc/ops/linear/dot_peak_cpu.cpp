// bf16_dot_peak: the ceiling of this kernel library's vdot_bf16 (vdpbf16ps, or its AVX2 emulation), for benchmarks
// that report a kernel's fraction of it (benchmarks/bench_linear_rows.py: MFU). A register-only loop of independent
// accumulators: no loads, no dependence stalls, so its FLOP/s is what one core can issue.
#include <torch/library.h>

#include "ops/common/checks.h"
#include "ops/common/cpu_vec.h"

namespace pagellm::cpu {
namespace {

// Independent accumulator chains: more than vdpbf16ps's latency x issue width on current x86 cores (Zen 5: 6 x 2).
constexpr int kDotPeakChains = 12;
// Up to this many iterations the result below is exact in fp32 (12 n < 2^24 multiples of 2^-6).
constexpr int64_t kDotPeakMaxIters = int64_t{1} << 20;

#ifdef PAGELLM_BF16_DOT
// Lane i of out = the sum over the chains of num_iters pair dot products of (1, 1) and (2^-7, 2^-7): 12 * n * 2^-6,
// exact, so the caller (and a test) can check every iteration ran.
__attribute__((noinline)) void dot_peak_loop(float* out, int64_t num_iters) {
  const BF16x32 ones = bf16x32_set1_pair(0x3f803f80u);  // bf16 1.0 in both halves
  const BF16x32 small = bf16x32_set1_pair(0x3c003c00u);  // bf16 2^-7
  VecF acc[kDotPeakChains];
  for (auto& a : acc) a = vzero();
  for (int64_t i = 0; i < num_iters; ++i) {
    _Pragma("GCC unroll 12")
    for (int c = 0; c < kDotPeakChains; ++c) acc[c] = vdot_bf16(acc[c], ones, small);
  }
  VecF s = acc[0];
  for (int c = 1; c < kDotPeakChains; ++c) s = vadd(s, acc[c]);
  vstore(out, s);
}
#endif

void bf16_dot_peak(at::Tensor& out, int64_t num_iters) {
  check_cpu(out, "out");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 1 && out.size(0) == kLanes && out.is_contiguous(),
              "bf16_dot_peak: out must be a contiguous float32 tensor of shape [", kLanes, "], got ",
              out.scalar_type(), " ", out.sizes());
  TORCH_CHECK(num_iters >= 0 && num_iters <= kDotPeakMaxIters, "bf16_dot_peak: num_iters must be in [0, ",
              kDotPeakMaxIters, "], got ", num_iters);
#ifdef PAGELLM_BF16_DOT
  dot_peak_loop(out.data_ptr<float>(), num_iters);
#else
  TORCH_CHECK(false, "bf16_dot_peak: this kernel library has no bf16 pair dot product");
#endif
}

}  // namespace
}  // namespace pagellm::cpu

TORCH_LIBRARY_IMPL(pagellm, CPU, m) { m.impl("bf16_dot_peak", &pagellm::cpu::bf16_dot_peak); }
