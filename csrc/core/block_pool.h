// Physical KV block pool: ref counts, the LRU free queue and the prefix-cache hash index.
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "core/block_hash.h"

namespace pagellm {

// Metadata of one physical KV cache block.
struct KVBlock {
  int32_t id = 0;
  int32_t ref_count = 0;
  int32_t prev = -1;  // free-queue links (intrusive doubly linked list)
  int32_t next = -1;
  bool in_free_queue = false;
  bool cached = false;            // registered in the hash index
  bool pending_cow_dst = false;   // destination of a copy-on-write not yet handed to the runner
  int32_t cow_pins = 0;           // references held by pending copies reading this block (not tables)
  BlockHash hash;                 // valid when cached
  BlockHash parent_hash;          // valid when cached
  uint64_t extra_key = 0;         // valid when cached
  std::vector<int64_t> token_ids; // valid when cached: the block's content, verified on lookup
};

// LRU queue of free blocks: an intrusive doubly linked list over the pool's block array, so removal
// from the middle (a free block revived by a prefix hit) is O(1).
class FreeBlockQueue {
 public:
  // Binds the queue to the pool's block array (which must outlive the queue and never resize).
  explicit FreeBlockQueue(std::vector<KVBlock>* blocks) : blocks_(blocks) {}
  // Appends a block at the tail (most recently freed).
  void push_back(int32_t id);
  // Removes and returns the head (least recently freed); throws std::logic_error when empty.
  int32_t pop_front();
  // Unlinks a block from anywhere in the queue; throws std::logic_error if it is not queued.
  void remove(int32_t id);
  // Head block id, -1 when empty.
  int32_t front() const { return head_; }
  // Number of queued blocks.
  int32_t size() const { return size_; }
  // Block ids from head to tail (for tests and invariant checks).
  std::vector<int32_t> to_vector() const;

 private:
  std::vector<KVBlock>* blocks_;
  int32_t head_ = -1;
  int32_t tail_ = -1;
  int32_t size_ = 0;
};

// Owns every block: allocation (LRU eviction), reference counting and the content-verified hash index.
class BlockPool {
 public:
  // Creates num_blocks free blocks of block_size slots (arguments validated by the caller).
  BlockPool(int32_t num_blocks, int32_t block_size);
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // Total number of blocks.
  int32_t num_blocks() const { return static_cast<int32_t>(blocks_.size()); }
  // Slots per block.
  int32_t block_size() const { return block_size_; }
  // Blocks with ref_count 0 (cached or not).
  int32_t num_free_blocks() const { return free_queue_.size(); }
  // Blocks registered in the hash index (live or free).
  int32_t num_cached_blocks() const { return static_cast<int32_t>(index_.size()); }

  // Takes the least recently freed block (evicting its cached hash) with ref_count 1.
  int32_t allocate();
  // Adds a reference; a free block is first pulled out of the free queue (a prefix-cache revival).
  void acquire(int32_t id);
  // Drops a reference; at 0 the block goes to the free-queue tail, keeping its hash. True if freed.
  bool release(int32_t id);

  // Cached block holding exactly this content (hash, parent, tokens, extra key), or -1.
  int32_t lookup(const BlockHash& hash, const BlockHash& parent, const int64_t* tokens,
                 uint64_t extra_key) const;
  // Registers a full block's content; false (block left uncached) if the hash is already indexed.
  bool register_block(int32_t id, const BlockHash& hash, const BlockHash& parent,
                      const int64_t* tokens, uint64_t extra_key);
  // Drops one block's cached hash (no-op if not cached): its content is about to change.
  void uncache(int32_t id);
  // Drops every cached hash (live and free blocks alike).
  void reset_prefix_cache();

  // Read access to one block's metadata.
  const KVBlock& block(int32_t id) const { return blocks_[static_cast<size_t>(id)]; }
  // Marks/unmarks a block as a pending copy-on-write destination.
  void set_pending_cow_dst(int32_t id, bool v) { blocks_[static_cast<size_t>(id)].pending_cow_dst = v; }
  // Adds (+1) or removes (-1) a pending-copy pin; the pin is counted in ref_count too.
  void add_cow_pin(int32_t id, int32_t delta) { blocks_[static_cast<size_t>(id)].cow_pins += delta; }
  // References held by block tables (ref_count minus pending-copy pins).
  int32_t table_refs(int32_t id) const { return blocks_[static_cast<size_t>(id)].ref_count - blocks_[static_cast<size_t>(id)].cow_pins; }
  // The free queue (for tests and invariant checks).
  const FreeBlockQueue& free_queue() const { return free_queue_; }
  // Block id the index holds for a hash value, -1 if none (for invariant checks).
  int32_t indexed_block(uint64_t hash) const;

 private:
  // Removes a block's hash from the index and forgets its content.
  void evict_hash(KVBlock& b);

  int32_t block_size_;
  std::vector<KVBlock> blocks_;
  FreeBlockQueue free_queue_;
  std::unordered_map<uint64_t, int32_t> index_;
};

}  // namespace pagellm
