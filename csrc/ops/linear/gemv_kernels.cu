// Raw-pointer launcher of the small-M linear kernel (declared in gemv_launch.h). Torch-free.
#include "ops/linear/gemv_cuda.cuh"
#include "ops/linear/gemv_launch.h"

namespace pagellm::cuda {

cudaError_t launch_linear_gemv(const GemvArgs& a, DType dtype, cudaStream_t stream) {
  if (a.M <= 0 || a.N <= 0) return cudaSuccess;
  if ((a.N + kGemvWarps - 1) / kGemvWarps > 0x7fffffffLL || (a.M + 7) / 8 > 65535) return cudaErrorInvalidConfiguration;
  switch (dtype) {
    case DType::kFloat32: return gemv_typed<float>(a, stream);
    case DType::kFloat16: return gemv_typed<__half>(a, stream);
    case DType::kBFloat16: return gemv_typed<__nv_bfloat16>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace pagellm::cuda
