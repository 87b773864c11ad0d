// Device-independent argument checks, shared by the CPU glue (*_cpu.cpp) and the CUDA glue (*_cuda.cpp).
// Every failure names the offending argument.
#pragma once

#include <ATen/ATen.h>

namespace pagellm {

inline void check_dim(const at::Tensor& t, int64_t dim, const char* name) {
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions, got shape ", t.sizes());
}

inline void check_dtype(const at::Tensor& t, at::ScalarType dt, const char* name) {
  TORCH_CHECK(t.scalar_type() == dt, name, " must have dtype ", dt, ", got ", t.scalar_type());
}

inline void check_float(const at::Tensor& t, const char* name) {
  auto dt = t.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, name,
              " must be float32, bfloat16 or float16, got ", dt);
}

inline void check_same_dtype(const at::Tensor& t, const at::Tensor& ref, const char* name, const char* ref_name) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), name, " must have the same dtype as ", ref_name, " (",
              ref.scalar_type(), "), got ", t.scalar_type());
}

inline void check_last_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 0 || t.size(-1) <= 1 || t.stride(-1) == 1, name,
              " must be contiguous in its last dimension, got strides ", t.strides());
}

inline void check_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous, got shape ", t.sizes(), " strides ", t.strides());
}

}  // namespace pagellm
