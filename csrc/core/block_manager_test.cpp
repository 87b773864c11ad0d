#include "core/block_manager.h"

#include <gtest/gtest.h>

#include <numeric>
#include <stdexcept>
#include <vector>

namespace pagellm {
namespace {

std::vector<int64_t> seq_tokens(int64_t start, int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), start);
  return v;
}

// Allocates the whole remaining prompt of `t` for `id` (after its cached prefix); returns handle.
BlockManager::Handle alloc_all(BlockManager& bm, const std::string& id, const std::vector<int64_t>& t,
                               int32_t lookahead = 0) {
  const PrefixMatch m = bm.find_cached_prefix(t.data(), static_cast<int64_t>(t.size()), 0);
  return bm.allocate(id, m, static_cast<int64_t>(t.size()) - m.num_tokens(bm.block_size()), lookahead, 0);
}

TEST(BlockManager, RejectsBadConfig) {
  EXPECT_THROW(BlockManager(0, 16), std::invalid_argument);
  EXPECT_THROW(BlockManager(8, 3), std::invalid_argument);
  EXPECT_THROW(BlockManager(8, 512), std::invalid_argument);
  EXPECT_THROW(BlockManager(8, 0), std::invalid_argument);
  EXPECT_THROW(BlockManager(8, 16, true, 1.0), std::invalid_argument);
  EXPECT_THROW(BlockManager(8, 16, true, -0.1), std::invalid_argument);
  EXPECT_NO_THROW(BlockManager(1, 1));
  EXPECT_NO_THROW(BlockManager(1, 256));
}

TEST(BlockManager, AllocateAndFree) {
  BlockManager bm(10, 4, true, 0.0);
  const auto t = seq_tokens(0, 10);  // 3 blocks
  const auto h = alloc_all(bm, "a", t);
  ASSERT_GE(h, 0);
  EXPECT_EQ(bm.block_table(h).size(), 3u);
  EXPECT_EQ(bm.num_free_blocks(), 7);
  EXPECT_DOUBLE_EQ(bm.usage(), 0.3);
  EXPECT_EQ(bm.num_tail_waste_slots(), 2);
  EXPECT_THROW(alloc_all(bm, "a", t), std::invalid_argument);  // duplicate id
  EXPECT_TRUE(bm.free("a"));
  EXPECT_FALSE(bm.free("a"));  // idempotent
  EXPECT_EQ(bm.num_free_blocks(), 10);
}

TEST(BlockManager, WatermarkAppliesToAdmissionOnly) {
  BlockManager bm(10, 4, false, 0.2);  // 2 watermark blocks
  EXPECT_EQ(bm.watermark_blocks(), 2);
  const auto h = alloc_all(bm, "a", seq_tokens(0, 28));  // 7 blocks, 3 left
  ASSERT_GE(h, 0);
  const auto t = seq_tokens(0, 8);  // 2 more would leave 1 < 2
  const PrefixMatch m = bm.find_cached_prefix(t.data(), 8, 0);
  EXPECT_FALSE(bm.can_allocate(m, 8, 0));
  EXPECT_EQ(bm.allocate("b", m, 8, 0, 0), -1);
  EXPECT_EQ(bm.num_free_blocks(), 3);
  // Growth of a running sequence may dig into the watermark.
  EXPECT_TRUE(bm.append_slots(h, 28, 12, 0));
  EXPECT_EQ(bm.num_free_blocks(), 0);
  EXPECT_FALSE(bm.append_slots(h, 40, 1, 0));
  EXPECT_EQ(bm.block_table(h).size(), 10u);
}

TEST(BlockManager, PrefixCacheReusesFullBlocksButNeverTheLastToken) {
  BlockManager bm(16, 4, true, 0.0);
  const auto t = seq_tokens(100, 12);  // exactly 3 full blocks
  const auto a = alloc_all(bm, "a", t);
  bm.cache_full_blocks(a, t.data(), 12);
  EXPECT_EQ(bm.num_cached_blocks(), 3);
  // Same prompt: the last block holds the final token, so only 2 blocks are reused.
  const PrefixMatch m = bm.find_cached_prefix(t.data(), 12, 0);
  EXPECT_EQ(m.blocks.size(), 2u);
  const auto b = alloc_all(bm, "b", t);
  const auto& ta = bm.block_table(a);
  const auto& tb = bm.block_table(b);
  EXPECT_EQ(tb[0], ta[0]);
  EXPECT_EQ(tb[1], ta[1]);
  EXPECT_NE(tb[2], ta[2]);
  EXPECT_EQ(bm.pool().block(ta[0]).ref_count, 2);
  EXPECT_EQ(bm.prefix_cache_queries(), 24);
  EXPECT_EQ(bm.prefix_cache_hits(), 8);
  // Different extra key: no hit.
  EXPECT_TRUE(bm.find_cached_prefix(t.data(), 12, 5).blocks.empty());
  // Longer prompt sharing the prefix gets all 3 blocks.
  auto longer = t;
  longer.push_back(1);
  EXPECT_EQ(bm.find_cached_prefix(longer.data(), 13, 0).blocks.size(), 3u);
}

