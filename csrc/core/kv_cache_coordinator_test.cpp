// KVCacheCoordinator (a hybrid cache: one BlockManager per group, one block table per request in each)
// and the scheduler over it: lockstep tables, all-or-nothing admission and growth, a prefix hit that is
// the minimum over groups, copy-on-write pairs naming their group, preemption when any group runs out.
#include <gtest/gtest.h>

#include <numeric>
#include <stdexcept>
#include <vector>

#include "core/kv_cache_coordinator.h"
#include "core/scheduler.h"

namespace pagellm {
namespace {

constexpr int32_t kBs = 4;
constexpr int32_t kWindow = 8;

std::vector<int64_t> seq_tokens(int64_t start, int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), start);
  return v;
}

// Group 0: full attention; group 1: a window of 8 tokens.
KVCacheCoordinator make_hybrid(int32_t full_blocks, int32_t sliding_blocks) {
  return KVCacheCoordinator({{full_blocks, 0}, {sliding_blocks, kWindow}}, kBs, true, 0.0);
}

// Runs a whole sequence through in chunks of `chunk` tokens, as the scheduler would; returns its handle.
KVCacheCoordinator::Handle run_through(KVCacheCoordinator& kv, const std::string& id, const std::vector<int64_t>& t,
                                       int64_t chunk) {
  const int64_t n = static_cast<int64_t>(t.size());
  const HybridPrefixMatch m = kv.find_cached_prefix(t.data(), n, 0);
  int64_t computed = m.num_tokens(kBs);
  int64_t step = std::min(chunk, n - computed);
  const auto h = kv.allocate(id, m, step, 0, 0);
  EXPECT_GE(h, 0);
  while (true) {
    computed += step;
    kv.cache_full_blocks(h, t.data(), computed);
    kv.drop_outside_window(h, computed);
    if (computed == n) return h;
    step = std::min(chunk, n - computed);
    EXPECT_TRUE(kv.append_slots(h, computed, step, 0));
  }
}

TEST(KVCacheCoordinator, RejectsBadGroups) {
  EXPECT_THROW(KVCacheCoordinator({}, kBs, true, 0.0), std::invalid_argument);
  EXPECT_THROW(KVCacheCoordinator({{8, 0}, {1, 8}}, kBs, true, 0.0), std::invalid_argument);  // only the null block
  EXPECT_THROW(KVCacheCoordinator({{8, 0}, {8, -1}}, kBs, true, 0.0), std::invalid_argument);
  CacheConfig c;
  c.extra_groups = {{1, 8}};
  EXPECT_THROW(c.validate(), std::invalid_argument);
  c.extra_groups = {{2, 8}};
  EXPECT_NO_THROW(c.validate());
  EXPECT_EQ(c.groups().size(), 2u);
}

TEST(KVCacheCoordinator, OneTablePerGroupOnlyTheSlidingGroupFrees) {
  auto kv = make_hybrid(32, 12);
  ASSERT_EQ(kv.num_groups(), 2u);
  EXPECT_EQ(kv.group(0).null_block(), -1);
  EXPECT_EQ(kv.group(1).null_block(), 0);
  const auto t = seq_tokens(100, 30);
  const auto h = run_through(kv, "a", t, 4);
  const auto& full = kv.block_table(h, 0);
  const auto& sliding = kv.block_table(h, 1);
  ASSERT_EQ(full.size(), 8u);
  ASSERT_EQ(sliding.size(), full.size());  // same length: slot = table[pos / block_size] in every group
  EXPECT_EQ(kv.group(0).num_live_blocks(h), 8);
  // The next query (position 30) reads keys 23..30: blocks 5..7 of the sliding group.
  EXPECT_EQ(kv.group(1).num_live_blocks(h), 3);
  for (size_t j = 0; j < 5; ++j) EXPECT_EQ(sliding[j], kv.group(1).null_block());
  EXPECT_EQ(kv.group(0).num_free_blocks(), 32 - 8);
  EXPECT_EQ(kv.group(1).num_free_blocks(), 11 - 3);
  EXPECT_EQ(kv.num_free_blocks(), 24 + 8);
  EXPECT_TRUE(kv.free(h));
  EXPECT_FALSE(kv.free(h));
  EXPECT_EQ(kv.group(0).num_free_blocks(), 32);
  EXPECT_EQ(kv.group(1).num_free_blocks(), 11);
  EXPECT_DOUBLE_EQ(kv.usage(), 0.0);
}

