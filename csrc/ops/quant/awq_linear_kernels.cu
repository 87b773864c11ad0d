// Raw-pointer launchers of the awq_linear CUDA kernels (declared in awq_linear_launch.h). Torch-free.
#include "ops/quant/awq_linear_cuda.cuh"
#include "ops/quant/awq_linear_launch.h"

namespace pagellm::cuda {

namespace {
bool valid_sizes(int64_t K, int64_t group_size) {
  return K > 0 && K % awq::kBlockElems == 0 && group_size > 0 && group_size % awq::kBlockElems == 0 &&
         K % group_size == 0;
}

template <typename T>
cudaError_t launch_gemv(void* out, const void* x, const uint8_t* qweight, const float* scales, const uint8_t* zeros,
                        const void* bias, int64_t M, int64_t N, int64_t K, int64_t group_size, int64_t ldx,
                        int64_t ldo, cudaStream_t stream) {
  const int64_t grid_x = ceil_div(N, kAwqWarpsPerCta), grid_y = ceil_div(M, kAwqRowsPerCta);
  if (grid_x > 0x7fffffffLL || grid_y > 65535) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y));
  awq_gemv_kernel<T><<<grid, kAwqWarpsPerCta * 32, 0, stream>>>(static_cast<T*>(out), static_cast<const T*>(x),
                                                                 qweight, scales, zeros, static_cast<const T*>(bias),
                                                                 M, N, K, group_size, ldx, ldo);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_dequant(void* dst, const uint8_t* qweight, const float* scales, const uint8_t* zeros, int64_t rows,
                           int64_t K, int64_t group_size, int64_t ldd, cudaStream_t stream) {
  const int64_t grid = ceil_div(rows * (K / 2), kAwqDequantThreads);
  if (grid > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  awq_dequantize_kernel<T><<<static_cast<unsigned>(grid), kAwqDequantThreads, 0, stream>>>(
      static_cast<T*>(dst), qweight, scales, zeros, rows, K, group_size, ldd);
  return cudaGetLastError();
}
}  // namespace

cudaError_t launch_awq_linear(void* out, const void* x, const uint8_t* qweight, const float* scales,
                              const uint8_t* zeros, const void* bias, int64_t M, int64_t N, int64_t K,
                              int64_t group_size, int64_t ldx, int64_t ldo, DType dtype, cudaStream_t stream) {
  if (!valid_sizes(K, group_size) || (reinterpret_cast<uintptr_t>(qweight) & 15u) != 0) return cudaErrorInvalidValue;
  if (M == 0 || N == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32:
      return launch_gemv<float>(out, x, qweight, scales, zeros, bias, M, N, K, group_size, ldx, ldo, stream);
    case DType::kFloat16:
      return launch_gemv<__half>(out, x, qweight, scales, zeros, bias, M, N, K, group_size, ldx, ldo, stream);
    case DType::kBFloat16:
      return launch_gemv<__nv_bfloat16>(out, x, qweight, scales, zeros, bias, M, N, K, group_size, ldx, ldo, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_awq_dequantize(void* dst, const uint8_t* qweight, const float* scales, const uint8_t* zeros,
                                  int64_t rows, int64_t K, int64_t group_size, int64_t ldd, DType dtype,
                                  cudaStream_t stream) {
  if (!valid_sizes(K, group_size)) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32:
      return launch_dequant<float>(dst, qweight, scales, zeros, rows, K, group_size, ldd, stream);
    case DType::kFloat16:
      return launch_dequant<__half>(dst, qweight, scales, zeros, rows, K, group_size, ldd, stream);
    case DType::kBFloat16:
      return launch_dequant<__nv_bfloat16>(dst, qweight, scales, zeros, rows, K, group_size, ldd, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace pagellm::cuda
