// Raw-pointer launcher of the gguf_linear CUDA kernel (declared in gguf_linear_launch.h). Torch-free.
#include "ops/quant/gguf_linear_cuda.cuh"
#include "ops/quant/gguf_linear_launch.h"

namespace pagellm::cuda {

namespace {
template <typename T, int QT>
cudaError_t launch_typed(void* out, const void* x, const uint8_t* qweight, const void* bias, int64_t M, int64_t N,
                         int64_t K, int64_t ldx, int64_t ldo, int64_t row_bytes, cudaStream_t stream) {
  const int64_t grid_x = ceil_div(N, kGgufWarpsPerCta), grid_y = ceil_div(M, kGgufRowsPerCta);
  if (grid_x > 0x7fffffffLL || grid_y > 65535) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y));
  gguf_linear_kernel<T, QT><<<grid, kGgufWarpsPerCta * 32, 0, stream>>>(
      static_cast<T*>(out), static_cast<const T*>(x), qweight, static_cast<const T*>(bias), M, N, K, ldx, ldo,
      row_bytes);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_qtype(int qtype, void* out, const void* x, const uint8_t* qweight, const void* bias, int64_t M,
                         int64_t N, int64_t K, int64_t ldx, int64_t ldo, int64_t row_bytes, cudaStream_t stream) {
  switch (qtype) {
    case gguf::kQ8_0: return launch_typed<T, gguf::kQ8_0>(out, x, qweight, bias, M, N, K, ldx, ldo, row_bytes, stream);
    case gguf::kQ4_0: return launch_typed<T, gguf::kQ4_0>(out, x, qweight, bias, M, N, K, ldx, ldo, row_bytes, stream);
    case gguf::kQ4_1: return launch_typed<T, gguf::kQ4_1>(out, x, qweight, bias, M, N, K, ldx, ldo, row_bytes, stream);
    case gguf::kQ4_K: return launch_typed<T, gguf::kQ4_K>(out, x, qweight, bias, M, N, K, ldx, ldo, row_bytes, stream);
    case gguf::kQ6_K: return launch_typed<T, gguf::kQ6_K>(out, x, qweight, bias, M, N, K, ldx, ldo, row_bytes, stream);
  }
  return cudaErrorInvalidValue;
}
}  // namespace

cudaError_t launch_gguf_linear(void* out, const void* x, const uint8_t* qweight, const void* bias, int64_t M,
                               int64_t N, int64_t K, int64_t ldx, int64_t ldo, int64_t row_bytes, int qtype,
                               DType dtype, cudaStream_t stream) {
  if (M == 0 || N == 0) return cudaSuccess;
  if (gguf::block_bytes(qtype) == 0 || K % gguf::block_elems(qtype) != 0) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat32:
      return launch_qtype<float>(qtype, out, x, qweight, bias, M, N, K, ldx, ldo, row_bytes, stream);
    case DType::kFloat16:
      return launch_qtype<__half>(qtype, out, x, qweight, bias, M, N, K, ldx, ldo, row_bytes, stream);
    case DType::kBFloat16:
      return launch_qtype<__nv_bfloat16>(qtype, out, x, qweight, bias, M, N, K, ldx, ldo, row_bytes, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace pagellm::cuda
