// Paged-attention prefill on the GPU (chunked prefill and prefix hits: the queries of sequence s are the last
// q_len = qsl[s+1] - qsl[s] of its seq_lens[s] positions; keys 0..seq_len-1 are read through the block table).
// Torch-free.
//
// Tensor-core path (half / bfloat16, sm_80+), FlashAttention-2 style:
//   grid = (ceil(num_tokens / BM) + num_seqs, num_heads), block = 128 threads (4 warps). blockIdx.x is a global
//   query-tile index; every warp maps it to (seq, tile) by a shuffle scan over qsl (sync-free; tiles past the
//   last one exit). A CTA owns BM = 64 query rows of one query head; warp w owns rows 16w..16w+15.
//   Shared memory (dynamic): Q [BM][D+8], K [BN][D+8], V [BN][D+8] in T (rows padded by 16 bytes: conflict-free
//   fragment loads); BN = 64 (D <= 128) or 32 (D = 256).
//   Per key tile: 16-byte loads of K/V rows through the block table (rows past seq_len or with a bad block id
//   are zero-filled), S = Q K^T with mma.sync m16n8k16 (fp32 accumulate), scale, soft-cap, causal/window mask,
//   fp32 online softmax in registers (row max/sum over the 4 lanes of a quad), P (as T) reused in registers as
//   the A operand of O += P V. At the end O / l is staged in the warp's own Q rows and stored with 16-byte stores.
// fp32 path: one warp per (query token, head), scalar online softmax over the keys; grid = (num_tokens,
//   ceil(num_heads / 4)), block = 128.
// Quantized caches (C = int8 / fp8): the tensor-core path dequantizes each K/V row (8 stored values per 8-byte
// load, times the row's scale) into its shared-memory tiles of T; the fp32 path scales each key's dot product
// and each value element by their rows' scales.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "ops/cache_ops/kv_quant.cuh"
#include "ops/paged_attention/attention_launch.h"
#include "ops/cuda_common/vec.cuh"

namespace pagellm::cuda {

constexpr int kPrefillThreads = 128;
constexpr int kPrefillBM = 64;

template <int D>
struct PrefillTile {
  static constexpr int BM = kPrefillBM;
  static constexpr int BN = D > 128 ? 32 : 64;
  static constexpr int LD = D + 8;  // smem row stride in elements (16-byte padding)
  template <typename T>
  static constexpr size_t smem_bytes() {
    return static_cast<size_t>(BM + 2 * BN) * LD * sizeof(T);
  }
};

__device__ __forceinline__ uint32_t pack_float2(float lo, float hi, __half*) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t pack_float2(float lo, float hi, __nv_bfloat16*) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// d += a * b, m16n8k16, row.col, fp32 accumulate.
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, __half*) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();
#endif
}
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                          __nv_bfloat16*) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();
#endif
}

// Warp-cooperative (all 32 lanes call it): maps a global tile index to (seq, local tile), where sequence s owns
// ceil(q_len_s / bm) consecutive tiles. Returns false when tile is past the last one. Same result in all lanes.
__device__ __forceinline__ bool find_query_tile(const int32_t* __restrict__ qsl, int num_seqs, int64_t tile, int bm,
                                                int& seq, int& local) {
  const int lane = threadIdx.x & 31;
  int64_t base = 0;
  for (int s0 = 0; s0 < num_seqs; s0 += 32) {
    const int s = s0 + lane;
    int cnt = 0;
    if (s < num_seqs) cnt = max(0, (qsl[s + 1] - qsl[s] + bm - 1) / bm);
    int inc = cnt;  // inclusive scan over the lanes
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, inc, off);
      if (lane >= off) inc += y;
    }
    const int total = __shfl_sync(0xffffffffu, inc, 31);
    if (tile < base + total) {
      const unsigned hit = __ballot_sync(0xffffffffu, base + inc > tile);
      const int l = __ffs(static_cast<int>(hit)) - 1;
      const int before = __shfl_sync(0xffffffffu, inc - cnt, l);
      seq = s0 + l;
      local = static_cast<int>(tile - base - before);
      return true;
    }
    base += total;
  }
  return false;
}

