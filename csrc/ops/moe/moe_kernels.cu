// Raw-pointer launcher of the fused_moe CUDA kernels (declared in moe_launch.h). Torch-free.
#include "ops/moe/moe_cuda.cuh"
#include "ops/moe/moe_launch.h"

namespace pagellm::cuda {

namespace {
constexpr int64_t kMaxInt32 = 0x7fffffffLL;

cudaError_t launch_elementwise_grid(int64_t n, unsigned* blocks) {
  const int64_t grid = ceil_div(n, kMoeElementwiseThreads);
  if (grid > kMaxInt32) return cudaErrorInvalidConfiguration;
  *blocks = static_cast<unsigned>(grid);
  return cudaSuccess;
}

// out[p, :N] = x[row(p), :K] . w[e]^T for every expert's pairs.
template <typename TX, typename TW>
cudaError_t launch_expert_gemv(float* out, const TX* x, const int32_t* x_token, const TW* w, const int32_t* offsets,
                               int64_t E, int64_t N, int64_t K, int64_t ldx, cudaStream_t stream) {
  const int64_t grid_x = ceil_div(N, kMoeWarpsPerCta);
  if (grid_x > kMaxInt32 || E > 65535) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(grid_x), static_cast<unsigned>(E));
  moe_expert_gemv_kernel<TX, TW><<<grid, kMoeWarpsPerCta * 32, 0, stream>>>(out, x, x_token, w, offsets, N, K, ldx, N);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_typed(void* out, const void* hidden, const void* w13, const void* w2, const float* topk_weights,
                         const int32_t* topk_ids, const MoeProblem& s, MoeActivation activation,
                         const MoeWorkspace& ws, cudaStream_t stream) {
  const int64_t num_pairs = s.T * s.k;
  moe_route_kernel<<<1, kMoeRouteThreads, 0, stream>>>(topk_ids, static_cast<int32_t>(num_pairs),
                                                       static_cast<int32_t>(s.k), static_cast<int32_t>(s.E),
                                                       ws.offsets, ws.pair_token, ws.pair_position);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  err = launch_expert_gemv(ws.gate_up, static_cast<const T*>(hidden), ws.pair_token, static_cast<const T*>(w13),
                           ws.offsets, s.E, 2 * s.I, s.H, s.ld_hidden, stream);
  if (err != cudaSuccess) return err;
  unsigned blocks = 0;
  if ((err = launch_elementwise_grid(num_pairs * s.I, &blocks)) != cudaSuccess) return err;
  moe_act_kernel<<<blocks, kMoeElementwiseThreads, 0, stream>>>(ws.act, ws.gate_up, num_pairs, s.I, activation);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  err = launch_expert_gemv(ws.expert_out, static_cast<const float*>(ws.act), nullptr, static_cast<const T*>(w2),
                           ws.offsets, s.E, s.H, s.I, s.I, stream);
  if (err != cudaSuccess) return err;
  if ((err = launch_elementwise_grid(s.T * s.H, &blocks)) != cudaSuccess) return err;
  moe_combine_kernel<T><<<blocks, kMoeElementwiseThreads, 0, stream>>>(
      static_cast<T*>(out), ws.expert_out, topk_weights, ws.pair_position, s.T, s.H, s.k, s.ld_out);
  return cudaGetLastError();
}
}  // namespace

cudaError_t launch_fused_moe(void* out, const void* hidden, const void* w13, const void* w2, const float* topk_weights,
                             const int32_t* topk_ids, const MoeProblem& problem, MoeActivation activation,
                             const MoeWorkspace& ws, DType dtype, cudaStream_t stream) {
  const MoeProblem& s = problem;
  if (s.T < 0 || s.H < 0 || s.E < 0 || s.I < 0 || s.k < 0 || s.T * s.k > kMaxInt32 || s.E >= kMaxInt32)
    return cudaErrorInvalidValue;
  if (s.T == 0 || s.H == 0 || s.k == 0 || s.I == 0 || s.E == 0) return cudaErrorInvalidValue;  // the glue handles these
  switch (dtype) {
    case DType::kFloat32:
      return launch_typed<float>(out, hidden, w13, w2, topk_weights, topk_ids, s, activation, ws, stream);
    case DType::kFloat16:
      return launch_typed<__half>(out, hidden, w13, w2, topk_weights, topk_ids, s, activation, ws, stream);
    case DType::kBFloat16:
      return launch_typed<__nv_bfloat16>(out, hidden, w13, w2, topk_weights, topk_ids, s, activation, ws, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace pagellm::cuda
