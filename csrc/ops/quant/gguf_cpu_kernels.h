// gguf_linear on the CPU: out[M, N] = x[M, K] @ dequant(qweight)[N, K]^T (+ bias[N]), qweight in GGUF's
// block layout (gguf_blocks.h). Math over raw pointers; the glue (gguf_linear_cpu.cpp) picks the path.
//
// Small M (decode): the weight is streamed once. The parallel loop walks N in tiles of kTileRows weight
// rows; each tile dequantizes its blocks in registers and multiplies them into fp32 accumulators for up to
// MR activation rows at a time (gguf_cpu_simd.h), so for M <= MR every weight byte is read exactly once.
// fp32 x is used as it is and the blocks are dequantized exactly (the result differs from dequantize-then-
// matmul only in summation order); half-precision x is quantized per block to int8 once per call and meets
// the blocks in AVX-512 VNNI dot products where the CPU has them (gguf_cpu_vnni.h), else it is converted to
// fp32. The result is rounded once into T (bias added in fp32 first). The SIMD path is chosen at run time
// (Isa): AVX-512 VNNI, AVX-512, AVX2 or portable scalar code.
//
// Larger M (prefill): `dequantize_rows` expands a tile of weight rows into T, to feed a GEMM (the glue).
#pragma once

#include "ops/common/parallel.h"
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ops/common/cpu_vec.h"
#include "ops/quant/gguf_blocks.h"
#include "ops/quant/gguf_cpu_simd.h"
#include "ops/quant/gguf_cpu_vnni.h"
#include "ops/quant/gguf_cpu_packed_k.h"

namespace pagellm::cpu::gguf {
using namespace pagellm::gguf;

constexpr int kTileRows = 4;         // weight rows per small-M tile (NR)
constexpr int64_t kChunkM = 16;      // x rows per pass over a tile (the weight tile is re-read from L1)

enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Vnni = 3 };

inline const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Vnni: return "avx512_vnni";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

// The widest SIMD path this CPU (and OS) can run.
inline Isa best_isa() {
#ifdef PAGELLM_GGUF_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq"))
    return __builtin_cpu_supports("avx512vnni") ? Isa::kAvx512Vnni : Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;  // every one has F16C
#endif
  return Isa::kScalar;
}

inline float fp16_bits_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

// Sub-block s of a k-quant super-block -> 32 floats, w = a q + b (Q4_K) or a_or_b (q - 32) (Q6_K) with the
// (a, b) of gguf_blocks.h: every product exact, one rounding, as gguf.quants' numpy.
template <int QT>
inline void dequant_k_sub(const uint8_t* blk, int s, float* out) {
  if constexpr (QT == kQ4_K) {
    int sc, mn;
    q4k_scale_min(blk + 4, s, sc, mn);
    const float a = fp16_bits_to_float(blk) * static_cast<float>(sc);
    const float b = -(fp16_bits_to_float(blk + 2) * static_cast<float>(mn));
    const uint8_t* qs = blk + 16 + 32 * (s / 2);
    for (int e = 0; e < 32; ++e) out[e] = std::fma(a, static_cast<float>((qs[e] >> (4 * (s & 1))) & 0xF), b);
  } else {
    const float d = fp16_bits_to_float(blk + 208);
    const auto* scales = reinterpret_cast<const int8_t*>(blk + 192);
    const uint8_t* ql = blk + 64 * (s / 4) + 32 * (s % 2);
    const uint8_t* qh = blk + 128 + 32 * (s / 4);
    for (int e = 0; e < 32; ++e) {
      const int q = ((ql[e] >> (4 * ((s / 2) % 2))) & 0xF) | (((qh[e] >> (2 * (s % 4))) & 3) << 4);
      out[e] = d * static_cast<float>(scales[2 * s + e / 16]) * static_cast<float>(q - 32);
    }
  }
}

