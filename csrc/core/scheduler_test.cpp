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

TEST(Scheduler, AbortPendingStepFreesItsRowsOnly) {
  Scheduler s(sched_cfg(64, 3), cache_cfg(32, 4));
  EXPECT_TRUE(s.abort_pending_step().empty());  // nothing pending: a no-op
  s.add_request("a", seq_tokens(0, 8), 0.0);
  s.add_request("b", seq_tokens(100, 6), 0.0);
  s.add_request("w", seq_tokens(200, 6), 0.0);
  s.add_request("d", seq_tokens(300, 5), 0.0);  // max_num_seqs=3: d keeps waiting
  auto out = s.schedule();
  ASSERT_EQ(out->num_reqs(), 3);  // a, b, w
  s.fork("a", "a#1");  // joins the pending step
  EXPECT_TRUE(s.abort("b"));  // a row aborted before the failure is skipped
  EXPECT_EQ(s.abort_pending_step(), (std::vector<std::string>{"a", "w", "a#1"}));
  EXPECT_FALSE(s.has_pending_step());
  EXPECT_EQ(s.block_manager().num_free_blocks(), 32);
  EXPECT_EQ(s.num_waiting(), 1);  // d, never scheduled, survives
  EXPECT_THROW(s.update(out->step_id, nullptr, 0, nullptr, 0, {}), std::invalid_argument);  // step is closed
  s.add_request("a", seq_tokens(0, 8), 0.0);  // the failed step's KV was never cached
  auto o2 = s.schedule();
  ASSERT_EQ(o2->num_reqs(), 2);
  EXPECT_EQ(o2->num_computed_tokens[0] + o2->num_computed_tokens[1], 0);
  const int32_t n[2] = {1, 1};
  const int64_t t[2] = {1, 2};
  s.update(o2->step_id, n, 2, t, 2, {{"a", RequestStatus::FINISHED_STOPPED}, {"d", RequestStatus::FINISHED_STOPPED}});
  EXPECT_FALSE(s.has_unfinished_requests());
  EXPECT_EQ(s.block_manager().num_free_blocks(), 32);
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


// A scheduler with `lookahead` drafts per step whose request "a" (prompt 0..prompt_len-1) is decode-ready.
std::unique_ptr<Scheduler> decode_ready_scheduler(int32_t lookahead, int64_t prompt_len = 5, int32_t budget = 64,
                                                  int64_t max_tokens = Request::kUnlimitedTokens, int32_t max_len = 256) {
  SchedulerConfig c = sched_cfg(budget, 8, max_len);
  c.num_lookahead_tokens = lookahead;
  auto s = std::make_unique<Scheduler>(c, cache_cfg(32, 4));
  s->add_request("a", seq_tokens(0, prompt_len), 0.0, 0, 0, max_tokens);
  step(*s);  // prefill + 1 token
  return s;
}

TEST(SchedulerDrafts, SpecRowLayout) {
  auto s_ptr = decode_ready_scheduler(3);
  Scheduler& s = *s_ptr;
  s.add_request("b", seq_tokens(40, 6), 1.0);
  s.add_request("d", seq_tokens(80, 3), 2.0);
  step(s);  // b and d prefilled: a, b, d all decode-ready
  EXPECT_EQ(s.decode_ready_request_ids(), (std::vector<std::string>{"a", "b", "d"}));
  s.add_request("p", seq_tokens(60, 5), 3.0);  // a prefill row in the same step
  EXPECT_EQ(s.set_draft_tokens("b", {11, 12, 13}), 3);
  const Request& b = s.get_request("b");
  const int64_t c = b.num_computed_tokens();
  auto out = s.schedule();
  // Rows: the pure decodes a, d first; then the spec row b and the prefill p in scheduling order.
  ASSERT_EQ(out->request_ids, (std::vector<std::string>{"a", "d", "b", "p"}));
  EXPECT_EQ(out->num_decode_reqs, 2);
  EXPECT_EQ(out->num_scheduled_tokens, (std::vector<int32_t>{1, 1, 4, 5}));
  EXPECT_EQ(out->num_draft_tokens, (std::vector<int32_t>{0, 0, 3, 0}));
  EXPECT_EQ(out->draft_token_ids, (std::vector<int64_t>{11, 12, 13}));
  EXPECT_EQ(out->seq_lens[2], c + 4);
  // Input ids [last token, drafts...] at the following positions and slots.
  const int64_t t0 = out->query_start_loc[2];
  const std::vector<int64_t> ids(out->input_ids.begin() + t0, out->input_ids.begin() + t0 + 4);
  EXPECT_EQ(ids, (std::vector<int64_t>{b.all_token_ids().back(), 11, 12, 13}));
  const int32_t* table = out->block_tables.data() + 2 * out->max_blocks_in_batch;
  for (int64_t j = 0; j < 4; ++j) {
    EXPECT_EQ(out->positions[static_cast<size_t>(t0 + j)], c + j);
    EXPECT_EQ(out->slot_mapping[static_cast<size_t>(t0 + j)], table[(c + j) / 4] * 4 + (c + j) % 4);
  }
  // Logits: a, d (one each), every position of b, the last token of p.
  EXPECT_EQ(out->logits_indices, (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 10}));
  EXPECT_EQ(out->total_num_scheduled_tokens, 11);
  EXPECT_TRUE(s.get_request("b").draft_token_ids().empty());  // consumed by schedule()
  const int32_t n[4] = {1, 1, 3, 1};
  const int64_t toks[6] = {7, 8, 11, 12, 99, 9};  // b: drafts 11, 12 accepted, 99 corrects 13
  s.update(out->step_id, n, 4, toks, 6, {});
  EXPECT_EQ(b.output_token_ids(), (std::vector<int64_t>{1002, 11, 12, 99}));
  EXPECT_EQ(b.num_computed_tokens(), b.num_tokens() - 1);
  EXPECT_EQ(s.block_manager().block_table(b.seq_handle()).size(), static_cast<size_t>((b.num_tokens() + 3) / 4));
}

