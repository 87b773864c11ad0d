// awq_linear on the CPU: out[M, N] = x[M, K] @ W^T (+ bias[N]), W[n, k] = (q[n, k] - z[n, k / G]) * s[n, k / G]
// in the layout of awq_layout.h. Math over raw pointers; the glue (awq_linear_cpu.cpp) picks the path.
//
// Small M (decode): the weight is streamed once. The parallel loop walks N in tiles of kTileRows weight rows;
// each tile expands its blocks in registers, exactly ((q - z) as an integer, then one product by s), and
// multiplies them into fp32 accumulators for up to MR activation rows at a time (awq_cpu_simd.h), so for
// M <= MR every weight byte is read exactly once. fp32 x is used as it is, so the result differs from
// dequantize-then-matmul in fp32 only in summation order. Half-precision x is quantized per 32-block to int8
// once per call and meets the raw nibbles in AVX-512 VNNI dot products where the CPU has them (awq_cpu_vnni.h:
// ~0.4% of each block's largest |x| of rounding, like llama.cpp's Q8 activations), else it is converted to
// fp32 (exact as for fp32 x). The result is rounded once into T (bias added in fp32 first). The SIMD path is
// chosen at run time (Isa): AVX-512 VNNI, AVX-512, AVX2 or portable code.
//
// Larger M (prefill): `dequantize_rows` expands a tile of weight rows into T, to feed a GEMM (the glue).
#pragma once

#include "ops/common/parallel.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "ops/common/cpu_vec.h"
#include "ops/quant/awq_cpu_simd.h"
#include "ops/quant/awq_cpu_vnni.h"
#include "ops/quant/awq_layout.h"

namespace pagellm::cpu::awq {
using namespace pagellm::awq;

constexpr int kTileRows = 4;     // weight rows per small-M tile (NR)
constexpr int64_t kChunkM = 16;  // x rows per pass over a tile (the weight tile is re-read from L1)

enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Vnni = 3 };

inline const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Vnni: return "vnni";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

// The widest SIMD path this CPU (and OS: libgcc checks XGETBV) can run.
inline Isa best_isa() {
#ifdef PAGELLM_AWQ_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq"))
    return __builtin_cpu_supports("avx512vnni") ? Isa::kAvx512Vnni : Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
#endif
  return Isa::kScalar;
}

// Block b of row 0 of `w` (group g) -> 32 floats (q - z) * s.
inline void dequant_block(const AwqWeightView& w, int64_t b, int64_t g, float* out) {
  const uint8_t* blk = w.qweight + b * kBlockBytes;
  const int z = w.zeros[g];
  const float s = w.scales[g];
  for (int e = 0; e < kBlockBytes; ++e) {
    out[e] = static_cast<float>((blk[e] & 0xF) - z) * s;
    out[e + 16] = static_cast<float>((blk[e] >> 4) - z) * s;
  }
}