// One block -> block_elems(QT) floats, bit-identical to gguf.quants.dequantize (d*q, d*(q-8), d*q+m, k-quants above).
template <int QT>
inline void dequant_block(const uint8_t* blk, float* out) {
  if constexpr (is_k_quant(QT)) {
    for (int s = 0; s < sub_blocks(QT); ++s) dequant_k_sub<QT>(blk, s, out + 32 * s);
    return;
  }
  const float d = fp16_bits_to_float(blk);
  if constexpr (QT == kQ8_0) {
    for (int i = 0; i < 32; ++i) out[i] = d * static_cast<float>(static_cast<int8_t>(blk[2 + i]));
  } else if constexpr (QT == kQ4_0) {
    for (int i = 0; i < 16; ++i) {
      out[i] = d * static_cast<float>((blk[2 + i] & 0xF) - 8);
      out[i + 16] = d * static_cast<float>((blk[2 + i] >> 4) - 8);
    }
  } else {
    const float m = fp16_bits_to_float(blk + 2);
    for (int i = 0; i < 16; ++i) {
      out[i] = std::fma(d, static_cast<float>(blk[4 + i] & 0xF), m);  // d*q is exact: one rounding, as numpy
      out[i + 16] = std::fma(d, static_cast<float>(blk[4 + i] >> 4), m);
    }
  }
}

