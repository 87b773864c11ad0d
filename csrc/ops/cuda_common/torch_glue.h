// Helpers for the *_cuda.cpp torch glue only (includes torch; never include it from a .cu / .cuh, which are
// torch-free by rule). Every check names the offending argument.
#pragma once
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include "ops/common/arg_checks.h"
#include "ops/cuda_common/dtype.h"

namespace pagellm::cuda {

inline void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got device ", t.device());
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* name, const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), name, " must be on the same device as ", ref_name, " (", ref.device(),
              "), got ", t.device());
}

inline DType to_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: TORCH_CHECK(false, name, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
  return DType::kFloat32;  // unreachable
}

inline bool aligned16(const at::Tensor& t) { return (reinterpret_cast<uintptr_t>(t.data_ptr()) & 15u) == 0; }

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

inline void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA launch failed: ", cudaGetErrorString(err));
}

}  // namespace pagellm::cuda
