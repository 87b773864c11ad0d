// bf16 linear on Intel AMX tiles: out[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]), fp32 accumulation,
// one rounding to bf16. For the row counts between decode (the small-M kernel) and big prefill chunks,
// where oneDNN's bf16 GEMM reaches only a fraction of the AMX peak on these shapes.
//
// The weight stays in its checkpoint layout. TDPBF16PS wants its B operand in "VNNI" pairs, which a
// row-major [N, K] weight is not; so the kernel computes the transposed product out^T = w @ x^T:
//   - A tiles are 16 weight rows x 32 k, loaded straight from w (rows contiguous in k);
//   - B tiles are x^T in VNNI pairs; x is small, so it is packed once per call (pack_x_panel);
//   - C tiles hold out^T (16 n x 16 m fp32); they are transposed on the way out (16x16 in registers).
// Register blocking is 2 A x 2 B -> 4 C tiles (all 8 tile registers): a 32 n x 32 m block per k step.
// Threads split N in blocks of 32 rows; each thread walks its weight rows once per chunk of M rows
// (256-512 rows, sized so x's packed chunk stays in L2), so the weight is streamed from memory once
// for decode; inside a block, K goes in 512-wide slices so the weight slice is reused from L1.
// K and N tails go through small zero-padded copies, M tails through zero rows of the packed x, so the
// tile configuration never changes. Every output element sums k in the same order whatever M is, so a
// row's result does not depend on the other rows in the batch.
#pragma once

#include "ops/common/parallel.h"
#include <c10/util/BFloat16.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops/common/transpose_avx512.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PAGELLM_HAVE_AMX 1
#endif

namespace pagellm::cpu::amx {

#ifdef PAGELLM_HAVE_AMX

constexpr int64_t kTileK = 32;  // bf16 elements of k per tile row (64 bytes)
constexpr int64_t kBlockN = 32;
constexpr int64_t kBlockM = 32;
constexpr int64_t kAmxPrefetchChunks = 4;  // software prefetch distance, in k chunks of the weight rows
constexpr int64_t kSliceChunks = 16;       // k chunks per slice (512 k): a block's weight slice is 32 KiB
constexpr int64_t kChunkPairs = 16;        // at most 16 pairs of 16-row panels of x per chunk of M (512 rows)

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Eight 16 x 64-byte tiles: 0-3 C (fp32 16x16), 4-5 A (weight rows), 6-7 B (packed x).
inline void load_tile_config() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

struct AmxArgs {
  int64_t M, N, K;
  int64_t ldx, ldw, ldo;  // row strides (elements); last dims contiguous
  int64_t k_pad;          // K rounded up to kTileK
};

using pagellm::cpu::transpose16;  // ops/common/transpose_avx512.h

// x rows [m0, m0 + 16) -> one packed panel: k_pad/2 rows of 16 dwords, dword (p, i) = x[m0+i][2p:2p+2]
// (zeros past M and K). A B tile for k chunk c is the 16 panel rows at p = 16c, stride 64 bytes.
// Each k chunk is a 16 x 16 dword transpose of the 16 rows' 64 bytes.
inline void pack_x_panel(uint32_t* dst, const c10::BFloat16* x, const AmxArgs& a, int64_t m0) {
  const int64_t rows = std::min<int64_t>(16, a.M - m0);
  for (int64_t k0 = 0; k0 < a.k_pad; k0 += kTileK) {
    const int64_t kn = std::min<int64_t>(kTileK, a.K - k0);  // bf16 elements of this chunk inside K
    const __mmask32 mask = kn >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((1u << kn) - 1);
    __m512 r[16];
    for (int64_t i = 0; i < 16; ++i)
      r[i] = i < rows ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(mask, x + (m0 + i) * a.ldx + k0))
                      : _mm512_setzero_ps();
    transpose16(r);
    for (int p = 0; p < 16; ++p) _mm512_storeu_ps(reinterpret_cast<float*>(dst + (k0 / 2 + p) * 16), r[p]);
  }
}

