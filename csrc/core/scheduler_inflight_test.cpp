// Pipeline micro-batches: several steps scheduled before the first is updated (max_steps_in_flight > 1).
#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "core/scheduler.h"

namespace pagellm {
namespace {

std::vector<int64_t> seq_tokens(int64_t start, int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), start);
  return v;
}

std::unique_ptr<Scheduler> make(int32_t budget, int32_t num_blocks, int32_t block_size = 4, int32_t in_flight = 2,
               bool prefix_caching = true) {
  SchedulerConfig c;
  c.max_num_batched_tokens = budget;
  c.max_num_seqs = 8;
  c.max_model_len = 256;
  CacheConfig k;
  k.num_blocks = num_blocks;
  k.block_size = block_size;
  k.watermark = 0.0;
  k.enable_prefix_caching = prefix_caching;
  auto s = std::make_unique<Scheduler>(c, k);
  s->set_max_steps_in_flight(in_flight);
  return s;
}

// Updates `out` as a stub model would: every sampling row accepts token 1000 + step id.
void update_with_stub(Scheduler& s, const SchedulerOutput& out, std::vector<FinishedRequest> finished = {}) {
  std::vector<int32_t> n(static_cast<size_t>(out.num_reqs()));
  std::vector<int64_t> toks;
  for (int32_t i = 0; i < out.num_reqs(); ++i) {
    n[static_cast<size_t>(i)] = out.do_sample[static_cast<size_t>(i)];
    if (out.do_sample[static_cast<size_t>(i)]) toks.push_back(1000 + static_cast<int64_t>(out.step_id));
  }
  s.update(out.step_id, n.data(), static_cast<int64_t>(n.size()), toks.data(), static_cast<int64_t>(toks.size()),
           finished);
}

std::set<std::string> ids_of(const SchedulerOutput& out) {
  return std::set<std::string>(out.request_ids.begin(), out.request_ids.end());
}

TEST(SchedulerInFlight, MaxStepsInFlightIsValidated) {
  auto owner = make(8, 32, 4, 1);
  Scheduler& s = *owner;
  EXPECT_EQ(s.max_steps_in_flight(), 1);
  EXPECT_THROW(s.set_max_steps_in_flight(0), std::invalid_argument);
  EXPECT_THROW(s.set_max_steps_in_flight(65), std::invalid_argument);
  s.add_request("a", seq_tokens(0, 5), 0.0);
  auto out = s.schedule();
  EXPECT_THROW(s.schedule(), std::logic_error);  // one step at a time, as before
  EXPECT_THROW(s.set_max_steps_in_flight(2), std::logic_error);  // not while a step is pending
  EXPECT_EQ(s.max_steps_in_flight(), 1);
  update_with_stub(s, *out);
  s.set_max_steps_in_flight(2);
  EXPECT_EQ(s.max_steps_in_flight(), 2);
}

TEST(SchedulerInFlight, ARequestIsNotRescheduledUntilItsStepIsUpdated) {
  auto owner = make(8, 32);
  Scheduler& s = *owner;
  s.add_request("a", seq_tokens(0, 8), 0.0);
  s.add_request("b", seq_tokens(100, 6), 1.0);
  auto o1 = s.schedule();  // the budget fits a's prompt only
  EXPECT_EQ(ids_of(*o1), std::set<std::string>{"a"});
  EXPECT_TRUE(s.get_request("a").in_flight());
  auto o2 = s.schedule();  // a is in flight: b is admitted into a second micro-batch
  EXPECT_EQ(ids_of(*o2), std::set<std::string>{"b"});
  EXPECT_EQ(s.num_steps_in_flight(), 2);
  EXPECT_THROW(s.schedule(), std::logic_error);  // two in flight: the most allowed
  EXPECT_THROW(update_with_stub(s, *o2), std::invalid_argument);  // updates go in order
  EXPECT_EQ(s.get_request("b").num_output_tokens(), 0);
  update_with_stub(s, *o1);
  EXPECT_FALSE(s.get_request("a").in_flight());
  EXPECT_EQ(s.get_request("a").output_token_ids(), std::vector<int64_t>{1000 + static_cast<int64_t>(o1->step_id)});
  auto o3 = s.schedule();  // a's decode; b still in flight
  EXPECT_EQ(ids_of(*o3), std::set<std::string>{"a"});
  EXPECT_EQ(o3->input_ids, std::vector<int64_t>{1000 + static_cast<int64_t>(o1->step_id)});
  EXPECT_EQ(o3->positions, std::vector<int64_t>{8});
  update_with_stub(s, *o2);
  update_with_stub(s, *o3);
  EXPECT_EQ(s.num_steps_in_flight(), 0);
  auto o4 = s.schedule();  // both free again: each micro-batch takes its share, ceil(2 / 2)
  EXPECT_EQ(ids_of(*o4), std::set<std::string>{"a"});
  EXPECT_EQ(ids_of(*s.schedule()), std::set<std::string>{"b"});
}

