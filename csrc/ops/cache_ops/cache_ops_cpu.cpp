// CPU glue for reshape_and_cache (float and quantized caches) / copy_blocks / copy_slots: validation (including every slot and block id, since a
// bad one would be an out-of-bounds write) then the byte-moving kernels in cache_ops_cpu_kernels.h.
#include <torch/library.h>

#include <vector>

#include "ops/cache_ops/cache_ops_cpu_kernels.h"
#include "ops/cache_ops/kv_quant_checks.h"
#include "ops/common/checks.h"

namespace pagellm::cpu {
namespace {

void check_cache(const at::Tensor& c, const char* name) {
  check_cpu(c, name);
  check_dim(c, 4, name);
  check_contiguous(c, name);
  const int64_t bs = c.size(2);
  TORCH_CHECK(bs >= 1 && bs <= 256 && (bs & (bs - 1)) == 0, name,
              ": block_size (dim 2) must be a power of two in [1, 256], got ", bs);
}

// Checks key/value [T, H, D] against the cache and every slot (a bad one would be an out-of-bounds write);
// returns the contiguous slot_mapping.
at::Tensor check_cache_write(const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& key,
                             const at::Tensor& value, const at::Tensor& slot_mapping) {
  check_cache(key_cache, "key_cache");
  check_cache(value_cache, "value_cache");
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes(), "value_cache shape ", value_cache.sizes(),
              " must equal key_cache shape ", key_cache.sizes());
  for (auto* p : {&key, &value}) {
    const char* name = p == &key ? "key" : "value";
    check_cpu(*p, name);
    check_dim(*p, 3, name);
    check_last_contiguous(*p, name);
  }
  check_same_dtype(value, key, "value", "key");
  check_same_dtype(value_cache, key_cache, "value_cache", "key_cache");
  check_cpu(slot_mapping, "slot_mapping");
  check_dtype(slot_mapping, at::kLong, "slot_mapping");
  check_dim(slot_mapping, 1, "slot_mapping");
  const int64_t T = slot_mapping.size(0), H = key_cache.size(1), D = key_cache.size(3);
  TORCH_CHECK(key.size(0) == T && key.size(1) == H && key.size(2) == D, "key must have shape [",
              T, ", ", H, ", ", D, "] (num_tokens from slot_mapping, heads/head_dim from key_cache), got ",
              key.sizes());
  TORCH_CHECK(value.sizes() == key.sizes(), "value shape ", value.sizes(), " must equal key shape ", key.sizes());
  auto slots_c = slot_mapping.contiguous();
  const int64_t* slots = slots_c.data_ptr<int64_t>();
  const int64_t num_slots = key_cache.size(0) * key_cache.size(2);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slots[t] >= -1 && slots[t] < num_slots, "slot_mapping[", t, "] = ", slots[t],
                " is out of range [-1, ", num_slots, ")");
  }
  return slots_c;
}

void reshape_and_cache(at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& key,
                       const at::Tensor& value, const at::Tensor& slot_mapping) {
  check_same_dtype(key, key_cache, "key", "key_cache");
  const at::Tensor slots = check_cache_write(key_cache, value_cache, key, value, slot_mapping);
  CacheWriteArgs a{static_cast<char*>(key_cache.data_ptr()), static_cast<char*>(value_cache.data_ptr()),
                   static_cast<const char*>(key.data_ptr()), static_cast<const char*>(value.data_ptr()),
                   slots.data_ptr<int64_t>(), slots.size(0), key_cache.size(1), key_cache.size(3), key_cache.size(2),
                   static_cast<int64_t>(key_cache.element_size()), key.stride(0), key.stride(1), value.stride(0),
                   value.stride(1)};
  reshape_and_cache_kernel(a);
}

void reshape_and_cache_quantized(at::Tensor& key_cache, at::Tensor& value_cache, at::Tensor& k_scale,
                                 at::Tensor& v_scale, const at::Tensor& key, const at::Tensor& value,
                                 const at::Tensor& slot_mapping) {
  check_quantized_kv_cache(key_cache, value_cache, k_scale, v_scale);
  check_float(key, "key");
  const at::Tensor slots = check_cache_write(key_cache, value_cache, key, value, slot_mapping);
  PAGELLM_DISPATCH_FLOAT_TYPES(key.scalar_type(), "reshape_and_cache_quantized", [&] {
    using T = scalar_t;
    PAGELLM_DISPATCH_KV_QUANT_TYPES(key_cache.scalar_type(), "reshape_and_cache_quantized", [&] {
      using C = scalar_t;
      QuantCacheWriteArgs<T, C> a{key_cache.data_ptr<C>(), value_cache.data_ptr<C>(), k_scale.data_ptr<float>(),
                                  v_scale.data_ptr<float>(), key.data_ptr<T>(), value.data_ptr<T>(),
                                  slots.data_ptr<int64_t>(), slots.size(0), key_cache.size(1), key_cache.size(3),
                                  key_cache.size(2), key.stride(0), key.stride(1), value.stride(0), value.stride(1)};
      reshape_and_cache_quantized_kernel(a);
    });
  });
}

