#include "core/kv_cache_coordinator.h"

#include <algorithm>
#include <stdexcept>

namespace pagellm {

KVCacheCoordinator::KVCacheCoordinator(const std::vector<KVCacheGroupConfig>& groups, int32_t block_size,
                                       bool enable_prefix_caching, double watermark) {
  if (groups.empty()) throw std::invalid_argument("a KV cache needs at least one group");
  groups_.reserve(groups.size());
  for (const KVCacheGroupConfig& g : groups) {
    groups_.push_back(std::make_unique<BlockManager>(g.num_blocks, block_size, enable_prefix_caching, watermark,
                                                     g.sliding_window));
  }
  first_ = groups_.front().get();
  single_ = groups_.size() == 1;
}

HybridPrefixMatch KVCacheCoordinator::find_cached_prefix(const int64_t* tokens, int64_t n, uint64_t extra_key) const {
  HybridPrefixMatch m;
  m.groups.resize(groups_.size());
  if (groups_.size() == 1) {
    m.groups[0] = groups_[0]->find_cached_prefix(tokens, n, extra_key);
    return m;
  }
  // Each pass asks every group for at most the lowest hit so far; a pass that ends with unequal hits
  // lowered the limit, so this ends, with every group matching exactly `limit` blocks.
  int64_t limit = INT64_MAX;
  for (bool agreed = false; !agreed;) {
    for (size_t g = 0; g < groups_.size(); ++g) {
      m.groups[g] = groups_[g]->find_cached_prefix(tokens, n, extra_key, limit);
      limit = std::min<int64_t>(limit, static_cast<int64_t>(m.groups[g].blocks.size()));
    }
    agreed = true;
    for (const PrefixMatch& pm : m.groups) agreed = agreed && static_cast<int64_t>(pm.blocks.size()) == limit;
  }
  return m;
}

bool KVCacheCoordinator::can_allocate(const HybridPrefixMatch& match, int64_t num_new_tokens,
                                      int32_t num_lookahead) const {
  if (match.groups.size() != groups_.size()) return false;
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (!groups_[g]->can_allocate(match.groups[g], num_new_tokens, num_lookahead)) return false;
  }
  return true;
}

KVCacheCoordinator::Handle KVCacheCoordinator::allocate(const std::string& id, const HybridPrefixMatch& match,
                                                        int64_t num_new_tokens, int32_t num_lookahead,
                                                        uint64_t extra_key) {
  if (match.groups.size() != groups_.size()) {
    throw std::invalid_argument("allocate: the prefix match has " + std::to_string(match.groups.size()) +
                                " groups, the cache " + std::to_string(groups_.size()));
  }
  if (num_new_tokens < 0 || num_lookahead < 0) {
    throw std::invalid_argument("allocate: num_new_tokens and num_lookahead_tokens must be >= 0");
  }
  if (groups_[0]->handle(id) >= 0) throw std::invalid_argument("sequence '" + id + "' already has blocks");
  if (groups_.size() > 1 && !can_allocate(match, num_new_tokens, num_lookahead)) return -1;
  const Handle h = groups_[0]->allocate(id, match.groups[0], num_new_tokens, num_lookahead, extra_key);
  if (h < 0) return h;
  for (size_t g = 1; g < groups_.size(); ++g) {
    same_handle(h, groups_[g]->allocate(id, match.groups[g], num_new_tokens, num_lookahead, extra_key), g);
  }
  return h;
}

bool KVCacheCoordinator::append_slots_all(Handle h, int64_t num_computed, int64_t num_new, int32_t num_lookahead) {
  for (const auto& bm : groups_) {
    if (bm->append_cost(h, num_computed, num_new, num_lookahead) > bm->num_free_blocks()) return false;
  }
  for (const auto& bm : groups_) {
    if (!bm->append_slots(h, num_computed, num_new, num_lookahead)) {
      throw std::logic_error("append_slots: a group ran out of blocks after its check");
    }
  }
  return true;
}

bool KVCacheCoordinator::free(Handle h) {
  bool freed = true;
  for (const auto& bm : groups_) freed = bm->free(h) && freed;
  return freed;
}

KVCacheCoordinator::Handle KVCacheCoordinator::fork(Handle parent, const std::string& child_id) {
  const Handle h = groups_[0]->fork(parent, child_id);
  for (size_t g = 1; g < groups_.size(); ++g) same_handle(h, groups_[g]->fork(parent, child_id), g);
  return h;
}

std::vector<GroupCowCopy> KVCacheCoordinator::take_cow_copies() {
  std::vector<GroupCowCopy> out;
  if (single_ && first_->pending_cow_copies().empty()) return out;
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (groups_[g]->pending_cow_copies().empty()) continue;
    for (const auto& c : groups_[g]->take_cow_copies()) out.push_back({static_cast<int32_t>(g), c.first, c.second});
  }
  return out;
}

bool KVCacheCoordinator::reset_prefix_cache() {
  for (const auto& bm : groups_) bm->reset_prefix_cache();
  return true;
}

int64_t KVCacheCoordinator::num_blocks() const {
  int64_t n = 0;
  for (const auto& bm : groups_) n += bm->num_blocks();
  return n;
}

int64_t KVCacheCoordinator::num_reserved_blocks() const {
  int64_t n = 0;
  for (const auto& bm : groups_) n += bm->num_reserved_blocks();
  return n;
}

int64_t KVCacheCoordinator::num_free_blocks() const {
  int64_t n = 0;
  for (const auto& bm : groups_) n += bm->num_free_blocks();
  return n;
}

int64_t KVCacheCoordinator::num_cached_blocks() const {
  int64_t n = 0;
  for (const auto& bm : groups_) n += bm->num_cached_blocks();
  return n;
}

double KVCacheCoordinator::usage() const {
  if (groups_.size() == 1) return groups_[0]->usage();
  int64_t usable = 0;
  int64_t used = 0;
  for (const auto& bm : groups_) {
    const int64_t u = bm->num_blocks() - bm->num_reserved_blocks();
    usable += u;
    used += u - bm->num_free_blocks();
  }
  return static_cast<double>(used) / static_cast<double>(usable);
}

int64_t KVCacheCoordinator::num_tail_waste_slots() const {
  int64_t n = 0;
  for (const auto& bm : groups_) n += bm->num_tail_waste_slots();
  return n;
}

KVCacheCoordinator::Handle KVCacheCoordinator::same_handle(Handle h0, Handle hg, size_t g) {
  if (hg != h0) {
    throw std::logic_error("KV-cache group " + std::to_string(g) + " handed out handle " + std::to_string(hg) +
                           ", group 0 handle " + std::to_string(h0) + ": the groups left lockstep");
  }
  return hg;
}

}  // namespace pagellm
