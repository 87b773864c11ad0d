// Host-side, torch-free entry point of the small-M linear CUDA kernel (gemv_kernels.cu).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda_common/dtype.h"

namespace pagellm::cuda {

// out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for m < M, n < N: x [M, K] (row stride x_stride), w [N, K]
// (row stride w_stride), out [M, N] (row stride o_stride), bias [N] or null; every row contiguous; fp32 sums.
struct GemvArgs {
  void* out;
  const void* x;
  const void* w;
  const void* bias;
  int64_t M, N, K, x_stride, w_stride, o_stride;
};

// Kernel 1 (gemv_cuda.cuh): one warp per output column.
cudaError_t launch_linear_gemv(const GemvArgs& args, DType dtype, cudaStream_t stream);

// Kernel 2 (gemv_split_cuda.cuh): K split across the warps of a CTA into the fewest slices (1, 2, 4, 8) that make
// at least min_ctas CTAs while a slice keeps >= min_slice_vecs 16-byte vectors; several columns per warp.
// low_regs: half the weight vectors in flight per lane at M <= 2 (more CTAs per SM; same bits). pdl: launch as a
// programmatic dependent of the kernel before it (sm_90; ignored below). Inputs without 16-byte vectors take
// kernel 1.
cudaError_t launch_linear_gemv_split(const GemvArgs& args, DType dtype, int64_t min_ctas, int64_t min_slice_vecs,
                                     bool low_regs, bool pdl, cudaStream_t stream);

// What kernels 2-4 compute from x before the product, for decode rows (each CTA stages its row's product input in
// shared memory, so the kernel that would have produced it is not launched; gemv_prologue_cuda.cuh):
//   kRmsNorm:    rms_norm(x) * norm_weight                       (x [M, K])
//   kAddRmsNorm: r = x + residual (rounded to T), written to residual_out; rms_norm(r) * norm_weight
//   kSiluMul:    silu(x[:, :K]) * x[:, K:2K]                      (x [M, 2K], the gate | up rows)
// with the bits of rms_norm / fused_add_rms_norm / silu_and_mul (their 16-byte-vector kernels).
enum class GemvPrologue : int { kNone = 0, kRmsNorm, kAddRmsNorm, kSiluMul };
struct GemvPrologueArgs {
  GemvPrologue kind = GemvPrologue::kNone;
  const void* norm_weight = nullptr;  // [K] (kRmsNorm, kAddRmsNorm)
  float eps = 0.f;
  const void* residual = nullptr;     // [M, K], row stride res_stride (kAddRmsNorm)
  void* residual_out = nullptr;       // [M, K], row stride res_out_stride: must not overlap x or residual
  int64_t res_stride = 0, res_out_stride = 0;
};

// Kernels 2-4 (as launch_linear_gemv_split) with a prologue. cudaErrorNotSupported, launching nothing, when the
// inputs do not allow it (no 16-byte vectors in x, the weight, residual / residual_out / norm_weight, or a K whose
// staged row would not fit the shared memory): the caller then runs the two ops apart.
cudaError_t launch_linear_gemv_prologue(const GemvArgs& args, const GemvPrologueArgs& prologue, DType dtype,
                                        int64_t min_ctas, int64_t min_slice_vecs, bool low_regs, bool pdl,
                                        cudaStream_t stream);

}  // namespace pagellm::cuda
