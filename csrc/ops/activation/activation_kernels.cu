// Raw-pointer launchers for the gated activations (declared in activation_launch.h). Torch-free.
#include "ops/activation/activation_cuda.cuh"
#include "ops/activation/activation_launch.h"

namespace pagellm::cuda {

namespace {
template <typename T>
cudaError_t launch_typed(void* out, const void* in, int64_t num_rows, int64_t d, int64_t os, int64_t is, GateActKind act,
                         cudaStream_t s) {
  if (num_rows == 0 || d == 0) return cudaSuccess;
  const int threads = d >= 1024 * VecTraits<T>::kElems ? 1024 : (d >= 4096 ? 512 : 256);
  const dim3 grid(static_cast<unsigned>(num_rows));
  auto* o = static_cast<T*>(out);
  const auto* x = static_cast<const T*>(in);
  switch (act) {
    case GateActKind::kSilu: act_and_mul_kernel<T, GateAct::kSilu><<<grid, threads, 0, s>>>(o, x, d, os, is); break;
    case GateActKind::kGelu: act_and_mul_kernel<T, GateAct::kGelu><<<grid, threads, 0, s>>>(o, x, d, os, is); break;
    case GateActKind::kGeluTanh: act_and_mul_kernel<T, GateAct::kGeluTanh><<<grid, threads, 0, s>>>(o, x, d, os, is); break;
  }
  return cudaGetLastError();
}
}  // namespace

cudaError_t launch_act_and_mul(void* out, const void* in, int64_t num_rows, int64_t d, int64_t out_row_stride,
                               int64_t in_row_stride, DType dtype, GateActKind act, cudaStream_t stream) {
  if (num_rows > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  switch (dtype) {
    case DType::kFloat32: return launch_typed<float>(out, in, num_rows, d, out_row_stride, in_row_stride, act, stream);
    case DType::kFloat16: return launch_typed<__half>(out, in, num_rows, d, out_row_stride, in_row_stride, act, stream);
    case DType::kBFloat16: return launch_typed<__nv_bfloat16>(out, in, num_rows, d, out_row_stride, in_row_stride, act, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace pagellm::cuda
