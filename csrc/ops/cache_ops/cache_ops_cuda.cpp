// CUDA glue for reshape_and_cache (float and quantized caches) / copy_blocks (kernels in cache_kernels.cu).
// Unlike the CPU glue, slot ids / block ids living on the device are not validated on the host (that would need
// a device sync); the kernels skip out-of-range entries instead of writing out of bounds.
#include <torch/library.h>

#include <cstdint>

#include "ops/cache_ops/cache_glue_cuda.h"
#include "ops/cache_ops/cache_launch.h"
#include "ops/cache_ops/kv_quant_checks.h"
#include "ops/cuda_common/torch_glue.h"

namespace pagellm::cuda {
namespace {

// Layout only (copy_blocks moves bytes of any dtype; the writers check theirs).
void check_cache(const at::Tensor& c, const char* name) {
  check_cuda(c, name);
  check_dim(c, 4, name);
  check_contiguous(c, name);
  const int64_t bs = c.size(2);
  TORCH_CHECK(bs >= 1 && bs <= 256 && (bs & (bs - 1)) == 0, name,
              ": block_size (dim 2) must be a power of two in [1, 256], got ", bs);
}

}  // namespace

ReshapeAndCacheArgs check_cache_write(const at::Tensor& key_cache, const at::Tensor& value_cache,
                                      const at::Tensor& key, const at::Tensor& value, const at::Tensor& slots) {
  check_cache(key_cache, "key_cache");
  check_cache(value_cache, "value_cache");
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes(), "value_cache shape ", value_cache.sizes(),
              " must equal key_cache shape ", key_cache.sizes());
  check_same_dtype(value_cache, key_cache, "value_cache", "key_cache");
  check_same_device(value_cache, key_cache, "value_cache", "key_cache");
  for (auto [t, name] : {std::pair<const at::Tensor*, const char*>{&key, "key"}, {&value, "value"}}) {
    check_cuda(*t, name);
    check_same_device(*t, key_cache, name, "key_cache");
    check_dim(*t, 3, name);
    check_last_contiguous(*t, name);
  }
  check_same_dtype(value, key, "value", "key");
  check_cuda(slots, "slot_mapping");
  check_same_device(slots, key_cache, "slot_mapping", "key_cache");
  check_dtype(slots, at::kLong, "slot_mapping");
  check_dim(slots, 1, "slot_mapping");
  const int64_t T = slots.size(0), H = key_cache.size(1), D = key_cache.size(3);
  TORCH_CHECK(key.size(0) == T && key.size(1) == H && key.size(2) == D, "key must have shape [", T, ", ", H, ", ", D,
              "] (num_tokens from slot_mapping, heads/head_dim from key_cache), got ", key.sizes());
  TORCH_CHECK(value.sizes() == key.sizes(), "value shape ", value.sizes(), " must equal key shape ", key.sizes());
  ReshapeAndCacheArgs a{};
  a.key_cache = key_cache.data_ptr();
  a.value_cache = value_cache.data_ptr();
  a.key = key.data_ptr();
  a.value = value.data_ptr();
  a.slot_mapping = slots.data_ptr<int64_t>();
  a.num_tokens = T;
  a.key_tok_stride = key.stride(0);
  a.key_head_stride = key.stride(1);
  a.value_tok_stride = value.stride(0);
  a.value_head_stride = value.stride(1);
  a.num_kv_heads = static_cast<int>(H);
  a.head_dim = static_cast<int>(D);
  a.block_size = static_cast<int>(key_cache.size(2));
  a.num_blocks = key_cache.size(0);
  return a;
}

