// CPU-only argument checks and the float dispatch macro; device-independent checks live in arg_checks.h.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include "ops/common/arg_checks.h"

// float32 / bfloat16 / float16 dispatch (scalar_t inside the lambda).
#define PAGELLM_DISPATCH_FLOAT_TYPES(TYPE, NAME, ...)                                          \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                    \
                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

#include <string>

namespace pagellm::cpu {

inline void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got device ", t.device());
}

}  // namespace pagellm::cpu