TEST(SchedulerInFlight, AStepWithoutRowsIsNeverInFlight) {
  auto owner = make(64, 32);
  Scheduler& s = *owner;
  s.add_request("a", seq_tokens(0, 5), 0.0);
  auto o1 = s.schedule();
  auto o2 = s.schedule();  // nothing left to run: no rows, never counted as in flight
  EXPECT_EQ(o2->num_reqs(), 0);
  EXPECT_EQ(s.num_steps_in_flight(), 1);
  auto o3 = s.schedule();  // replaces the empty step
  EXPECT_EQ(o3->num_reqs(), 0);
  update_with_stub(s, *o1);
  EXPECT_EQ(s.num_steps_in_flight(), 0);
  EXPECT_TRUE(s.has_pending_step());  // the empty o3, until the next schedule() (as with one step at a time)
  EXPECT_EQ(s.schedule()->num_reqs(), 1);  // a's decode
}

TEST(SchedulerInFlight, PreemptionNeverTakesAnInFlightRequest) {
  // 6 blocks of 4 tokens: a (8 tokens + decode) and b (8 tokens) cannot both grow for long.
  auto owner = make(16, 6, 4, 1, false);  // one step at a time while a and b grow
  Scheduler& s = *owner;
  s.add_request("a", seq_tokens(0, 8), 5.0);  // the latest arrival: the victim, were it not in flight
  auto o1 = s.schedule();
  update_with_stub(s, *o1);  // a: 8 prompt tokens + 1 output, 3 blocks
  s.add_request("b", seq_tokens(100, 11), 1.0);  // 3 blocks
  auto o2 = s.schedule();  // a decodes (9 -> 10 tokens), b prefills: all 6 blocks
  EXPECT_EQ(ids_of(*o2), (std::set<std::string>{"a", "b"}));
  update_with_stub(s, *o2);
  // a's next decode fits its block; b's does not (block 3 is full at 12 tokens)
  auto o3 = s.schedule();
  ASSERT_EQ(ids_of(*o3), (std::set<std::string>{"a", "b"}));
  update_with_stub(s, *o3);
  // now: a has 11 tokens (3 blocks), b 13 (3 full blocks); b needs a 4th block to decode
  s.set_max_steps_in_flight(2);
  auto o4 = s.schedule();  // a's share of two micro-batches
  EXPECT_EQ(ids_of(*o4), std::set<std::string>{"a"});
  auto o5 = s.schedule();  // a is in flight: not the victim, though it arrived last; b yields
  EXPECT_EQ(o5->preempted_request_ids, std::vector<std::string>{"b"});
  EXPECT_EQ(o5->num_reqs(), 0);
  EXPECT_EQ(s.get_request("a").status(), RequestStatus::RUNNING);
  EXPECT_EQ(s.get_request("b").status(), RequestStatus::PREEMPTED);
  update_with_stub(s, *o4, {{"a", RequestStatus::FINISHED_STOPPED}});
  auto o6 = s.schedule();  // a's blocks are back: b is recomputed
  EXPECT_EQ(ids_of(*o6), std::set<std::string>{"b"});
  EXPECT_EQ(o6->num_computed_tokens[0], 0);
}

