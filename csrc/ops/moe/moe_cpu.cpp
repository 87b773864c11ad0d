// CPU glue for fused_moe (kernels: moe_cpu_kernels.h, moe_gemm_cpu_kernels.h): checks, the id range, then
// per chunk of tokens
//   route the (token, slot) pairs by expert -> gather their rows -> gate_up = X_e W13_e^T (fp32)
//   -> act(gate) * up -> y = . W2_e^T (fp32) -> weighted combine per token in slot order, one rounding.
// Experts with at most kTileMaxPairs pairs (decode, small batches) run on the weight-streaming tile kernel;
// busier experts on the packed grouped GEMM (moe_gemm_cpu_kernels.h), which reads the weights in their dtype.
// Either way a pair's result does not depend on the other pairs of its expert; it does depend on which of
// the two paths its expert took (their summation orders differ).
#include <torch/library.h>

#include "ops/common/checks.h"
#include "ops/moe/moe_checks.h"
#include "ops/moe/moe_cpu_kernels.h"
#include "ops/moe/moe_gemm_cpu_kernels.h"

namespace pagellm::cpu {
namespace {

constexpr int64_t kTileMaxPairs = 32;
// fp32 scratch per chunk of tokens (gate_up, act, y): bounds what a long prefill allocates.
constexpr int64_t kScratchBytes = int64_t{256} << 20;

struct MoeWeights {
  at::Tensor w13, w2;  // contiguous
};

// Experts by path: few pairs (tile kernel) and many (GEMM); experts without pairs in neither.
void split_experts(const std::vector<int64_t>& offsets, std::vector<int32_t>& tile, std::vector<int32_t>& gemm) {
  for (size_t e = 0; e + 1 < offsets.size(); ++e) {
    const int64_t n = offsets[e + 1] - offsets[e];
    if (n > kTileMaxPairs) gemm.push_back(static_cast<int32_t>(e));
    else if (n > 0) tile.push_back(static_cast<int32_t>(e));
  }
}

// Tokens [t0, t0 + n) of the call: out rows written, nothing else.
void fused_moe_chunk(at::Tensor& out, const at::Tensor& hidden, const MoeWeights& wt, const float* weights,
                     const int32_t* ids, const moe::MoeShape& s, MoeActivation activation, int64_t t0, int64_t n) {
  const ExpertRouting r = route_pairs(ids + t0 * s.k, n, s.k, s.E);
  std::vector<int32_t> tile_experts, gemm_experts_list;
  split_experts(r.offsets, tile_experts, gemm_experts_list);
  const int64_t P = n * s.k, H = s.H, I = s.I;
  const auto f32 = hidden.options().dtype(at::kFloat);
  at::Tensor xs = at::empty({P, H}, hidden.options());
  at::Tensor gu = at::empty({P, 2 * I}, f32), act = at::empty({P, I}, f32), y = at::empty({P, H}, f32);
  PAGELLM_DISPATCH_FLOAT_TYPES(hidden.scalar_type(), "fused_moe", [&] {
    gather_pair_rows(xs.data_ptr<scalar_t>(), hidden.data_ptr<scalar_t>() + t0 * hidden.stride(0),
                          hidden.stride(0), r.pair_token, H);
    const ExpertGemmArgs up{2 * I, H, H, 2 * I, 2 * I * H};
    grouped_expert_gemm(gu.data_ptr<float>(), xs.data_ptr<scalar_t>(), wt.w13.data_ptr<scalar_t>(), up,
                             r.offsets.data(), tile_experts);
    packed_expert_gemm(gu.data_ptr<float>(), xs.data_ptr<scalar_t>(), wt.w13.data_ptr<scalar_t>(), up,
                       r.offsets.data(), gemm_experts_list);
    gated_expert_activation(act.data_ptr<float>(), gu.data_ptr<float>(), P, I, activation);
    const ExpertGemmArgs down{H, I, I, H, H * I};
    grouped_expert_gemm(y.data_ptr<float>(), act.data_ptr<float>(), wt.w2.data_ptr<scalar_t>(), down,
                             r.offsets.data(), tile_experts);
    packed_expert_gemm(y.data_ptr<float>(), act.data_ptr<float>(), wt.w2.data_ptr<scalar_t>(), down,
                       r.offsets.data(), gemm_experts_list);
    combine_expert_outputs(out.data_ptr<scalar_t>() + t0 * out.stride(0), out.stride(0), y.data_ptr<float>(),
                                weights + t0 * s.k, r.pair_position, n, s.k, H);
  });
}

at::Tensor fused_moe(const at::Tensor& hidden, const at::Tensor& w13, const at::Tensor& w2,
                     const at::Tensor& topk_weights, const at::Tensor& topk_ids, c10::string_view activation) {
  check_cpu(hidden, "hidden");
  check_cpu(w13, "w13");
  check_cpu(w2, "w2");
  check_cpu(topk_weights, "topk_weights");
  check_cpu(topk_ids, "topk_ids");
  const moe::MoeShape s = moe::check_fused_moe(hidden, w13, w2, topk_weights, topk_ids);
  const MoeActivation act = moe::parse_moe_activation(std::string(activation));
  const at::Tensor ids = topk_ids.contiguous(), weights = topk_weights.contiguous();
  const int64_t bad = first_invalid_expert_id(ids.data_ptr<int32_t>(), s.T * s.k, s.E);
  TORCH_CHECK(bad < 0, "fused_moe: topk_ids must be in [0, E = ", s.E, "), got ",
              bad < 0 ? 0 : ids.data_ptr<int32_t>()[bad], " at [", bad / std::max<int64_t>(s.k, 1), ", ",
              bad % std::max<int64_t>(s.k, 1), "]");
  at::Tensor out = at::empty({s.T, s.H}, hidden.options());
  if (out.numel() == 0) return out;
  if (s.k == 0 || s.I == 0) return out.zero_();
  const at::Tensor x = hidden.stride(1) == 1 ? hidden : hidden.contiguous();
  const MoeWeights wt{w13.contiguous(), w2.contiguous()};
  const int64_t pair_bytes = s.k * ((3 * s.I + s.H) * int64_t{4} + s.H * static_cast<int64_t>(x.element_size()));
  const int64_t chunk = std::max<int64_t>(1, kScratchBytes / pair_bytes);
  for (int64_t t0 = 0; t0 < s.T; t0 += chunk) {
    fused_moe_chunk(out, x, wt, weights.data_ptr<float>(), ids.data_ptr<int32_t>(), s, act, t0,
                    std::min(chunk, s.T - t0));
  }
  return out;
}

}  // namespace
}  // namespace pagellm::cpu

TORCH_LIBRARY_IMPL(pagellm, CPU, m) { m.impl("fused_moe", &pagellm::cpu::fused_moe); }
