// Which CPU prefill attention kernel runs for a call: AMX tiles (bf16 query and cache, head_dim % 32 == 0, AMX
// usable: prefill_amx_kernels.h), else the bf16 pair-dot kernel (bf16 query and cache: prefill_bf16_kernels.h,
// the same bits from both kernel libraries), else the fp32 broadcast-FMA kernel (prefill_cpu_kernels.h: fp32 /
// fp16, int8 / fp8 caches). PAGELLM_PREFILL_AMX=0 and PAGELLM_PREFILL_BF16=0 turn a path off.
#pragma once

#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "ops/paged_attention/prefill_amx_kernels.h"
#include "ops/paged_attention/prefill_bf16_kernels.h"
#include "ops/paged_attention/prefill_cpu_kernels.h"

namespace pagellm::cpu {

// PAGELLM_PREFILL_BF16=0 keeps bf16 prefill on the FMA kernel. Read on every call (a getenv per call is noise
// next to a prefill), so a benchmark or test can compare both kernels in one process.
inline bool prefill_bf16_disabled() {
  const char* v = std::getenv("PAGELLM_PREFILL_BF16");
  return v != nullptr && std::strcmp(v, "0") == 0;
}

template <typename T, typename C>
void run_paged_attention_prefill(const PagedAttnArgs<T, C>& a) {
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, T>) {
#ifdef PAGELLM_HAVE_AMX
    if (prefill_amx_applies(a) && !prefill_amx_disabled()) return paged_attention_prefill_amx(a);
#endif
#ifdef PAGELLM_HAVE_PREFILL_BF16
    if (!prefill_bf16_disabled()) return paged_attention_prefill_bf16(a);
#endif
  }
  paged_attention_prefill_kernel(a);
}

}  // namespace pagellm::cpu
