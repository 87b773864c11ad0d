// Raw-pointer launcher of lora_apply (declared in lora_launch.h). Torch-free.
#include "ops/lora/lora_cuda.cuh"
#include "ops/lora/lora_launch.h"

namespace pagellm::cuda {

namespace {
template <typename T>
cudaError_t launch_typed(void* y, const void* x, const void* lora_a, const void* lora_b, const float* scales,
                         const int32_t* slots, float* tmp, int64_t T_, int64_t K, int64_t N, int64_t S, int64_t R,
                         int64_t ys, int64_t xs, cudaStream_t stream) {
  if (T_ == 0 || N == 0 || R == 0) return cudaSuccess;
  const dim3 shrink_grid(static_cast<unsigned>(T_), static_cast<unsigned>(ceil_div(R, kLoraWarpsPerBlock)));
  lora_shrink_kernel<T><<<shrink_grid, 32 * kLoraWarpsPerBlock, 0, stream>>>(
      tmp, static_cast<const T*>(x), static_cast<const T*>(lora_a), slots, K, S, R, xs);
  const dim3 expand_grid(static_cast<unsigned>(T_), static_cast<unsigned>(ceil_div(N, kLoraExpandThreads)));
  lora_expand_kernel<T><<<expand_grid, kLoraExpandThreads, 0, stream>>>(
      static_cast<T*>(y), tmp, static_cast<const T*>(lora_b), scales, slots, N, S, R, ys);
  return cudaGetLastError();
}
}  // namespace

cudaError_t launch_lora_apply(void* y, const void* x, const void* lora_a, const void* lora_b, const float* scales,
                              const int32_t* token_slots, float* tmp, int64_t T, int64_t K, int64_t N, int64_t S,
                              int64_t R, int64_t y_stride, int64_t x_stride, DType dtype, cudaStream_t stream) {
  if (T > 0x7fffffffLL || ceil_div(N, kLoraExpandThreads) > 65535 || ceil_div(R, kLoraWarpsPerBlock) > 65535)
    return cudaErrorInvalidConfiguration;
  switch (dtype) {
    case DType::kFloat32:
      return launch_typed<float>(y, x, lora_a, lora_b, scales, token_slots, tmp, T, K, N, S, R, y_stride, x_stride, stream);
    case DType::kFloat16:
      return launch_typed<__half>(y, x, lora_a, lora_b, scales, token_slots, tmp, T, K, N, S, R, y_stride, x_stride,
                                  stream);
    case DType::kBFloat16:
      return launch_typed<__nv_bfloat16>(y, x, lora_a, lora_b, scales, token_slots, tmp, T, K, N, S, R, y_stride,
                                         x_stride, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace pagellm::cuda
