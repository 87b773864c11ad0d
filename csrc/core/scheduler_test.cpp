#include "core/scheduler.h"

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

namespace pagellm {
namespace {

std::vector<int64_t> seq_tokens(int64_t start, int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), start);
  return v;
}

SchedulerConfig sched_cfg(int32_t budget = 64, int32_t max_seqs = 8, int32_t max_len = 256) {
  SchedulerConfig c;
  c.max_num_batched_tokens = budget;
  c.max_num_seqs = max_seqs;
  c.max_model_len = max_len;
  return c;
}

CacheConfig cache_cfg(int32_t num_blocks = 64, int32_t block_size = 4) {
  CacheConfig c;
  c.num_blocks = num_blocks;
  c.block_size = block_size;
  c.watermark = 0.0;
  return c;
}

// Runs the model "as a stub": every sampling row accepts token 1000 + step.
std::unique_ptr<SchedulerOutput> step(Scheduler& s, std::vector<FinishedRequest> finished = {}) {
  auto out = s.schedule();
  std::vector<int32_t> n(static_cast<size_t>(out->num_reqs()));
  std::vector<int64_t> toks;
  for (int32_t i = 0; i < out->num_reqs(); ++i) {
    n[static_cast<size_t>(i)] = out->do_sample[static_cast<size_t>(i)];
    if (out->do_sample[static_cast<size_t>(i)]) toks.push_back(1000 + static_cast<int64_t>(out->step_id));
  }
  s.update(out->step_id, n.data(), static_cast<int64_t>(n.size()), toks.data(), static_cast<int64_t>(toks.size()), finished);
  return out;
}

TEST(SchedulerConfig, ValidationNamesTheField) {
  SchedulerConfig c;
  c.max_num_seqs = 0;
  try {
    c.validate();
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("max_num_seqs"), std::string::npos);
  }
  SchedulerConfig p;
  p.policy = "lifo";
  EXPECT_THROW(p.validate(), std::invalid_argument);
  CacheConfig k;
  k.block_size = 12;
  EXPECT_THROW(k.validate(), std::invalid_argument);
  k.block_size = 16;
  k.num_blocks = 0;
  EXPECT_THROW(Scheduler(SchedulerConfig(), k), std::invalid_argument);
}

TEST(Scheduler, AddRequestValidationLeavesStateUntouched) {
  Scheduler s(sched_cfg(64, 8, 16), cache_cfg());
  EXPECT_THROW(s.add_request("a", {}, 0.0), std::invalid_argument);
  EXPECT_THROW(s.add_request("a", seq_tokens(0, 17), 0.0), std::invalid_argument);
  s.add_request("a", seq_tokens(0, 16), 0.0);
  EXPECT_THROW(s.add_request("a", seq_tokens(0, 3), 0.0), std::invalid_argument);
  EXPECT_EQ(s.num_waiting(), 1);
  SchedulerConfig c = sched_cfg(8, 8, 64);
  c.enable_chunked_prefill = false;
  Scheduler s2(c, cache_cfg());
  EXPECT_THROW(s2.add_request("x", seq_tokens(0, 9), 0.0), std::invalid_argument);
  EXPECT_FALSE(s2.has_unfinished_requests());
}

