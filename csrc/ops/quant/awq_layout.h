// awq_linear's weight layout (the kernel layout of python/pagellm/quantization/awq_format.py), shared by the
// CPU and CUDA kernels. Torch-free and CUDA-free (included from .cu files compiled by nvcc alone).
//
// A weight W [N, K] (K % 32 == 0, group size G a multiple of 32 dividing K) is three tensors:
//   qweight uint8   [N, K / 2]   per row, blocks of 32 along K, 16 bytes each: byte j of block b holds
//                                q[n, 32b + j] in its low nibble and q[n, 32b + 16 + j] in its high nibble
//   scales  float32 [N, K / G]   s[n, g]
//   zeros   uint8   [N, K / G]   z[n, g] in 0..15
//   W[n, k] = (q[n, k] - z[n, k / G]) * s[n, k / G]
// (q - z) is a small integer, so every kernel computes W exactly: one rounding, the product by s.
#pragma once

#include <cstdint>

namespace pagellm::awq {

constexpr int kBlockElems = 32;  // weights per block
constexpr int kBlockBytes = 16;  // bytes per block (two nibbles per byte)

// Raw pointers to rows [n0, n0 + rows) of one AWQ weight (contiguous tensors).
struct AwqWeightView {
  const uint8_t* qweight;  // row n at qweight + n * row_bytes()
  const float* scales;     // row n at scales + n * num_groups()
  const uint8_t* zeros;    // row n at zeros + n * num_groups()
  int64_t K;               // in_features
  int64_t group_size;      // G

  int64_t row_bytes() const { return K / 2; }
  int64_t num_groups() const { return K / group_size; }
  int64_t blocks_per_group() const { return group_size / kBlockElems; }
  // The same weight starting at row n.
  AwqWeightView from_row(int64_t n) const {
    return {qweight + n * row_bytes(), scales + n * num_groups(), zeros + n * num_groups(), K, group_size};
  }
};

}  // namespace pagellm::awq