// C tile (16 n x 16 m, fp32, row stride 16) -> out[m0 + i][n0 + j] for the valid i < rows, j < cols.
inline void store_ct(const float* c, c10::BFloat16* out, const c10::BFloat16* bias, const AmxArgs& a, int64_t m0,
                     int64_t n0) {
  const int64_t rows = std::min<int64_t>(16, a.M - m0), cols = std::min<int64_t>(16, a.N - n0);
  if (rows <= 0 || cols <= 0) return;
  __m512 r[16];
  for (int j = 0; j < 16; ++j) r[j] = _mm512_load_ps(c + 16 * j);
  transpose16(r);
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
  const __m512 bv = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(  // bf16 -> fp32: the high half of the word
                               _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + n0)), 16))
                         : _mm512_setzero_ps();
  for (int64_t i = 0; i < rows; ++i) {
    const __m256bh v = _mm512_cvtneps_pbh(_mm512_add_ps(r[i], bv));
    _mm256_mask_storeu_epi16(out + (m0 + i) * a.ldo + n0, mask, (__m256i)v);
  }
}

// Prefetches the 32 weight rows of k chunk pc of the block at w0 (or, past its end, of the next block).
inline void prefetch_a(const c10::BFloat16* w0, const c10::BFloat16* next, int64_t ldw, int64_t pc,
                       int64_t full_chunks) {
  const c10::BFloat16* pw = pc < full_chunks ? w0 + pc * kTileK
                            : next && pc - full_chunks < full_chunks ? next + (pc - full_chunks) * kTileK
                                                                     : nullptr;
  if (pw)
    for (int r = 0; r < 32; ++r) _mm_prefetch(reinterpret_cast<const char*>(pw + r * ldw), _MM_HINT_T0);
}

// One 32-row weight block (two A tiles at w0 and w0 + 16 rows, row stride ldw elements; the last k
// chunk from ktail, 32 rows x kTileK, when K is not a multiple of kTileK) against packed panels
// [t0, t1) of x, at most 2 * kChunkPairs panels. prefetch: software-prefetch w0's rows (a block of the
// real weight); next: the following block's rows (same stride) when it is a full one, else null.
//
// K is walked in slices of kSliceChunks chunks: the block's slice of weight (32 x 512 bf16, 32 KiB) is
// loaded from memory on the first pair of panels and stays in L1 for the others, so for large M only
// the packed x streams from L2. Between slices each pair's four C tiles wait in cacc (fp32, exact), so
// every output still sums k in the same order whatever M is.
inline void block_kernel(const c10::BFloat16* w0, int64_t ldw, const c10::BFloat16* ktail,
                         bool prefetch, const c10::BFloat16* next, const uint32_t* xp, int64_t t0, int64_t t1,
                         c10::BFloat16* out, const c10::BFloat16* bias, const AmxArgs& a, int64_t n0, float* cacc) {
  const int64_t chunks = a.k_pad / kTileK;
  const int64_t full_chunks = ktail ? chunks - 1 : chunks;
  const int64_t panel = a.k_pad / 2 * 16;  // dwords per packed panel
  const int64_t wstride = ldw * 2;          // bytes
  for (int64_t ks = 0; ks < chunks; ks += kSliceChunks) {
    const int64_t ke = std::min(chunks, ks + kSliceChunks);
    const bool first = ks == 0, last = ke == chunks;
    for (int64_t t = t0; t < t1; t += 2) {
      const bool two = t + 1 < t1;
      const uint32_t* b0 = xp + t * panel;
      const uint32_t* b1 = b0 + panel;
      float* cp = cacc + (t - t0) / 2 * 1024;
      if (first) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      } else {
        _tile_loadd(0, cp, 64);
        _tile_loadd(1, cp + 256, 64);
        _tile_loadd(2, cp + 512, 64);
        _tile_loadd(3, cp + 768, 64);
      }
      for (int64_t c = ks; c < ke; ++c) {
        // Tile loads that miss cache stall the tile unit in order: on the first pass over this slice pull
        // the weight rows kAmxPrefetchChunks chunks ahead (the next block's start near the end).
        if (prefetch && t == t0) prefetch_a(w0, next, ldw, c + kAmxPrefetchChunks, full_chunks);
        const bool tail = c >= full_chunks;
        const c10::BFloat16* wa = tail ? ktail : w0 + c * kTileK;
        const int64_t stride = tail ? kTileK * 2 : wstride;
        _tile_loadd(4, wa, stride);
        _tile_loadd(5, wa + 16 * (stride / 2), stride);
        _tile_loadd(6, b0 + c * 16 * 16, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 5, 6);
        if (two) {
          _tile_loadd(7, b1 + c * 16 * 16, 64);
          _tile_dpbf16ps(2, 4, 7);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, cp, 64);
      _tile_stored(1, cp + 256, 64);
      if (two) {
        _tile_stored(2, cp + 512, 64);
        _tile_stored(3, cp + 768, 64);
      }
      if (last) {
        store_ct(cp, out, bias, a, t * 16, n0);
        store_ct(cp + 256, out, bias, a, t * 16, n0 + 16);
        if (two) {
          store_ct(cp + 512, out, bias, a, (t + 1) * 16, n0);
          store_ct(cp + 768, out, bias, a, (t + 1) * 16, n0 + 16);
        }
      }
    }
  }
}