// The portable tile (same contract as the SIMD ones in gguf_cpu_simd.h).
template <int QT, int MR, int NR>
struct ScalarTile {
  using XType = float;
  static constexpr int kMaxMR = 4;
  static void run(const uint8_t* w, int64_t ldw, const float* x, int64_t ldx, int64_t nb, float* sums, int64_t lds) {
    constexpr int kBytes = block_bytes(QT), kElems = block_elems(QT);
    float acc[MR][NR] = {};
    float wb[NR][kElems];
    for (int64_t b = 0; b < nb; ++b) {
      for (int j = 0; j < NR; ++j) dequant_block<QT>(w + j * ldw + b * kBytes, wb[j]);
      for (int i = 0; i < MR; ++i) {
        const float* xb = x + i * ldx + b * kElems;
        for (int j = 0; j < NR; ++j) {
          float s = 0.f;
          for (int e = 0; e < kElems; ++e) s += wb[j][e] * xb[e];
          acc[i][j] += s;
        }
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) sums[i * lds + j] = acc[i][j];
  }
};

// sums[i * lds + j] = x row i . weight row j for i < M, j < NR, in tiles of the Tile's MR rows (x rows are ldx
// Tile::XType apart: fp32 values, or quantized rows for VnniTile).
template <template <int, int, int> class Tile, int QT, int NR>
void rows_dot_nr(const uint8_t* w, int64_t ldw, const void* xv, int64_t ldx, int64_t M, int64_t nb, float* sums,
                 int64_t lds) {
  using Fn = Tile<QT, 1, NR>;
  constexpr int MR = Fn::kMaxMR;
  const auto* x = static_cast<const typename Fn::XType*>(xv);
  int64_t i = 0;
  for (; i + MR <= M; i += MR) Tile<QT, MR, NR>::run(w, ldw, x + i * ldx, ldx, nb, sums + i * lds, lds);
  const int64_t rest = M - i;
  x += i * ldx;
  sums += i * lds;
  if constexpr (MR > 3) {
    if (rest == 3) return Tile<QT, 3, NR>::run(w, ldw, x, ldx, nb, sums, lds);
  }
  if constexpr (MR > 2) {
    if (rest == 2) return Tile<QT, 2, NR>::run(w, ldw, x, ldx, nb, sums, lds);
  }
  if (rest == 1) Tile<QT, 1, NR>::run(w, ldw, x, ldx, nb, sums, lds);
}

// sums[i * kTileRows + j] = x row i . weight row j for i < M, j < nr <= kTileRows.
template <template <int, int, int> class Tile, int QT>
void rows_dot(const uint8_t* w, int64_t ldw, int nr, const void* x, int64_t ldx, int64_t M, int64_t nb, float* sums) {
  if (nr == kTileRows) return rows_dot_nr<Tile, QT, kTileRows>(w, ldw, x, ldx, M, nb, sums, kTileRows);
  for (int j = 0; j < nr; ++j) rows_dot_nr<Tile, QT, 1>(w + j * ldw, ldw, x, ldx, M, nb, sums + j, kTileRows);
}

using RowsDotFn = void (*)(const uint8_t*, int64_t, int, const void*, int64_t, int64_t, int64_t, float*);

template <template <int, int, int> class Tile>
RowsDotFn rows_dot_for_type(int qtype) {
  switch (qtype) {
    case kQ8_0: return &rows_dot<Tile, kQ8_0>;
    case kQ4_0: return &rows_dot<Tile, kQ4_0>;
    case kQ4_1: return &rows_dot<Tile, kQ4_1>;
    case kQ4_K: return &rows_dot<Tile, kQ4_K>;
    case kQ6_K: return &rows_dot<Tile, kQ6_K>;
    default: return nullptr;
  }
}

// The fp32-activation tiles of `isa` (VNNI machines use the AVX-512 ones: fp32 x stays exact).
inline RowsDotFn rows_dot_fn(Isa isa, int qtype) {
#ifdef PAGELLM_GGUF_X86
  if (isa >= Isa::kAvx512) return rows_dot_for_type<Avx512Tile>(qtype);
  if (isa == Isa::kAvx2) return rows_dot_for_type<Avx2Tile>(qtype);
#endif
  return rows_dot_for_type<ScalarTile>(qtype);
}

struct GgufLinearArgs {
  int64_t M, N, K;
  int64_t ldx, ldo;  // row strides of x and out (elements); rows contiguous
  int64_t ldw;       // bytes per weight row (K / block_elems(qtype) * block_bytes(qtype))
  int qtype;         // the block type
  bool packed = false;  // rows interleaved in groups of kPackRows (gguf_cpu_packed.h)
};

// x rows as the tiles read them: fp32 (converted unless T is float), or int8-quantized for the VNNI tiles.
struct PreparedX {
  std::vector<float> f32;
  std::vector<uint8_t> quantized;
  const void* data = nullptr;
  int64_t ld = 0;  // row stride in the tile's XType
};

template <typename T>
PreparedX prepare_x(const T* x, const GgufLinearArgs& a, bool vnni) {
  PreparedX p;
  if constexpr (std::is_same_v<T, float>) {
    p.data = x;
    p.ld = a.ldx;
  } else {
    p.f32.resize(static_cast<size_t>(a.M * a.K));
    for (int64_t m = 0; m < a.M; ++m) load_row_f32(x + m * a.ldx, p.f32.data() + m * a.K, a.K);
    p.data = p.f32.data();
    p.ld = a.K;
  }
#ifdef PAGELLM_GGUF_X86
  if (vnni) {
    const int64_t nb = a.K / kBlockElems, row_bytes = (nb + 1) / 2 * vnni::kPairBytes;
    p.quantized.resize(static_cast<size_t>(a.M * row_bytes));
    const float* xf = static_cast<const float*>(p.data);
    for (int64_t m = 0; m < a.M; ++m) {
      uint8_t* dst = p.quantized.data() + m * row_bytes;
      switch (a.qtype) {
        case kQ8_0: vnni::quantize_row<kQ8_0>(xf + m * p.ld, nb, dst); break;
        case kQ4_0: vnni::quantize_row<kQ4_0>(xf + m * p.ld, nb, dst); break;
        case kQ4_K: vnni::quantize_row<kQ4_K>(xf + m * p.ld, nb, dst); break;
        case kQ6_K: vnni::quantize_row<kQ6_K>(xf + m * p.ld, nb, dst); break;
        default: vnni::quantize_row<kQ4_1>(xf + m * p.ld, nb, dst); break;
      }
    }
    p.data = p.quantized.data();
    p.ld = row_bytes;
  }
#endif
  return p;
}

// out[m0 + i, n0 + j] = sums[i * lds + j] (+ bias), rounded once to T, for i < mc, j < nr.
template <typename T>
void store_sums(T* out, const T* bias, const GgufLinearArgs& a, int64_t m0, int64_t mc, int64_t n0, int64_t nr,
                const float* sums, int64_t lds) {
  for (int64_t i = 0; i < mc; ++i) {
    T* o = out + (m0 + i) * a.ldo + n0;
    for (int64_t j = 0; j < nr; ++j) {
      const float s = sums[i * lds + j] + (bias ? static_cast<float>(bias[n0 + j]) : 0.f);
      o[j] = static_cast<T>(s);
    }
  }
}

template <typename T>
void gguf_linear_small_m(T* out, const T* x, const uint8_t* w, const T* bias, const GgufLinearArgs& a, Isa isa);

#ifdef PAGELLM_GGUF_X86
// The packed layout's VNNI path: x quantized once, both threads stream contiguous runs of 16-row groups; the
// last N % 16 rows (file layout) go through the unpacked tiles.
template <typename T, int QT>
void packed_small_m(T* out, const T* x, const uint8_t* w, const T* bias, const GgufLinearArgs& a) {
  const int64_t xblocks = a.K / kBlockElems, ldq = xblocks * packed::x_block_bytes<QT>(), groups = a.N / kPackRows;
  const int64_t nb = a.K / block_elems(QT);
  std::vector<float> xf(static_cast<size_t>(a.K));
  std::vector<uint8_t> xq(static_cast<size_t>(a.M * ldq));
  for (int64_t m = 0; m < a.M; ++m) {
    load_row_f32(x + m * a.ldx, xf.data(), a.K);
    packed::quantize_row<QT>(xf.data(), xblocks, xq.data() + m * ldq);
  }
  const int64_t group_bytes = kPackRows * a.ldw;
  // >= ~128 KiB of weight per task: small layers run inline (a wake-up costs more than they do).
  const int64_t grain = std::max<int64_t>(1, (128 << 10) / std::max<int64_t>(group_bytes, 1));
  pagellm::cpu::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    float sums[kChunkM * kPackRows];
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t m0 = 0; m0 < a.M; m0 += kChunkM) {
        const int64_t mc = std::min(kChunkM, a.M - m0);
        packed::group_dot_m<QT>(w + g * group_bytes, xq.data() + m0 * ldq, ldq, mc, nb, sums);
        store_sums(out, bias, a, m0, mc, g * kPackRows, kPackRows, sums, kPackRows);
      }
    }
  });
  const int64_t full = groups * kPackRows;
  if (full == a.N) return;
  GgufLinearArgs tail = a;
  tail.N = a.N - full;
  tail.packed = false;
  gguf_linear_small_m<T>(out + full, x, w + full * a.ldw, bias ? bias + full : nullptr, tail, Isa::kAvx512Vnni);
}
#endif

