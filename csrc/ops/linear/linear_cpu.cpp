// CPU glue for the linear ops, out[M, N] = x[M, K] @ weight[N, K]^T (+ bias[N]):
//   linear_small_m - weight-streaming kernel designed for small M (decode), correct for any M; bf16 takes
//                    schedules with the same per-row bits at 2-16 rows on AVX-512 (linear_cpu_few_rows.h) and from
//                    kLinearGemmMinM rows on (linear_cpu_gemm.h);
//   linear_amx     - bf16 on AMX tiles (linear_amx_kernels.h), for CPUs with AMX-BF16;
//   linear_argmax  - the greedy LM head: argmax of linear_small_m's rounded outputs, fused at 1-16 rows
//                    (linear_argmax_cpu_kernels.h).
#include <torch/library.h>

#include "ops/common/checks.h"
#include "ops/linear/linear_amx_kernels.h"
#include "ops/linear/amx_support.h"
#include "ops/linear/linear_cpu_kernels.h"
#include "ops/linear/linear_cpu_gemm.h"
#include "ops/linear/linear_cpu_few_rows.h"
#include "ops/linear/next_weight_hints.h"
#include "ops/linear/linear_argmax_cpu_kernels.h"
#include "ops/linear/linear_checks.h"
#include "ops/sampling/argmax_cpu_kernels.h"

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
  if (bias.has_value() && bias->defined()) check_cpu(*bias, "bias");
  LinearInputs in;
  in.b = linear::check_linear_args(out, x, weight, bias);
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

// At M = 1 (batch-1 decode) names the weight the step streams next to the pool's idle worker (next_weight_hints.h).
void hint_next_weight(const at::Tensor& w, int64_t M) {
  if (M != 1 || !use_thread_pool()) return;
  const int64_t N = w.size(0), K = w.size(1);
  const WeightRange next = NextWeightHints::for_this_thread().advance(
      {w.data_ptr(), ((N - 1) * w.stride(0) + K) * static_cast<int64_t>(w.element_size())});
  if (next.ptr != nullptr) pagellm::prefetch_next(next.ptr, next.bytes);
}

// linear_small_m's schedules on checked inputs (out [M, N]).
void run_linear_small_m(at::Tensor& out, const LinearInputs& in) {
  const int64_t M = in.x.size(0), K = in.x.size(1), N = in.w.size(0);
  LinearArgs a{M, N, K, in.x.stride(0), in.w.stride(0), out.stride(0)};
#if defined(PAGELLM_GEMM_QUAD) || defined(PAGELLM_LINEAR_DPBF16)
  const auto bf16 = [](const at::Tensor& t) { return reinterpret_cast<c10::BFloat16*>(t.data_ptr()); };
  c10::BFloat16* const bias_bf16 = in.b.defined() ? bf16(in.b) : nullptr;  // read only by the bf16 schedules
#endif
#ifdef PAGELLM_GEMM_QUAD
  if (in.x.scalar_type() == at::kBFloat16 && M >= kLinearFewRowsMinM && M <= kLinearFewRowsMaxM) {  // verify rows
    linear_few_rows_bf16(bf16(out), bf16(in.x), bf16(in.w), bias_bf16, a);
    return;
  }
#endif
#ifdef PAGELLM_LINEAR_DPBF16
  if (in.x.scalar_type() == at::kBFloat16 && M >= kLinearGemmMinM) {  // same bits per row, a GEMM schedule
    linear_gemm_bf16(bf16(out), bf16(in.x), bf16(in.w), bias_bf16, a);
    return;
  }
#endif
  PAGELLM_DISPATCH_FLOAT_TYPES(in.x.scalar_type(), "linear_small_m", [&] {
    linear_small_m_kernel<scalar_t>(out.data_ptr<scalar_t>(), in.x.data_ptr<scalar_t>(), in.w.data_ptr<scalar_t>(),
                                    in.b.defined() ? in.b.data_ptr<scalar_t>() : nullptr, a);
  });
}

void linear_small_m(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias) {
  const LinearInputs in = check_linear(out, x, weight, bias);
  if (linear_trivial(out, in)) return;
  hint_next_weight(in.w, x.size(0));
  run_linear_small_m(out, in);
}

// out[m] = argmax_rows(linear_small_m(x, weight, bias))[m], the logits never stored where argmax_fuses_rows (the greedy
// LM head of a decode row or a verify step's rows).
void linear_argmax(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                   const std::optional<at::Tensor>& bias) {
  check_cpu(out, "out");
  check_dtype(out, at::kLong, "out");
  check_dim(x, 2, "x");
  check_dim(weight, 2, "weight");
  const int64_t M = x.size(0), N = weight.size(0);
  TORCH_CHECK(out.dim() == 1 && out.size(0) == M, "out must have shape [", M, "] (the rows of x), got ", out.sizes());
  TORCH_CHECK(out.stride(0) == 1 || M <= 1, "out must be contiguous");
  TORCH_CHECK(N > 0, "weight must have at least one row, got shape ", weight.sizes());
  TORCH_CHECK(N < kArgmaxMaxCols, "weight may have at most ", kArgmaxMaxCols - 1, " rows, got ", N);
  // The logits linear_small_m would write, as a stride-0 stand-in: check_linear checks it as linear's out.
  const LinearInputs in = check_linear(at::empty({1, N}, x.options()).expand({M, N}), x, weight, bias);
  if (M == 0) return;
  hint_next_weight(in.w, M);
  if (!argmax_fuses_rows(in.x.scalar_type() == at::kBFloat16, M) || in.x.size(1) == 0) {
    // the many-row (or few_rows_wide) schedules, then one argmax pass over the stored logits
    at::Tensor logits = at::empty({M, N}, x.options());
    if (!linear_trivial(logits, in)) run_linear_small_m(logits, in);
    PAGELLM_DISPATCH_FLOAT_TYPES(logits.scalar_type(), "linear_argmax", [&] {
      argmax_rows_kernel<scalar_t>(out.data_ptr<int64_t>(), logits.data_ptr<scalar_t>(), M, N, N);
    });
    return;
  }
  const LinearArgs a{M, N, in.x.size(1), in.x.stride(0), in.w.stride(0), N};
  PAGELLM_DISPATCH_FLOAT_TYPES(in.x.scalar_type(), "linear_argmax", [&] {
    linear_argmax_kernel<scalar_t>(out.data_ptr<int64_t>(), in.x.data_ptr<scalar_t>(), in.w.data_ptr<scalar_t>(),
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
  m.impl("linear_argmax", &pagellm::cpu::linear_argmax);
}
