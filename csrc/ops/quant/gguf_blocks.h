// GGUF (ggml) quantized block layouts used natively by gguf_linear, shared by the CPU and CUDA kernels.
// Torch-free and CUDA-free: plain structs and constants (included from .cu files compiled by nvcc alone).
//
// A weight row of K elements is K / 32 consecutive blocks; a weight [N, K] is N such rows (bytes
// [N, K / 32 * block_bytes], exactly as stored in a .gguf file). Per block of 32 elements:
//   Q8_0 (type 8): fp16 d, int8 qs[32]                    w[i] = d * qs[i]
//   Q4_0 (type 2): fp16 d, uint8 qs[16]                   w[i] = d * (nib[i] - 8)
//   Q4_1 (type 3): fp16 d, fp16 m, uint8 qs[16]           w[i] = d * nib[i] + m
// where nib[i] = qs[i] & 0xF for i < 16 and qs[i - 16] >> 4 for i >= 16 (low nibbles hold the first half).
// Every block size is even and every field 2-byte aligned within it, so the fp16 fields of any block of a
// row starting at an even address are 2-byte aligned.
#pragma once

#include <cstdint>

namespace pagellm::gguf {

// ggml's type ids (gguf.GGMLQuantizationType), the `qtype` argument of gguf_linear.
enum QType : int { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };

constexpr int kBlockElems = 32;

// qtype | kPackedFlag: the same blocks with every full group of 16 rows interleaved for the CPU's VNNI kernel
// (layout in gguf_cpu_packed.h; CPU only). Python: pagellm.quantization.gguf_packing.
constexpr int kPackedFlag = 0x100;

struct BlockQ8_0 {
  uint16_t d;  // fp16 bits
  int8_t qs[32];
};
struct BlockQ4_0 {
  uint16_t d;
  uint8_t qs[16];
};
struct BlockQ4_1 {
  uint16_t d, m;
  uint8_t qs[16];
};
static_assert(sizeof(BlockQ8_0) == 34 && sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20,
              "GGUF block structs must match the file layout (no padding)");

// Bytes of one block of `qtype`; 0 for a type gguf_linear does not support.
constexpr int block_bytes(int qtype) {
  return qtype == kQ8_0 ? 34 : qtype == kQ4_0 ? 18 : qtype == kQ4_1 ? 20 : 0;
}

constexpr const char* kSupportedTypes = "2 (Q4_0), 3 (Q4_1) or 8 (Q8_0), optionally | 0x100 (row-packed, CPU)";

}  // namespace pagellm::gguf
