// BlockManager with a sliding window: the null block, dropping blocks that left the window, window-bounded
// admission and prefix hits found from the right.
#include <gtest/gtest.h>

#include <numeric>
#include <stdexcept>
#include <vector>

#include "core/block_manager.h"

namespace pagellm {
namespace {

std::vector<int64_t> seq_tokens(int64_t start, int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), start);
  return v;
}

// Allocates the prompt after its cached prefix; returns the handle (-1 if it does not fit).
BlockManager::Handle alloc_all(BlockManager& bm, const std::string& id, const std::vector<int64_t>& t) {
  const PrefixMatch m = bm.find_cached_prefix(t.data(), static_cast<int64_t>(t.size()), 0);
  return bm.allocate(id, m, static_cast<int64_t>(t.size()) - m.num_tokens(bm.block_size()), 0, 0);
}

// What the scheduler does after a step that brought a sequence to num_computed tokens.
void finish_step(BlockManager& bm, BlockManager::Handle h, const std::vector<int64_t>& t, int64_t num_computed) {
  bm.cache_full_blocks(h, t.data(), num_computed);
  bm.drop_outside_window(h, num_computed);
}

TEST(SlidingWindow, RejectsBadConfig) {
  EXPECT_THROW(BlockManager(8, 4, true, 0.0, -1), std::invalid_argument);
  EXPECT_THROW(BlockManager(1, 4, true, 0.0, 8), std::invalid_argument);  // nothing left beside the null block
  EXPECT_NO_THROW(BlockManager(2, 4, true, 0.0, 8));
}

TEST(SlidingWindow, FullAttentionReservesNothing) {
  BlockManager bm(10, 4);
  EXPECT_EQ(bm.null_block(), -1);
  EXPECT_EQ(bm.num_reserved_blocks(), 0);
  EXPECT_EQ(bm.num_free_blocks(), 10);
  EXPECT_EQ(bm.first_live_block(1000), 0);
  EXPECT_EQ(bm.max_live_blocks(1000, 1), 250);
}

TEST(SlidingWindow, DecodeHoldsAtMostTheWindowsBlocks) {
  const int32_t window = 6, bs = 4;
  BlockManager bm(20, bs, true, 0.0, window);
  ASSERT_EQ(bm.null_block(), 0);
  EXPECT_EQ(bm.num_free_blocks(), 19);
  EXPECT_DOUBLE_EQ(bm.usage(), 0.0);
  auto t = seq_tokens(0, 10);
  const auto h = alloc_all(bm, "a", t);
  ASSERT_GE(h, 0);
  finish_step(bm, h, t, 10);  // the next query (position 10) reads keys 5..10: block 0 is gone
  ASSERT_EQ(bm.block_table(h).size(), 3u);
  EXPECT_EQ(bm.block_table(h)[0], bm.null_block());
  EXPECT_EQ(bm.num_live_blocks(h), 2);
  EXPECT_EQ(bm.num_free_blocks(), 17);
  EXPECT_EQ(bm.num_cached_blocks(), 2);  // the dropped block stays findable
  const int64_t bound = (window + bs - 1) / bs + 1;
  for (int64_t computed = 10; computed < 200; ++computed) {
    t.push_back(1000 + computed);
    ASSERT_TRUE(bm.append_slots(h, computed, 1, 0)) << computed;
    finish_step(bm, h, t, computed + 1);
    ASSERT_LE(bm.num_live_blocks(h), bound) << computed;
    ASSERT_EQ(static_cast<int64_t>(bm.block_table(h).size()), (computed + 1 + bs - 1) / bs);
    for (int64_t j = 0; j < bm.first_live_block(computed + 1); ++j) ASSERT_EQ(bm.block_table(h)[j], bm.null_block());
  }
  EXPECT_EQ(bm.num_free_blocks(), 19 - bm.num_live_blocks(h));
  EXPECT_TRUE(bm.free(h));
  EXPECT_EQ(bm.num_free_blocks(), 19);
  EXPECT_EQ(bm.pool().block(bm.null_block()).ref_count, 1);  // held by the manager, never freed
}

