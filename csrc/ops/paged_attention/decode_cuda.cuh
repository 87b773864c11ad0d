// Paged-attention decode on the GPU (one query token per sequence). Torch-free.
//
// grid = (num_seqs, num_kv_heads * head_groups, split CTAs), block = 128 threads (4 warps).
// Flash-decoding: a sequence's context [start, L) is cut into nsplit = ceil(range / per) splits of `per` tokens,
// per = max(grain, ceil(range / kDecodeMaxSplits)) (decode_split_len; grain = DecodeArgs::split_grain, default
// kDecodeSplitGrain): a function of the sequence's
// own length alone, so a row's result does not depend on the batch, the grid or the block-table width (batch
// invariance). CTA z of a (sequence, kv head, head group) takes splits z, z + gridDim.z, ... (decode_split_ctas
// sizes the grid to fill the GPU); a short context is still spread over several CTAs, since one CTA walking a
// few hundred tokens is bound by the latency of its dependent loads (session 17, H200: 30 us per layer at 190
// tokens with one split, most of a batch-1 step).
// A CTA serves up to kDecodeMaxHeads query heads that share one kv head (GQA: every K/V element is read once
// per CTA), over one split. It walks the split in chunks of kDecodeChunk tokens; per chunk:
//   0. the chunk's row offsets (block-table lookups) go to shared memory, all at once;
//   1. QK: a group of TG lanes reads one key row with 16-byte loads (lane l takes vectors l, l+TG, ...), forms
//      the dot products with every query head (q in shared memory, fp32) and reduces them with shuffles; a lane
//      issues the loads of U rows before it uses the first (memory-level parallelism); logits go to shared memory.
//   2. softmax: warp w owns heads w, w+4: chunk max, running max / sum update (fp32 online softmax),
//      p = exp(s - m) written back over the logits, the rescale factor of the old accumulator in alpha_s.
//   3. PV: thread (r, c) owns 16-byte column c of V and token lane r (tokens r, r+R, ...); it rescales its
//      fp32 accumulator [heads][vec] by alpha and adds p * v, loading kPvRows rows ahead of their use.
// At the end the R token lanes are summed (shuffles inside a warp, then warps in order: deterministic). A
// sequence with one split writes out = acc * (1 / l); otherwise each split writes its unnormalized acc, max and
// sum to the fp32 scratch, and the splits are merged: with DecodeArgs::split_counters by the last CTA of the
// (sequence, kv head, head group) to finish (an atomic counter per CTA column, reset by that CTA), else by
// paged_decode_reduce_kernel (grid = (num_seqs, num_heads), 128 threads). Both merge with the same arithmetic
// (decode_split_weights / decode_split_combine): the same bits.
// DV < D (MLA over the latent cache: D = 576 for QK, DV = 512): keys are D wide, the output and the value (the
// first DV dims of the value rows, which keep the key rows' stride) DV wide; the PV tiling follows DV.
// Quantized caches (C = int8 / fp8): the same tiling, a lane's kVec stored elements are one kVec-byte load
// converted to fp32 in registers; a key row's scale multiplies its logit, a value row's its probability.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "ops/cache_ops/kv_quant.cuh"
#include "ops/paged_attention/attention_launch.h"
#include "ops/paged_attention/decode_merge_cuda.cuh"
#include "ops/cuda_common/pdl.cuh"
#include "ops/cuda_common/vec.cuh"

