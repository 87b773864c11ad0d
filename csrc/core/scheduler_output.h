// The per-step batch description handed from the scheduler to the model runner.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <string>
#include <vector>

namespace pagellm {

// An allocator whose resize() leaves new elements uninitialized (default-init), for large buffers
// that are fully overwritten right away: zero-filling the padded block table dominated schedule().
template <typename T>
struct DefaultInitAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  using std::allocator<T>::allocator;
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    if constexpr (sizeof...(Args) == 0) {
      ::new (static_cast<void*>(p)) U;  // default-init: no zeroing
    } else {
      ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
    }
  }
};

template <typename T>
using UninitVector = std::vector<T, DefaultInitAllocator<T>>;

// One scheduling step. Rows (requests) are ordered decodes first (query length exactly 1), then the
// multi-token rows in scheduling order: prefill chunks and spec rows. A spec row is a decode-ready
// request given k >= 1 draft tokens: query length 1 + k, input ids [last token, drafts...] at the
// positions (and the lookahead slots) that follow, and logits needed at all 1 + k positions (position
// j's logits verify draft j; the last gives the bonus token). Flat token arrays have
// total_num_scheduled_tokens entries.
struct SchedulerOutput {
  uint64_t step_id = 0;                         // matches the update() of this step
  std::vector<std::string> request_ids;         // [R]
  std::vector<int32_t> num_scheduled_tokens;    // [R] query length per row
  std::vector<int32_t> query_start_loc;         // [R+1] prefix sums of num_scheduled_tokens
  std::vector<int32_t> num_computed_tokens;     // [R] context already in the cache before this chunk
  std::vector<int32_t> seq_lens;                // [R] num_computed + num_scheduled
  std::vector<int64_t> input_ids;               // [T] token ids to compute
  std::vector<int64_t> positions;               // [T]
  std::vector<int64_t> slot_mapping;            // [T] block_id * block_size + offset
  UninitVector<int32_t> block_tables;           // [R, max_blocks_in_batch] row-major, 0-padded
  int32_t max_blocks_in_batch = 0;
  std::vector<uint8_t> do_sample;               // [R] last prefill chunk, decode or spec row
  std::vector<int32_t> num_draft_tokens;        // [R] k of a spec row, else 0
  std::vector<int64_t> draft_token_ids;         // [sum k] the drafts, row by row
  // [sum over sampling rows of 1 + k] flat token indices that need logits, row by row: a sampling
  // row's last token, or every one of a spec row's 1 + k tokens in position order.
  std::vector<int64_t> logits_indices;
  std::vector<int64_t> cow_copies;              // [C, 2] (src, dst) block copies to apply first, in order
  // A hybrid cache (KV-cache groups 1.., csrc/core/kv_cache_coordinator.h) only, else empty: each group's
  // slot mapping [T] and block tables [R, max_blocks_in_batch] (its own block ids; slot_mapping and
  // block_tables above are group 0's), and the group of each copy-on-write pair [C].
  std::vector<std::vector<int64_t>> group_slot_mappings;
  std::vector<UninitVector<int32_t>> group_block_tables;
  std::vector<int32_t> cow_copy_groups;
  std::vector<std::string> preempted_request_ids;
  int32_t num_decode_reqs = 0;
  int64_t total_num_scheduled_tokens = 0;

  // Number of scheduled rows.
  int32_t num_reqs() const { return static_cast<int32_t>(num_scheduled_tokens.size()); }
  // Number of copy-on-write pairs.
  int32_t num_cow_copies() const { return static_cast<int32_t>(cow_copies.size() / 2); }
};

}  // namespace pagellm
