// linear_gemv kernel 2 on the GPU: a split-K, several-columns-per-warp GEMV for decode rows. Torch-free.
//
// Why not gemv_cuda.cuh's warp-per-column kernel (session 19, H200): at M = 1 it reached 0.38-0.81 of the copy
// bandwidth (cuBLAS 0.34-0.86): a 2048-wide o_proj made only 256 CTAs of 8 columns, a K = 8192 row took a warp
// four dependent round trips to memory; at M = 8 every weight vector re-read 8 x vectors from L1 (0.10-0.22).
// Here:
//  - split-K across the warps of a CTA: warp w works on K slice w % S of columns group w / S, so a small N still
//    makes hundreds of CTAs (S from N and K alone, gemv_split_slices(): never from M, see below);
//  - a warp owns NCW columns: a lane keeps NCW x U 16-byte weight vectors in flight and reuses each x vector it
//    loads for NCW columns (x traffic from L1 = MR / NCW of the weight bytes, not MR times);
//  - weights are streamed with ld.global.nc.L1::no_allocate (they do not evict the x rows from L1);
//  - PDL: the first weight chunk is loaded before pdl_wait(), so when launched as a programmatic dependent the
//    fetch overlaps the tail of the kernel before it (x and out are touched only after the wait).
// Reduction in a fixed order: lane sums over its vectors in K order, a butterfly over the warp, then the S slices
// in slice order through shared memory. For a given (N, K) the bits of out[m, n] do not depend on M, MR or NCW.
// Needs 16-byte vectors (K, strides, bases); the launcher sends other inputs to gemv_cuda.cuh.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda_common/pdl.cuh"
#include "ops/cuda_common/vec.cuh"
#include "ops/linear/gemv_launch.h"
#include "ops/linear/gemv_prologue_cuda.cuh"

namespace pagellm::cuda {

constexpr int kSplitGemvWarps = 8;

// A weight vector that is read once: no L1 line allocated, the L2 told to fetch the whole 256-byte sector group.
// kBeforeWait: the prologue's loads, issued before pdl_wait(). ptxas moves ld.global.nc (and the plain asm around
// it) below griddepcontrol.wait, which would undo the prefetch; a coherent ld.global with a memory clobber stays
// above it (checked in the sm_90 SASS: LDG.E.NA before ACQBULK). The loop's loads keep the .nc path.
template <typename T, bool kBeforeWait = false>
__device__ __forceinline__ Vec16<T> load16_stream(const T* p) {
  Vec16<T> v;
  uint4 r;
  if constexpr (kBeforeWait)
    asm volatile("ld.global.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p)
                 : "memory");
  else
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
  *reinterpret_cast<uint4*>(&v) = r;
  return v;
}

// grid = (ceil(N / (8 / S * NCW)), ceil(M / MR)), block = 256. See the file comment. P: a prologue (MR = 1; dynamic
// shared memory K * sizeof(T)) computes the CTA's x row after pdl_wait(); the loop then reads it from shared memory.
// Prologue kernels at U = 2 (kernel 4) are held to 64 registers, four CTAs per SM, as kernel 4 is without one.
template <typename T, int MR, int NCW, int U, GemvPrologue P = GemvPrologue::kNone>
__global__ void __launch_bounds__(kSplitGemvWarps * 32, P != GemvPrologue::kNone && U == 2 ? 4 : 1)
    linear_gemv_split_kernel(const GemvArgs a, const int S, const GemvPrologueArgs pa) {
  static_assert(P == GemvPrologue::kNone || MR == 1, "a prologue stages one row per CTA");
  constexpr int kVec = VecTraits<T>::kElems;
  __shared__ float red[kSplitGemvWarps][NCW][MR];
  extern __shared__ __align__(16) unsigned char gemv_row_smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int slice = warp % S, group = warp / S, groups = kSplitGemvWarps / S;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * groups * NCW + static_cast<int64_t>(group) * NCW;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * MR;
  const int mr = static_cast<int>(a.M - m0 < MR ? a.M - m0 : MR);
  const int64_t num_vecs = a.K / kVec, per_slice = (num_vecs + S - 1) / S;
  const int64_t v_begin = slice * per_slice, v_end = v_begin + per_slice < num_vecs ? v_begin + per_slice : num_vecs;
  const T* __restrict__ w_rows[NCW];
#pragma unroll
  for (int c = 0; c < NCW; ++c)  // columns past N read row N - 1 (never written): no branch in the loads
    w_rows[c] = static_cast<const T*>(a.w) + (n0 + c < a.N ? n0 + c : a.N - 1) * a.w_stride;
  // not __restrict__: no load of x may move above pdl_wait()
  const T* x = static_cast<const T*>(a.x) + m0 * a.x_stride;

  float acc[NCW][MR];
#pragma unroll
  for (int c = 0; c < NCW; ++c)
#pragma unroll
    for (int m = 0; m < MR; ++m) acc[c][m] = 0.f;
  // Vectors past the slice's end are zeros (their products add +0): no branch between a chunk's loads.
  Vec16<T> wv[NCW][U];
  int64_t v0 = v_begin + lane;
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int c = 0; c < NCW; ++c)
      wv[c][u] = v0 + 32 * u < v_end ? load16_stream<T, true>(w_rows[c] + (v0 + 32 * u) * kVec) : zero16<T>();
  pdl_wait();  // x and out belong to the kernels around this one from here on
  pdl_launch_dependents();
  if constexpr (P != GemvPrologue::kNone) {
    T* xs = reinterpret_cast<T*>(gemv_row_smem);
    gemv_stage_row<T, P>(a, pa, m0, xs);
    x = xs;  // one row (MR = 1): the loop reads it at x + v * kVec
  }
  for (; v0 < v_end; v0 += 32 * U) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t v = v0 + 32 * u;
      Vec16<T> xv[MR];
#pragma unroll
      for (int m = 0; m < MR; ++m)
        xv[m] = v < v_end && m < mr ? load16<T>(x + m * a.x_stride + v * kVec) : zero16<T>();
#pragma unroll
      for (int m = 0; m < MR; ++m)
#pragma unroll
        for (int c = 0; c < NCW; ++c)
#pragma unroll
          for (int e = 0; e < kVec; ++e)
            acc[c][m] = fmaf(to_float(wv[c][u].elem[e]), to_float(xv[m].elem[e]), acc[c][m]);
    }
    const int64_t next = v0 + 32 * U;
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int c = 0; c < NCW; ++c)
        wv[c][u] = next + 32 * u < v_end ? load16_stream<T>(w_rows[c] + (next + 32 * u) * kVec) : zero16<T>();
  }