// The small-M path (correct for any M; the weight tile is re-read from L1 for every kChunkM rows). A packed
// weight takes packed_small_m on VNNI with half-precision x, else its rows are unpacked tile by tile.
template <typename T>
void gguf_linear_small_m(T* out, const T* x, const uint8_t* w, const T* bias, const GgufLinearArgs& a, Isa isa) {
  const bool vnni = !std::is_same_v<T, float> && isa == Isa::kAvx512Vnni;
#ifdef PAGELLM_GGUF_X86
  if (vnni && a.packed) {
    switch (a.qtype) {
      case kQ8_0: return packed_small_m<T, kQ8_0>(out, x, w, bias, a);
      case kQ4_0: return packed_small_m<T, kQ4_0>(out, x, w, bias, a);
      case kQ4_K: return packed_small_m<T, kQ4_K>(out, x, w, bias, a);
      case kQ6_K: return packed_small_m<T, kQ6_K>(out, x, w, bias, a);
      default: return packed_small_m<T, kQ4_1>(out, x, w, bias, a);
    }
  }
#endif
  const PreparedX px = prepare_x(x, a, vnni);
  RowsDotFn dot = rows_dot_fn(isa, a.qtype);
#ifdef PAGELLM_GGUF_X86
  if (vnni) dot = rows_dot_for_type<VnniTile>(a.qtype);
#endif
  const int64_t elem = vnni ? 1 : static_cast<int64_t>(sizeof(float));
  const int64_t nb = a.K / block_elems(a.qtype);
  const int64_t tiles = (a.N + kTileRows - 1) / kTileRows;
  // >= ~64 KiB of weight per task, so small matrices run inline and big ones split across threads.
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(kTileRows * a.ldw, 1));
  pagellm::cpu::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    float sums[kChunkM * kTileRows];
    std::vector<uint8_t> rows(a.packed ? static_cast<size_t>(kTileRows * a.ldw) : 0);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kTileRows;
      const int nr = static_cast<int>(std::min<int64_t>(kTileRows, a.N - n0));
      const uint8_t* wt = w + n0 * a.ldw;
      if (a.packed) {
        unpack_rows(a.qtype, w, a.N, a.ldw, n0, nr, rows.data());
        wt = rows.data();
      }
      for (int64_t m0 = 0; m0 < a.M; m0 += kChunkM) {
        const int64_t mc = std::min(kChunkM, a.M - m0);
        const auto* xm = static_cast<const uint8_t*>(px.data) + m0 * px.ld * elem;
        dot(wt, a.ldw, nr, xm, px.ld, mc, nb, sums);
        store_sums(out, bias, a, m0, mc, n0, nr, sums, kTileRows);
      }
    }
  });
}