void copy_blocks(at::TensorList key_caches, at::TensorList value_caches, const at::Tensor& block_mapping) {
  TORCH_CHECK(key_caches.size() == value_caches.size(), "key_caches and value_caches must have the same length, got ",
              key_caches.size(), " and ", value_caches.size());
  check_cpu(block_mapping, "block_mapping");
  check_dtype(block_mapping, at::kLong, "block_mapping");
  TORCH_CHECK(block_mapping.dim() == 2 && block_mapping.size(1) == 2,
              "block_mapping must have shape [num_pairs, 2], got ", block_mapping.sizes());
  const int64_t L = static_cast<int64_t>(key_caches.size()), P = block_mapping.size(0);
  if (L == 0 || P == 0) return;
  auto map_c = block_mapping.contiguous();
  const int64_t* map = map_c.data_ptr<int64_t>();
  std::vector<char*> kptr(L), vptr(L);
  std::vector<int64_t> block_bytes(L);
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor& k = key_caches[l];
    const at::Tensor& v = value_caches[l];
    check_cache(k, "key_caches[i]");
    check_cache(v, "value_caches[i]");
    TORCH_CHECK(k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type(), "key_caches[", l,
                "] and value_caches[", l, "] must have the same shape and dtype");
    for (int64_t p = 0; p < 2 * P; ++p) {
      TORCH_CHECK(map[p] >= 0 && map[p] < k.size(0), "block_mapping[", p / 2, "][", p % 2, "] = ", map[p],
                  " is out of range [0, ", k.size(0), ") for key_caches[", l, "]");
    }
    kptr[l] = static_cast<char*>(k.data_ptr());
    vptr[l] = static_cast<char*>(v.data_ptr());
    block_bytes[l] = k.stride(0) * k.element_size();
  }
  copy_blocks_kernel(kptr.data(), vptr.data(), L, map, P, block_bytes.data());
}

void copy_slots(at::TensorList caches, const at::Tensor& slot_mapping) {
  check_cpu(slot_mapping, "slot_mapping");
  check_dtype(slot_mapping, at::kLong, "slot_mapping");
  TORCH_CHECK(slot_mapping.dim() == 2 && slot_mapping.size(1) == 2, "slot_mapping must have shape [num_pairs, 2], got ",
              slot_mapping.sizes());
  const int64_t P = slot_mapping.size(0);
  if (caches.empty() || P == 0) return;
  auto map_c = slot_mapping.contiguous();
  const int64_t* map = map_c.data_ptr<int64_t>();
  std::vector<SlotTensor> tensors;
  tensors.reserve(caches.size());
  for (const at::Tensor& c : caches) {
    check_cpu(c, "caches[i]");
    check_contiguous(c, "caches[i]");
    TORCH_CHECK(c.dim() >= 3, "caches[i] must be [num_blocks, num_kv_heads, block_size, ...], got ", c.sizes());
    const int64_t num_slots = c.size(0) * c.size(2);
    for (int64_t p = 0; p < 2 * P; ++p) {
      TORCH_CHECK(map[p] >= 0 && map[p] < num_slots, "slot_mapping[", p / 2, "][", p % 2, "] = ", map[p],
                  " is out of range [0, ", num_slots, ") for a cache of shape ", c.sizes());
    }
    tensors.push_back({static_cast<char*>(c.data_ptr()), c.size(1), c.size(2), c.stride(2) * c.element_size()});
  }
  std::vector<char> scratch;
  copy_slots_kernel(tensors.data(), static_cast<int64_t>(tensors.size()), map, P, scratch);
}

}  // namespace
}  // namespace pagellm::cpu

TORCH_LIBRARY_IMPL(pagellm, CPU, m) {
  m.impl("reshape_and_cache", &pagellm::cpu::reshape_and_cache);
  m.impl("reshape_and_cache_quantized", &pagellm::cpu::reshape_and_cache_quantized);
  m.impl("copy_blocks", &pagellm::cpu::copy_blocks);
  m.impl("copy_slots", &pagellm::cpu::copy_slots);
}
