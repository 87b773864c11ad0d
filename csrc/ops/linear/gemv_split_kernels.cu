// Raw-pointer launcher of linear_gemv's kernels 2-4 (gemv_split_cuda.cuh; declared in gemv_launch.h). Torch-free.
#include <atomic>

#include "ops/linear/gemv_launch.h"
#include "ops/linear/gemv_split_cuda.cuh"

namespace pagellm::cuda {
namespace {

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// PDL needs sm_90; below it the attribute is dropped rather than trusted. Cached per device (0 = not asked yet).
bool device_has_pdl() {
  static std::atomic<int> cache[64] = {};
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  const bool cacheable = dev >= 0 && dev < 64;
  if (cacheable && cache[dev].load(std::memory_order_relaxed) != 0) return cache[dev].load() > 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return false;
  if (cacheable) cache[dev].store(major >= 9 ? 1 : -1, std::memory_order_relaxed);
  return major >= 9;
}

template <typename T>
cudaError_t gemv_split_regs(const GemvArgs& a, int S, bool low_regs, bool pdl, cudaStream_t stream) {
  return low_regs ? gemv_split_typed<T, true>(a, S, pdl, stream) : gemv_split_typed<T, false>(a, S, pdl, stream);
}

template <typename T>
cudaError_t gemv_prologue_regs(const GemvArgs& a, const GemvPrologueArgs& pa, int S, bool low_regs, bool pdl,
                               cudaStream_t stream) {
  return low_regs ? gemv_prologue_typed<T, true>(a, pa, S, pdl, stream)
                  : gemv_prologue_typed<T, false>(a, pa, S, pdl, stream);
}

// 16-byte vectors everywhere the prologue reads or writes (the norm / activation kernels' own vector condition).
bool prologue_vectorized(const GemvArgs& a, const GemvPrologueArgs& pa, int vec) {
  switch (pa.kind) {
    case GemvPrologue::kNone: return true;
    case GemvPrologue::kSiluMul: return true;  // x + K is aligned when x and K are
    case GemvPrologue::kRmsNorm: return aligned16(pa.norm_weight);
    case GemvPrologue::kAddRmsNorm:
      return aligned16(pa.norm_weight) && aligned16(pa.residual) && aligned16(pa.residual_out) &&
             pa.res_stride % vec == 0 && pa.res_out_stride % vec == 0;
  }
  return false;
}

}  // namespace

cudaError_t launch_linear_gemv_prologue(const GemvArgs& a, const GemvPrologueArgs& pa, DType dtype, int64_t min_ctas,
                                        int64_t min_slice_vecs, bool low_regs, bool pdl, cudaStream_t stream) {
  const int elem = dtype == DType::kFloat32 ? 4 : 2, vec = 16 / elem;
  const bool vectorized = a.K % vec == 0 && a.x_stride % vec == 0 && a.w_stride % vec == 0 && aligned16(a.x) &&
                          aligned16(a.w) && prologue_vectorized(a, pa, vec);
  if (!vectorized || a.K * elem > kGemvPrologueMaxBytes) return cudaErrorNotSupported;
  if (a.M <= 0 || a.N <= 0) return cudaSuccess;
  if (a.M > 65535 || a.N / 2 > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  const int S = gemv_split_slices(a.N, a.K, elem, min_ctas, min_slice_vecs);
  pdl = pdl && device_has_pdl();
  switch (dtype) {
    case DType::kFloat32: return gemv_prologue_regs<float>(a, pa, S, low_regs, pdl, stream);
    case DType::kFloat16: return gemv_prologue_regs<__half>(a, pa, S, low_regs, pdl, stream);
    case DType::kBFloat16: return gemv_prologue_regs<__nv_bfloat16>(a, pa, S, low_regs, pdl, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_linear_gemv_split(const GemvArgs& a, DType dtype, int64_t min_ctas, int64_t min_slice_vecs,
                                     bool low_regs, bool pdl, cudaStream_t stream) {
  if (a.M <= 0 || a.N <= 0) return cudaSuccess;
  const int elem = dtype == DType::kFloat32 ? 4 : 2, vec = 16 / elem;
  const bool vectorized = a.K % vec == 0 && a.x_stride % vec == 0 && a.w_stride % vec == 0 && aligned16(a.x) &&
                          aligned16(a.w);
  if (!vectorized) return launch_linear_gemv(a, dtype, stream);  // the scalar path lives there
  if ((a.M + 7) / 8 > 65535 || a.N / 2 > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  const int S = gemv_split_slices(a.N, a.K, elem, min_ctas, min_slice_vecs);
  pdl = pdl && device_has_pdl();
  switch (dtype) {
    case DType::kFloat32: return gemv_split_regs<float>(a, S, low_regs, pdl, stream);
    case DType::kFloat16: return gemv_split_regs<__half>(a, S, low_regs, pdl, stream);
    case DType::kBFloat16: return gemv_split_regs<__nv_bfloat16>(a, S, low_regs, pdl, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace pagellm::cuda
