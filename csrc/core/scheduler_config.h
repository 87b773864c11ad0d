// Scheduler and KV cache configuration with validation.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace pagellm {

// Batching limits and policy.
struct SchedulerConfig {
  int32_t max_num_seqs = 256;
  int32_t max_num_batched_tokens = 2048;
  int32_t max_model_len = 8192;
  bool enable_chunked_prefill = true;
  std::string policy = "fcfs";  // "fcfs" | "priority"
  int32_t long_prefill_token_threshold = 0;  // 0 = off; else max tokens of one prefill chunk
  int32_t num_lookahead_tokens = 0;          // spec-decode slots reserved after each sampled token

  // Throws std::invalid_argument naming the bad field and its allowed range.
  void validate() const;
  // True for policy "priority".
  bool priority_policy() const { return policy == "priority"; }
};

// One KV-cache group's pool (csrc/core/kv_cache_coordinator.h): its block count (its null block
// included) and its window (0 = every block lives as long as its request).
struct KVCacheGroupConfig {
  int32_t num_blocks = 0;
  int32_t sliding_window = 0;
};

// Paged KV cache shape.
struct CacheConfig {
  int32_t num_blocks = 1024;
  int32_t block_size = 16;
  bool enable_prefix_caching = true;
  double watermark = 0.01;
  int32_t sliding_window = 0;  // every layer sees the last W keys: blocks before them are freed; 0 = full
  // Groups 1.. of a hybrid cache (a mixed model's sliding layers get their own block ids and tables);
  // group 0 is (num_blocks, sliding_window). Empty: one group, one block table per request.
  std::vector<KVCacheGroupConfig> extra_groups;

  // Every group, group 0 first.
  std::vector<KVCacheGroupConfig> groups() const;

  // Throws std::invalid_argument naming the bad field and its allowed range.
  void validate() const;
};

}  // namespace pagellm
