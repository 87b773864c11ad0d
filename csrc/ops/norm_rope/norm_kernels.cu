// Raw-pointer launchers for the RMSNorm kernels (declared in norm_launch.h). Torch-free.
#include <cstdint>

#include "ops/norm_rope/norm_launch.h"
#include "ops/norm_rope/rms_norm_cuda.cuh"

namespace pagellm::cuda {

namespace {
int threads_for(int64_t units) { return rms_norm_threads(units); }

bool vec_ok(int64_t elems_per_vec, int64_t hidden, int64_t s0, int64_t s1, const void* a, const void* b,
            const void* c) {
  auto al = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; };
  return hidden % elems_per_vec == 0 && s0 % elems_per_vec == 0 && s1 % elems_per_vec == 0 && al(a) && al(b) && al(c);
}

template <typename T>
cudaError_t rms_typed(void* out, const void* in, const void* w, int64_t rows, int64_t hidden, int64_t is, int64_t os,
                      float eps, cudaStream_t s) {
  if (rows == 0) return cudaSuccess;
  constexpr int W = VecTraits<T>::kElems;
  if (vec_ok(W, hidden, is, os, out, in, w)) {
    rms_norm_kernel<T, true><<<static_cast<unsigned>(rows), threads_for(hidden / W), 0, s>>>(
        static_cast<T*>(out), static_cast<const T*>(in), static_cast<const T*>(w), hidden, is, os, eps);
  } else {
    rms_norm_kernel<T, false><<<static_cast<unsigned>(rows), threads_for(hidden), 0, s>>>(
        static_cast<T*>(out), static_cast<const T*>(in), static_cast<const T*>(w), hidden, is, os, eps);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t fused_typed(void* x, void* res, const void* w, int64_t rows, int64_t hidden, int64_t xs, int64_t rs,
                        float eps, cudaStream_t s) {
  if (rows == 0) return cudaSuccess;
  constexpr int W = VecTraits<T>::kElems;
  if (vec_ok(W, hidden, xs, rs, x, res, w)) {
    fused_add_rms_norm_kernel<T, true><<<static_cast<unsigned>(rows), threads_for(hidden / W), 0, s>>>(
        static_cast<T*>(x), static_cast<T*>(res), static_cast<const T*>(w), hidden, xs, rs, eps);
  } else {
    fused_add_rms_norm_kernel<T, false><<<static_cast<unsigned>(rows), threads_for(hidden), 0, s>>>(
        static_cast<T*>(x), static_cast<T*>(res), static_cast<const T*>(w), hidden, xs, rs, eps);
  }
  return cudaGetLastError();
}
}  // namespace

cudaError_t launch_rms_norm(void* out, const void* in, const void* weight, int64_t num_rows, int64_t hidden,
                            int64_t in_row_stride, int64_t out_row_stride, float eps, DType dtype, cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat32: return rms_typed<float>(out, in, weight, num_rows, hidden, in_row_stride, out_row_stride, eps, stream);
    case DType::kFloat16: return rms_typed<__half>(out, in, weight, num_rows, hidden, in_row_stride, out_row_stride, eps, stream);
    case DType::kBFloat16:
      return rms_typed<__nv_bfloat16>(out, in, weight, num_rows, hidden, in_row_stride, out_row_stride, eps, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_fused_add_rms_norm(void* x, void* residual, const void* weight, int64_t num_rows, int64_t hidden,
                                      int64_t x_row_stride, int64_t res_row_stride, float eps, DType dtype,
                                      cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat32:
      return fused_typed<float>(x, residual, weight, num_rows, hidden, x_row_stride, res_row_stride, eps, stream);
    case DType::kFloat16:
      return fused_typed<__half>(x, residual, weight, num_rows, hidden, x_row_stride, res_row_stride, eps, stream);
    case DType::kBFloat16:
      return fused_typed<__nv_bfloat16>(x, residual, weight, num_rows, hidden, x_row_stride, res_row_stride, eps, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace pagellm::cuda