TEST(SchedulerInFlight, AbortInFlightFreesBlocksOnceAndUpdateSkipsTheRow) {
  auto owner = make(8, 16);
  Scheduler& s = *owner;
  const int32_t free0 = s.block_manager().num_free_blocks();
  s.add_request("a", seq_tokens(0, 8), 0.0);
  s.add_request("b", seq_tokens(100, 8), 0.0);
  auto o1 = s.schedule();
  auto o2 = s.schedule();
  EXPECT_TRUE(s.abort("a"));  // its step is in flight: blocks freed now, the row skipped at update
  EXPECT_FALSE(s.abort("a"));
  EXPECT_EQ(s.block_manager().num_free_blocks(), free0 - 2);  // b's 2 blocks
  s.add_request("a", seq_tokens(0, 8), 0.0);  // the id is free again; the aborted request is another one
  update_with_stub(s, *o1);  // a's row is skipped: the new "a" is untouched
  EXPECT_EQ(s.get_request("a").status(), RequestStatus::WAITING);
  EXPECT_EQ(s.get_request("a").num_output_tokens(), 0);
  update_with_stub(s, *o2, {{"b", RequestStatus::FINISHED_STOPPED}});
  EXPECT_TRUE(s.abort("a"));
  EXPECT_EQ(s.block_manager().num_free_blocks(), free0);
  EXPECT_FALSE(s.has_unfinished_requests());
  auto o3 = s.schedule();
  EXPECT_EQ(o3->num_reqs(), 0);
}

TEST(SchedulerInFlight, AbortPendingStepClosesOnlyThatStep) {
  auto owner = make(8, 16);
  Scheduler& s = *owner;
  const int32_t free0 = s.block_manager().num_free_blocks();
  s.add_request("a", seq_tokens(0, 8), 0.0);
  s.add_request("b", seq_tokens(100, 8), 0.0);
  auto o1 = s.schedule();
  auto o2 = s.schedule();
  EXPECT_EQ(s.abort_pending_step(o2->step_id), std::vector<std::string>{"b"});  // the newer step failed
  EXPECT_EQ(s.num_steps_in_flight(), 1);
  EXPECT_TRUE(s.abort_pending_step(o2->step_id).empty());  // closed: a no-op
  update_with_stub(s, *o1);
  EXPECT_EQ(s.get_request("a").num_output_tokens(), 1);
  auto o3 = s.schedule();
  EXPECT_EQ(s.abort_pending_step(), std::vector<std::string>{"a"});  // 0: the oldest
  EXPECT_FALSE(s.has_unfinished_requests());
  EXPECT_EQ(s.block_manager().num_free_blocks(), free0);
  EXPECT_EQ(o3->num_reqs(), 1);
}

TEST(SchedulerInFlight, ForkJoinsTheOldestStepOnly) {
  auto owner = make(8, 32);
  Scheduler& s = *owner;
  s.add_request("p", seq_tokens(0, 8), 0.0);
  s.add_request("q", seq_tokens(100, 6), 0.0);
  auto o1 = s.schedule();
  auto o2 = s.schedule();
  EXPECT_EQ(ids_of(*o2), std::set<std::string>{"q"});
  EXPECT_THROW(s.fork("q", "q#1"), std::invalid_argument);  // q's step is behind the oldest one
  s.fork("p", "p#1");  // p samples in the oldest step: the child joins it
  EXPECT_TRUE(s.get_request("p#1").in_flight());
  const int32_t n[2] = {1, 1};
  const int64_t toks[2] = {7, 8};
  s.update(o1->step_id, n, 2, toks, 2, {});
  EXPECT_EQ(s.get_request("p#1").output_token_ids(), std::vector<int64_t>{8});
  EXPECT_FALSE(s.get_request("p#1").in_flight());
  update_with_stub(s, *o2);
}