namespace pagellm::cuda {

constexpr int kDecodeThreads = 128;
constexpr int kDecodeWarps = kDecodeThreads / 32;
constexpr int kDecodeChunk = 256;           // tokens whose logits sit in shared memory at once
constexpr int kDecodeSplitGrain = 64;       // a split covers at least this many tokens
constexpr int kDecodeMaxSplits = 64;        // a sequence has at most this many splits
constexpr int kPvRows = 4;                  // value rows a PV lane loads before it uses the first

// Tokens per split of a context of `range` tokens, and the number of splits (>= 1; 1 for an empty context).
// grain <= 0: kDecodeSplitGrain.
__host__ __device__ inline int64_t decode_split_len(int64_t range, int grain) {
  const int64_t per = (range + kDecodeMaxSplits - 1) / kDecodeMaxSplits, g = grain > 0 ? grain : kDecodeSplitGrain;
  return per > g ? per : g;
}
__host__ __device__ inline int decode_split_count(int64_t range, int grain) {
  const int64_t per = decode_split_len(range, grain);
  return range <= 0 ? 1 : static_cast<int>((range + per - 1) / per);
}

// Largest power of two <= cap dividing n.
__host__ __device__ constexpr int pow2_divisor(int n, int cap) { return (cap > 1 && n % cap == 0) ? cap : (cap > 1 ? pow2_divisor(n, cap / 2) : 1); }

__device__ __forceinline__ int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// Width of the output rows (and of tmp_out's): v_head_dim when set, else head_dim.
__host__ __device__ __forceinline__ int decode_out_dim(const DecodeArgs& p) {
  return p.v_head_dim > 0 ? p.v_head_dim : p.head_dim;
}

__device__ __forceinline__ float apply_softcap(float s, float softcap) {
  return softcap > 0.f ? softcap * tanhf(s / softcap) : s;
}

// kVec elements of a cache row at p as fp32: one 16-byte load of T, or a kVec-byte load of stored values.
template <typename T, typename C, int kVec>
__device__ __forceinline__ void load_row_vec(const C* p, float (&out)[kVec]) {
  if constexpr (std::is_same_v<C, T>) {
    const Vec16<T> v = load16<T>(p);
#pragma unroll
    for (int e = 0; e < kVec; ++e) out[e] = to_float(v.elem[e]);
  } else {
    load_stored<C, kVec>(p, out);
  }
}

// The context range of sequence `seq` as the kernels see it: [start, L), nsplit splits of `per` tokens. A split
// count past the scratch's capacity (a seq_len beyond the block table, bad input) is clamped: memory stays safe.
struct DecodeSplits {
  int64_t L, start, per;
  int nsplit;
};
__device__ __forceinline__ DecodeSplits decode_splits(const DecodeArgs& p, int seq) {
  DecodeSplits r;
  r.L = max(p.seq_lens[seq], 0);
  r.start = p.window > 0 ? max64(0, r.L - p.window) : 0;
  const int64_t range = r.L - r.start;
  r.per = decode_split_len(range, p.split_grain);
  r.nsplit = decode_split_count(range, p.split_grain);
  if (r.nsplit > p.num_splits) {
    r.nsplit = p.num_splits;
    r.per = ceil_div(range, p.num_splits);
  }
  return r;
}

template <typename T, int D, typename C = T, int DV = D>
__global__ void __launch_bounds__(kDecodeThreads) paged_decode_kernel(const DecodeArgs p) {
  pdl_launch_dependents();  // lets a PDL-launched kernel after it (o_proj) start fetching its weights
  constexpr bool kQuantized = kIsQuantizedCache<C>;
  constexpr int kVec = VecTraits<T>::kElems;  // elements per 16-byte vector of T (and per load of the cache)
  static_assert(D % kVec == 0, "head_dim must be a multiple of the vector width");
  constexpr int NV = D / kVec;                // vectors per row
  constexpr int TG = pow2_divisor(NV, 8);     // lanes per key row in the QK phase (divides 32)
  constexpr int VPL = NV / TG;                // vectors per lane in the QK phase
  constexpr int U = VPL >= 4 ? 1 : 4 / VPL;   // key rows a QK lane loads before it uses the first
  constexpr int kRowsPerIter = kDecodeThreads / TG;
  static_assert(DV <= D && DV % kVec == 0, "the value width must be a vector multiple <= head_dim");
  constexpr int NVV = DV / kVec;              // vectors per value / output row
  constexpr int R = kDecodeThreads / NVV;     // token lanes in the PV phase
  constexpr int GC = kDecodeMaxHeads;
  static_assert(R >= 1 && TG >= 1 && 32 % TG == 0, "bad decode tiling");
  // token lanes of one warp summed with shuffles when a warp holds whole rows of lanes
  constexpr bool kWarpLanes = NVV <= 32 && 32 % NVV == 0;

  __shared__ float q_s[GC][D];
  __shared__ float logit_s[GC][kDecodeChunk];
  __shared__ float out_s[GC][DV];
  __shared__ int64_t off_s[kDecodeChunk];
  __shared__ float m_s[GC], l_s[GC], alpha_s[GC];
  __shared__ int merge_s;  // this CTA merges the splits (the in-kernel reduction)

  const T* __restrict__ query = static_cast<const T*>(p.query);
  const C* __restrict__ key_cache = static_cast<const C*>(p.key_cache);
  const C* __restrict__ value_cache = static_cast<const C*>(p.value_cache);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int seq = blockIdx.x;
  const DecodeSplits sp = decode_splits(p, seq);
  if (static_cast<int>(blockIdx.z) >= sp.nsplit) return;  // uniform over the CTA
  const int G = p.num_heads / p.num_kv_heads;
  const int groups = (G + GC - 1) / GC;
  const int kvh = blockIdx.y / groups;
  const int grp = blockIdx.y - kvh * groups;
  const int h0 = kvh * G + grp * GC;  // first query head of this CTA
  const int gc = min(GC, G - grp * GC);

  for (int i = tid; i < GC * D; i += kDecodeThreads) {
    const int g = i / D, d = i - g * D;
    q_s[g][d] = g < gc ? to_float(query[seq * p.q_stride_tok + (h0 + g) * p.q_stride_head + d]) : 0.f;
  }

  const int32_t* __restrict__ bt = p.block_tables + seq * p.bt_stride;
  const int64_t block_elems = static_cast<int64_t>(p.num_kv_heads) * p.block_size * D;
  const int64_t head_off = static_cast<int64_t>(kvh) * p.block_size * D;
  // Element offset of token t's row in the caches, or -1 when the block table / block id is out of range.
  auto row_offset = [&](int64_t t) -> int64_t {
    const int64_t bi = t / p.block_size;
    if (bi >= p.max_blocks) return -1;
    const int64_t blk = bt[bi];
    if (blk < 0 || blk >= p.num_blocks) return -1;
    return blk * block_elems + head_off + (t - bi * p.block_size) * D;
  };

  const int qk_row = tid / TG, qk_lane = tid % TG;
  const int pv_row = tid / NVV, pv_col = tid % NVV;
  const bool pv_active = pv_row < R;

  for (int split = blockIdx.z; split < sp.nsplit; split += gridDim.z) {
    const int64_t t0 = min64(sp.L, sp.start + split * sp.per);
    const int64_t t1 = min64(sp.L, t0 + sp.per);
    for (int i = tid; i < GC * DV; i += kDecodeThreads) out_s[i / DV][i % DV] = 0.f;
    if (tid < GC) {
      m_s[tid] = -INFINITY;
      l_s[tid] = 0.f;
      alpha_s[tid] = 1.f;
    }
    float acc[GC][kVec];
#pragma unroll
    for (int g = 0; g < GC; ++g)
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[g][e] = 0.f;
    __syncthreads();  // q_s, out_s and the statistics are ready (an empty context has no chunk barrier)

    for (int64_t c0 = t0; c0 < t1; c0 += kDecodeChunk) {
      const int n = static_cast<int>(min64(kDecodeChunk, t1 - c0));
      // 0. Row offsets of the chunk.
      for (int i = tid; i < n; i += kDecodeThreads) off_s[i] = row_offset(c0 + i);
      __syncthreads();
      // 1. QK. The trip count is uniform over the block so all lanes reach the shuffles.
      for (int base = 0; base < n; base += kRowsPerIter * U) {
        float k[U][VPL][kVec];
        float ks[U];  // the key rows' scales (quantized caches)
        bool ok[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int i = base + u * kRowsPerIter + qk_row;
          const int64_t off = i < n ? off_s[i] : -1;
          ok[u] = off >= 0;
          ks[u] = 1.f;
          if (ok[u]) {
#pragma unroll
            for (int v = 0; v < VPL; ++v)
              load_row_vec<T, C, kVec>(key_cache + off + (qk_lane + v * TG) * kVec, k[u][v]);
            if constexpr (kQuantized) ks[u] = row_scale<D>(p.k_scale, off);
          } else {
#pragma unroll
            for (int v = 0; v < VPL; ++v)
#pragma unroll
              for (int e = 0; e < kVec; ++e) k[u][v][e] = 0.f;
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int i = base + u * kRowsPerIter + qk_row;
#pragma unroll
          for (int g = 0; g < GC; ++g) {
            if (g < gc) {  // uniform over the block
              float dot = 0.f;
#pragma unroll
              for (int v = 0; v < VPL; ++v)
#pragma unroll
                for (int e = 0; e < kVec; ++e) dot = fmaf(q_s[g][(qk_lane + v * TG) * kVec + e], k[u][v][e], dot);
#pragma unroll
              for (int o = TG / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
              if (i < n && qk_lane == 0)
                logit_s[g][i] = ok[u] ? apply_softcap(dot * ks[u] * p.scale, p.softcap) : -INFINITY;
            }
          }
        }
      }
      __syncthreads();
      // 2. Online softmax over the chunk, one warp per head.
      for (int g = warp; g < gc; g += kDecodeWarps) {
        float mx = -INFINITY;
        for (int i = lane; i < n; i += 32) mx = fmaxf(mx, logit_s[g][i]);
        mx = warp_reduce_max(mx);
        const float m_old = m_s[g];
        const float m_new = fmaxf(m_old, mx);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;  // all masked so far: keep exp() finite
        float sum = 0.f;
        for (int i = lane; i < n; i += 32) {
          const float e = __expf(logit_s[g][i] - m_use);
          logit_s[g][i] = e;
          sum += e;
        }
        sum = warp_reduce_sum(sum);
        if (lane == 0) {
          const float alpha = __expf(m_old - m_use);
          alpha_s[g] = alpha;
          l_s[g] = l_s[g] * alpha + sum;
          m_s[g] = m_new;
        }
      }
      __syncthreads();
      // 3. PV.
      if (pv_active) {
#pragma unroll
        for (int g = 0; g < GC; ++g) {
          if (g < gc) {
            const float a = alpha_s[g];
#pragma unroll
            for (int e = 0; e < kVec; ++e) acc[g][e] *= a;
          }
        }
        for (int i0 = pv_row; i0 < n; i0 += R * kPvRows) {
          float v[kPvRows][kVec];
          float vs[kPvRows];  // the value rows' scales, folded into the probabilities (l_s keeps the unscaled sums)
          bool ok[kPvRows];
#pragma unroll
          for (int u = 0; u < kPvRows; ++u) {
            const int i = i0 + u * R;
            const int64_t off = i < n ? off_s[i] : -1;
            ok[u] = off >= 0;
            vs[u] = 1.f;
            if (ok[u]) {
              load_row_vec<T, C, kVec>(value_cache + off + pv_col * kVec, v[u]);
              if constexpr (kQuantized) vs[u] = row_scale<D>(p.v_scale, off);
            }
          }
#pragma unroll
          for (int u = 0; u < kPvRows; ++u) {
            if (!ok[u]) continue;
            const int i = i0 + u * R;
#pragma unroll
            for (int g = 0; g < GC; ++g) {
              if (g < gc) {
                const float pr = logit_s[g][i] * vs[u];
#pragma unroll
                for (int e = 0; e < kVec; ++e) acc[g][e] = fmaf(pr, v[u][e], acc[g][e]);
              }
            }
          }
        }
      }
      __syncthreads();  // off_s / logit_s / alpha_s are rewritten by the next chunk
    }

    // Sum the token lanes in a fixed order (deterministic).
    if constexpr (kWarpLanes) {
#pragma unroll
      for (int g = 0; g < GC; ++g)
#pragma unroll
        for (int e = 0; e < kVec; ++e)
#pragma unroll
          for (int o = NVV; o < 32; o <<= 1) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], o);
      for (int w = 0; w < kDecodeWarps; ++w) {
        if (warp == w && lane < NVV) {
#pragma unroll
          for (int g = 0; g < GC; ++g) {
            if (g < gc) {
#pragma unroll
              for (int e = 0; e < kVec; ++e) out_s[g][pv_col * kVec + e] += acc[g][e];
            }
          }
        }
        __syncthreads();
      }
    } else {
      for (int r = 0; r < R; ++r) {
        if (pv_active && pv_row == r) {
#pragma unroll
          for (int g = 0; g < GC; ++g) {
            if (g < gc) {
#pragma unroll
              for (int e = 0; e < kVec; ++e) out_s[g][pv_col * kVec + e] += acc[g][e];
            }
          }
        }
        __syncthreads();
      }
    }

    if (sp.nsplit == 1) {
      T* __restrict__ out = static_cast<T*>(p.out);
      for (int i = tid; i < gc * DV; i += kDecodeThreads) {
        const int g = i / DV, d = i - g * DV;
        const float l = l_s[g];  // the reduction's arithmetic for one split: acc * (1 / l)
        out[seq * p.o_stride_tok + (h0 + g) * p.o_stride_head + d] = from_float<T>(l > 0.f ? out_s[g][d] * (1.f / l) : 0.f);
      }
    } else {
      for (int i = tid; i < gc * DV; i += kDecodeThreads) {
        const int g = i / DV, d = i - g * DV;
        const int64_t row = (static_cast<int64_t>(seq) * p.num_heads + h0 + g) * p.num_splits + split;
        p.tmp_out[row * DV + d] = out_s[g][d];
      }
      if (tid < gc) {
        const int64_t row = (static_cast<int64_t>(seq) * p.num_heads + h0 + tid) * p.num_splits + split;
        p.tmp_max[row] = m_s[tid];
        p.tmp_sum[row] = l_s[tid];
      }
    }
    __syncthreads();  // the next split re-initialises out_s and the statistics
  }
  if (sp.nsplit > 1 && p.split_counters != nullptr)
    merge_splits_in_kernel<T, DV>(p, seq, sp.nsplit, h0, gc, merge_s, &logit_s[0][0], kDecodeChunk, alpha_s);
}

// Merge the splits of one (seq, head) (the reduction without split_counters), with the in-kernel merge's arithmetic.
// grid = (num_seqs, num_heads), block = 128 threads. A sequence with one split was written by the split kernel.
template <typename T>
__global__ void __launch_bounds__(128) paged_decode_reduce_kernel(const DecodeArgs p) {
  pdl_launch_dependents();
  __shared__ float w_s[kDecodeMaxSplits];
  __shared__ float inv_s;
  const int seq = blockIdx.x, h = blockIdx.y, D = decode_out_dim(p);
  const int S = decode_splits(p, seq).nsplit;
  if (S == 1) return;
  const int64_t row0 = (static_cast<int64_t>(seq) * p.num_heads + h) * p.num_splits;
  if (threadIdx.x < 32) {
    const float inv = decode_split_weights(p, row0, S, w_s, threadIdx.x);
    if (threadIdx.x == 0) inv_s = inv;
  }
  __syncthreads();
  T* __restrict__ out = static_cast<T*>(p.out);
  for (int d = threadIdx.x; d < D; d += blockDim.x)
    out[seq * p.o_stride_tok + h * p.o_stride_head + d] = from_float<T>(decode_split_combine(p, row0, S, w_s, D, d, inv_s));
}

// Launch of one (T, D, C, DV) instantiation: the split kernel, then the reduction when a context may split and the
// kernel does not merge the splits itself.
template <typename T, int D, typename C = T, int DV = D>
cudaError_t decode_typed(const DecodeArgs& a, cudaStream_t s) {
  const int G = a.num_heads / a.num_kv_heads;
  const int groups = (G + kDecodeMaxHeads - 1) / kDecodeMaxHeads;
  const dim3 grid(static_cast<unsigned>(a.num_seqs), static_cast<unsigned>(a.num_kv_heads * groups),
                  static_cast<unsigned>(decode_split_ctas(a.num_seqs, a.num_kv_heads * groups, a.num_splits)));
  paged_decode_kernel<T, D, C, DV><<<grid, kDecodeThreads, 0, s>>>(a);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || a.num_splits == 1 || a.split_counters != nullptr) return err;  // merged in the kernel
  const dim3 rgrid(static_cast<unsigned>(a.num_seqs), static_cast<unsigned>(a.num_heads));
  paged_decode_reduce_kernel<T><<<rgrid, 128, 0, s>>>(a);
  return cudaGetLastError();
}