// dst[r, :K] (row stride ldd) = dequantized weight row r, rounded to T, for r < rows.
// A packed weight (`packed`: w is the whole packed [N, ldw] weight, rows start at row n0) is unpacked row by row.
template <typename T>
void dequantize_rows(int qtype, const uint8_t* w, int64_t ldw, int64_t rows, int64_t K, T* dst, int64_t ldd, Isa isa,
                     bool packed = false, int64_t N = 0, int64_t n0 = 0) {
  const int64_t nb = K / block_elems(qtype);
  auto run = [&](auto qt) {
    constexpr int QT = decltype(qt)::value;
    pagellm::cpu::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(static_cast<size_t>(K));
      std::vector<uint8_t> unpacked(packed ? static_cast<size_t>(ldw) : 0);
      for (int64_t r = begin; r < end; ++r) {
        const uint8_t* row = w + r * ldw;
        if (packed) {
          unpack_row(qtype, w, N, ldw, n0 + r, unpacked.data());
          row = unpacked.data();
        }
#ifdef PAGELLM_GGUF_X86
        if (isa >= Isa::kAvx512) {
          avx512::dequant_row<QT>(row, nb, buf.data());
        } else
#endif
        {
          for (int64_t b = 0; b < nb; ++b) {
            dequant_block<QT>(row + b * block_bytes(QT), buf.data() + b * block_elems(QT));
          }
        }
        store_row(buf.data(), dst + r * ldd, K);
      }
    });
  };
  switch (qtype) {
    case kQ8_0: run(std::integral_constant<int, kQ8_0>{}); break;
    case kQ4_0: run(std::integral_constant<int, kQ4_0>{}); break;
    case kQ4_1: run(std::integral_constant<int, kQ4_1>{}); break;
    case kQ4_K: run(std::integral_constant<int, kQ4_K>{}); break;
    case kQ6_K: run(std::integral_constant<int, kQ6_K>{}); break;
    default: break;
  }
}

}  // namespace pagellm::cpu::gguf
