// Device-independent argument checks of gguf_linear, shared by the CPU and CUDA glue. Every failure names
// the offending argument (and, for qtype, the supported types).
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "ops/common/arg_checks.h"
#include "ops/quant/gguf_blocks.h"

namespace pagellm::gguf {

struct GgufLinearInputs {
  at::Tensor x, bias;  // x with a contiguous last dim; bias contiguous or undefined
  int64_t M, N, K, row_bytes;
  int qtype;           // the block type (kPackedFlag removed)
  bool packed = false;  // qweight rows interleaved in groups of 16 (gguf_cpu_packed.h)
};

// out [M, N] (x's dtype, last dim contiguous) = x [M, K] @ dequant(qweight [N, K / block_elems * block_bytes])^T
// + bias [N].
inline GgufLinearInputs check_gguf_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight,
                                          int64_t qtype, int64_t in_features, const std::optional<at::Tensor>& bias) {
  const bool packed = qtype >= 0 && (qtype & kPackedFlag) != 0;
  const int64_t base_type = packed ? qtype & ~static_cast<int64_t>(kPackedFlag) : qtype;
  const int bytes = block_bytes(static_cast<int>(base_type));
  const bool known = base_type == static_cast<int>(base_type) && bytes > 0;
  TORCH_CHECK(known && (!packed || packable(static_cast<int>(base_type))), "qtype must be ", kSupportedTypes, ", got ",
              qtype);
  const int elems = block_elems(static_cast<int>(base_type));
  TORCH_CHECK(in_features > 0 && in_features % elems == 0, "in_features must be a positive multiple of ", elems,
              " (the block size of qtype ", base_type, "), got ", in_features);
  check_float(x, "x");
  check_same_dtype(out, x, "out", "x");
  check_dtype(qweight, at::kByte, "qweight");
  check_dim(x, 2, "x");
  check_dim(qweight, 2, "qweight");
  check_dim(out, 2, "out");
  const int64_t M = x.size(0), K = in_features, N = qweight.size(0), row_bytes = K / elems * bytes;
  TORCH_CHECK(x.size(1) == K, "x must have shape [M, in_features = ", K, "], got ", x.sizes());
  TORCH_CHECK(qweight.size(1) == row_bytes, "qweight must have shape [N, in_features / ", elems, " * ", bytes, " = ",
              row_bytes, "] (uint8 blocks of qtype ", qtype, "), got ", qweight.sizes());
  check_contiguous(qweight, "qweight");
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "out must have shape [", M, ", ", N, "], got ", out.sizes());
  check_last_contiguous(out, "out");
  GgufLinearInputs in{x.stride(1) == 1 ? x : x.contiguous(), at::Tensor(), M, N, K, row_bytes,
                      static_cast<int>(base_type), packed};
  if (bias.has_value() && bias->defined()) {
    check_same_dtype(*bias, x, "bias", "x");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bias must have shape [", N, "], got ", bias->sizes());
    in.bias = bias->contiguous();
  }
  return in;
}

}  // namespace pagellm::gguf