// The portable tile (same contract as the SIMD ones in awq_cpu_simd.h).
template <int MR, int NR>
struct ScalarTile {
  static constexpr int kMaxMR = 4;
  static void run(const AwqWeightView& w, const float* x, int64_t ldx, float* sums, int64_t lds) {
    float acc[MR][NR] = {};
    float wb[NR][kBlockElems];
    const int64_t nb = w.K / kBlockElems, bpg = w.blocks_per_group();
    for (int64_t b = 0; b < nb; ++b) {
      for (int j = 0; j < NR; ++j) dequant_block(w.from_row(j), b, b / bpg, wb[j]);
      for (int i = 0; i < MR; ++i) {
        const float* xb = x + i * ldx + b * kBlockElems;
        for (int j = 0; j < NR; ++j) {
          float s = 0.f;
          for (int e = 0; e < kBlockElems; ++e) s += wb[j][e] * xb[e];
          acc[i][j] += s;
        }
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) sums[i * lds + j] = acc[i][j];
  }
};

// x from its row i on: fp32 rows ldx apart, or rows quantized for the VNNI tiles (which carry their strides).
inline const float* skip_rows(const float* x, int64_t i, int64_t ldx) { return x + i * ldx; }
#ifdef PAGELLM_AWQ_X86
inline vnni::QuantizedX skip_rows(const vnni::QuantizedX& x, int64_t i, int64_t /*ldx*/) { return x.from_row(i); }
#endif

// sums[i * lds + j] = x row i . weight row j for i < M, j < NR, in tiles of the Tile's MR rows.
template <template <int, int> class Tile, int NR, typename X>
void rows_dot_nr(const AwqWeightView& w, X x, int64_t ldx, int64_t M, float* sums, int64_t lds) {
  constexpr int MR = Tile<1, NR>::kMaxMR;
  int64_t i = 0;
  for (; i + MR <= M; i += MR) Tile<MR, NR>::run(w, skip_rows(x, i, ldx), ldx, sums + i * lds, lds);
  const int64_t rest = M - i;
  x = skip_rows(x, i, ldx);
  sums += i * lds;
  if constexpr (MR > 3) {
    if (rest == 3) return Tile<3, NR>::run(w, x, ldx, sums, lds);
  }
  if constexpr (MR > 2) {
    if (rest == 2) return Tile<2, NR>::run(w, x, ldx, sums, lds);
  }
  if (rest == 1) Tile<1, NR>::run(w, x, ldx, sums, lds);
}

// sums[i * kTileRows + j] = x row i . weight row j for i < M, j < nr <= kTileRows.
template <template <int, int> class Tile, typename X = const float*>
void rows_dot(const AwqWeightView& w, int nr, X x, int64_t ldx, int64_t M, float* sums) {
  if (nr == kTileRows) return rows_dot_nr<Tile, kTileRows>(w, x, ldx, M, sums, kTileRows);
  for (int j = 0; j < nr; ++j) rows_dot_nr<Tile, 1>(w.from_row(j), x, ldx, M, sums + j, kTileRows);
}

using RowsDotFn = void (*)(const AwqWeightView&, int, const float*, int64_t, int64_t, float*);

// The fp32-activation tiles of `isa` (VNNI machines use the AVX-512 ones: fp32 x stays exact).
inline RowsDotFn rows_dot_fn(Isa isa) {
#ifdef PAGELLM_AWQ_X86
  if (isa >= Isa::kAvx512) return &rows_dot<Avx512Tile>;
  if (isa == Isa::kAvx2) return &rows_dot<Avx2Tile>;
#endif
  return &rows_dot<ScalarTile>;
}

struct AwqLinearArgs {
  int64_t M, N;
  int64_t ldx, ldo;  // row strides of x and out (elements); rows contiguous
};

// out rows = dot(weight tile, its rows, x rows m0.., their count, sums) + bias, the weight streamed once: the
// parallel loop walks N in tiles of kTileRows rows, each meeting every x row in chunks of kChunkM.
template <typename T, typename Dot>
void stream_weight_tiles(T* out, const AwqWeightView& w, const T* bias, const AwqLinearArgs& a, const Dot& dot) {
  const int64_t tiles = (a.N + kTileRows - 1) / kTileRows;
  // >= ~64 KiB of weight per task, so small matrices run inline and big ones split across threads.
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(kTileRows * w.row_bytes(), 1));
  pagellm::cpu::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    float sums[kChunkM * kTileRows];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kTileRows;
      const int nr = static_cast<int>(std::min<int64_t>(kTileRows, a.N - n0));
      for (int64_t m0 = 0; m0 < a.M; m0 += kChunkM) {
        const int64_t mc = std::min(kChunkM, a.M - m0);
        dot(w.from_row(n0), nr, m0, mc, sums);
        for (int64_t i = 0; i < mc; ++i) {
          T* o = out + (m0 + i) * a.ldo + n0;
          for (int j = 0; j < nr; ++j) {
            const float s = sums[i * kTileRows + j] + (bias ? static_cast<float>(bias[n0 + j]) : 0.f);
            o[j] = static_cast<T>(s);
          }
        }
      }
    }
  });
}

// The small-M path (correct for any M; the weight tile is re-read from L1 for every kChunkM rows). Half-precision
// x takes the VNNI tiles when isa is kAvx512Vnni; fp32 x always the exact FMA tiles.
template <typename T>
void awq_linear_small_m(T* out, const T* x, const AwqWeightView& w, const T* bias, const AwqLinearArgs& a, Isa isa) {
  const float* xf = nullptr;
  int64_t ldxf = a.ldx;
  std::vector<float> x32;  // half-precision x as fp32, converted once per call
  if constexpr (std::is_same_v<T, float>) {
    xf = x;
  } else {
    x32.resize(static_cast<size_t>(a.M * w.K));
    for (int64_t m = 0; m < a.M; ++m) load_row_f32(x + m * a.ldx, x32.data() + m * w.K, w.K);
    xf = x32.data();
    ldxf = w.K;
  }
#ifdef PAGELLM_AWQ_X86
  if (!std::is_same_v<T, float> && isa == Isa::kAvx512Vnni) {
    const VnniX xq = quantize_x_vnni(xf, ldxf, a.M, w);
    return stream_weight_tiles(out, w, bias, a, [&](const AwqWeightView& wt, int nr, int64_t m0, int64_t mc, float* s) {
      rows_dot<VnniTile>(wt, nr, xq.view.from_row(m0), 0, mc, s);
    });
  }
#endif
  const RowsDotFn dot = rows_dot_fn(isa);
  stream_weight_tiles(out, w, bias, a, [&](const AwqWeightView& wt, int nr, int64_t m0, int64_t mc, float* s) {
    dot(wt, nr, xf + m0 * ldxf, ldxf, mc, s);
  });
}

// dst[r, :K] (row stride ldd) = weight row r of `w` dequantized, rounded to T, for r < rows.
template <typename T>
void dequantize_rows(const AwqWeightView& w, int64_t rows, T* dst, int64_t ldd, Isa isa) {
  pagellm::cpu::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(static_cast<size_t>(w.K));
    for (int64_t r = begin; r < end; ++r) {
      const AwqWeightView row = w.from_row(r);
#ifdef PAGELLM_AWQ_X86
      if (isa >= Isa::kAvx512) {
        avx512::dequant_row(row, buf.data());
      } else
#endif
      {
        const int64_t bpg = w.blocks_per_group();
        for (int64_t b = 0; b < w.K / kBlockElems; ++b) dequant_block(row, b, b / bpg, buf.data() + b * kBlockElems);
      }
      store_row(buf.data(), dst + r * ldd, w.K);
    }
  });
}

}  // namespace pagellm::cpu::awq
