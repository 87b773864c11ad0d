// GGUF (ggml) quantized block layouts used natively by gguf_linear, shared by the CPU and CUDA kernels.
// Torch-free and CUDA-free: plain structs and constants (included from .cu files compiled by nvcc alone).
//
// A weight row of K elements is K / 32 consecutive blocks; a weight [N, K] is N such rows (bytes
// [N, K / 32 * block_bytes], exactly as stored in a .gguf file). Per block of 32 elements:
//   Q8_0 (type 8): fp16 d, int8 qs[32]                    w[i] = d * qs[i]
//   Q4_0 (type 2): fp16 d, uint8 qs[16]                   w[i] = d * (nib[i] - 8)
//   Q4_1 (type 3): fp16 d, fp16 m, uint8 qs[16]           w[i] = d * nib[i] + m
// where nib[i] = qs[i] & 0xF for i < 16 and qs[i - 16] >> 4 for i >= 16 (low nibbles hold the first half).
// The k-quants are super-blocks of 256 elements (a row is K / 256 of them), seen by the kernels as 8 sub-blocks of
// 32 elements s = 0..7, each with two fp32 parameters (a, b) derived from the super-block's scales (sub_params):
//   Q4_K (type 12, 144 bytes): fp16 d, fp16 dmin, uint8 scales[12] (8 6-bit scales sc and mins mn, packed as
//        gguf.quants.Q4_K.get_scale_min unpacks them), uint8 qs[128]. Sub-block s's nibbles are qs[32 (s/2) + e]
//        (low nibbles for even s, high for odd); w = (d sc[s]) q - dmin mn[s]: a = d sc[s], b = -(dmin mn[s]).
//   Q6_K (type 14, 210 bytes): uint8 ql[128], uint8 qh[64], int8 scales[16], fp16 d. With h = s / 4, the 6-bit
//        q = (ql[64 h + 32 (s % 2) + e] >> 4 ((s / 2) % 2)) & 0xF | ((qh[32 h + e] >> 2 (s % 4)) & 3) << 4, and
//        w = (d scales[2 s + e / 16]) (q - 32): a = d scales[2 s], b = d scales[2 s + 1] (elements 16..31).
// Every product above (d times a 6-bit / 8-bit integer, times a 4-bit / 6-bit q) is exact in fp32, so a kernel
// rounds each weight exactly once, as gguf.quants' numpy does.
// Every block size is even and every field 2-byte aligned within it, so the fp16 fields of any block of a
// row starting at an even address are 2-byte aligned.
#pragma once

#include <cstdint>

// Functions shared by host and device code (nvcc compiles this header too).
#if defined(__CUDACC__)
#define PAGELLM_GGUF_HD __host__ __device__
#else
#define PAGELLM_GGUF_HD
#endif

namespace pagellm::gguf {

// ggml's type ids (gguf.GGMLQuantizationType), the `qtype` argument of gguf_linear.
enum QType : int { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14 };

constexpr int kBlockElems = 32;     // elements per block, and per sub-block of a k-quant super-block
constexpr int kSuperElems = 256;    // elements per k-quant super-block

PAGELLM_GGUF_HD constexpr bool is_k_quant(int qtype) { return qtype == kQ4_K || qtype == kQ6_K; }
// Elements per block of `qtype` (what in_features must be a multiple of).
PAGELLM_GGUF_HD constexpr int block_elems(int qtype) { return is_k_quant(qtype) ? kSuperElems : kBlockElems; }
// 32-element sub-blocks per block.
PAGELLM_GGUF_HD constexpr int sub_blocks(int qtype) { return block_elems(qtype) / kBlockElems; }

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
struct BlockQ4_K {
  uint16_t d, dmin;
  uint8_t scales[12];
  uint8_t qs[128];
};
struct BlockQ6_K {
  uint8_t ql[128];
  uint8_t qh[64];
  int8_t scales[16];
  uint16_t d;
};
static_assert(sizeof(BlockQ8_0) == 34 && sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20 &&
                  sizeof(BlockQ4_K) == 144 && sizeof(BlockQ6_K) == 210,
              "GGUF block structs must match the file layout (no padding)");

// Bytes of one block of `qtype`; 0 for a type gguf_linear does not support.
PAGELLM_GGUF_HD constexpr int block_bytes(int qtype) {
  return qtype == kQ8_0   ? 34
         : qtype == kQ4_0 ? 18
         : qtype == kQ4_1 ? 20
         : qtype == kQ4_K ? 144
         : qtype == kQ6_K ? 210
                          : 0;
}

// Whether the row-packed layout (kPackedFlag) exists for `qtype`: every supported type.
PAGELLM_GGUF_HD constexpr bool packable(int qtype) { return block_bytes(qtype) > 0; }

constexpr const char* kSupportedTypes =
    "2 (Q4_0), 3 (Q4_1), 8 (Q8_0), 12 (Q4_K) or 14 (Q6_K), optionally | 0x100 (row-packed, CPU)";

// Q4_K's 6-bit scale and min of sub-block s (0..7) from its 12 packed bytes.
PAGELLM_GGUF_HD inline void q4k_scale_min(const uint8_t* scales, int s, int& sc, int& mn) {
  if (s < 4) {
    sc = scales[s] & 0x3F;
    mn = scales[s + 4] & 0x3F;
  } else {
    sc = (scales[s + 4] & 0x0F) | ((scales[s - 4] >> 6) << 4);
    mn = (scales[s + 4] >> 4) | ((scales[s] >> 6) << 4);
  }
}

}  // namespace pagellm::gguf