TEST(KVCacheCoordinator, AdmissionNeedsEveryGroup) {
  auto kv = make_hybrid(32, 4);  // the sliding group has 3 usable blocks
  const auto t = seq_tokens(0, 16);
  const HybridPrefixMatch m = kv.find_cached_prefix(t.data(), 16, 0);
  EXPECT_FALSE(kv.can_allocate(m, 16, 0));  // 4 blocks: the full group has them, the sliding one does not
  EXPECT_EQ(kv.allocate("a", m, 16, 0, 0), -1);
  EXPECT_EQ(kv.group(0).num_free_blocks(), 32);  // nothing taken from the group that had room
  EXPECT_EQ(kv.group(0).num_seqs(), 0);
  EXPECT_EQ(kv.group(1).num_seqs(), 0);
  EXPECT_THROW(kv.allocate("a", m, -1, 0, 0), std::invalid_argument);
  const auto h = kv.allocate("a", m, 12, 0, 0);
  ASSERT_GE(h, 0);
  EXPECT_THROW(kv.allocate("a", m, 1, 0, 0), std::invalid_argument);  // a live id
  // Growing by one block fails in the sliding group (nothing dropped yet: 12 computed tokens keep blocks 1..2
  // only after update) and changes neither group.
  EXPECT_FALSE(kv.append_slots(h, 0, 13, 0));
  EXPECT_EQ(kv.block_table(h, 0).size(), 3u);
  EXPECT_EQ(kv.group(0).num_free_blocks(), 29);
  kv.cache_full_blocks(h, t.data(), 12);
  kv.drop_outside_window(h, 12);  // keys 5.. are read next: block 0 leaves the sliding group
  EXPECT_TRUE(kv.append_slots(h, 12, 4, 0));
  EXPECT_EQ(kv.block_table(h, 1).size(), 4u);
  EXPECT_EQ(kv.group(1).num_live_blocks(h), 3);
}

TEST(KVCacheCoordinator, PrefixHitIsTheMinimumOverGroups) {
  auto kv = make_hybrid(64, 6);  // the sliding pool is small: its old blocks get evicted, the full ones stay
  const auto a = seq_tokens(0, 40);
  const auto ha = run_through(kv, "a", a, 4);
  kv.free(ha);
  // A query sharing all of a: both groups hit 10 blocks (the sliding one needs only blocks 8..9).
  auto q = a;
  q.push_back(999);
  HybridPrefixMatch m = kv.find_cached_prefix(q.data(), 41, 0);
  ASSERT_EQ(m.groups.size(), 2u);
  EXPECT_EQ(m.num_tokens(kBs), 40);
  EXPECT_EQ(m.groups[1].blocks.size(), 10u);
  EXPECT_EQ(m.groups[1].blocks[0], kv.group(1).null_block());
  // A query sharing a's first 18 tokens: the full group hits 4 blocks, the sliding group's blocks 2..3 were
  // evicted, so neither hit is used past what both have.
  std::vector<int64_t> p(a.begin(), a.begin() + 18);
  p.push_back(-5);
  const int64_t full_alone = kv.group(0).find_cached_prefix(p.data(), 19, 0).num_tokens(kBs);
  const int64_t sliding_alone = kv.group(1).find_cached_prefix(p.data(), 19, 0).num_tokens(kBs);
  EXPECT_EQ(full_alone, 16);
  EXPECT_LT(sliding_alone, full_alone);
  m = kv.find_cached_prefix(p.data(), 19, 0);
  EXPECT_EQ(m.num_tokens(kBs), sliding_alone);
  EXPECT_EQ(m.groups[0].blocks.size(), m.groups[1].blocks.size());
  const auto hp = kv.allocate("p", m, 19 - m.num_tokens(kBs), 0, 0);
  ASSERT_GE(hp, 0);
  EXPECT_EQ(kv.block_table(hp, 0).size(), kv.block_table(hp, 1).size());
  EXPECT_EQ(kv.prefix_cache_hits(), sliding_alone);  // the 41-token query was only looked up
}

