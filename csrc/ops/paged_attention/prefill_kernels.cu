// Raw-pointer launchers of the paged-attention prefill kernels (declared in attention_launch.h). Torch-free.
#include <cstdint>

#include "ops/paged_attention/attention_launch.h"
#include "ops/paged_attention/prefill_cuda.cuh"

namespace pagellm::cuda {

namespace {
bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

template <typename T, int D>
cudaError_t prefill_mma(const PrefillArgs& a, cudaStream_t s) {
  constexpr size_t smem = PrefillTile<D>::template smem_bytes<T>();
  auto kernel = paged_prefill_mma_kernel<T, D>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  const int64_t tiles = ceil_div(a.num_tokens, kPrefillBM) + a.num_seqs;  // >= sum over seqs of ceil(q_len / BM)
  if (tiles > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(a.num_heads));
  kernel<<<grid, kPrefillThreads, smem, s>>>(a);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t prefill_simple(const PrefillArgs& a, cudaStream_t s) {
  const int warps = kPrefillThreads / 32;
  const dim3 grid(static_cast<unsigned>(a.num_tokens), static_cast<unsigned>((a.num_heads + warps - 1) / warps));
  paged_prefill_simple_kernel<T, D><<<grid, kPrefillThreads, 0, s>>>(a);
  return cudaGetLastError();
}

template <int D>
cudaError_t prefill_dim(const PrefillArgs& a, DType dtype, cudaStream_t s) {
  switch (dtype) {
    case DType::kFloat32: return prefill_simple<float, D>(a, s);
    case DType::kFloat16: return prefill_mma<__half, D>(a, s);
    case DType::kBFloat16: return prefill_mma<__nv_bfloat16, D>(a, s);
  }
  return cudaErrorInvalidValue;
}
}  // namespace

cudaError_t launch_paged_attention_prefill(const PrefillArgs& a, DType dtype, cudaStream_t stream) {
  if (a.num_tokens == 0 || a.num_heads == 0 || a.num_seqs == 0) return cudaSuccess;
  if (a.num_kv_heads <= 0 || a.num_heads % a.num_kv_heads != 0 || a.num_heads > 65535) return cudaErrorInvalidValue;
  if (dtype != DType::kFloat32) {
    const bool ok = aligned16(a.query) && aligned16(a.out) && aligned16(a.key_cache) && aligned16(a.value_cache) &&
                    a.q_stride_tok % 8 == 0 && a.q_stride_head % 8 == 0 && a.o_stride_tok % 8 == 0 &&
                    a.o_stride_head % 8 == 0;
    if (!ok) return cudaErrorMisalignedAddress;
  }
  switch (a.head_dim) {
    case 64: return prefill_dim<64>(a, dtype, stream);
    case 80: return prefill_dim<80>(a, dtype, stream);
    case 96: return prefill_dim<96>(a, dtype, stream);
    case 112: return prefill_dim<112>(a, dtype, stream);
    case 128: return prefill_dim<128>(a, dtype, stream);
    case 256: return prefill_dim<256>(a, dtype, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace pagellm::cuda
