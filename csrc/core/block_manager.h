// Paged KV cache manager: per-sequence block tables, prefix caching, fork + copy-on-write, watermark,
// and (for sliding-window attention) freeing the blocks that left every query's window.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/block_pool.h"

namespace pagellm {

// Result of a prefix-cache lookup; valid until the pool is next mutated.
struct PrefixMatch {
  std::vector<int32_t> blocks;  // cached full blocks, in order (a sliding window's leading ones: the null block)
  BlockHash last_hash;          // chain hash of the last matched block (BlockHash{} if none)
  int64_t num_query_tokens = 0; // tokens of the looked-up sequence (prefix-cache stats)
  // Number of prompt tokens covered by the match.
  int64_t num_tokens(int32_t block_size) const { return static_cast<int64_t>(blocks.size()) * block_size; }
};

// Block-level state of one live sequence (request).
struct SeqBlocks {
  std::string id;
  std::vector<int32_t> blocks;
  int64_t num_slots = 0;       // slots reserved by the last allocate/append/shrink
  int32_t num_hashed = 0;      // leading blocks whose chain hash is known (registered or dup)
  int32_t num_dropped = 0;     // leading entries that left the sliding window (the null block)
  BlockHash last_hash;         // chain hash of block num_hashed-1
  uint64_t extra_key = 0;
  bool live = false;
};

// Manages the KV cache blocks of all sequences. Sequences are addressed by a string id or by the
// integer handle returned at allocation (fast path used by the scheduler). Single-threaded.
// Copy-on-write sources stay pinned (one extra reference) until take_cow_copies() hands the copies
// to the runner, so a source can never be reallocated before its copy has been applied.
// Sliding window W > 0 (every layer sees only the last W keys, itself included): a query at position p
// reads keys >= p - W + 1, so once num_computed tokens are cached, blocks lying entirely before
// num_computed - W + 1 are never read again. drop_outside_window() replaces their table entries by the
// null block (reserved at construction, never allocated or cached; the table keeps its length so
// slot = table[pos / block_size] still holds) and releases them to the free queue, still hashed.
class BlockManager {
 public:
  using Handle = int32_t;

  // Throws std::invalid_argument for num_blocks < 1 (< 2 with a window), block_size not a power of two
  // in [1, 256], watermark outside [0, 1) or sliding_window < 0 (0 = full attention).
  BlockManager(int32_t num_blocks, int32_t block_size = 16, bool enable_prefix_caching = true,
               double watermark = 0.01, int32_t sliding_window = 0);

  // Longest cached prefix of tokens in full blocks, never covering the last token nor more than
  // max_blocks blocks (a hybrid cache asks each group for at most the others' hit). With a window only
  // the blocks the next query still reads must be cached (the match is found scanning from the right).
  PrefixMatch find_cached_prefix(const int64_t* tokens, int64_t n, uint64_t extra_key,
                                 int64_t max_blocks = INT64_MAX) const;
  // Whether allocate() would succeed (free blocks after allocation >= watermark blocks).
  bool can_allocate(const PrefixMatch& match, int64_t num_new_tokens, int32_t num_lookahead) const;
  // Creates sequence `id` reusing the matched blocks plus fresh blocks for num_new_tokens +
  // num_lookahead slots. Returns its handle, or -1 (nothing changed) if the watermark forbids it.
  // Throws std::invalid_argument if id is live or counts are negative.
  Handle allocate(const std::string& id, const PrefixMatch& match, int64_t num_new_tokens,
                  int32_t num_lookahead, uint64_t extra_key);
  // Blocks append_slots() would take from the free queue (fresh + copy-on-write); throws for negative counts.
  int64_t append_cost(Handle h, int64_t num_computed, int64_t num_new, int32_t num_lookahead) const;
  // Ensures slots for num_computed + num_new + num_lookahead tokens, copy-on-writing shared blocks
  // that will be written. Ignores the watermark. False (nothing changed) if blocks run out.
  bool append_slots(Handle h, int64_t num_computed, int64_t num_new, int32_t num_lookahead);
  // Hashes and registers the full blocks among the first num_computed tokens (no-op if disabled).
  void cache_full_blocks(Handle h, const int64_t* tokens, int64_t num_computed);
  // Frees trailing blocks not needed for num_slots slots (rejected spec-decode lookahead).
  void shrink(Handle h, int64_t num_slots);
  // Sliding window: releases the blocks no query after num_computed tokens reads (no-op without one).
  // Call after cache_full_blocks() so they stay findable in the prefix cache.
  void drop_outside_window(Handle h, int64_t num_computed);
  // Frees a sequence's blocks tail first (so its tail is evicted before its prefix). False if unknown.
  bool free(const std::string& id);
  // Handle-based free; false if the handle is not live.
  bool free(Handle h);
  // Creates child_id sharing every block of parent (ref++). Throws on unknown parent / live child.
  Handle fork(Handle parent, const std::string& child_id);
  // Returns and clears pending (src, dst) copy-on-write pairs; unpins their sources.
  std::vector<std::pair<int32_t, int32_t>> take_cow_copies();
  // Drops every cached hash, including those of blocks in use. Always returns true.
  bool reset_prefix_cache();