// 8 elements of the cache row at `off` (element offset) as a T vector: a 16-byte load, or for a quantized cache
// 8 stored values times the row's scale, rounded to T.
template <typename T, typename C, int D>
__device__ __forceinline__ Vec16<T> load_cache_vec8(const C* __restrict__ cache, const float* __restrict__ scales,
                                                    int64_t off) {
  if constexpr (std::is_same_v<C, T>) {
    return load16<T>(cache + off);
  } else {
    float f[8];
    load_stored<C, 8>(cache + off, f);
    const float sc = row_scale<D>(scales, off);
    Vec16<T> v;
#pragma unroll
    for (int e = 0; e < 8; ++e) v.elem[e] = from_float<T>(f[e] * sc);
    return v;
  }
}

template <typename T, int D, typename C = T>
__global__ void __launch_bounds__(kPrefillThreads) paged_prefill_mma_kernel(const PrefillArgs p) {
  using Tile = PrefillTile<D>;
  constexpr int BM = Tile::BM, BN = Tile::BN, LD = Tile::LD;
  constexpr int kVec = 8;     // elements per 16-byte vector
  constexpr int NV = D / kVec;
  static_assert(sizeof(T) == 2 && D % 16 == 0 && BN % 16 == 0 && BM == 16 * (kPrefillThreads / 32), "bad tiling");
  T* const tag = nullptr;  // overload selector for pack/mma

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* q_s = reinterpret_cast<T*>(smem_raw);  // [BM][LD]
  T* k_s = q_s + BM * LD;                   // [BN][LD]
  T* v_s = k_s + BN * LD;                   // [BN][LD]

  int seq = 0, tile = 0;
  if (!find_query_tile(p.query_start_loc, p.num_seqs, blockIdx.x, BM, seq, tile)) return;  // uniform over the CTA

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gid = lane >> 2, tig = lane & 3;  // mma fragment coordinates
  const int h = blockIdx.y;
  const int kvh = h / (p.num_heads / p.num_kv_heads);
  const int q_begin = p.query_start_loc[seq];
  const int q_len = p.query_start_loc[seq + 1] - q_begin;
  const int64_t L = p.seq_lens[seq];
  const int row0 = tile * BM;
  const int rows = min(BM, q_len - row0);
  const int64_t ctx0 = L - q_len;  // absolute position of the sequence's first query

  const T* __restrict__ query = static_cast<const T*>(p.query);
  const C* __restrict__ key_cache = static_cast<const C*>(p.key_cache);
  const C* __restrict__ value_cache = static_cast<const C*>(p.value_cache);

  // Q tile (rows past q_len zero-filled).
  for (int i = tid; i < BM * NV; i += kPrefillThreads) {
    const int r = i / NV, c = i - r * NV;
    Vec16<T> v = zero16<T>();
    if (r < rows) v = load16<T>(query + static_cast<int64_t>(q_begin + row0 + r) * p.q_stride_tok + h * p.q_stride_head + c * kVec);
    store16<T>(q_s + r * LD + c * kVec, v);
  }
  __syncthreads();

  const int64_t p_lo = ctx0 + row0;             // first query position of the tile
  const int64_t p_hi = ctx0 + row0 + rows - 1;  // last one
  const int64_t k_lo = p.window > 0 ? (p_lo - p.window + 1 > 0 ? p_lo - p.window + 1 : 0) : 0;
  const int64_t k_hi = p_hi < L - 1 ? p_hi : L - 1;
  // Absolute positions of this thread's two rows (gid and gid + 8 of the warp's 16).
  const int64_t pos0 = p_lo + warp * 16 + gid;
  const int64_t pos1 = pos0 + 8;

  const int32_t* __restrict__ bt = p.block_tables + seq * p.bt_stride;
  const int64_t block_elems = static_cast<int64_t>(p.num_kv_heads) * p.block_size * D;
  const int64_t head_off = static_cast<int64_t>(kvh) * p.block_size * D;

  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};
  float l_run[2] = {0.f, 0.f};  // per-thread partial sums (quad-reduced at the end)

  const T* qw = q_s + (warp * 16 + gid) * LD + tig * 2;  // this thread's A-fragment base
  const uint16_t* v16 = reinterpret_cast<const uint16_t*>(v_s);

  for (int64_t kb = (k_lo / BN) * BN; kb <= k_hi; kb += BN) {
    __syncthreads();  // everyone is done with the previous K/V tile
    for (int i = tid; i < BN * NV; i += kPrefillThreads) {
      const int r = i / NV, c = i - r * NV;
      const int64_t j = kb + r;
      Vec16<T> kv = zero16<T>(), vv = zero16<T>();
      if (j < L) {
        const int64_t bi = j / p.block_size;
        if (bi < p.max_blocks) {
          const int64_t blk = bt[bi];
          if (blk >= 0 && blk < p.num_blocks) {
            const int64_t off = blk * block_elems + head_off + (j - bi * p.block_size) * D + c * kVec;
            kv = load_cache_vec8<T, C, D>(key_cache, p.k_scale, off);
            vv = load_cache_vec8<T, C, D>(value_cache, p.v_scale, off);
          }
        }
      }
      store16<T>(k_s + r * LD + c * kVec, kv);
      store16<T>(v_s + r * LD + c * kVec, vv);
    }
    __syncthreads();

    // S = Q K^T for this warp's 16 rows x BN keys.
    float s[BN / 8][4];
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[4];
      a[0] = *reinterpret_cast<const uint32_t*>(qw + kk * 16);
      a[1] = *reinterpret_cast<const uint32_t*>(qw + 8 * LD + kk * 16);
      a[2] = *reinterpret_cast<const uint32_t*>(qw + kk * 16 + 8);
      a[3] = *reinterpret_cast<const uint32_t*>(qw + 8 * LD + kk * 16 + 8);
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt) {
        const T* kr = k_s + (nt * 8 + gid) * LD + kk * 16 + tig * 2;
        mma_16816(s[nt], a, *reinterpret_cast<const uint32_t*>(kr), *reinterpret_cast<const uint32_t*>(kr + 8), tag);
      }
    }

    // Scale, soft-cap, mask; row max.
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t j = kb + nt * 8 + tig * 2 + (e & 1);
        const int64_t pos = e < 2 ? pos0 : pos1;
        const bool ok = j <= pos && j < L && (p.window <= 0 || j > pos - p.window);
        float x = s[nt][e] * p.scale;
        if (p.softcap > 0.f) x = p.softcap * tanhf(x / p.softcap);
        x = ok ? x : -INFINITY;
        s[nt][e] = x;
        mx[e >> 1] = fmaxf(mx[e >> 1], x);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    }
    float m_use[2], alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m_new = fmaxf(m_run[r], mx[r]);
      m_use[r] = m_new == -INFINITY ? 0.f : m_new;  // row fully masked so far: keep exp() finite
      alpha[r] = __expf(m_run[r] - m_use[r]);
      m_run[r] = m_new;
      l_run[r] *= alpha[r];
    }
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pe = __expf(s[nt][e] - m_use[e >> 1]);
        s[nt][e] = pe;
        l_run[e >> 1] += pe;
      }
    }
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      o[dt][0] *= alpha[0];
      o[dt][1] *= alpha[0];
      o[dt][2] *= alpha[1];
      o[dt][3] *= alpha[1];
    }

    // O += P V. P's C-fragments of n-tiles 2kk, 2kk+1 are the A-fragment of k-step kk.
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t a[4];
      a[0] = pack_float2(s[2 * kk][0], s[2 * kk][1], tag);
      a[1] = pack_float2(s[2 * kk][2], s[2 * kk][3], tag);
      a[2] = pack_float2(s[2 * kk + 1][0], s[2 * kk + 1][1], tag);
      a[3] = pack_float2(s[2 * kk + 1][2], s[2 * kk + 1][3], tag);
      const uint16_t* vr = v16 + (kk * 16 + tig * 2) * LD + gid;  // key rows tig*2 (+1, +8, +9), column gid
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        const uint16_t* vc = vr + dt * 8;
        const uint32_t b0 = static_cast<uint32_t>(vc[0]) | (static_cast<uint32_t>(vc[LD]) << 16);
        const uint32_t b1 = static_cast<uint32_t>(vc[8 * LD]) | (static_cast<uint32_t>(vc[9 * LD]) << 16);
        mma_16816(o[dt], a, b0, b1, tag);
      }
    }
  }

  // Normalize and stage O in this warp's own Q rows (only this warp ever read them), then store 16-byte vectors.
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = l_run[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    inv[r] = l > 0.f ? 1.f / l : 0.f;
  }
  __syncwarp();
  T* ow = q_s + (warp * 16 + gid) * LD + tig * 2;
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
    *reinterpret_cast<uint32_t*>(ow + dt * 8) = pack_float2(o[dt][0] * inv[0], o[dt][1] * inv[0], tag);
    *reinterpret_cast<uint32_t*>(ow + 8 * LD + dt * 8) = pack_float2(o[dt][2] * inv[1], o[dt][3] * inv[1], tag);
  }
  __syncwarp();
  T* __restrict__ out = static_cast<T*>(p.out);
  for (int i = lane; i < 16 * NV; i += 32) {
    const int r = i / NV, c = i - r * NV;
    const int lr = warp * 16 + r;
    if (lr < rows)
      store16<T>(out + static_cast<int64_t>(q_begin + row0 + lr) * p.o_stride_tok + h * p.o_stride_head + c * kVec,
                 load16<T>(q_s + lr * LD + c * kVec));
  }
}

