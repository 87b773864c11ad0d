#include "core/block_pool.h"

#include <gtest/gtest.h>

#include <numeric>
#include <stdexcept>
#include <vector>

namespace pagellm {
namespace {

std::vector<int64_t> tokens(int64_t start, int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), start);
  return v;
}

TEST(FreeBlockQueue, FifoOrderAndMiddleRemoval) {
  std::vector<KVBlock> blocks(5);
  for (int i = 0; i < 5; ++i) blocks[i].id = i;
  FreeBlockQueue q(&blocks);
  for (int i = 0; i < 5; ++i) q.push_back(i);
  EXPECT_EQ(q.size(), 5);
  q.remove(2);  // middle
  q.remove(0);  // head
  q.remove(4);  // tail
  EXPECT_EQ(q.to_vector(), (std::vector<int32_t>{1, 3}));
  q.push_back(0);
  EXPECT_EQ(q.pop_front(), 1);
  EXPECT_EQ(q.pop_front(), 3);
  EXPECT_EQ(q.pop_front(), 0);
  EXPECT_EQ(q.size(), 0);
  EXPECT_EQ(q.front(), -1);
  EXPECT_THROW(q.pop_front(), std::logic_error);
  EXPECT_THROW(q.remove(1), std::logic_error);
  q.push_back(1);
  EXPECT_THROW(q.push_back(1), std::logic_error);
}

TEST(BlockPool, AllocatesLeastRecentlyFreedFirst) {
  BlockPool pool(4, 16);
  EXPECT_EQ(pool.num_free_blocks(), 4);
  const int32_t a = pool.allocate(), b = pool.allocate(), c = pool.allocate();
  EXPECT_EQ(pool.num_free_blocks(), 1);
  EXPECT_EQ(pool.block(a).ref_count, 1);
  EXPECT_TRUE(pool.release(b));
  EXPECT_TRUE(pool.release(a));
  // queue: [3 (never used), b, a]
  EXPECT_EQ(pool.allocate(), 3);
  EXPECT_EQ(pool.allocate(), b);
  EXPECT_EQ(pool.allocate(), a);
  EXPECT_THROW(pool.allocate(), std::logic_error);
  (void)c;
}

TEST(BlockPool, RefCountingAndRevival) {
  BlockPool pool(2, 4);
  const int32_t a = pool.allocate();
  pool.acquire(a);
  EXPECT_EQ(pool.block(a).ref_count, 2);
  EXPECT_FALSE(pool.release(a));
  EXPECT_TRUE(pool.release(a));
  EXPECT_THROW(pool.release(a), std::logic_error);
  EXPECT_EQ(pool.num_free_blocks(), 2);
  pool.acquire(a);  // revive a free block: leaves the free queue
  EXPECT_EQ(pool.num_free_blocks(), 1);
  EXPECT_FALSE(pool.block(a).in_free_queue);
}

TEST(BlockPool, HashIndexVerifiesContent) {
  BlockPool pool(3, 4);
  const auto t = tokens(10, 4);
  const BlockHash h = hash_block_tokens(BlockHash{}, t.data(), 4, 0);
  const int32_t a = pool.allocate();
  EXPECT_TRUE(pool.register_block(a, h, BlockHash{}, t.data(), 0));
  EXPECT_EQ(pool.num_cached_blocks(), 1);
  EXPECT_EQ(pool.lookup(h, BlockHash{}, t.data(), 0), a);
  // Same hash key, different content / parent / extra key: never a hit.
  const auto other = tokens(11, 4);
  EXPECT_EQ(pool.lookup(h, BlockHash{}, other.data(), 0), -1);
  EXPECT_EQ(pool.lookup(h, BlockHash{1, 2}, t.data(), 0), -1);
  EXPECT_EQ(pool.lookup(h, BlockHash{}, t.data(), 7), -1);
  BlockHash forged = h;
  forged.check ^= 1;
  EXPECT_EQ(pool.lookup(forged, BlockHash{}, t.data(), 0), -1);
  // A second block with the same hash is not indexed; the first stays.
  const int32_t b = pool.allocate();
  EXPECT_FALSE(pool.register_block(b, h, BlockHash{}, t.data(), 0));
  EXPECT_FALSE(pool.block(b).cached);
  EXPECT_EQ(pool.indexed_block(h.hash), a);
}

TEST(BlockPool, FreeCachedBlockStaysFindableUntilEvicted) {
  BlockPool pool(2, 4);
  const auto t = tokens(0, 4);
  const BlockHash h = hash_block_tokens(BlockHash{}, t.data(), 4, 0);
  const int32_t a = pool.allocate();
  pool.register_block(a, h, BlockHash{}, t.data(), 0);
  pool.release(a);
  EXPECT_EQ(pool.lookup(h, BlockHash{}, t.data(), 0), a);
  pool.allocate();            // takes the never-used block first
  const int32_t again = pool.allocate();  // now evicts a
  EXPECT_EQ(again, a);
  EXPECT_EQ(pool.lookup(h, BlockHash{}, t.data(), 0), -1);
  EXPECT_EQ(pool.num_cached_blocks(), 0);
}

TEST(BlockPool, ResetDropsAllHashes) {
  BlockPool pool(2, 2);
  const auto t = tokens(0, 2);
  const BlockHash h = hash_block_tokens(BlockHash{}, t.data(), 2, 0);
  const int32_t a = pool.allocate();
  pool.register_block(a, h, BlockHash{}, t.data(), 0);
  pool.reset_prefix_cache();
  EXPECT_EQ(pool.num_cached_blocks(), 0);
  EXPECT_FALSE(pool.block(a).cached);
  EXPECT_EQ(pool.lookup(h, BlockHash{}, t.data(), 0), -1);
}

TEST(BlockHash, ChainsParentTokensAndExtraKey) {
  const auto t = tokens(0, 8);
  const BlockHash a = hash_block_tokens(BlockHash{}, t.data(), 8, 0);
  EXPECT_EQ(a, hash_block_tokens(BlockHash{}, t.data(), 8, 0));
  EXPECT_NE(a, hash_block_tokens(BlockHash{}, t.data(), 8, 1));
  EXPECT_NE(a, hash_block_tokens(a, t.data(), 8, 0));
  auto u = t;
  u[7] = 99;
  EXPECT_NE(a.hash, hash_block_tokens(BlockHash{}, u.data(), 8, 0).hash);
}

}  // namespace
}  // namespace pagellm
