// Raw-pointer launcher of the int8_linear CUDA kernels (declared in int8_linear_launch.h). Torch-free.
#include "ops/quant/int8_linear_cuda.cuh"
#include "ops/quant/int8_linear_launch.h"

namespace pagellm::cuda {

namespace {
bool aligned4(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 3u) == 0; }

template <typename T>
cudaError_t launch_typed(const Int8LinearCudaArgs& a, cudaStream_t s) {
  if (a.M == 0 || a.N == 0) return cudaSuccess;
  const auto* x = static_cast<const T*>(a.x);
  const unsigned mask_blocks = static_cast<unsigned>((a.ldq + 255) / 256);
  int8::outlier_mask_kernel<T><<<mask_blocks, 256, 0, s>>>(x, a.M, a.K, a.ldx, a.ldq, a.threshold, a.outlier_mask);
  if (a.group_size > 0) {
    const dim3 qgrid(static_cast<unsigned>((a.num_groups + int8::kGroupWarps - 1) / int8::kGroupWarps),
                     static_cast<unsigned>(a.M));
    int8::quantize_groups_kernel<T><<<qgrid, 32 * int8::kGroupWarps, 0, s>>>(
        x, a.K, a.ldx, a.ldq, a.outlier_mask, a.group_size, a.num_groups, a.q, a.row_scale);
  } else {
    int8::quantize_rows_kernel<T><<<static_cast<unsigned>(a.M), int8::kQuantThreads, 0, s>>>(
        x, a.K, a.ldx, a.ldq, a.outlier_mask, a.zero_point, a.q, a.row_scale, a.row_zero);
  }
  const bool words = a.K % 4 == 0 && a.ldw % 4 == 0 && aligned4(a.w) && a.ldq % 4 == 0 && aligned4(a.q);
  const dim3 grid(static_cast<unsigned>((a.N + int8::kGemmWarps - 1) / int8::kGemmWarps), static_cast<unsigned>(a.M));
  int8::int8_gemm_kernel<T><<<grid, 32 * int8::kGemmWarps, 0, s>>>(
      static_cast<T*>(a.out), x, a.w, a.w_scale, static_cast<const T*>(a.bias), a.outlier_mask, a.q, a.row_scale,
      a.row_zero, a.zero_point, a.group_size, a.num_groups, a.N, a.K, a.ldx, a.ldw, a.ldo, a.ldq, words);
  return cudaGetLastError();
}
}  // namespace

cudaError_t launch_int8_linear(const Int8LinearCudaArgs& args, DType dtype, cudaStream_t stream) {
  if (args.M > 65535 || args.N > 0x7fffffffLL * int8::kGemmWarps) return cudaErrorInvalidConfiguration;
  switch (dtype) {
    case DType::kFloat32: return launch_typed<float>(args, stream);
    case DType::kFloat16: return launch_typed<__half>(args, stream);
    case DType::kBFloat16: return launch_typed<__nv_bfloat16>(args, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace pagellm::cuda