// Scalar path (fp32, or any T): one warp per (query token, head); lane owns elements lane, lane+32, ...
template <typename T, int D, typename C = T>
__global__ void __launch_bounds__(kPrefillThreads) paged_prefill_simple_kernel(const PrefillArgs p) {
  constexpr bool kQuantized = kIsQuantizedCache<C>;
  constexpr int E = (D + 31) / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int t = blockIdx.x;
  const int h = blockIdx.y * (kPrefillThreads / 32) + warp;
  if (h >= p.num_heads || t >= p.num_tokens) return;  // warp-uniform; no block barriers below
  // Sequence of token t: the largest s with qsl[s] <= t.
  int lo = 0, hi = p.num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (p.query_start_loc[mid] <= t) lo = mid; else hi = mid - 1;
  }
  const int seq = lo;
  const int q_begin = p.query_start_loc[seq];
  const int q_len = p.query_start_loc[seq + 1] - q_begin;
  if (t < q_begin || t >= q_begin + q_len) return;  // token outside every sequence's range: left untouched
  const int64_t L = p.seq_lens[seq];
  const int64_t pos = L - q_len + (t - q_begin);
  const int kvh = h / (p.num_heads / p.num_kv_heads);
  const T* __restrict__ query = static_cast<const T*>(p.query);
  const C* __restrict__ key_cache = static_cast<const C*>(p.key_cache);
  const C* __restrict__ value_cache = static_cast<const C*>(p.value_cache);
  float q[E], acc[E];
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int d = lane + 32 * e;
    q[e] = d < D ? to_float(query[static_cast<int64_t>(t) * p.q_stride_tok + h * p.q_stride_head + d]) : 0.f;
    acc[e] = 0.f;
  }
  const int32_t* __restrict__ bt = p.block_tables + seq * p.bt_stride;
  const int64_t block_elems = static_cast<int64_t>(p.num_kv_heads) * p.block_size * D;
  const int64_t head_off = static_cast<int64_t>(kvh) * p.block_size * D;
  const int64_t j_lo = p.window > 0 ? (pos - p.window + 1 > 0 ? pos - p.window + 1 : 0) : 0;
  const int64_t j_hi = pos < L - 1 ? pos : L - 1;
  float m = -INFINITY, l = 0.f;
  for (int64_t j = j_lo; j <= j_hi; ++j) {
    const int64_t bi = j / p.block_size;
    if (bi >= p.max_blocks) continue;
    const int64_t blk = bt[bi];
    if (blk < 0 || blk >= p.num_blocks) continue;
    const int64_t off = blk * block_elems + head_off + (j - bi * p.block_size) * D;
    float dot = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const int d = lane + 32 * e;
      if (d < D) dot = fmaf(q[e], to_float(key_cache[off + d]), dot);
    }
    float ks = 1.f, vs = 1.f;  // the rows' scales (quantized caches)
    if constexpr (kQuantized) {
      ks = row_scale<D>(p.k_scale, off);
      vs = row_scale<D>(p.v_scale, off);
    }
    dot = warp_reduce_sum(dot) * ks * p.scale;
    if (p.softcap > 0.f) dot = p.softcap * tanhf(dot / p.softcap);
    const float m_new = fmaxf(m, dot);
    const float alpha = __expf(m - m_new);
    const float pe = __expf(dot - m_new);
    l = l * alpha + pe;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const int d = lane + 32 * e;
      const float v = d < D ? to_float(value_cache[off + d]) * vs : 0.f;
      acc[e] = acc[e] * alpha + pe * v;
    }
    m = m_new;
  }
  const float inv = l > 0.f ? 1.f / l : 0.f;
  T* __restrict__ out = static_cast<T*>(p.out);
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int d = lane + 32 * e;
    if (d < D) out[static_cast<int64_t>(t) * p.o_stride_tok + h * p.o_stride_head + d] = from_float<T>(acc[e] * inv);
  }
}

