#include "core/block_manager.h"

#include <algorithm>
#include <stdexcept>

namespace pagellm {

namespace {

bool is_power_of_two(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

void check_non_negative(int64_t v, const char* name) {
  if (v < 0) throw std::invalid_argument(std::string(name) + " must be >= 0 (got " + std::to_string(v) + ")");
}

// Validates the constructor arguments before any memory is allocated; returns num_blocks.
int32_t validated_num_blocks(int32_t num_blocks, int32_t block_size, double watermark, int32_t sliding_window) {
  if (sliding_window < 0) {
    throw std::invalid_argument("sliding_window must be >= 0 (0 = full attention; got " +
                                std::to_string(sliding_window) + ")");
  }
  const int32_t min_blocks = sliding_window > 0 ? 2 : 1;  // a window reserves the null block
  if (num_blocks < min_blocks) {
    throw std::invalid_argument("num_blocks must be >= " + std::to_string(min_blocks) + " (got " +
                                std::to_string(num_blocks) + ")");
  }
  if (!is_power_of_two(block_size) || block_size > 256) {
    throw std::invalid_argument("block_size must be a power of two in [1, 256] (got " +
                                std::to_string(block_size) + ")");
  }
  if (!(watermark >= 0.0 && watermark < 1.0)) {
    throw std::invalid_argument("watermark must be in [0, 1) (got " + std::to_string(watermark) + ")");
  }
  return num_blocks;
}

}  // namespace

BlockManager::BlockManager(int32_t num_blocks, int32_t block_size, bool enable_prefix_caching,
                           double watermark, int32_t sliding_window)
    : pool_(validated_num_blocks(num_blocks, block_size, watermark, sliding_window), block_size),
      block_size_(block_size),
      enable_prefix_caching_(enable_prefix_caching),
      watermark_blocks_(static_cast<int32_t>(watermark * num_blocks)),
      sliding_window_(sliding_window) {
  // Held for the manager's life: never on the free queue, so never handed out, written or cached.
  if (sliding_window_ > 0) null_block_ = pool_.allocate();
}

PrefixMatch BlockManager::find_cached_prefix(const int64_t* tokens, int64_t n, uint64_t extra_key,
                                             int64_t limit) const {
  PrefixMatch m;
  m.num_query_tokens = n;
  if (!enable_prefix_caching_ || n <= 1 || limit <= 0) return m;
  // Never reuse the block holding the last token: it must be recomputed (and would be written).
  const int64_t max_blocks = std::min<int64_t>((n - 1) / block_size_, limit);
  if (sliding_window_ > 0) {
    std::vector<BlockHash> hashes;
    std::vector<int32_t> hits;
    hash_all_blocks(tokens, max_blocks, extra_key, hashes, hits);
    const int64_t k = longest_window_hit(hits);
    const int64_t first = first_live_block(k * block_size_);
    for (int64_t j = 0; j < k; ++j) m.blocks.push_back(j < first ? null_block_ : hits[static_cast<size_t>(j)]);
    if (k > 0) m.last_hash = hashes[static_cast<size_t>(k - 1)];
    return m;
  }
  BlockHash parent;
  for (int64_t j = 0; j < max_blocks; ++j) {
    const int64_t* blk = tokens + j * block_size_;
    const BlockHash h = hash_block_tokens(parent, blk, block_size_, extra_key);
    const int32_t id = pool_.lookup(h, parent, blk, extra_key);
    if (id < 0) break;
    m.blocks.push_back(id);
    parent = h;
  }
  m.last_hash = parent;
  return m;
}

void BlockManager::hash_all_blocks(const int64_t* tokens, int64_t num_blocks, uint64_t extra_key,
                                   std::vector<BlockHash>& hashes, std::vector<int32_t>& hits) const {
  BlockHash parent;
  hashes.reserve(static_cast<size_t>(num_blocks));
  hits.reserve(static_cast<size_t>(num_blocks));
  for (int64_t j = 0; j < num_blocks; ++j) {
    const int64_t* blk = tokens + j * block_size_;
    const BlockHash h = hash_block_tokens(parent, blk, block_size_, extra_key);
    hashes.push_back(h);
    hits.push_back(pool_.lookup(h, parent, blk, extra_key));
    parent = h;
  }
}

int64_t BlockManager::longest_window_hit(const std::vector<int32_t>& hits) const {
  // run[j]: consecutive hits ending at block j; k works when the run ending at k - 1 covers the window.
  std::vector<int64_t> run(hits.size(), 0);
  for (size_t j = 0; j < hits.size(); ++j) run[j] = hits[j] < 0 ? 0 : (j > 0 ? run[j - 1] : 0) + 1;
  for (int64_t k = static_cast<int64_t>(hits.size()); k > 0; --k) {
    if (run[static_cast<size_t>(k - 1)] >= k - first_live_block(k * block_size_)) return k;
  }
  return 0;
}

bool BlockManager::can_allocate(const PrefixMatch& match, int64_t num_new_tokens, int32_t num_lookahead) const {
  if (num_new_tokens < 0 || num_lookahead < 0) return false;
  const int64_t matched = static_cast<int64_t>(match.blocks.size());
  const int64_t total = blocks_for(match.num_tokens(block_size_) + num_new_tokens + num_lookahead);
  int64_t revived = 0;  // cached blocks that are currently free leave the free pool when reused
  for (int32_t b : match.blocks) revived += b != null_block_ && pool_.block(b).ref_count == 0 ? 1 : 0;
  const int64_t fresh = std::max<int64_t>(0, total - matched);
  return num_free_blocks() - revived - fresh >= watermark_blocks_;
}

BlockManager::Handle BlockManager::allocate(const std::string& id, const PrefixMatch& match,
                                            int64_t num_new_tokens, int32_t num_lookahead, uint64_t extra_key) {
  check_non_negative(num_new_tokens, "num_new_tokens");
  check_non_negative(num_lookahead, "num_lookahead_tokens");
  if (ids_.count(id)) throw std::invalid_argument("sequence '" + id + "' already has blocks");
  if (!can_allocate(match, num_new_tokens, num_lookahead)) return -1;
  const Handle h = new_handle(id);
  SeqBlocks& s = seqs_[static_cast<size_t>(h)];
  s.extra_key = extra_key;
  s.blocks.reserve(match.blocks.size() + 4);
  for (int32_t b : match.blocks) {
    hold_block(b);
    s.blocks.push_back(b);
  }
  s.num_hashed = static_cast<int32_t>(match.blocks.size());
  s.num_dropped = static_cast<int32_t>(std::count(match.blocks.begin(), match.blocks.end(), null_block_));
  s.last_hash = match.last_hash;
  s.num_slots = match.num_tokens(block_size_) + num_new_tokens + num_lookahead;
  const int64_t total = blocks_for(s.num_slots);
  while (static_cast<int64_t>(s.blocks.size()) < total) s.blocks.push_back(pool_.allocate());
  if (enable_prefix_caching_) {
    queries_ += match.num_query_tokens;
    hits_ += match.num_tokens(block_size_);
  }
  return h;
}

int64_t BlockManager::append_cost(Handle h, int64_t num_computed, int64_t num_new, int32_t num_lookahead) const {
  check_non_negative(num_computed, "num_computed_tokens");
  check_non_negative(num_new, "num_new_tokens");
  check_non_negative(num_lookahead, "num_lookahead_tokens");
  const SeqBlocks& s = seq(h);
  const size_t need = static_cast<size_t>(blocks_for(num_computed + num_new + num_lookahead));
  const size_t have = s.blocks.size();
  int64_t cow = 0;
  for (size_t j = static_cast<size_t>(num_computed / block_size_); j < std::min(have, need); ++j) {
    cow += pool_.table_refs(s.blocks[j]) > 1 ? 1 : 0;
  }
  return cow + (need > have ? static_cast<int64_t>(need - have) : 0);
}

bool BlockManager::append_slots(Handle h, int64_t num_computed, int64_t num_new, int32_t num_lookahead) {
  check_non_negative(num_computed, "num_computed_tokens");
  check_non_negative(num_new, "num_new_tokens");
  check_non_negative(num_lookahead, "num_lookahead_tokens");
  SeqBlocks& s = mut_seq(h);
  const int64_t end = num_computed + num_new + num_lookahead;
  const size_t need = static_cast<size_t>(blocks_for(end));
  const size_t have = s.blocks.size();
  const size_t first = static_cast<size_t>(num_computed / block_size_);
  int64_t cow = 0;  // the count append_cost() gives, inlined: this is every decode step's path
  for (size_t j = first; j < std::min(have, need); ++j) cow += pool_.table_refs(s.blocks[j]) > 1 ? 1 : 0;
  const int64_t fresh = need > have ? static_cast<int64_t>(need - have) : 0;
  if (cow + fresh > num_free_blocks()) return false;
  for (size_t j = first; j < std::min(have, need); ++j) {
    if (pool_.table_refs(s.blocks[j]) > 1) {
      copy_on_write(s, j, static_cast<int64_t>(j) * block_size_ < num_computed);
    } else {
      // A block another (forked, spec-decode) holder registered as full may be written here by
      // this holder: it must leave the prefix cache first.
      pool_.uncache(s.blocks[j]);
    }
  }
  while (s.blocks.size() < need) s.blocks.push_back(pool_.allocate());
  s.num_slots = end;
  return true;
}

void BlockManager::copy_on_write(SeqBlocks& s, size_t j, bool needs_copy) {
  const int32_t src = s.blocks[j];
  const int32_t dst = pool_.allocate();
  s.blocks[j] = dst;
  if (needs_copy) {
    // The table's reference on src moves to the pending copy (pinned until take_cow_copies()).
    cow_copies_.emplace_back(src, dst);
    pool_.set_pending_cow_dst(dst, true);
    pool_.add_cow_pin(src, 1);
  } else {
    release_block(src);  // nothing valid to copy: the sequence writes the whole block itself
  }
}

void BlockManager::cache_full_blocks(Handle h, const int64_t* tokens, int64_t num_computed) {
  SeqBlocks& s = mut_seq(h);
  if (!enable_prefix_caching_) return;
  const int64_t n_full = std::min<int64_t>(num_computed / block_size_, static_cast<int64_t>(s.blocks.size()));
  for (int64_t j = s.num_hashed; j < n_full; ++j) {
    const int64_t* blk = tokens + j * block_size_;
    const BlockHash hash = hash_block_tokens(s.last_hash, blk, block_size_, s.extra_key);
    const int32_t b = s.blocks[static_cast<size_t>(j)];
    // An identical block already cached is kept; this one stays uncached (live blocks are not deduped).
    if (b != null_block_ && !pool_.block(b).cached) pool_.register_block(b, hash, s.last_hash, blk, s.extra_key);
    s.last_hash = hash;
    s.num_hashed = static_cast<int32_t>(j + 1);
  }
}

void BlockManager::shrink(Handle h, int64_t num_slots) {
  check_non_negative(num_slots, "num_slots");
  SeqBlocks& s = mut_seq(h);
  const size_t keep = std::max(static_cast<size_t>(blocks_for(num_slots)), static_cast<size_t>(s.num_hashed));
  while (s.blocks.size() > keep) {
    if (s.blocks.back() != null_block_) release_block(s.blocks.back());
    s.blocks.pop_back();
  }
  s.num_slots = std::min<int64_t>(num_slots, static_cast<int64_t>(s.blocks.size()) * block_size_);
}

void BlockManager::drop_outside_window(Handle h, int64_t num_computed) {
  if (sliding_window_ == 0) return;
  SeqBlocks& s = mut_seq(h);
  const int64_t first = std::min<int64_t>(first_live_block(num_computed), static_cast<int64_t>(s.blocks.size()));
  // Oldest first, so the free queue evicts them before the window's newer blocks.
  for (int64_t j = s.num_dropped; j < first; ++j) {
    int32_t& b = s.blocks[static_cast<size_t>(j)];
    if (b != null_block_) release_block(b);
    b = null_block_;
  }
  s.num_dropped = static_cast<int32_t>(std::max<int64_t>(s.num_dropped, first));
}

bool BlockManager::free(const std::string& id) {
  const Handle h = handle(id);
  return h >= 0 && free(h);
}

bool BlockManager::free(Handle h) {
  if (!is_live(h)) return false;
  SeqBlocks& s = seqs_[static_cast<size_t>(h)];
  // Release tail first: the tail lands nearer the free-queue head and is evicted before the prefix.
  for (auto it = s.blocks.rbegin(); it != s.blocks.rend(); ++it) {
    if (*it != null_block_) release_block(*it);
  }
  ids_.erase(s.id);
  s = SeqBlocks();
  free_handles_.push_back(h);
  return true;
}

BlockManager::Handle BlockManager::fork(Handle parent, const std::string& child_id) {
  if (!is_live(parent)) throw std::out_of_range("fork: unknown parent sequence");
  if (ids_.count(child_id)) throw std::invalid_argument("fork: sequence '" + child_id + "' already has blocks");
  const Handle h = new_handle(child_id);
  SeqBlocks& c = seqs_[static_cast<size_t>(h)];
  const SeqBlocks& p = seqs_[static_cast<size_t>(parent)];
  c.blocks = p.blocks;
  c.num_slots = p.num_slots;
  c.num_hashed = p.num_hashed;
  c.last_hash = p.last_hash;
  c.extra_key = p.extra_key;
  c.num_dropped = p.num_dropped;
  for (int32_t b : c.blocks) hold_block(b);
  return h;
}

std::vector<std::pair<int32_t, int32_t>> BlockManager::take_cow_copies() {
  std::vector<std::pair<int32_t, int32_t>> out;
  out.swap(cow_copies_);
  for (const auto& c : out) pool_.set_pending_cow_dst(c.second, false);
  for (const auto& c : out) {
    pool_.add_cow_pin(c.first, -1);
    pool_.release(c.first);
  }
  return out;
}

bool BlockManager::reset_prefix_cache() {
  pool_.reset_prefix_cache();
  return true;
}

BlockManager::Handle BlockManager::handle(const std::string& id) const {
  const auto it = ids_.find(id);
  return it == ids_.end() ? -1 : it->second;
}

BlockManager::Handle BlockManager::checked_handle(const std::string& id) const {
  const Handle h = handle(id);
  if (h < 0) throw std::out_of_range("unknown sequence '" + id + "'");
  return h;
}

bool BlockManager::is_live(Handle h) const {
  return h >= 0 && static_cast<size_t>(h) < seqs_.size() && seqs_[static_cast<size_t>(h)].live;
}

const SeqBlocks& BlockManager::seq(Handle h) const {
  if (!is_live(h)) throw std::out_of_range("unknown sequence handle " + std::to_string(h));
  return seqs_[static_cast<size_t>(h)];
}

SeqBlocks& BlockManager::mut_seq(Handle h) {
  if (!is_live(h)) throw std::out_of_range("unknown sequence handle " + std::to_string(h));
  return seqs_[static_cast<size_t>(h)];
}

int64_t BlockManager::num_live_blocks(Handle h) const {
  const std::vector<int32_t>& t = seq(h).blocks;
  return static_cast<int64_t>(t.size()) - (null_block_ < 0 ? 0 : std::count(t.begin(), t.end(), null_block_));
}

int64_t BlockManager::max_live_blocks(int64_t num_slots, int64_t max_chunk) const {
  const int64_t all = blocks_for(num_slots);
  if (sliding_window_ == 0) return all;
  // Keys [c - W + 1, c + chunk) live during a step from c: W - 1 + chunk slots, +1 for block alignment.
  return std::min(all, blocks_for(sliding_window_ - 1 + max_chunk) + 1);
}

void BlockManager::hold_block(int32_t id) {
  if (id != null_block_) pool_.acquire(id);
}

double BlockManager::usage() const {
  const int32_t usable = num_blocks() - num_reserved_blocks();
  return static_cast<double>(usable - num_free_blocks()) / static_cast<double>(usable);
}

int64_t BlockManager::num_tail_waste_slots() const {
  int64_t waste = 0;
  for (const SeqBlocks& s : seqs_) {
    if (s.live) waste += static_cast<int64_t>(s.blocks.size()) * block_size_ - s.num_slots;
  }
  return waste;
}

BlockManager::Handle BlockManager::new_handle(const std::string& id) {
  Handle h;
  if (!free_handles_.empty()) {
    h = free_handles_.back();
    free_handles_.pop_back();
  } else {
    h = static_cast<Handle>(seqs_.size());
    seqs_.emplace_back();
  }
  SeqBlocks& s = seqs_[static_cast<size_t>(h)];
  s.id = id;
  s.live = true;
  ids_.emplace(id, h);
  return h;
}

void BlockManager::release_block(int32_t id) {
  const KVBlock& b = pool_.block(id);
  if (b.pending_cow_dst && b.ref_count == 1) {
    // Its owner is gone before the copy was handed out: cancel the copy and unpin its source.
    auto it = std::find_if(cow_copies_.begin(), cow_copies_.end(),
                           [id](const std::pair<int32_t, int32_t>& c) { return c.second == id; });
    pool_.set_pending_cow_dst(id, false);
    if (it != cow_copies_.end()) {
      const int32_t src = it->first;
      cow_copies_.erase(it);
      pool_.add_cow_pin(src, -1);
      release_block(src);
    }
  }
  pool_.release(id);
}

}  // namespace pagellm