#pragma unroll
  for (int c = 0; c < NCW; ++c)
#pragma unroll
    for (int m = 0; m < MR; ++m) {
      const float s = warp_reduce_sum(acc[c][m]);
      if (lane == 0) red[warp][c][m] = s;
    }
  __syncthreads();
  // thread t: (group, column, row) = t / (NCW * MR), ...; sums the S slices in slice order
  const int t = threadIdx.x;
  if (t >= groups * NCW * MR) return;
  const int g = t / (NCW * MR), c = (t / MR) % NCW, m = t % MR;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * groups * NCW + static_cast<int64_t>(g) * NCW + c;
  if (n >= a.N || m >= mr) return;
  float s = red[g * S][c][m];
  for (int i = 1; i < S; ++i) s += red[g * S + i][c][m];
  if (a.bias != nullptr) s += to_float(static_cast<const T*>(a.bias)[n]);
  static_cast<T*>(a.out)[(m0 + m) * a.o_stride + n] = from_float<T>(s);
}

// K slices per column: the fewest (1, 2, 4, 8) that give at least min_ctas CTAs at two columns per warp, while a
// slice keeps >= min_slice_vecs 16-byte vectors. A function of N and K only, so a row's bits do not depend on M.
inline int gemv_split_slices(int64_t N, int64_t K, int elem_bytes, int64_t min_ctas, int64_t min_slice_vecs) {
  const int64_t num_vecs = K * elem_bytes / 16;
  int S = 1;
  while (S < kSplitGemvWarps && (N + (kSplitGemvWarps / S) * 2 - 1) / ((kSplitGemvWarps / S) * 2) < min_ctas &&
         num_vecs / (2 * S) >= min_slice_vecs)
    S *= 2;
  return S;
}

template <typename T, int MR, int NCW, int U, GemvPrologue P = GemvPrologue::kNone>
cudaError_t gemv_split_rows(const GemvArgs& a, int S, bool pdl, cudaStream_t stream,
                            const GemvPrologueArgs& pa = GemvPrologueArgs{}) {
  const int64_t cols = static_cast<int64_t>(kSplitGemvWarps / S) * NCW;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>((a.N + cols - 1) / cols), static_cast<unsigned>((a.M + MR - 1) / MR));
  cfg.blockDim = dim3(kSplitGemvWarps * 32);
  cfg.dynamicSmemBytes = P == GemvPrologue::kNone ? 0 : static_cast<size_t>(a.K) * sizeof(T);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, linear_gemv_split_kernel<T, MR, NCW, U, P>, a, S, pa);
}

// MR rows of x per CTA (1, 2, 4, 8); columns per warp and vectors in flight per column by MR: NCW x U = 8
// weight vectors (128 bytes) in flight per lane. kLowRegs (MR <= 2): U = 2, 4 vectors, ~64 registers instead of
// ~100 for bf16 (sm_90), so 4 CTAs per SM instead of 2 (fewer waves for the small matrices); same bits.
template <typename T, bool kLowRegs>
cudaError_t gemv_split_typed(const GemvArgs& a, int S, bool pdl, cudaStream_t s) {
  if (a.M == 1) return gemv_split_rows<T, 1, 2, kLowRegs ? 2 : 4>(a, S, pdl, s);
  if (a.M == 2) return gemv_split_rows<T, 2, 2, kLowRegs ? 2 : 4>(a, S, pdl, s);
  if (a.M <= 4) return gemv_split_rows<T, 4, 4, 2>(a, S, pdl, s);
  return gemv_split_rows<T, 8, 4, 2>(a, S, pdl, s);
}

// With a prologue every row takes the MR = 1 kernel (a CTA stages one row), kernel 2's or 4's vectors in flight:
// at M = 1 the same kernel as without one, so the same bits.
template <typename T, bool kLowRegs>
cudaError_t gemv_prologue_typed(const GemvArgs& a, const GemvPrologueArgs& pa, int S, bool pdl, cudaStream_t s) {
  constexpr int U = kLowRegs ? 2 : 4;
  switch (pa.kind) {
    case GemvPrologue::kRmsNorm: return gemv_split_rows<T, 1, 2, U, GemvPrologue::kRmsNorm>(a, S, pdl, s, pa);
    case GemvPrologue::kAddRmsNorm: return gemv_split_rows<T, 1, 2, U, GemvPrologue::kAddRmsNorm>(a, S, pdl, s, pa);
    case GemvPrologue::kSiluMul: return gemv_split_rows<T, 1, 2, U, GemvPrologue::kSiluMul>(a, S, pdl, s, pa);
    case GemvPrologue::kNone: return gemv_split_typed<T, kLowRegs>(a, S, pdl, s);
  }
  return cudaErrorInvalidValue;
}

}  // namespace pagellm::cuda
