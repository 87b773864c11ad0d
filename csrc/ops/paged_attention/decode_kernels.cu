// Raw-pointer launchers of the paged-attention decode kernels (declared in attention_launch.h). Torch-free.
#include <atomic>
#include <cstdint>

#include "ops/paged_attention/attention_launch.h"
#include "ops/paged_attention/decode_cuda.cuh"

namespace pagellm::cuda {

namespace {
int sm_count() {
  static std::atomic<int> cache[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 1;
  if (dev >= 0 && dev < 64) {
    const int cached = cache[dev].load(std::memory_order_relaxed);
    if (cached > 0) return cached;
  }
  int n = 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) return 1;
  if (dev >= 0 && dev < 64) cache[dev].store(n, std::memory_order_relaxed);
  return n;
}

}  // namespace

int decode_num_splits(int num_seqs, int num_heads, int num_kv_heads, int64_t max_context, int window,
                      int split_grain) {
  if (num_seqs <= 0 || num_kv_heads <= 0 || num_heads <= 0) return 1;
  int64_t ctx = max_context;
  if (window > 0 && window < ctx) ctx = window;
  return decode_split_count(ctx, split_grain);  // the most splits a context this long has (grows with it)
}

int decode_split_ctas(int num_seqs, int heads_ctas, int num_splits) {
  const int64_t ctas = static_cast<int64_t>(num_seqs) * heads_ctas;
  if (num_splits <= 1 || ctas <= 0) return 1;
  int64_t z = ceil_div(4 * static_cast<int64_t>(sm_count()), ctas);  // about four CTAs per SM
  if (z > num_splits) z = num_splits;
  return z < 1 ? 1 : static_cast<int>(z);
}

cudaError_t launch_paged_attention_decode(const DecodeArgs& a, DType dtype, cudaStream_t stream) {
  if (a.num_seqs == 0 || a.num_heads == 0) return cudaSuccess;
  if (const cudaError_t err = check_decode_launch(a); err != cudaSuccess) return err;
  switch (dtype) {
    case DType::kFloat32: return decode_dispatch<float>(a, stream);
    case DType::kFloat16: return decode_dispatch<__half>(a, stream);
    case DType::kBFloat16: return decode_dispatch<__nv_bfloat16>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace pagellm::cuda