TEST(SchedulerInFlight, DecodesSplitEvenlyOverTheMicroBatches) {
  auto owner = make(64, 64);
  Scheduler& s = *owner;
  for (int i = 0; i < 5; ++i) s.add_request("r" + std::to_string(i), seq_tokens(10 * i, 4), i);
  auto o1 = s.schedule();  // ceil(5 / 2) = 3 of the 5 live requests
  auto o2 = s.schedule();  // the other 2
  EXPECT_EQ(ids_of(*o1), (std::set<std::string>{"r0", "r1", "r2"}));
  EXPECT_EQ(ids_of(*o2), (std::set<std::string>{"r3", "r4"}));
  update_with_stub(s, *o1);
  auto o3 = s.schedule();  // r0..r2 decode while r3, r4 are in flight
  EXPECT_EQ(ids_of(*o3), (std::set<std::string>{"r0", "r1", "r2"}));
  EXPECT_EQ(o3->num_decode_reqs, 3);
  update_with_stub(s, *o2);
  update_with_stub(s, *o3);
  s.set_max_steps_in_flight(1);
  EXPECT_EQ(s.schedule()->num_reqs(), 5);  // one step at a time: every request in one batch, as before
}

// Two steps always in flight over many requests of different lengths with a small cache: every request
// receives its tokens in order, no request rides in two pending steps, every block comes back.
TEST(SchedulerInFlight, TwoStepsInFlightLeakNothing) {
  auto owner = make(24, 20, 4, 2, true);
  Scheduler& s = *owner;
  const int32_t free0 = s.block_manager().num_free_blocks();
  std::map<std::string, int64_t> want;  // request -> output tokens to finish after
  for (int i = 0; i < 9; ++i) {
    const std::string id = "r" + std::to_string(i);
    s.add_request(id, seq_tokens(i % 3 == 0 ? 0 : 50 * i, 3 + 5 * (i % 4)), i);  // shared prefixes too
    want[id] = 2 + i % 5;
  }
  std::map<std::string, std::vector<int64_t>> got;
  std::deque<std::unique_ptr<SchedulerOutput>> queue;
  int64_t max_queue = 0;
  for (int iter = 0; iter < 400 && s.has_unfinished_requests(); ++iter) {
    if (s.num_steps_in_flight() < 2) {  // schedule -> submit; collect only when the queue is full or idle
      auto out = s.schedule();
      for (const auto& id : out->request_ids) {
        for (const auto& q : queue) {
          ASSERT_EQ(std::count(q->request_ids.begin(), q->request_ids.end(), id), 0) << id << " twice in flight";
        }
      }
      const bool scheduled = out->num_reqs() > 0;
      if (scheduled) queue.push_back(std::move(out));
      max_queue = std::max<int64_t>(max_queue, static_cast<int64_t>(queue.size()));
      if (scheduled && queue.size() < 2) continue;
    }
    ASSERT_FALSE(queue.empty()) << "nothing in flight and nothing schedulable";
    std::unique_ptr<SchedulerOutput> out = std::move(queue.front());
    queue.pop_front();
    std::vector<FinishedRequest> finished;
    for (int32_t i = 0; i < out->num_reqs(); ++i) {
      const std::string& id = out->request_ids[static_cast<size_t>(i)];
      if (!out->do_sample[static_cast<size_t>(i)]) continue;
      auto& toks = got[id];
      toks.push_back(1000 + static_cast<int64_t>(out->step_id));
      if (static_cast<int64_t>(toks.size()) == want[id]) finished.emplace_back(id, RequestStatus::FINISHED_LENGTH);
    }
    update_with_stub(s, *out, finished);
  }
  EXPECT_FALSE(s.has_unfinished_requests());
  EXPECT_EQ(max_queue, 2);  // the pipeline was kept full at times
  for (const auto& [id, n] : want) EXPECT_EQ(static_cast<int64_t>(got[id].size()), n) << id;
  EXPECT_EQ(s.block_manager().num_free_blocks(), free0);
}