TEST(BlockManager, FreedCachedBlocksAreRevivedAndTailEvictedFirst) {
  BlockManager bm(4, 2, true, 0.0);
  const auto t = seq_tokens(0, 7);  // 4 blocks, 3 full-and-computed
  const auto a = alloc_all(bm, "a", t);
  bm.cache_full_blocks(a, t.data(), 6);
  const std::vector<int32_t> table = bm.block_table(a);
  bm.free("a");
  EXPECT_EQ(bm.num_free_blocks(), 4);
  EXPECT_EQ(bm.num_cached_blocks(), 3);
  // Reverse order: tail block first in line for eviction.
  EXPECT_EQ(bm.pool().free_queue().to_vector(), (std::vector<int32_t>{table[3], table[2], table[1], table[0]}));
  const auto b = alloc_all(bm, "b", t);
  ASSERT_GE(b, 0);
  EXPECT_EQ(bm.block_table(b)[0], table[0]);
  EXPECT_EQ(bm.block_table(b)[2], table[2]);
  EXPECT_EQ(bm.prefix_cache_hits(), 6);
}

TEST(BlockManager, ForkSharesAndCopyOnWriteOnPartialBlock) {
  BlockManager bm(8, 4, true, 0.0);
  const auto t = seq_tokens(0, 6);  // blocks: [full][2 of 4]
  const auto p = alloc_all(bm, "p", t);
  const auto c = bm.fork(p, "c");
  const std::vector<int32_t> shared = bm.block_table(p);
  EXPECT_EQ(bm.block_table(c), shared);
  EXPECT_EQ(bm.pool().block(shared[1]).ref_count, 2);
  // Parent writes position 6 into the shared partial block -> copy-on-write.
  ASSERT_TRUE(bm.append_slots(p, 6, 1, 0));
  EXPECT_EQ(bm.block_table(p)[0], shared[0]);  // full block stays shared
  EXPECT_NE(bm.block_table(p)[1], shared[1]);
  ASSERT_EQ(bm.pending_cow_copies().size(), 1u);
  EXPECT_EQ(bm.pending_cow_copies()[0], std::make_pair(shared[1], bm.block_table(p)[1]));
  // Child now owns the old block alone: writes in place, no copy.
  ASSERT_TRUE(bm.append_slots(c, 6, 1, 0));
  EXPECT_EQ(bm.block_table(c)[1], shared[1]);
  const auto copies = bm.take_cow_copies();
  EXPECT_EQ(copies.size(), 1u);
  EXPECT_EQ(bm.pool().block(shared[1]).ref_count, 1);
  EXPECT_TRUE(bm.pending_cow_copies().empty());
  bm.free("p");
  bm.free("c");
  EXPECT_EQ(bm.num_free_blocks(), 8);
}

TEST(BlockManager, CopySourcePinnedAndCancelledCopyReleased) {
  BlockManager bm(6, 4, false, 0.0);
  const auto t = seq_tokens(0, 2);
  const auto p = alloc_all(bm, "p", t);
  bm.fork(p, "c");
  const int32_t src = bm.block_table(p)[0];
  ASSERT_TRUE(bm.append_slots(p, 2, 1, 0));
  bm.free("c");  // src still pinned by the pending copy
  EXPECT_EQ(bm.pool().block(src).ref_count, 1);
  bm.free("p");  // its copy destination is gone: the copy is cancelled, src released
  EXPECT_TRUE(bm.pending_cow_copies().empty());
  EXPECT_EQ(bm.num_free_blocks(), 6);
}

TEST(BlockManager, AppendFailsAtomically) {
  BlockManager bm(3, 4, false, 0.0);
  const auto p = alloc_all(bm, "p", seq_tokens(0, 6));  // 2 blocks
  bm.fork(p, "c");
  // Needs 1 CoW block + 2 new blocks, only 1 free.
  EXPECT_FALSE(bm.append_slots(p, 6, 6, 0));
  EXPECT_EQ(bm.num_free_blocks(), 1);
  EXPECT_TRUE(bm.pending_cow_copies().empty());
}

TEST(BlockManager, LookaheadAndShrink) {
  BlockManager bm(16, 4, false, 0.0);
  const auto h = alloc_all(bm, "a", seq_tokens(0, 5), 7);  // 12 slots -> 3 blocks
  EXPECT_EQ(bm.block_table(h).size(), 3u);
  EXPECT_EQ(bm.num_tail_waste_slots(), 0);
  bm.shrink(h, 6);
  EXPECT_EQ(bm.block_table(h).size(), 2u);
  EXPECT_EQ(bm.num_tail_waste_slots(), 2);
  EXPECT_EQ(bm.num_free_blocks(), 14);
}

TEST(BlockManager, ResetPrefixCacheDropsEveryHash) {
  BlockManager bm(8, 2, true, 0.0);
  const auto t = seq_tokens(0, 5);
  const auto a = alloc_all(bm, "a", t);
  bm.cache_full_blocks(a, t.data(), 4);
  EXPECT_EQ(bm.num_cached_blocks(), 2);
  EXPECT_TRUE(bm.reset_prefix_cache());
  EXPECT_EQ(bm.num_cached_blocks(), 0);
  EXPECT_TRUE(bm.find_cached_prefix(t.data(), 5, 0).blocks.empty());
}

TEST(BlockManager, DisabledPrefixCachingNeverMatches) {
  BlockManager bm(8, 2, false, 0.0);
  const auto t = seq_tokens(0, 5);
  const auto a = alloc_all(bm, "a", t);
  bm.cache_full_blocks(a, t.data(), 4);
  EXPECT_EQ(bm.num_cached_blocks(), 0);
  EXPECT_TRUE(bm.find_cached_prefix(t.data(), 5, 0).blocks.empty());
}

}  // namespace
}  // namespace pagellm
