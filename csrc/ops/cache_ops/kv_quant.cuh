// Quantized KV-cache rows on the GPU (torch-free): int8 or fp8-e4m3 values with one fp32 scale per (token, kv
// head) row, value = stored * scale. The same rule as the CPU kernels and pagellm.ops.reference.quantize_kv_rows:
//   scale = absmax / kMax, stored = Q(x * (kMax / absmax)), zeros and scale 0 for a zero row;
//   int8: round half to even, clamped to [-127, 127]; fp8: clamped to [-448, 448], round to nearest even.
// Divisions and products use the _rn intrinsics so the bits match the reference even under --use_fast_math.
#pragma once
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace pagellm::cuda {

template <typename C>
struct KvQuant;

template <>
struct KvQuant<int8_t> {
  static constexpr float kMax = 127.f;
  __device__ static int8_t from_scaled(float x) { return static_cast<int8_t>(max(-127, min(127, __float2int_rn(x)))); }
  __device__ static int8_t from_bits(uint8_t b) { return static_cast<int8_t>(b); }
};

template <>
struct KvQuant<__nv_fp8_e4m3> {
  static constexpr float kMax = 448.f;
  __device__ static __nv_fp8_e4m3 from_scaled(float x) {
    __nv_fp8_e4m3 r;
    r.__x = __nv_cvt_float_to_fp8(fminf(fmaxf(x, -448.f), 448.f), __NV_SATFINITE, __NV_E4M3);
    return r;
  }
  __device__ static __nv_fp8_e4m3 from_bits(uint8_t b) {
    __nv_fp8_e4m3 r;
    r.__x = b;
    return r;
  }
};

template <typename C>
constexpr bool kIsQuantizedCache = std::is_same_v<C, int8_t> || std::is_same_v<C, __nv_fp8_e4m3>;

__device__ __forceinline__ float to_float(int8_t x) { return static_cast<float>(x); }
__device__ __forceinline__ float to_float(__nv_fp8_e4m3 x) { return static_cast<float>(x); }

// out[e] = stored element e of p as fp32 (unscaled), one N-byte load (p N-byte aligned).
template <int N>
struct alignas(N) StoredBytes {
  uint8_t b[N];
};
template <typename C, int N>
__device__ __forceinline__ void load_stored(const C* p, float (&out)[N]) {
  const StoredBytes<N> v = *reinterpret_cast<const StoredBytes<N>*>(p);
#pragma unroll
  for (int e = 0; e < N; ++e) out[e] = to_float(KvQuant<C>::from_bits(v.b[e]));
}

// Scale of the cache row holding element offset `elem_off` (rows of head_dim elements; one scale per row).
template <int D>
__device__ __forceinline__ float row_scale(const float* __restrict__ scales, int64_t elem_off) {
  return scales[elem_off / D];
}

}  // namespace pagellm::cuda