TEST(SlidingWindow, AdmissionCountsOnlyTheWindow) {
  BlockManager bm(8, 4, false, 0.0, 6);
  EXPECT_EQ(bm.max_live_blocks(1000, 1), 3);     // decode: ceil(6 / 4) + 1
  EXPECT_EQ(bm.max_live_blocks(1000, 16), 7);    // a 16-token chunk plus the 5 keys before it
  EXPECT_EQ(bm.max_live_blocks(8, 8), 2);        // never more than the whole sequence
  // 7 free blocks serve a 200-token sequence when it arrives in chunks of 8.
  auto t = seq_tokens(0, 200);
  const PrefixMatch none;
  const auto h = bm.allocate("a", none, 8, 0, 0);
  ASSERT_GE(h, 0);
  for (int64_t c = 8; c < 200; c += 8) {
    bm.drop_outside_window(h, c);
    ASSERT_TRUE(bm.append_slots(h, c, 8, 0)) << c;
  }
  EXPECT_LE(bm.num_live_blocks(h), 4);
}

TEST(SlidingWindow, PrefixHitNeedsOnlyTheWindowsBlocks) {
  BlockManager bm(20, 4, true, 0.0, 6);  // ids 1..19 free, in order
  const auto t = seq_tokens(0, 24);
  const auto a = alloc_all(bm, "a", t);  // ids 1..6
  ASSERT_GE(a, 0);
  finish_step(bm, a, t, 24);             // drops indices 0..3 (ids 1..4), still cached
  ASSERT_TRUE(bm.free(a));
  // Take the 13 never-used blocks and then id 1, evicting block index 0 of "a"'s prompt.
  const PrefixMatch none;
  ASSERT_GE(bm.allocate("filler", none, 56, 0, 0), 0);
  ASSERT_EQ(bm.pool().block(1).ref_count, 1);
  auto t2 = t;
  t2.push_back(99);
  const PrefixMatch m = bm.find_cached_prefix(t2.data(), 25, 0);
  // Position 24 reads keys 19..24: blocks 4 and 5 (ids 5, 6) are all it needs.
  ASSERT_EQ(m.blocks, (std::vector<int32_t>{0, 0, 0, 0, 5, 6}));
  EXPECT_EQ(m.num_tokens(4), 24);
  EXPECT_TRUE(bm.can_allocate(m, 1, 0));
  const auto b = bm.allocate("b", m, 1, 0, 0);
  ASSERT_GE(b, 0);
  EXPECT_EQ(bm.num_live_blocks(b), 3);
  EXPECT_EQ(bm.prefix_cache_hits(), 24);
  // Without the window block 0 would have to be cached as well: a shorter prompt finds nothing.
  const auto t3 = seq_tokens(0, 9);  // hit of 2 blocks needs blocks 0..1 (position 8 reads keys 3..8)
  EXPECT_TRUE(bm.find_cached_prefix(t3.data(), 9, 0).blocks.empty());
  EXPECT_TRUE(bm.free(b));
  EXPECT_TRUE(bm.free("filler"));
  EXPECT_EQ(bm.num_free_blocks(), 19);
}

TEST(SlidingWindow, ForkAndCopyOnWriteKeepTheNullEntries) {
  BlockManager bm(20, 4, true, 0.0, 5);
  auto t = seq_tokens(0, 14);
  const auto p = alloc_all(bm, "p", t);
  finish_step(bm, p, t, 13);  // decode-ready: 13 computed, 14 tokens; drops block 0 and 1 (keys >= 9)
  ASSERT_EQ(bm.num_live_blocks(p), 2);
  const auto c = bm.fork(p, "c");
  EXPECT_EQ(bm.block_table(c), bm.block_table(p));
  EXPECT_EQ(bm.seq(c).num_dropped, 2);
  // Both write position 13 of the shared partial block 3: the child copies it.
  ASSERT_TRUE(bm.append_slots(p, 13, 1, 0));
  ASSERT_TRUE(bm.append_slots(c, 13, 1, 0));
  const auto copies = bm.take_cow_copies();
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_NE(bm.block_table(c)[3], bm.block_table(p)[3]);
  EXPECT_EQ(bm.block_table(c)[0], bm.null_block());
  t.push_back(7);
  finish_step(bm, c, t, 14);
  EXPECT_TRUE(bm.free(p));
  EXPECT_TRUE(bm.free(c));
  EXPECT_EQ(bm.num_free_blocks(), 19);
}

}  // namespace
}  // namespace pagellm