TEST(Scheduler, ChunkedPrefillThenDecodesFirst) {
  Scheduler s(sched_cfg(8), cache_cfg());
  s.add_request("long", seq_tokens(0, 20), 0.0);
  auto o1 = step(s);
  ASSERT_EQ(o1->num_reqs(), 1);
  EXPECT_EQ(o1->num_scheduled_tokens[0], 8);
  EXPECT_EQ(o1->do_sample[0], 0);
  EXPECT_TRUE(o1->logits_indices.empty());
  EXPECT_EQ(s.get_request("long").num_computed_tokens(), 8);
  s.add_request("short", seq_tokens(50, 3), 1.0);
  auto o2 = step(s);  // long: 8 more (16), short gets nothing (budget spent)
  EXPECT_EQ(o2->num_reqs(), 1);
  auto o3 = step(s);  // long: last 4 tokens (sample), short: 3 tokens... budget 8 -> 4 + 3
  ASSERT_EQ(o3->num_reqs(), 2);
  EXPECT_EQ(o3->num_scheduled_tokens[0], 4);
  EXPECT_EQ(o3->num_scheduled_tokens[1], 3);
  EXPECT_EQ(o3->num_decode_reqs, 0);
  auto o4 = step(s);  // long decodes (1 token), short decodes
  EXPECT_EQ(o4->num_decode_reqs, 2);
  EXPECT_EQ(o4->total_num_scheduled_tokens, 2);
  // Positions and slots of the long request's decode token.
  const auto& r = s.get_request("long");
  EXPECT_EQ(r.num_output_tokens(), 2);
  EXPECT_EQ(o4->positions[0], 20);
  const int64_t blk = o4->block_tables[static_cast<size_t>(0 * o4->max_blocks_in_batch + 20 / 4)];
  EXPECT_EQ(o4->slot_mapping[0], blk * 4 + 0);
  EXPECT_EQ(o4->input_ids[0], r.output_token_ids()[0]);
  EXPECT_EQ(o4->query_start_loc, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(o4->logits_indices, (std::vector<int64_t>{0, 1}));
}

TEST(Scheduler, DecodesOrderedBeforePrefills) {
  Scheduler s(sched_cfg(64), cache_cfg());
  s.add_request("a", seq_tokens(0, 5), 0.0);
  step(s);
  s.add_request("b", seq_tokens(10, 9), 1.0);
  auto o = step(s);
  ASSERT_EQ(o->num_reqs(), 2);
  EXPECT_EQ(o->request_ids[0], "a");
  EXPECT_EQ(o->request_ids[1], "b");
  EXPECT_EQ(o->num_decode_reqs, 1);
  EXPECT_EQ(o->query_start_loc[2], 10);
}

TEST(Scheduler, PreemptsLatestArrivalWhenBlocksRunOut) {
  // 4 blocks of 4 slots; two requests of 7 tokens take 2 blocks each; growing past 8 needs a block.
  Scheduler s(sched_cfg(64), cache_cfg(4, 4));
  s.add_request("old", seq_tokens(0, 7), 0.0);
  s.add_request("new", seq_tokens(100, 7), 1.0);
  step(s);  // both prefilled: 8 tokens each now (7 + 1 sampled)
  auto o = step(s);  // both decode position 7: still in block 1
  EXPECT_EQ(o->num_reqs(), 2);
  auto o2 = s.schedule();  // position 8 needs a 3rd block for each: only "old" can get it after preempting "new"
  EXPECT_EQ(o2->preempted_request_ids, (std::vector<std::string>{"new"}));
  ASSERT_EQ(o2->num_reqs(), 1);
  EXPECT_EQ(o2->request_ids[0], "old");
  const auto& v = s.get_request("new");
  EXPECT_EQ(v.status(), RequestStatus::PREEMPTED);
  EXPECT_EQ(v.num_computed_tokens(), 0);
  EXPECT_EQ(v.num_preemptions(), 1);
  EXPECT_EQ(v.num_output_tokens(), 2);  // outputs kept, re-prefilled on resume
  EXPECT_EQ(s.num_waiting(), 1);
}

TEST(Scheduler, PrefixHitAtAdmission) {
  Scheduler s(sched_cfg(64), cache_cfg(64, 4));
  s.add_request("a", seq_tokens(0, 13), 0.0);
  step(s);
  s.add_request("b", seq_tokens(0, 13), 1.0);
  auto o = step(s);
  const auto& b = s.get_request("b");
  EXPECT_EQ(b.num_cached_tokens(), 12);
  ASSERT_EQ(o->num_reqs(), 2);
  EXPECT_EQ(o->request_ids[1], "b");
  EXPECT_EQ(o->num_computed_tokens[1], 12);
  EXPECT_EQ(o->num_scheduled_tokens[1], 1);
  // A one-token prefill counts as a decode row by query length.
  EXPECT_EQ(o->num_decode_reqs, 2);
  EXPECT_EQ(s.block_manager().prefix_cache_hits(), 12);
  EXPECT_EQ(s.block_manager().prefix_cache_queries(), 26);
}

TEST(Scheduler, PriorityPolicyAdmitsLowestValueFirst) {
  SchedulerConfig c = sched_cfg(4, 8, 64);
  c.policy = "priority";
  Scheduler s(c, cache_cfg());
  s.add_request("low", seq_tokens(0, 4), 0.0, 5);
  s.add_request("high", seq_tokens(10, 4), 1.0, 0);
  auto o = s.schedule();
  ASSERT_EQ(o->num_reqs(), 1);
  EXPECT_EQ(o->request_ids[0], "high");
}

TEST(Scheduler, AbortAnyTime) {
  Scheduler s(sched_cfg(64), cache_cfg(16, 4));
  s.add_request("a", seq_tokens(0, 6), 0.0);
  s.add_request("w", seq_tokens(0, 6), 0.0);
  EXPECT_TRUE(s.abort("w"));  // waiting
  auto out = s.schedule();
  EXPECT_TRUE(s.abort("a"));  // scheduled, not yet updated
  EXPECT_EQ(s.block_manager().num_free_blocks(), 16);
  const int32_t n = 1;
  const int64_t t = 5;
  s.update(out->step_id, &n, 1, &t, 1, {});  // the aborted row is skipped
  EXPECT_FALSE(s.abort("a"));
  EXPECT_FALSE(s.abort("zzz"));
  EXPECT_FALSE(s.has_unfinished_requests());
}

TEST(Scheduler, UpdateValidatesAndFinishes) {
  Scheduler s(sched_cfg(64), cache_cfg());
  s.add_request("a", seq_tokens(0, 6), 0.0);
  auto out = s.schedule();
  const int32_t two = 2, zero = 0, one = 1;
  const int64_t toks[2] = {1, 2};
  EXPECT_THROW(s.update(out->step_id, &two, 1, toks, 2, {}), std::invalid_argument);   // > 1 + lookahead
  EXPECT_THROW(s.update(out->step_id, &zero, 1, toks, 0, {}), std::invalid_argument);  // sampling row needs 1
  EXPECT_THROW(s.update(out->step_id, &one, 1, toks, 2, {}), std::invalid_argument);   // sum mismatch
  EXPECT_THROW(s.update(out->step_id + 1, &one, 1, toks, 1, {}), std::invalid_argument);
  EXPECT_THROW(s.update(out->step_id, &one, 1, toks, 1, {{"a", RequestStatus::RUNNING}}), std::invalid_argument);
  EXPECT_EQ(s.get_request("a").num_output_tokens(), 0);
  EXPECT_THROW(s.schedule(), std::logic_error);
  s.update(out->step_id, &one, 1, toks, 1, {{"a", RequestStatus::FINISHED_STOPPED}});
  EXPECT_FALSE(s.has_unfinished_requests());
  EXPECT_THROW(s.update(out->step_id, &one, 1, toks, 1, {}), std::invalid_argument);  // twice
}

TEST(Scheduler, ForkIntoPendingStepAndCopyOnWrite) {
  Scheduler s(sched_cfg(64), cache_cfg(32, 4));
  s.add_request("p", seq_tokens(0, 6), 0.0);
  auto out = s.schedule();
  s.fork("p", "c");  // joins the pending step as an extra sampling row
  EXPECT_THROW(s.fork("p", "c"), std::invalid_argument);
  const int32_t n[2] = {1, 1};
  const int64_t t[2] = {7, 8};
  EXPECT_THROW(s.update(out->step_id, n, 1, t, 1, {}), std::invalid_argument);  // child row missing
  s.update(out->step_id, n, 2, t, 2, {});
  EXPECT_EQ(s.get_request("p").output_token_ids(), (std::vector<int64_t>{7}));
  EXPECT_EQ(s.get_request("c").output_token_ids(), (std::vector<int64_t>{8}));
  EXPECT_EQ(s.get_request("c").num_computed_tokens(), 6);
  auto o2 = s.schedule();  // both write position 6 into their shared partial block
  ASSERT_EQ(o2->num_reqs(), 2);
  EXPECT_EQ(o2->num_cow_copies(), 1);
  EXPECT_NE(o2->slot_mapping[0], o2->slot_mapping[1]);
  EXPECT_EQ(o2->block_tables[0], o2->block_tables[static_cast<size_t>(o2->max_blocks_in_batch)]);  // full block shared
}

TEST(Scheduler, ForkRules) {
  Scheduler s(sched_cfg(4), cache_cfg(32, 4));
  s.add_request("p", seq_tokens(0, 10), 0.0);
  EXPECT_THROW(s.fork("p", "c"), std::invalid_argument);  // waiting
  EXPECT_THROW(s.fork("nope", "c"), UnknownRequestError);
  auto out = s.schedule();  // mid-prefill chunk
  EXPECT_THROW(s.fork("p", "c"), std::invalid_argument);
  const int32_t z = 0;
  s.update(out->step_id, &z, 1, nullptr, 0, {});
  EXPECT_THROW(s.fork("p", "c"), std::invalid_argument);  // still mid-prefill
  step(s);
  step(s);  // prefill done + 1 token
  EXPECT_NO_THROW(s.fork("p", "c"));  // decode-ready, no pending step
  EXPECT_EQ(s.num_running(), 2);
}

TEST(Scheduler, SpecDecodeLookaheadAccepted) {
  SchedulerConfig c = sched_cfg(64);
  c.num_lookahead_tokens = 3;
  Scheduler s(c, cache_cfg(32, 4));
  s.add_request("a", seq_tokens(0, 5), 0.0);
  step(s);  // prefill + 1 token: 6 tokens, computed 5
  auto out = s.schedule();
  // slots for computed(5) + 1 + 3 lookahead = 9 -> 3 blocks
  EXPECT_EQ(out->max_blocks_in_batch, 3);
  const int32_t m = 3;  // 2 drafts accepted + bonus token
  const int64_t t[3] = {1, 2, 3};
  s.update(out->step_id, &m, 1, t, 3, {});
  const auto& r = s.get_request("a");
  EXPECT_EQ(r.num_tokens(), 9);
  EXPECT_EQ(r.num_computed_tokens(), 8);
  // Surplus lookahead blocks are released: 9 tokens need 3 blocks.
  EXPECT_EQ(s.block_manager().block_table(r.seq_handle()).size(), 3u);
  const int32_t too_many = 5;
  auto o2 = s.schedule();
  EXPECT_THROW(s.update(o2->step_id, &too_many, 1, t, 5, {}), std::invalid_argument);
}

}  // namespace
}  // namespace pagellm
