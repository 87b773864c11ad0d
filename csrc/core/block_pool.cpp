#include "core/block_pool.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace pagellm {

void FreeBlockQueue::push_back(int32_t id) {
  KVBlock& b = (*blocks_)[static_cast<size_t>(id)];
  if (b.in_free_queue) throw std::logic_error("block " + std::to_string(id) + " is already free");
  b.in_free_queue = true;
  b.prev = tail_;
  b.next = -1;
  if (tail_ >= 0) {
    (*blocks_)[static_cast<size_t>(tail_)].next = id;
  } else {
    head_ = id;
  }
  tail_ = id;
  ++size_;
}

int32_t FreeBlockQueue::pop_front() {
  if (head_ < 0) throw std::logic_error("no free KV blocks left");
  const int32_t id = head_;
  remove(id);
  return id;
}

void FreeBlockQueue::remove(int32_t id) {
  KVBlock& b = (*blocks_)[static_cast<size_t>(id)];
  if (!b.in_free_queue) throw std::logic_error("block " + std::to_string(id) + " is not free");
  if (b.prev >= 0) {
    (*blocks_)[static_cast<size_t>(b.prev)].next = b.next;
  } else {
    head_ = b.next;
  }
  if (b.next >= 0) {
    (*blocks_)[static_cast<size_t>(b.next)].prev = b.prev;
  } else {
    tail_ = b.prev;
  }
  b.prev = b.next = -1;
  b.in_free_queue = false;
  --size_;
}

std::vector<int32_t> FreeBlockQueue::to_vector() const {
  std::vector<int32_t> out;
  out.reserve(static_cast<size_t>(size_));
  for (int32_t id = head_; id >= 0; id = (*blocks_)[static_cast<size_t>(id)].next) out.push_back(id);
  return out;
}

BlockPool::BlockPool(int32_t num_blocks, int32_t block_size)
    : block_size_(block_size), blocks_(static_cast<size_t>(num_blocks)), free_queue_(&blocks_) {
  index_.reserve(static_cast<size_t>(num_blocks));
  for (int32_t i = 0; i < num_blocks; ++i) {
    blocks_[static_cast<size_t>(i)].id = i;
    free_queue_.push_back(i);
  }
}

int32_t BlockPool::allocate() {
  const int32_t id = free_queue_.pop_front();
  KVBlock& b = blocks_[static_cast<size_t>(id)];
  if (b.cached) evict_hash(b);
  b.ref_count = 1;
  return id;
}

void BlockPool::acquire(int32_t id) {
  KVBlock& b = blocks_[static_cast<size_t>(id)];
  if (b.ref_count == 0) free_queue_.remove(id);
  ++b.ref_count;
}

bool BlockPool::release(int32_t id) {
  KVBlock& b = blocks_[static_cast<size_t>(id)];
  if (b.ref_count <= 0) throw std::logic_error("release of free block " + std::to_string(id));
  if (--b.ref_count > 0) return false;
  free_queue_.push_back(id);
  return true;
}

int32_t BlockPool::lookup(const BlockHash& hash, const BlockHash& parent, const int64_t* tokens,
                          uint64_t extra_key) const {
  const auto it = index_.find(hash.hash);
  if (it == index_.end()) return -1;
  const KVBlock& b = blocks_[static_cast<size_t>(it->second)];
  if (b.hash != hash || b.parent_hash != parent || b.extra_key != extra_key) return -1;
  if (!std::equal(b.token_ids.begin(), b.token_ids.end(), tokens)) return -1;
  return b.id;
}

bool BlockPool::register_block(int32_t id, const BlockHash& hash, const BlockHash& parent,
                               const int64_t* tokens, uint64_t extra_key) {
  KVBlock& b = blocks_[static_cast<size_t>(id)];
  if (b.cached) return false;
  if (!index_.emplace(hash.hash, id).second) return false;
  b.cached = true;
  b.hash = hash;
  b.parent_hash = parent;
  b.extra_key = extra_key;
  b.token_ids.assign(tokens, tokens + block_size_);
  return true;
}

void BlockPool::reset_prefix_cache() {
  for (auto& kv : index_) {
    KVBlock& b = blocks_[static_cast<size_t>(kv.second)];
    b.cached = false;
    b.token_ids.clear();
  }
  index_.clear();
}

void BlockPool::uncache(int32_t id) {
  KVBlock& b = blocks_[static_cast<size_t>(id)];
  if (b.cached) evict_hash(b);
}

int32_t BlockPool::indexed_block(uint64_t hash) const {
  const auto it = index_.find(hash);
  return it == index_.end() ? -1 : it->second;
}

void BlockPool::evict_hash(KVBlock& b) {
  const auto it = index_.find(b.hash.hash);
  if (it != index_.end() && it->second == b.id) index_.erase(it);
  b.cached = false;
  b.token_ids.clear();
}

}  // namespace pagellm