namespace {

void reshape_and_cache(at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& key, const at::Tensor& value,
                       const at::Tensor& slot_mapping) {
  to_dtype(key_cache, "key_cache");
  check_same_dtype(key, key_cache, "key", "key_cache");
  const c10::cuda::CUDAGuard guard(key_cache.device());
  const at::Tensor slots = slot_mapping.contiguous();
  ReshapeAndCacheArgs a = check_cache_write(key_cache, value_cache, key, value, slots);
  if (a.num_tokens == 0 || a.num_kv_heads == 0 || a.head_dim == 0) return;
  a.elem_size = static_cast<int>(key_cache.element_size());
  check_launch(launch_reshape_and_cache(a, current_stream()), "reshape_and_cache");
}

void reshape_and_cache_quantized(at::Tensor& key_cache, at::Tensor& value_cache, at::Tensor& k_scale,
                                 at::Tensor& v_scale, const at::Tensor& key, const at::Tensor& value,
                                 const at::Tensor& slot_mapping) {
  check_quantized_kv_cache(key_cache, value_cache, k_scale, v_scale);
  const DType dt = to_dtype(key, "key");
  const c10::cuda::CUDAGuard guard(key_cache.device());
  const at::Tensor slots = slot_mapping.contiguous();
  ReshapeAndCacheArgs a = check_cache_write(key_cache, value_cache, key, value, slots);
  if (a.num_tokens == 0 || a.num_kv_heads == 0 || a.head_dim == 0) return;
  a.k_scale = k_scale.data_ptr<float>();
  a.v_scale = v_scale.data_ptr<float>();
  const KvCacheDType cdt = key_cache.scalar_type() == at::kChar ? KvCacheDType::kInt8 : KvCacheDType::kFp8E4M3;
  check_launch(launch_reshape_and_cache_quantized(a, dt, cdt, current_stream()), "reshape_and_cache_quantized");
}

void copy_blocks(at::TensorList key_caches, at::TensorList value_caches, const at::Tensor& block_mapping) {
  TORCH_CHECK(key_caches.size() == value_caches.size(), "key_caches and value_caches must have the same length, got ",
              key_caches.size(), " and ", value_caches.size());
  check_dtype(block_mapping, at::kLong, "block_mapping");
  TORCH_CHECK(block_mapping.dim() == 2 && block_mapping.size(1) == 2,
              "block_mapping must have shape [num_pairs, 2], got ", block_mapping.sizes());
  const int64_t L = static_cast<int64_t>(key_caches.size()), P = block_mapping.size(0);
  if (L == 0 || P == 0) return;
  const at::Tensor& k0 = key_caches[0];
  check_cache(k0, "key_caches[0]");
  TORCH_CHECK(L <= 65535, "copy_blocks supports at most 65535 layers, got ", L);
  at::Tensor ptrs = at::empty({2, L}, at::TensorOptions().dtype(at::kLong));  // host: [key ptrs; value ptrs]
  int64_t* hp = ptrs.data_ptr<int64_t>();
  uintptr_t all_addr = 0;
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor& k = key_caches[l];
    const at::Tensor& v = value_caches[l];
    check_cache(k, "key_caches[i]");
    check_cache(v, "value_caches[i]");
    TORCH_CHECK(k.sizes() == k0.sizes() && v.sizes() == k0.sizes() && k.scalar_type() == k0.scalar_type() &&
                    v.scalar_type() == k0.scalar_type() && k.device() == k0.device() && v.device() == k0.device(),
                "key_caches[", l, "] and value_caches[", l,
                "] must have the same shape, dtype and device as key_caches[0] (the CUDA kernel copies every layer "
                "in one launch)");
    hp[l] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(k.data_ptr()));
    hp[L + l] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(v.data_ptr()));
    all_addr |= reinterpret_cast<uintptr_t>(k.data_ptr()) | reinterpret_cast<uintptr_t>(v.data_ptr());
  }
  const int64_t num_blocks = k0.size(0);
  at::Tensor map;
  if (block_mapping.is_cuda()) {
    check_same_device(block_mapping, k0, "block_mapping", "key_caches[0]");
    map = block_mapping.contiguous();  // ids are not validated (device data); out-of-range pairs are skipped
  } else {
    const at::Tensor map_c = block_mapping.contiguous();
    const int64_t* m = map_c.data_ptr<int64_t>();
    for (int64_t p = 0; p < 2 * P; ++p) {
      TORCH_CHECK(m[p] >= 0 && m[p] < num_blocks, "block_mapping[", p / 2, "][", p % 2, "] = ", m[p],
                  " is out of range [0, ", num_blocks, ")");
    }
    map = map_c.to(k0.device());
  }
  const c10::cuda::CUDAGuard guard(k0.device());
  const at::Tensor dptrs = ptrs.to(k0.device());  // blocking host-to-device copy of 2 * L addresses
  const int64_t block_bytes = k0.stride(0) * k0.element_size();
  const int align = (all_addr & 15u) == 0 ? 16 : ((all_addr & 3u) == 0 ? 4 : ((all_addr & 1u) == 0 ? 2 : 1));
  const int64_t* dp = dptrs.data_ptr<int64_t>();
  check_launch(launch_copy_blocks(dp, dp + L, map.data_ptr<int64_t>(), static_cast<int>(L), P, num_blocks,
                                  block_bytes, align, current_stream()),
               "copy_blocks");
}

}  // namespace
}  // namespace pagellm::cuda

TORCH_LIBRARY_IMPL(pagellm, CUDA, m) {
  m.impl("reshape_and_cache", &pagellm::cuda::reshape_and_cache);
  m.impl("reshape_and_cache_quantized", &pagellm::cuda::reshape_and_cache_quantized);
  m.impl("copy_blocks", &pagellm::cuda::copy_blocks);
}