// Random arrivals, aborts (also of requests in flight), forks, finishes and preemptions with up to three
// steps in flight: no request rides in two pending steps, a request in flight stays RUNNING (never a
// preemption victim) and is in exactly one of them, and once everything is updated and aborted every
// block is free again.
void random_in_flight_run(uint32_t seed, int32_t max_in_flight, bool prefix_caching) {
  auto owner = make(24, 24, 4, max_in_flight, prefix_caching);
  Scheduler& s = *owner;
  std::mt19937 rng(seed);
  const std::vector<int64_t> prefix = seq_tokens(500, 12);
  std::deque<std::unique_ptr<SchedulerOutput>> queue;
  int64_t next_id = 0, preempted = 0, aborted_in_flight = 0, forks = 0, max_queue = 0;
  const auto live_ids = [&s]() {
    std::vector<std::string> ids;
    for (const auto& kv : s.requests()) ids.push_back(kv.first);
    std::sort(ids.begin(), ids.end());
    return ids;
  };
  const auto update_oldest = [&]() {
    std::unique_ptr<SchedulerOutput> out = std::move(queue.front());
    queue.pop_front();
    std::vector<std::string> rows(out->request_ids);
    if (rng() % 4 == 0) {  // n > 1: a sampling row forks a child into this (the oldest) step
      for (int32_t i = 0; i < out->num_reqs(); ++i) {
        const auto& id = out->request_ids[static_cast<size_t>(i)];
        if (out->do_sample[static_cast<size_t>(i)] && s.requests().count(id)) {
          rows.push_back("c" + std::to_string(next_id++));
          s.fork(id, rows.back());
          ++forks;
          break;
        }
      }
    }
    std::vector<int32_t> n;
    std::vector<int64_t> toks;
    std::vector<FinishedRequest> finished;
    for (size_t i = 0; i < rows.size(); ++i) {
      const bool live = s.requests().count(rows[i]) > 0;  // aborted while in flight: no token
      const bool sample = i >= out->request_ids.size() || out->do_sample[i];
      n.push_back(live && sample ? 1 : 0);
      if (!live || !sample) continue;
      toks.push_back(static_cast<int64_t>(rng() % 50));
      if (s.get_request(rows[i]).num_tokens() + 2 >= 64 || rng() % 6 == 0) {
        finished.emplace_back(rows[i], RequestStatus::FINISHED_LENGTH);
      }
    }
    s.update(out->step_id, n.data(), static_cast<int64_t>(n.size()), toks.data(), static_cast<int64_t>(toks.size()),
             finished);
  };
  for (int op = 0; op < 20000 && !::testing::Test::HasFailure(); ++op) {
    const uint32_t dice = rng() % 100;
    if (dice < 25 && s.num_waiting() < 12) {
      std::vector<int64_t> prompt(prefix.begin(), prefix.begin() + 1 + rng() % prefix.size());
      for (uint32_t j = rng() % 10; j > 0; --j) prompt.push_back(static_cast<int64_t>(rng() % 50));
      s.add_request("r" + std::to_string(next_id++), prompt, static_cast<double>(op));
    } else if (dice < 60 && s.num_steps_in_flight() < max_in_flight) {
      auto out = s.schedule();
      preempted += static_cast<int64_t>(out->preempted_request_ids.size());
      for (const auto& id : out->preempted_request_ids) ASSERT_FALSE(s.get_request(id).in_flight()) << id;
      if (out->num_reqs() > 0) queue.push_back(std::move(out));
      max_queue = std::max<int64_t>(max_queue, static_cast<int64_t>(queue.size()));
    } else if (dice < 88 && !queue.empty()) {
      update_oldest();
    } else if (dice < 96) {
      const auto ids = live_ids();
      if (ids.empty()) continue;
      const std::string& id = ids[rng() % ids.size()];
      aborted_in_flight += s.get_request(id).in_flight() ? 1 : 0;
      ASSERT_TRUE(s.abort(id));
    } else {
      for (const auto& id : live_ids()) {  // a decode-ready request not in flight forks on its own
        const Request& r = s.get_request(id);
        if (r.status() == RequestStatus::RUNNING && !r.in_flight() && r.num_computed_tokens() == r.num_tokens() - 1) {
          s.fork(id, "f" + std::to_string(next_id++));
          ++forks;
          break;
        }
      }
    }
    std::map<std::string, int> in_steps;
    for (const auto& q : queue) {
      for (const auto& id : q->request_ids) ASSERT_EQ(++in_steps[id], 1) << id << " in two pending steps";
    }
    for (const auto& [id, r] : s.requests()) {
      ASSERT_EQ(r->in_flight(), in_steps.count(id) > 0) << id;
      if (r->in_flight()) ASSERT_EQ(r->status(), RequestStatus::RUNNING) << id;
    }
    ASSERT_EQ(s.num_steps_in_flight(), static_cast<int32_t>(queue.size()));
  }
  while (!queue.empty()) update_oldest();
  for (const auto& id : live_ids()) s.abort(id);
  EXPECT_FALSE(s.has_unfinished_requests());
  EXPECT_EQ(s.block_manager().num_free_blocks(), s.block_manager().num_blocks());
  EXPECT_EQ(max_queue, max_in_flight);
  EXPECT_GT(preempted, 0);
  EXPECT_GT(aborted_in_flight, 0);
  EXPECT_GT(forks, 0);
  if (prefix_caching) EXPECT_GT(s.block_manager().prefix_cache_hits(), 0);
}

