#include "core/scheduler_config.h"

#include <stdexcept>

namespace pagellm {

namespace {

void require(bool ok, const std::string& field, const std::string& range, const std::string& got) {
  if (!ok) throw std::invalid_argument(field + " must be " + range + " (got " + got + ")");
}

}  // namespace

void SchedulerConfig::validate() const {
  require(max_num_seqs >= 1, "max_num_seqs", ">= 1", std::to_string(max_num_seqs));
  require(max_num_batched_tokens >= 1, "max_num_batched_tokens", ">= 1", std::to_string(max_num_batched_tokens));
  require(max_model_len >= 1, "max_model_len", ">= 1", std::to_string(max_model_len));
  require(policy == "fcfs" || policy == "priority", "policy", "'fcfs' or 'priority'", "'" + policy + "'");
  require(long_prefill_token_threshold >= 0, "long_prefill_token_threshold", ">= 0 (0 = off)",
          std::to_string(long_prefill_token_threshold));
  require(num_lookahead_tokens >= 0 && num_lookahead_tokens <= 256, "num_lookahead_tokens", "in [0, 256]",
          std::to_string(num_lookahead_tokens));
}

void CacheConfig::validate() const {
  require(num_blocks >= 1, "num_blocks", ">= 1", std::to_string(num_blocks));
  require(block_size >= 1 && block_size <= 256 && (block_size & (block_size - 1)) == 0, "block_size",
          "a power of two in [1, 256]", std::to_string(block_size));
  require(watermark >= 0.0 && watermark < 1.0, "watermark", "in [0, 1)", std::to_string(watermark));
  require(sliding_window >= 0, "sliding_window", ">= 0 (0 = full attention)", std::to_string(sliding_window));
  require(sliding_window == 0 || num_blocks >= 2, "num_blocks", ">= 2 with a sliding window (one is the null block)",
          std::to_string(num_blocks));
  for (size_t g = 0; g < extra_groups.size(); ++g) {
    const KVCacheGroupConfig& k = extra_groups[g];
    const std::string name = "extra_groups[" + std::to_string(g) + "].";
    require(k.sliding_window >= 0, name + "sliding_window", ">= 0 (0 = full attention)",
            std::to_string(k.sliding_window));
    require(k.num_blocks >= (k.sliding_window > 0 ? 2 : 1), name + "num_blocks",
            k.sliding_window > 0 ? ">= 2 with a sliding window (one is the null block)" : ">= 1",
            std::to_string(k.num_blocks));
  }
}

std::vector<KVCacheGroupConfig> CacheConfig::groups() const {
  std::vector<KVCacheGroupConfig> all{{num_blocks, sliding_window}};
  all.insert(all.end(), extra_groups.begin(), extra_groups.end());
  return all;
}

}  // namespace pagellm