TEST(SchedulerDrafts, UpdateChecksAcceptedTokensAgainstDrafts) {
  auto s_ptr = decode_ready_scheduler(3);
  Scheduler& s = *s_ptr;
  s.set_draft_tokens("a", {21});
  auto out = s.schedule();
  const int64_t before = s.get_request("a").num_tokens();
  const int32_t two = 2, three = 3;
  const int64_t wrong[2] = {22, 5}, right[3] = {21, 5, 6};
  EXPECT_THROW(s.update(out->step_id, &two, 1, wrong, 2, {}), std::invalid_argument);  // 22 is not draft 21
  EXPECT_THROW(s.update(out->step_id, &three, 1, right, 3, {}), std::invalid_argument);  // > 1 + k (k = 1 < L)
  EXPECT_EQ(s.get_request("a").num_tokens(), before);
  s.update(out->step_id, &two, 1, right, 2, {});
  EXPECT_EQ(s.get_request("a").num_tokens(), before + 2);
}

TEST(SchedulerDrafts, SetDraftTokensValidationLeavesStateUntouched) {
  auto s_ptr = decode_ready_scheduler(2);
  Scheduler& s = *s_ptr;
  s.add_request("w", seq_tokens(0, 9), 1.0);
  EXPECT_THROW(s.set_draft_tokens("nope", {1}), UnknownRequestError);
  EXPECT_THROW(s.set_draft_tokens("a", {1, 2, 3}), std::invalid_argument);  // > num_lookahead_tokens
  EXPECT_THROW(s.set_draft_tokens("a", {1, -2}), std::invalid_argument);
  EXPECT_THROW(s.set_draft_tokens("w", {1}), std::invalid_argument);  // waiting
  EXPECT_TRUE(s.get_request("a").draft_token_ids().empty());
  auto out = s.schedule();
  EXPECT_THROW(s.set_draft_tokens("a", {1}), std::logic_error);  // pending step
  const int32_t n[2] = {1, 1};
  const int64_t t[2] = {3, 4};
  s.update(out->step_id, n, 2, t, 2, {});
  EXPECT_EQ(s.set_draft_tokens("a", {5, 6}), 2);
  EXPECT_EQ(s.set_draft_tokens("a", {}), 0);  // clears
  EXPECT_TRUE(s.get_request("a").draft_token_ids().empty());
  EXPECT_THROW(s.set_num_lookahead_tokens(-1), std::invalid_argument);
  EXPECT_EQ(s.config().num_lookahead_tokens, 2);
  s.set_num_lookahead_tokens(0);
  EXPECT_THROW(s.set_draft_tokens("a", {1}), std::invalid_argument);
}

TEST(SchedulerDrafts, ChunkedRequestIsNotDecodeReady) {
  SchedulerConfig c = sched_cfg(4, 8, 256);
  c.num_lookahead_tokens = 2;
  Scheduler s(c, cache_cfg(32, 4));
  s.add_request("a", seq_tokens(0, 10), 0.0);
  step(s);  // 4 of 10 prompt tokens
  EXPECT_TRUE(s.decode_ready_request_ids().empty());
  EXPECT_THROW(s.set_draft_tokens("a", {1}), std::invalid_argument);
}

