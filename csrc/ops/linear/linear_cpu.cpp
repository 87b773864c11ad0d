// CPU glue for the linear ops, out[M, N] = x[M, K] @ weight[N, K]^T (+ bias[N]):
//   linear_small_m - weight-streaming kernel designed for small M (decode), correct for any M; bf16 takes
//                    schedules with the same per-row bits at 2-16 rows on AVX-512 (linear_cpu_few_rows.h) and from
//                    kLinearGemmMinM rows on (linear_cpu_gemm.h);
//   linear_amx     - bf16 on AMX tiles (linear_amx_kernels.h), for CPUs with AMX-BF16.
#include <torch/library.h>

#include "ops/common/checks.h"
#include "ops/linear/linear_amx_kernels.h"
#include "ops/linear/amx_support.h"
#include "ops/linear/linear_cpu_kernels.h"
#include "ops/linear/linear_cpu_gemm.h"
#include "ops/linear/linear_cpu_few_rows.h"
#include "ops/linear/next_weight_hints.h"

#include <sys/syscall.h>
#include <unistd.h>
#include <cpuid.h>

namespace pagellm::cpu {

namespace amx {
bool amx_bf16_usable() {
#ifdef PAGELLM_HAVE_AMX
  static const bool ok = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool amx_bf16 = edx & (1u << 22), amx_tile = edx & (1u << 24);
    if (!amx_bf16 || !amx_tile) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // linux/arch/x86 uapi
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}
}  // namespace amx

namespace {

// Shared argument checks; returns the contiguous-last-dim x, weight and bias (undefined if none).
struct LinearInputs {
  at::Tensor x, w, b;
};

LinearInputs check_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias) {
  check_cpu(out, "out");
  check_cpu(x, "x");
  check_cpu(weight, "weight");
  check_float(x, "x");
  check_same_dtype(weight, x, "weight", "x");
  check_same_dtype(out, x, "out", "x");
  check_dim(x, 2, "x");
  check_dim(weight, 2, "weight");
  check_dim(out, 2, "out");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "weight must have shape [N, ", K, "] (K of x), got ", weight.sizes());
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "out must have shape [", M, ", ", N, "], got ", out.sizes());
  LinearInputs in;
  if (bias.has_value() && bias->defined()) {
    in.b = *bias;
    check_cpu(in.b, "bias");
    check_same_dtype(in.b, x, "bias", "x");
    TORCH_CHECK(in.b.dim() == 1 && in.b.size(0) == N, "bias must have shape [", N, "], got ", in.b.sizes());
    in.b = in.b.contiguous();
  }
  check_last_contiguous(out, "out");
  in.x = x.stride(1) == 1 ? x : x.contiguous();
  in.w = weight.stride(1) == 1 ? weight : weight.contiguous();
  return in;
}

// Handles the empty cases; true when nothing is left to compute.
bool linear_trivial(at::Tensor& out, const LinearInputs& in) {
  if (out.numel() == 0) return true;
  if (in.x.size(1) != 0) return false;
  if (in.b.defined()) out.copy_(in.b.unsqueeze(0).expand({out.size(0), out.size(1)}));
  else out.zero_();
  return true;
}

void linear_small_m(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias) {
  const LinearInputs in = check_linear(out, x, weight, bias);
  if (linear_trivial(out, in)) return;
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  LinearArgs a{M, N, K, in.x.stride(0), in.w.stride(0), out.stride(0)};
  if (M == 1 && use_thread_pool()) {  // batch-1 decode: let the idle worker start on the next weight early
    const WeightRange next = NextWeightHints::for_this_thread().advance(
        {in.w.data_ptr(), ((N - 1) * in.w.stride(0) + K) * static_cast<int64_t>(in.w.element_size())});
    if (next.ptr != nullptr) pagellm::prefetch_next(next.ptr, next.bytes);
  }
#if defined(PAGELLM_GEMM_QUAD) || defined(PAGELLM_LINEAR_DPBF16)
  const auto bf16 = [](const at::Tensor& t) { return reinterpret_cast<c10::BFloat16*>(t.data_ptr()); };
  c10::BFloat16* const bias_bf16 = in.b.defined() ? bf16(in.b) : nullptr;  // read only by the bf16 schedules
#endif
#ifdef PAGELLM_GEMM_QUAD
  if (x.scalar_type() == at::kBFloat16 && M >= kLinearFewRowsMinM && M <= kLinearFewRowsMaxM) {  // verify rows
    linear_few_rows_bf16(bf16(out), bf16(in.x), bf16(in.w), bias_bf16, a);
    return;
  }
#endif
#ifdef PAGELLM_LINEAR_DPBF16
  if (x.scalar_type() == at::kBFloat16 && M >= kLinearGemmMinM) {  // same bits per row, a GEMM schedule
    linear_gemm_bf16(bf16(out), bf16(in.x), bf16(in.w), bias_bf16, a);
    return;
  }
#endif
  PAGELLM_DISPATCH_FLOAT_TYPES(x.scalar_type(), "linear_small_m", [&] {
    linear_small_m_kernel<scalar_t>(out.data_ptr<scalar_t>(), in.x.data_ptr<scalar_t>(), in.w.data_ptr<scalar_t>(),
                                    in.b.defined() ? in.b.data_ptr<scalar_t>() : nullptr, a);
  });
}

void linear_amx(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "linear_amx: x must be bfloat16, got ", x.scalar_type());
  TORCH_CHECK(amx::amx_bf16_usable(),
              "linear_amx: this CPU (or this build, or the OS) does not provide AMX-BF16; use linear_small_m or "
              "torch.nn.functional.linear");
  const LinearInputs in = check_linear(out, x, weight, bias);
  if (linear_trivial(out, in)) return;
#ifdef PAGELLM_HAVE_AMX
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const amx::AmxArgs a{M, N, K, in.x.stride(0), in.w.stride(0), out.stride(0),
                       (K + amx::kTileK - 1) / amx::kTileK * amx::kTileK};
  amx::linear_amx_kernel(reinterpret_cast<c10::BFloat16*>(out.data_ptr()),
                         reinterpret_cast<const c10::BFloat16*>(in.x.data_ptr()),
                         reinterpret_cast<const c10::BFloat16*>(in.w.data_ptr()),
                         in.b.defined() ? reinterpret_cast<const c10::BFloat16*>(in.b.data_ptr()) : nullptr, a);
#endif
}

}  // namespace
}  // namespace pagellm::cpu

TORCH_LIBRARY_IMPL(pagellm, CPU, m) {
  m.impl("linear_small_m", &pagellm::cpu::linear_small_m);
  m.impl("linear_amx", &pagellm::cpu::linear_amx);
}
