// Hybrid KV cache: one BlockManager per KV-cache group, every request holding one block table in each.
// A mixed model (Gemma 2/3: sliding-window and full-attention layers) keeps its sliding layers' pages
// in their own group so that group frees the blocks that left its window while the full group keeps
// all of them. Each group has its own pool (own block ids, free queue, prefix-cache index, watermark
// and null block); the groups move in lockstep: a request is admitted, extended, forked, preempted and
// freed in every group at once, so its handle is the same in each. With one group this is a thin
// forwarder to that group's BlockManager.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/block_manager.h"
#include "core/scheduler_config.h"

namespace pagellm {

// A prefix-cache hit in every group, all of the same length (the minimum over groups).
struct HybridPrefixMatch {
  std::vector<PrefixMatch> groups;
  // Prompt tokens covered by the match.
  int64_t num_tokens(int32_t block_size) const { return groups.front().num_tokens(block_size); }
};

// A copy-on-write pair (src, dst) in one group's pool.
struct GroupCowCopy {
  int32_t group = 0;
  int32_t src = 0;
  int32_t dst = 0;
};

class KVCacheCoordinator {
 public:
  using Handle = BlockManager::Handle;

  // Throws std::invalid_argument for no group or a group the BlockManager constructor rejects.
  KVCacheCoordinator(const std::vector<KVCacheGroupConfig>& groups, int32_t block_size, bool enable_prefix_caching,
                     double watermark);

  // Longest prefix every group has cached: each group is asked for at most the others' hit until they
  // agree (a full group's hit is prefix-closed, a window group's is the longest <= the limit).
  HybridPrefixMatch find_cached_prefix(const int64_t* tokens, int64_t n, uint64_t extra_key) const;
  // Whether every group can allocate (each above its own watermark).
  bool can_allocate(const HybridPrefixMatch& match, int64_t num_new_tokens, int32_t num_lookahead) const;
  // Allocates in every group or none; -1 (nothing changed) when a group's watermark forbids it.
  Handle allocate(const std::string& id, const HybridPrefixMatch& match, int64_t num_new_tokens,
                  int32_t num_lookahead, uint64_t extra_key);
  // Extends the tables of every group or none; false (nothing changed) when a group runs out of blocks.
  // (The per-row calls are inline so that a one-group cache calls its BlockManager as directly as before.)
  bool append_slots(Handle h, int64_t num_computed, int64_t num_new, int32_t num_lookahead) {
    return single_ ? first_->append_slots(h, num_computed, num_new, num_lookahead)
                   : append_slots_all(h, num_computed, num_new, num_lookahead);
  }
  // BlockManager's per-table operations, applied to every group.
  void cache_full_blocks(Handle h, const int64_t* tokens, int64_t num_computed) {
    for (const auto& bm : groups_) bm->cache_full_blocks(h, tokens, num_computed);
  }
  void shrink(Handle h, int64_t num_slots) {
    for (const auto& bm : groups_) bm->shrink(h, num_slots);
  }
  void drop_outside_window(Handle h, int64_t num_computed) {
    for (const auto& bm : groups_) bm->drop_outside_window(h, num_computed);
  }
  bool free(Handle h);
  Handle fork(Handle parent, const std::string& child_id);
  // Pending copy-on-write pairs of every group (group order), cleared; their sources are unpinned.
  std::vector<GroupCowCopy> take_cow_copies();
  bool reset_prefix_cache();

  // Number of groups (block tables per request).
  size_t num_groups() const { return groups_.size(); }
  // One group's manager (read-only).
  const BlockManager& group(size_t g) const { return *groups_.at(g); }
  // A live request's block table in group g (every group's table has the same length).
  const std::vector<int32_t>& block_table(Handle h, size_t g = 0) const {
    return (g == 0 ? first_ : groups_[g].get())->block_table(h);
  }
  // Slots per block (the same in every group).
  int32_t block_size() const { return groups_.front()->block_size(); }
  // Whether a handle names a live request.
  bool is_live(Handle h) const { return groups_.front()->is_live(h); }
  // Blocks summed over groups (null blocks included).
  int64_t num_blocks() const;
  // Blocks never handed to requests (the null blocks), summed over groups.
  int64_t num_reserved_blocks() const;
  // Free blocks summed over groups.
  int64_t num_free_blocks() const;
  // Cached blocks summed over groups.
  int64_t num_cached_blocks() const;
  // Blocks in use over usable blocks, summed over groups.
  double usage() const;
  // Reserved but unused tail slots, summed over groups.
  int64_t num_tail_waste_slots() const;
  // Prefix-cache queries / hits in tokens (every group counts the same; group 0's).
  int64_t prefix_cache_queries() const { return groups_.front()->prefix_cache_queries(); }
  int64_t prefix_cache_hits() const { return groups_.front()->prefix_cache_hits(); }

 private:
  // append_slots() of a cache with several groups: checks every group, then extends every group.
  bool append_slots_all(Handle h, int64_t num_computed, int64_t num_new, int32_t num_lookahead);
  // Throws std::logic_error when group g handed out another handle than group 0 (the lockstep broke).
  static Handle same_handle(Handle h0, Handle hg, size_t g);

  std::vector<std::unique_ptr<BlockManager>> groups_;
  BlockManager* first_ = nullptr;  // groups_[0]: the per-row calls of a one-group cache go straight to it
  bool single_ = true;             // one group: today's single-table path
};

}  // namespace pagellm