TEST(KVCacheCoordinator, CopyOnWriteNamesItsGroup) {
  auto kv = make_hybrid(16, 8);
  const auto t = seq_tokens(0, 6);
  const HybridPrefixMatch m = kv.find_cached_prefix(t.data(), 6, 0);
  const auto p = kv.allocate("p", m, 6, 0, 0);
  kv.cache_full_blocks(p, t.data(), 6);
  const auto c = kv.fork(p, "c");
  EXPECT_EQ(kv.block_table(c, 0), kv.block_table(p, 0));
  EXPECT_EQ(kv.block_table(c, 1), kv.block_table(p, 1));
  ASSERT_TRUE(kv.append_slots(c, 6, 1, 0));  // block 1 (tokens 4..5 valid) is shared: copied in both groups
  const auto copies = kv.take_cow_copies();
  ASSERT_EQ(copies.size(), 2u);
  EXPECT_EQ(copies[0].group, 0);
  EXPECT_EQ(copies[1].group, 1);
  EXPECT_EQ(copies[0].src, kv.block_table(p, 0)[1]);
  EXPECT_EQ(copies[0].dst, kv.block_table(c, 0)[1]);
  EXPECT_EQ(copies[1].src, kv.block_table(p, 1)[1]);
  EXPECT_EQ(copies[1].dst, kv.block_table(c, 1)[1]);
  EXPECT_TRUE(kv.take_cow_copies().empty());
  kv.free(p);
  kv.free(c);
  EXPECT_EQ(kv.group(0).num_free_blocks(), 16);
  EXPECT_EQ(kv.group(1).num_free_blocks(), 7);
}

// The scheduler over a hybrid cache: tables and slot mappings per group; the small sliding group, not the
// roomy full one, forces preemption; admission refuses a prompt one group can never hold.
TEST(HybridScheduler, TablesPerGroupAndPreemptionByAnyGroup) {
  SchedulerConfig c;
  c.max_num_seqs = 4;
  c.max_num_batched_tokens = 64;
  c.max_model_len = 64;
  CacheConfig k;
  k.num_blocks = 64;
  k.block_size = kBs;
  k.watermark = 0.0;
  k.extra_groups = {{6, kWindow}};  // 5 usable: a prompt of 16 tokens takes 4 there
  Scheduler s(c, k);
  EXPECT_THROW(s.add_request("big", seq_tokens(0, 28), 0.0), std::invalid_argument);  // 7 sliding blocks at once
  s.add_request("a", seq_tokens(0, 16), 0.0);
  s.add_request("b", seq_tokens(100, 4), 1.0);
  auto out = s.schedule();
  ASSERT_EQ(out->num_reqs(), 2);
  ASSERT_EQ(out->request_ids[0], "a");
  ASSERT_EQ(out->group_block_tables.size(), 1u);
  ASSERT_EQ(out->group_slot_mappings.size(), 1u);
  ASSERT_EQ(out->group_block_tables[0].size(), out->block_tables.size());
  const auto ha = s.get_request("a").seq_handle();
  for (int64_t p = 0; p < 16; ++p) {
    EXPECT_EQ(out->slot_mapping[p], s.kv_cache().block_table(ha, 0)[p / kBs] * kBs + p % kBs);
    EXPECT_EQ(out->group_slot_mappings[0][p], s.kv_cache().block_table(ha, 1)[p / kBs] * kBs + p % kBs);
    EXPECT_EQ(out->group_block_tables[0][p / kBs], s.kv_cache().block_table(ha, 1)[p / kBs]);
  }
  std::vector<int32_t> n{1, 1};
  std::vector<int64_t> tok{7, 8};
  s.update(out->step_id, n.data(), 2, tok.data(), 2, {});
  EXPECT_EQ(s.kv_cache().group(1).num_live_blocks(ha), 2);  // keys 9.. from now on: blocks 2..3
  EXPECT_EQ(s.kv_cache().group(0).num_live_blocks(ha), 4);
  // Decoding, b reaches a new block when the sliding group has none left (a took the last one): b, the
  // latest arrival, is preempted though the full group has 58 blocks free.
  int64_t preempted = 0;
  for (int step = 0; step < 8 && preempted == 0; ++step) {
    out = s.schedule();
    preempted += static_cast<int64_t>(out->preempted_request_ids.size());
    std::vector<int32_t> ones(static_cast<size_t>(out->num_reqs()), 1);
    std::vector<int64_t> toks(static_cast<size_t>(out->num_reqs()), 5);
    s.update(out->step_id, ones.data(), out->num_reqs(), toks.data(), out->num_reqs(), {});
  }
  EXPECT_GT(preempted, 0);
  EXPECT_GT(s.kv_cache().group(0).num_free_blocks(), 40);  // the full group never ran short
  s.abort("a");
  s.abort("b");
  EXPECT_EQ(s.kv_cache().group(0).num_free_blocks(), 64);
  EXPECT_EQ(s.kv_cache().group(1).num_free_blocks(), 5);
}

}  // namespace
}  // namespace pagellm