template <typename T, typename C = T>
cudaError_t decode_dispatch(const DecodeArgs& a, cudaStream_t s) {
  switch (a.head_dim) {
    case 64: return decode_typed<T, 64, C>(a, s);
    case 80: return decode_typed<T, 80, C>(a, s);
    case 96: return decode_typed<T, 96, C>(a, s);
    case 112: return decode_typed<T, 112, C>(a, s);
    case 128: return decode_typed<T, 128, C>(a, s);
    case 256: return decode_typed<T, 256, C>(a, s);
    default: return cudaErrorInvalidValue;
  }
}

// The launch checks shared by the float and the quantized entry points; cudaSuccess when the launch may go on.
inline cudaError_t check_decode_launch(const DecodeArgs& a) {
  if (a.num_kv_heads <= 0 || a.num_heads % a.num_kv_heads != 0) return cudaErrorInvalidValue;
  if (a.num_splits < 1 || a.num_splits > kDecodeMaxSplits) return cudaErrorInvalidValue;
  if (a.num_splits > 1 && (a.tmp_out == nullptr || a.tmp_max == nullptr || a.tmp_sum == nullptr))
    return cudaErrorInvalidValue;
  const int G = a.num_heads / a.num_kv_heads;
  if (static_cast<int64_t>(a.num_kv_heads) * ((G + kDecodeMaxHeads - 1) / kDecodeMaxHeads) > 65535 ||
      a.num_heads > 65535)
    return cudaErrorInvalidConfiguration;
  return cudaSuccess;
}

}  // namespace pagellm::cuda