  // Handle of a live sequence, -1 if unknown.
  Handle handle(const std::string& id) const;
  // Handle of a live sequence; throws std::out_of_range if unknown.
  Handle checked_handle(const std::string& id) const;
  // Whether a handle names a live sequence.
  bool is_live(Handle h) const;
  // Block table of a live sequence.
  const std::vector<int32_t>& block_table(Handle h) const { return seq(h).blocks; }
  // Full per-sequence state of a live sequence.
  const SeqBlocks& seq(Handle h) const;

  // Total blocks (the null block included).
  int32_t num_blocks() const { return pool_.num_blocks(); }
  // Sliding window in tokens, 0 = full attention.
  int32_t sliding_window() const { return sliding_window_; }
  // The reserved block id standing for dropped table entries, -1 without a window.
  int32_t null_block() const { return null_block_; }
  // Blocks never handed to sequences (the null block).
  int32_t num_reserved_blocks() const { return null_block_ >= 0 ? 1 : 0; }
  // Index of the first block a query after num_computed cached tokens still reads (0 without a window).
  int64_t first_live_block(int64_t num_computed) const {
    return sliding_window_ > 0 ? std::max<int64_t>(0, num_computed - sliding_window_ + 1) / block_size_ : 0;
  }
  // Table entries of a live sequence that hold a real block (not the null block).
  int64_t num_live_blocks(Handle h) const;
  // Most blocks one sequence holds at once with num_slots slots whose chunks are at most max_chunk
  // tokens (+ lookahead): all of them without a window, else those a window plus a chunk can span.
  int64_t max_live_blocks(int64_t num_slots, int64_t max_chunk) const;
  // Slots per block.
  int32_t block_size() const { return block_size_; }
  // Blocks with ref_count 0.
  int32_t num_free_blocks() const { return pool_.num_free_blocks(); }
  // Fraction of blocks in use (ref_count > 0).
  double usage() const;
  // Blocks holding a registered prefix hash (live or free).
  int32_t num_cached_blocks() const { return pool_.num_cached_blocks(); }
  // Reserved but unused slots at the tails of live sequences.
  int64_t num_tail_waste_slots() const;
  // Free blocks admission must leave untouched.
  int32_t watermark_blocks() const { return watermark_blocks_; }
  // Whether prefix caching is on.
  bool enable_prefix_caching() const { return enable_prefix_caching_; }
  // Prefix-cache queries, in tokens (all tokens of every admitted sequence).
  int64_t prefix_cache_queries() const { return queries_; }
  // Prefix-cache hits, in tokens (tokens served from cached blocks at admission).
  int64_t prefix_cache_hits() const { return hits_; }
  // Number of live sequences.
  int32_t num_seqs() const { return static_cast<int32_t>(ids_.size()); }
  // Underlying pool (read-only; for tests and invariant checks).
  const BlockPool& pool() const { return pool_; }
  // Pending copy-on-write pairs (read-only).
  const std::vector<std::pair<int32_t, int32_t>>& pending_cow_copies() const { return cow_copies_; }

 private:
  // Blocks needed to hold n slots.
  int64_t blocks_for(int64_t n) const { return (n + block_size_ - 1) / block_size_; }
  // Mutable state of a live handle (throws std::out_of_range otherwise).
  SeqBlocks& mut_seq(Handle h);
  // New handle slot for id.
  Handle new_handle(const std::string& id);
  // Drops one reference of a block held by a table, cancelling a pending copy into it.
  void release_block(int32_t id);
  // Replaces block index j of s by a fresh block, recording a copy if it holds valid tokens.
  void copy_on_write(SeqBlocks& s, size_t j, bool needs_copy);
  // Adds a table reference to a block (the null block is not counted).
  void hold_block(int32_t id);
  // Sliding window: chain hashes of every full block before the last token, and the pool's hit for each.
  void hash_all_blocks(const int64_t* tokens, int64_t num_blocks, uint64_t extra_key,
                       std::vector<BlockHash>& hashes, std::vector<int32_t>& hits) const;
  // Sliding window: the largest k whose blocks [first_live_block(k * block_size), k) are all hits.
  int64_t longest_window_hit(const std::vector<int32_t>& hits) const;

  BlockPool pool_;
  int32_t block_size_;
  bool enable_prefix_caching_;
  int32_t watermark_blocks_;
  int32_t sliding_window_;
  int32_t null_block_ = -1;
  std::vector<SeqBlocks> seqs_;
  std::vector<Handle> free_handles_;
  std::unordered_map<std::string, Handle> ids_;
  std::vector<std::pair<int32_t, int32_t>> cow_copies_;
  std::vector<int32_t> pinned_srcs_;
  int64_t queries_ = 0;
  int64_t hits_ = 0;
};

}  // namespace pagellm
