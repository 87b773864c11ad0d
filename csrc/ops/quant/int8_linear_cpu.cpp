// CPU glue for int8_linear (LLM.int8(), int8_cpu_kernels.h): out[M, N] = x[M, K] @ dequant(weight[N, K])^T
// with outlier columns of x in fp32, the rest as int8 (absmax per row or per group of K) or uint8 (zero point)
// x int8 -> int32 (+ bias[N]).
//
// The dot-product ISA is chosen once, at the first call, from CPUID (and the OS's saved register state):
// AVX-512 VNNI, else AVX2, else plain C++. PAGELLM_INT8_KERNEL=avx512_vnni|avx2|scalar forces one (the tests
// use it to run every path on one machine); forcing one this CPU lacks is an error at the call.
#include <torch/library.h>

#include <cstdlib>
#include <optional>
#include <string>

#include "ops/common/checks.h"
#include "ops/quant/int8_cpu_kernels.h"
#include "ops/quant/int8_linear_checks.h"

namespace pagellm::cpu::int8 {
namespace {

bool cpu_supports(Isa isa) {
#ifdef PAGELLM_INT8_X86
  __builtin_cpu_init();  // libgcc checks CPUID and XGETBV (the OS saves zmm / ymm state)
  switch (isa) {
    case Isa::kAvx512Vnni:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    case Isa::kAvx2: return __builtin_cpu_supports("avx2");
    case Isa::kScalar: return true;
  }
  return false;
#else
  return isa == Isa::kScalar;
#endif
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Vnni: return "avx512_vnni";
    case Isa::kAvx2: return "avx2";
    case Isa::kScalar: return "scalar";
  }
  return "?";
}

struct IsaChoice {
  Isa isa = Isa::kScalar;
  std::string error;  // non-empty: PAGELLM_INT8_KERNEL names something this CPU cannot run
};

IsaChoice choose_isa() {
  IsaChoice c;
  const char* env = std::getenv("PAGELLM_INT8_KERNEL");
  const std::string want = env == nullptr ? "auto" : env;
  if (want.empty() || want == "auto") {
    for (Isa isa : {Isa::kAvx512Vnni, Isa::kAvx2, Isa::kScalar}) {
      if (cpu_supports(isa)) {
        c.isa = isa;
        break;
      }
    }
    return c;
  }
  for (Isa isa : {Isa::kAvx512Vnni, Isa::kAvx2, Isa::kScalar}) {
    if (want == isa_name(isa)) {
      c.isa = isa;
      if (!cpu_supports(isa)) c.error = "PAGELLM_INT8_KERNEL=" + want + ": this CPU (or OS) does not support it";
      return c;
    }
  }
  c.error = "PAGELLM_INT8_KERNEL must be auto, avx512_vnni, avx2 or scalar, got '" + want + "'";
  return c;
}

Isa selected_isa() {
  static const IsaChoice choice = choose_isa();
  TORCH_CHECK(choice.error.empty(), "int8_linear: ", choice.error);
  return choice.isa;
}

void check_int8_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                       const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias, double threshold,
                       bool zero_point, int64_t group_size) {
  check_cpu(out, "out");
  check_cpu(x, "x");
  check_cpu(weight, "weight");
  check_cpu(weight_scale, "weight_scale");
  if (bias.has_value() && bias->defined()) check_cpu(*bias, "bias");
  ::pagellm::int8::check_int8_linear_args(out, x, weight, weight_scale, bias, threshold, zero_point, group_size);
}

void int8_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                 const std::optional<at::Tensor>& bias, double threshold, bool zero_point, int64_t group_size) {
  check_int8_linear(out, x, weight, weight_scale, bias, threshold, zero_point, group_size);
  const Isa isa = selected_isa();
  const bool has_bias = bias.has_value() && bias->defined();
  if (out.numel() == 0) return;
  if (x.size(1) == 0) {  // empty sums
    if (has_bias) out.copy_(bias->unsqueeze(0).expand_as(out));
    else out.zero_();
    return;
  }
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const at::Tensor wc = weight.stride(1) == 1 ? weight : weight.contiguous();
  const at::Tensor sc = weight_scale.contiguous();
  const at::Tensor bc = has_bias ? bias->contiguous() : at::Tensor();
  PAGELLM_DISPATCH_FLOAT_TYPES(x.scalar_type(), "int8_linear", [&] {
    const Int8LinearArgs<scalar_t> a{x.size(0), weight.size(0), x.size(1),
                                     xc.data_ptr<scalar_t>(), xc.stride(0),
                                     wc.data_ptr<int8_t>(), wc.stride(0),
                                     sc.data_ptr<float>(),
                                     has_bias ? bc.data_ptr<scalar_t>() : nullptr,
                                     out.data_ptr<scalar_t>(), out.stride(0),
                                     static_cast<float>(threshold), zero_point, group_size};
    int8_linear_kernel(a, isa);
  });
}

}  // namespace
}  // namespace pagellm::cpu::int8

TORCH_LIBRARY_IMPL(pagellm, CPU, m) { m.impl("int8_linear", &pagellm::cpu::int8::int8_linear); }