TEST(SchedulerDrafts, DraftsClampedToMaxTokensAndModelLen) {
  auto s_ptr = decode_ready_scheduler(4, 5, 64, /*max_tokens=*/3);
  Scheduler& s = *s_ptr;
  EXPECT_EQ(s.get_request("a").max_tokens(), 3);
  EXPECT_EQ(s.set_draft_tokens("a", {1, 2, 3, 4}), 1);  // 1 output so far: 2 more, one of them the bonus
  EXPECT_EQ(s.get_request("a").draft_token_ids(), (std::vector<int64_t>{1}));
  auto s2_ptr = decode_ready_scheduler(4, 5, 64, Request::kUnlimitedTokens, /*max_len=*/8);
  Scheduler& s2 = *s2_ptr;
  EXPECT_EQ(s2.set_draft_tokens("a", {1, 2, 3, 4}), 1);  // 6 tokens of 8
  auto s3_ptr = decode_ready_scheduler(4, 5, 64, Request::kUnlimitedTokens, /*max_len=*/7);
  Scheduler& s3 = *s3_ptr;
  EXPECT_EQ(s3.set_draft_tokens("a", {1, 2}), 0);  // room for the last token only
  EXPECT_THROW(s3.add_request("z", seq_tokens(0, 3), 0.0, 0, 0, 0), std::invalid_argument);
}

TEST(SchedulerDrafts, BudgetCountsDraftsAndTrimsThem) {
  auto s_ptr = decode_ready_scheduler(3, 5, /*budget=*/3);
  Scheduler& s = *s_ptr;
  s.add_request("b", seq_tokens(30, 2), 1.0);
  step(s);  // a decodes (1 token), b prefills its 2 tokens
  s.set_draft_tokens("a", {1, 2, 3});
  s.set_draft_tokens("b", {4, 5, 6});
  auto out = s.schedule();  // a takes 1 + 2 of the 3-token budget (drafts trimmed); b does not fit
  ASSERT_EQ(out->num_reqs(), 1);
  EXPECT_EQ(out->num_scheduled_tokens[0], 3);
  EXPECT_EQ(out->draft_token_ids, (std::vector<int64_t>{1, 2}));
  EXPECT_TRUE(s.get_request("b").draft_token_ids().empty());  // consumed although not scheduled
  const int32_t one = 1;
  const int64_t t = 9;
  s.update(out->step_id, &one, 1, &t, 1, {});
  auto o2 = s.schedule();
  EXPECT_EQ(o2->total_num_scheduled_tokens, 2);  // plain decodes: the drafts are gone
}

TEST(SchedulerDrafts, RejectedDraftsFreeBlocksAndStayOutOfThePrefixCache) {
  SchedulerConfig c = sched_cfg(64);
  c.num_lookahead_tokens = 6;
  Scheduler s(c, cache_cfg(16, 4));
  s.add_request("a", seq_tokens(0, 3), 0.0);
  step(s);  // 4 tokens, computed 3
  const Request& a = s.get_request("a");
  s.set_draft_tokens("a", {50, 51, 52, 53, 54, 55});
  auto out = s.schedule();  // positions 3..9: 3 blocks
  EXPECT_EQ(s.block_manager().block_table(a.seq_handle()).size(), 3u);
  EXPECT_EQ(s.block_manager().num_free_blocks(), 13);
  const int32_t one = 1;
  const int64_t t = 7;  // every draft rejected
  s.update(out->step_id, &one, 1, &t, 1, {});
  EXPECT_EQ(a.num_computed_tokens(), 4);
  EXPECT_EQ(s.block_manager().block_table(a.seq_handle()).size(), 2u);  // 5 tokens
  EXPECT_EQ(s.block_manager().num_free_blocks(), 14);
  EXPECT_EQ(s.block_manager().num_cached_blocks(), 1);  // block 0 = tokens 0, 1, 2, 1001: accepted only
  EXPECT_EQ(s.block_manager().pool().block(s.block_manager().block_table(a.seq_handle())[0]).token_ids,
            (std::vector<int64_t>{0, 1, 2, 1001}));
}

TEST(SchedulerDrafts, PreemptedRequestDropsItsDrafts) {
  SchedulerConfig c = sched_cfg(64);
  c.num_lookahead_tokens = 1;
  Scheduler s(c, cache_cfg(4, 4));
  s.add_request("old", seq_tokens(0, 7), 0.0);
  s.add_request("new", seq_tokens(100, 7), 1.0);
  step(s);  // 8 tokens each, 2 blocks each: the cache is full
  s.set_draft_tokens("new", {1});
  auto out = s.schedule();  // "old" needs a 3rd block for its lookahead: "new" is preempted
  EXPECT_EQ(out->preempted_request_ids, (std::vector<std::string>{"new"}));
  EXPECT_TRUE(out->draft_token_ids.empty());
  EXPECT_TRUE(s.get_request("new").draft_token_ids().empty());
}

}  // namespace
}  // namespace pagellm