TEST(SchedulerInFlight, DraftsGoToRequestsNotInFlightWhileAnotherStepIsPending) {
  auto owner = make(64, 32, 4, 1);
  Scheduler& s = *owner;
  s.set_num_lookahead_tokens(2);
  s.add_request("a", seq_tokens(0, 5), 0.0);
  s.add_request("b", seq_tokens(100, 5), 1.0);
  update_with_stub(s, *s.schedule());  // both prefilled: decode-ready
  s.set_max_steps_in_flight(2);
  auto o1 = s.schedule();  // each micro-batch takes its share: one request
  ASSERT_EQ(o1->num_reqs(), 1);
  const std::string busy = o1->request_ids[0], idle = busy == "a" ? "b" : "a";
  EXPECT_EQ(s.decode_ready_request_ids(), std::vector<std::string>{idle});  // the one in flight is not offered
  EXPECT_THROW(s.set_draft_tokens(busy, {7}), std::logic_error);  // its tokens are not known yet
  EXPECT_TRUE(s.get_request(busy).draft_token_ids().empty());
  EXPECT_EQ(s.set_draft_tokens(idle, {7, 8}), 2);
  auto o2 = s.schedule();  // the idle request as a spec row of 1 + 2 tokens
  ASSERT_EQ(ids_of(*o2), std::set<std::string>{idle});
  EXPECT_EQ(o2->num_draft_tokens, std::vector<int32_t>{2});
  EXPECT_EQ(o2->draft_token_ids, (std::vector<int64_t>{7, 8}));
  EXPECT_EQ(o2->input_ids.size(), 3u);
  update_with_stub(s, *o1);
  const int64_t before = s.get_request(idle).num_tokens();
  const int32_t n = 2;  // draft 7 accepted, then the target's own token 9
  const int64_t toks[2] = {7, 9};
  s.update(o2->step_id, &n, 1, toks, 2, {});
  const Request& r = s.get_request(idle);
  EXPECT_EQ(r.num_tokens(), before + 2);
  EXPECT_EQ(r.num_computed_tokens(), r.num_tokens() - 1);  // the rejected draft's slot is not counted
  EXPECT_EQ(s.num_steps_in_flight(), 0);
  EXPECT_EQ(s.decode_ready_request_ids().size(), 2u);
}

TEST(SchedulerInFlight, RandomRunsKeepTheInvariants) {
  random_in_flight_run(11, 2, true);
  random_in_flight_run(12, 3, true);
  random_in_flight_run(13, 2, false);
}

}  // namespace
}  // namespace pagellm
