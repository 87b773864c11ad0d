// Host-side, torch-free entry point of the int8_linear (LLM.int8()) CUDA kernels (int8_linear_kernels.cu).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda_common/dtype.h"

namespace pagellm::cuda {

// Row strides in elements; every row contiguous. Scratch buffers are the caller's (device memory):
// outlier_mask [ldq] uint8, q [M, ldq] int8, row_scale [M, num_groups] float32, row_zero [M] int32, with ldq = K
// rounded up to a multiple of 16.
struct Int8LinearCudaArgs {
  void* out;             // [M, N] (dtype)
  const void* x;         // [M, K] (dtype)
  const int8_t* w;       // [N, K]
  const float* w_scale;  // [N]
  const void* bias;      // [N] (dtype) or nullptr
  int64_t M, N, K, ldx, ldw, ldo;
  float threshold;  // > 0: outlier threshold; 0: none
  bool zero_point;  // rows as uint8 with a zero point (K < 65536) instead of absmax int8
  int64_t group_size;  // > 0: absmax int8 per group of group_size elements of K (zero_point false)
  int64_t num_groups;  // ceil(K / group_size), or 1
  uint8_t* outlier_mask;
  int8_t* q;
  float* row_scale;
  int32_t* row_zero;
  int64_t ldq;
};

// The same computation as the CPU kernel (csrc/ops/quant/int8_cpu_kernels.h): outlier columns of x (|x| >
// threshold in any row) in fp32 against the dequantized weight, the other columns quantized per row to int8
// (or uint8 with a zero point) and multiplied with the int8 weight into int32. Three kernels on `stream`: outlier mask, row quantization, products.
cudaError_t launch_int8_linear(const Int8LinearCudaArgs& args, DType dtype, cudaStream_t stream);

}  // namespace pagellm::cuda
