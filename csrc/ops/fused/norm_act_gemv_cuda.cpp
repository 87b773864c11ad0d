// CUDA glue for rms_norm_linear and silu_and_mul_linear: linear_gemv's kernels 2-4 with the norm / activation before
// the product folded into their prologue (gemv_prologue_cuda.cuh). Inputs the prologue cannot take (no 16-byte
// vectors, a row too long for shared memory) run the two ops' kernels one after the other instead, into a scratch
// row. CUDA only: the ops have no CPU kernel.
#include <torch/library.h>

#include <ATen/MemoryOverlap.h>

#include <optional>

#include "ops/activation/activation_launch.h"
#include "ops/cuda_common/torch_glue.h"
#include "ops/linear/gemv_glue_cuda.h"
#include "ops/linear/gemv_launch.h"
#include "ops/norm_rope/norm_launch.h"

namespace pagellm::cuda {
namespace {

// linear_gemv's kernel numbers: 2 and 3 differ in their K slices (>= 512 / >= 1024 CTAs), 4 is 2 with fewer registers.
struct GemvKernel {
  int64_t min_ctas, min_slice_vecs;
  bool low_regs;
};
GemvKernel gemv_kernel(int64_t kernel, const char* op) {
  TORCH_CHECK(kernel >= 2 && kernel <= 4, op, ": kernel must be 2, 3 or 4 (linear_gemv's split-K kernels), got ",
              kernel);
  return kernel == 3 ? GemvKernel{1024, 32, false} : GemvKernel{512, 64, kernel == 4};
}

void check_row_operand(const at::Tensor& t, const at::Tensor& x, const char* name) {
  check_cuda(t, name);
  check_same_device(t, x, name, "x");
  check_same_dtype(t, x, name, "x");
  TORCH_CHECK(t.sizes() == x.sizes(), name, " must have x's shape ", x.sizes(), ", got ", t.sizes());
  check_last_contiguous(t, name);
}

void rms_norm_linear(at::Tensor& out, const std::optional<at::Tensor>& residual_out, const at::Tensor& x,
                     const std::optional<at::Tensor>& residual, const at::Tensor& norm_weight, double epsilon,
                     const at::Tensor& weight, const std::optional<at::Tensor>& bias, int64_t kernel, bool pdl) {
  const GemvKernel k = gemv_kernel(kernel, "rms_norm_linear");
  const bool add = residual.has_value() && residual->defined();
  TORCH_CHECK(add == (residual_out.has_value() && residual_out->defined()),
              "residual and residual_out must be given together (or neither)");
  GemvInputs held;
  const std::optional<GemvArgs> a = gemv_args(out, x, weight, bias, held);
  check_cuda(norm_weight, "norm_weight");
  check_same_device(norm_weight, x, "norm_weight", "x");
  check_same_dtype(norm_weight, x, "norm_weight", "x");
  TORCH_CHECK(norm_weight.dim() == 1 && norm_weight.size(0) == x.size(1), "norm_weight must have shape [",
              x.size(1), "] (K of x), got ", norm_weight.sizes());
  check_contiguous(norm_weight, "norm_weight");
  if (add) {
    check_row_operand(*residual, x, "residual");
    check_row_operand(*residual_out, x, "residual_out");
    TORCH_CHECK(at::get_overlap_status(*residual_out, x) == at::MemOverlapStatus::No &&
                    at::get_overlap_status(*residual_out, *residual) == at::MemOverlapStatus::No,
                "residual_out must not overlap x or residual (every CTA reads them while one writes residual_out)");
  }
  if (x.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const DType dt = to_dtype(x, "x");
  const float eps = static_cast<float>(epsilon);
  if (a) {
    GemvPrologueArgs p;
    p.kind = add ? GemvPrologue::kAddRmsNorm : GemvPrologue::kRmsNorm;
    p.norm_weight = norm_weight.data_ptr();
    p.eps = eps;
    if (add) {
      p.residual = residual->data_ptr();
      p.res_stride = residual->stride(0);
      p.residual_out = residual_out->data_ptr();
      p.res_out_stride = residual_out->stride(0);
    }
    const cudaError_t err = launch_linear_gemv_prologue(*a, p, dt, k.min_ctas, k.min_slice_vecs, k.low_regs, pdl,
                                                        current_stream());
    if (err != cudaErrorNotSupported) return check_launch(err, "rms_norm_linear");
  }
  // The two ops apart: the norm into a scratch row (with the residual sum in residual_out), then the GEMV.
  at::Tensor h = at::empty(x.sizes(), x.options());
  const int64_t M = x.size(0), K = x.size(1);
  if (add) {
    residual_out->copy_(*residual);
    h.copy_(x);
    check_launch(launch_fused_add_rms_norm(h.data_ptr(), residual_out->data_ptr(), norm_weight.data_ptr(), M, K,
                                           h.stride(0), residual_out->stride(0), eps, dt, current_stream()),
                 "rms_norm_linear");
  } else {
    check_launch(launch_rms_norm(h.data_ptr(), x.data_ptr(), norm_weight.data_ptr(), M, K, x.stride(0), h.stride(0),
                                 eps, dt, current_stream()),
                 "rms_norm_linear");
  }
  if (!a) return;
  GemvArgs g = *a;
  g.x = h.data_ptr();
  g.x_stride = h.stride(0);
  check_launch(launch_linear_gemv_split(g, dt, k.min_ctas, k.min_slice_vecs, k.low_regs, pdl, current_stream()),
               "rms_norm_linear");
}

void silu_and_mul_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias, int64_t kernel, bool pdl) {
  const GemvKernel k = gemv_kernel(kernel, "silu_and_mul_linear");
  check_cuda(x, "x");
  check_dim(x, 2, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x must have shape [M, 2 * K] (gate | up), got ", x.sizes());
  check_last_contiguous(x, "x");
  const int64_t M = x.size(0), K = x.size(1) / 2;
  GemvInputs held;
  const std::optional<GemvArgs> a = gemv_args(out, x.narrow(1, 0, K), weight, bias, held);  // the gate half: [M, K]
  if (!a) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const DType dt = to_dtype(x, "x");
  GemvPrologueArgs p;
  p.kind = GemvPrologue::kSiluMul;
  const cudaError_t err =
      launch_linear_gemv_prologue(*a, p, dt, k.min_ctas, k.min_slice_vecs, k.low_regs, pdl, current_stream());
  if (err != cudaErrorNotSupported) return check_launch(err, "silu_and_mul_linear");
  at::Tensor h = at::empty({M, K}, x.options());  // silu_and_mul into a scratch row, then the GEMV
  check_launch(launch_act_and_mul(h.data_ptr(), x.data_ptr(), M, K, h.stride(0), x.stride(0), dt, GateActKind::kSilu,
                                  current_stream()),
               "silu_and_mul_linear");
  GemvArgs g = *a;
  g.x = h.data_ptr();
  g.x_stride = h.stride(0);
  check_launch(launch_linear_gemv_split(g, dt, k.min_ctas, k.min_slice_vecs, k.low_regs, pdl, current_stream()),
               "silu_and_mul_linear");
}

}  // namespace
}  // namespace pagellm::cuda

TORCH_LIBRARY_IMPL(pagellm, CUDA, m) {
  m.impl("rms_norm_linear", &pagellm::cuda::rms_norm_linear);
  m.impl("silu_and_mul_linear", &pagellm::cuda::silu_and_mul_linear);
}