// Launches of one (T, D, C) instantiation (prefill_kernels.cu: float caches; prefill_quant_kernels.cu: quantized).
template <typename T, int D, typename C = T>
cudaError_t prefill_mma(const PrefillArgs& a, cudaStream_t s) {
  constexpr size_t smem = PrefillTile<D>::template smem_bytes<T>();
  auto kernel = paged_prefill_mma_kernel<T, D, C>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  const int64_t tiles = ceil_div(a.num_tokens, kPrefillBM) + a.num_seqs;  // >= sum over seqs of ceil(q_len / BM)
  if (tiles > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(a.num_heads));
  kernel<<<grid, kPrefillThreads, smem, s>>>(a);
  return cudaGetLastError();
}

template <typename T, int D, typename C = T>
cudaError_t prefill_simple(const PrefillArgs& a, cudaStream_t s) {
  const int warps = kPrefillThreads / 32;
  const dim3 grid(static_cast<unsigned>(a.num_tokens), static_cast<unsigned>((a.num_heads + warps - 1) / warps));
  paged_prefill_simple_kernel<T, D, C><<<grid, kPrefillThreads, 0, s>>>(a);
  return cudaGetLastError();
}

// C: the cache's element type for a quantized cache; void = the query's dtype (a float cache).
template <int D, typename C = void>
cudaError_t prefill_dim(const PrefillArgs& a, DType dtype, cudaStream_t s) {
  constexpr bool kFloatCache = std::is_void_v<C>;
  switch (dtype) {
    case DType::kFloat32: return prefill_simple<float, D, std::conditional_t<kFloatCache, float, C>>(a, s);
    case DType::kFloat16: return prefill_mma<__half, D, std::conditional_t<kFloatCache, __half, C>>(a, s);
    case DType::kBFloat16: return prefill_mma<__nv_bfloat16, D, std::conditional_t<kFloatCache, __nv_bfloat16, C>>(a, s);
  }
  return cudaErrorInvalidValue;
}