// Panels of M per packed chunk: x's packed chunk (m x k_pad bf16) stays within ~1 MiB of L2, but at
// least 16 panels (256 rows; for large K, re-reading the weight per chunk costs more than L2 misses on
// x) and at most 2 * kChunkPairs, whose C tiles (4 KiB per pair) sit in cacc between k slices.
inline int64_t m_chunk_panels(const AmxArgs& a) {
  const int64_t rows = (int64_t(1) << 20) / (a.k_pad * 2);
  return std::clamp<int64_t>(rows / kBlockM * 2, 16, 2 * kChunkPairs);
}

inline void linear_amx_kernel(c10::BFloat16* out, const c10::BFloat16* x, const c10::BFloat16* w,
                              const c10::BFloat16* bias, const AmxArgs& a) {
  const int64_t panels = (a.M + 15) / 16;
  const int64_t panel = a.k_pad / 2 * 16;
  // The packed x lives in a per-thread buffer that only grows: a fresh multi-MiB allocation per call
  // costs a page fault per 4 KiB, which for prefill-sized M took as long as the GEMM itself.
  thread_local std::vector<uint32_t> xp;
  if (xp.size() < static_cast<size_t>(panels * panel)) xp.resize(static_cast<size_t>(panels * panel));
  uint32_t* const xpd = xp.data();
  pagellm::cpu::parallel_for(0, panels, 4, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) pack_x_panel(xpd + t * panel, x, a, t * 16);
  });
  const int64_t n_blocks = (a.N + kBlockN - 1) / kBlockN;
  const int64_t chunk_panels = m_chunk_panels(a);
  const bool k_tail = a.K % kTileK != 0;
  const int64_t k_full = a.K / kTileK * kTileK;
  // ~>= 128 KiB of weight per task
  const int64_t grain = std::max<int64_t>(1, (128 << 10) / std::max<int64_t>(kBlockN * a.K * 2, 1));
  pagellm::cpu::parallel_for(0, n_blocks, grain, [&](int64_t nb0, int64_t nb1) {
    load_tile_config();
    alignas(64) float cacc[kChunkPairs * 4 * 256];
    std::vector<c10::BFloat16> ktail(k_tail ? kBlockN * kTileK : 0);
    std::vector<c10::BFloat16> npad;  // the last, partial block of rows, zero-padded to 32 x k_pad
    for (int64_t t0 = 0; t0 < panels; t0 += chunk_panels) {
      const int64_t t1 = std::min(panels, t0 + chunk_panels);
      for (int64_t nb = nb0; nb < nb1; ++nb) {
        const int64_t n0 = nb * kBlockN, rows = std::min<int64_t>(kBlockN, a.N - n0);
        const c10::BFloat16* wb = w + n0 * a.ldw;
        int64_t ldw = a.ldw;
        const c10::BFloat16* kt = nullptr;
        if (rows < kBlockN) {
          if (npad.empty()) {
            npad.assign(kBlockN * a.k_pad, c10::BFloat16(0.0f));
            for (int64_t r = 0; r < rows; ++r) std::memcpy(npad.data() + r * a.k_pad, wb + r * a.ldw, a.K * 2);
          }
          wb = npad.data();
          ldw = a.k_pad;
        } else if (k_tail) {
          std::fill(ktail.begin(), ktail.end(), c10::BFloat16(0.0f));
          for (int64_t r = 0; r < kBlockN; ++r)
            std::memcpy(ktail.data() + r * kTileK, wb + r * a.ldw + k_full, (a.K - k_full) * 2);
          kt = ktail.data();
        }
        const bool next_full = rows == kBlockN && n0 + 2 * kBlockN <= a.N;
        block_kernel(wb, ldw, kt, rows == kBlockN, next_full ? wb + kBlockN * ldw : nullptr, xpd, t0, t1, out,
                     bias, a, n0, cacc);
      }
    }
    _tile_release();
  });
}

#endif  // PAGELLM_HAVE_AMX

}  // namespace pagellm::cpu::amx