// Shared launch checks; cudaSuccess when the launch may go on (alignment: the tensor-core path's 16-byte rows).
inline cudaError_t check_prefill_launch(const PrefillArgs& a, DType dtype) {
  if (a.num_kv_heads <= 0 || a.num_heads % a.num_kv_heads != 0 || a.num_heads > 65535) return cudaErrorInvalidValue;
  if (dtype != DType::kFloat32) {
    const auto aligned16 = [](const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; };
    const bool ok = aligned16(a.query) && aligned16(a.out) && aligned16(a.key_cache) && aligned16(a.value_cache) &&
                    a.q_stride_tok % 8 == 0 && a.q_stride_head % 8 == 0 && a.o_stride_tok % 8 == 0 &&
                    a.o_stride_head % 8 == 0;
    if (!ok) return cudaErrorMisalignedAddress;
  }
  return cudaSuccess;
}

template <typename C = void>
cudaError_t prefill_head_dim(const PrefillArgs& a, DType dtype, cudaStream_t stream) {
  switch (a.head_dim) {
    case 64: return prefill_dim<64, C>(a, dtype, stream);
    case 80: return prefill_dim<80, C>(a, dtype, stream);
    case 96: return prefill_dim<96, C>(a, dtype, stream);
    case 112: return prefill_dim<112, C>(a, dtype, stream);
    case 128: return prefill_dim<128, C>(a, dtype, stream);
    case 256: return prefill_dim<256, C>(a, dtype, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace pagellm::cuda
