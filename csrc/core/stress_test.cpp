// Randomized stress test of the scheduler + block manager with a simulated KV cache: after every
// operation the block/ref-count/hash-index invariants are checked, and after every step the simulated
// KV content of every running request is compared with its tokens. With drafts on, decode-ready
// requests get random drafts before each step and a random prefix of them is accepted. With a sliding
// window, only the positions the next query reads must hold their tokens, entries before them must be
// the null block, and a request never holds more blocks than admission counted. A hybrid cache (extra
// KV-cache groups, e.g. a full group plus a sliding one) is checked group by group, each with its own
// simulated KV content.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "core/scheduler.h"

namespace pagellm {
namespace {

class StressHarness {
 public:
  StressHarness(const SchedulerConfig& c, const CacheConfig& k, uint32_t seed, bool use_drafts = false)
      : s_(c, k), rng_(seed), use_drafts_(use_drafts) {
    for (const KVCacheGroupConfig& g : k.groups()) {
      kv_.emplace_back(static_cast<size_t>(g.num_blocks) * k.block_size, -7);
    }
    for (int i = 0; i < 4; ++i) prefixes_.push_back(random_tokens(8 + 8 * i));
  }

  void run(int num_ops) {
    for (int op = 0; op < num_ops; ++op) {
      const int dice = static_cast<int>(rng_() % 100);
      if (dice < 25) {
        if (s_.num_waiting() < 24) arrive();
      } else if (dice < 85) {
        do_step();
      } else if (dice < 93) {
        abort_random();
      } else {
        fork_decode_ready();
      }
      for (size_t g = 0; g < kv_.size(); ++g) check_invariants(g);
      if (::testing::Test::HasFailure()) {
        ADD_FAILURE() << "first failure at op " << op << " (dice " << dice << ")";
        return;
      }
    }
    for (const auto& id : live_ids()) s_.abort(id);
    for (size_t g = 0; g < kv_.size(); ++g) {
      check_invariants(g);
      const BlockManager& bm = s_.kv_cache().group(g);
      EXPECT_EQ(bm.num_free_blocks(), bm.num_blocks() - bm.num_reserved_blocks()) << "group " << g;
    }
    EXPECT_FALSE(s_.has_unfinished_requests());
  }

  // Prefix-cache hit tokens so far.
  int64_t prefix_hits() const { return s_.block_manager().prefix_cache_hits(); }
  int64_t preemptions = 0, forks = 0, cow_copies = 0, steps = 0, dropped = 0;
  int64_t spec_rows = 0, drafts_scheduled = 0, drafts_accepted = 0, drafts_clamped = 0;

 private:
  std::vector<int64_t> random_tokens(int n) {
    std::vector<int64_t> v(static_cast<size_t>(n));
    for (auto& t : v) t = static_cast<int64_t>(rng_() % 50);
    return v;
  }

  std::vector<std::string> live_ids() const {
    std::vector<std::string> ids;
    for (const auto& kv : s_.requests()) ids.push_back(kv.first);
    std::sort(ids.begin(), ids.end());
    return ids;
  }

  void arrive() {
    std::vector<int64_t> prompt = prefixes_[rng_() % prefixes_.size()];
    prompt.resize(static_cast<size_t>(1 + rng_() % prompt.size()));
    const auto tail = random_tokens(static_cast<int>(rng_() % 12));
    prompt.insert(prompt.end(), tail.begin(), tail.end());
    const std::string id = "r" + std::to_string(next_id_++);
    const int64_t max_tokens = rng_() % 3 == 0 ? 1 + static_cast<int64_t>(rng_() % 12) : Request::kUnlimitedTokens;
    s_.add_request(id, prompt, static_cast<double>(next_id_), static_cast<int32_t>(rng_() % 3),
                   rng_() % 8 == 0 ? 1 : 0, max_tokens);
  }

  void abort_random() {
    const auto ids = live_ids();
    if (ids.empty() || rng_() % 10 == 0) {
      EXPECT_FALSE(s_.abort("unknown"));
      return;
    }
    EXPECT_TRUE(s_.abort(ids[rng_() % ids.size()]));
  }

  void fork_decode_ready() {
    for (const auto& id : live_ids()) {
      const Request& r = s_.get_request(id);
      if (r.status() == RequestStatus::RUNNING && r.num_computed_tokens() == r.num_tokens() - 1) {
        s_.fork(id, "f" + std::to_string(next_id_++));
        ++forks;
        return;
      }
    }
  }

  // Simulated runner: copies, then writes the scheduled tokens' "KV" (the token id) into their slots.
  void run_model(const SchedulerOutput& out) {
    const int64_t bs = s_.cache_config().block_size;
    ASSERT_EQ(out.group_slot_mappings.size(), kv_.size() - 1);
    ASSERT_EQ(out.cow_copy_groups.size(), kv_.size() > 1 ? static_cast<size_t>(out.num_cow_copies()) : 0u);
    for (int32_t c = 0; c < out.num_cow_copies(); ++c) {
      std::vector<int64_t>& kv = kv_[out.cow_copy_groups.empty() ? 0 : static_cast<size_t>(out.cow_copy_groups[c])];
      const int64_t src = out.cow_copies[2 * c], dst = out.cow_copies[2 * c + 1];
      std::copy_n(kv.begin() + src * bs, bs, kv.begin() + dst * bs);
    }
    cow_copies += out.num_cow_copies();
    for (size_t g = 0; g < kv_.size(); ++g) {
      const BlockManager& bm = s_.kv_cache().group(g);
      const std::vector<int64_t>& slot_mapping = g == 0 ? out.slot_mapping : out.group_slot_mappings[g - 1];
      if (g > 0) ASSERT_EQ(out.group_block_tables[g - 1].size(), out.block_tables.size());
      std::set<int64_t> slots;
      for (int64_t t = 0; t < out.total_num_scheduled_tokens; ++t) {
        ASSERT_TRUE(slots.insert(slot_mapping[t]).second) << "two tokens share a slot";
        ASSERT_EQ(bm.pool().block(static_cast<int32_t>(slot_mapping[t] / bs)).ref_count, 1)
            << "write into a shared block of group " << g;
        ASSERT_NE(slot_mapping[t] / bs, bm.null_block()) << "write into the null block of group " << g;
        kv_[g][static_cast<size_t>(slot_mapping[t])] = out.input_ids[t];
      }
    }
  }

  // Slot of position p of a request's block table in group g.
  int64_t slot_of(const Request& r, int64_t p, size_t g = 0) const {
    const int64_t bs = s_.cache_config().block_size;
    return s_.kv_cache().block_table(r.seq_handle(), g)[static_cast<size_t>(p / bs)] * bs + p % bs;
  }

  // Random drafts for decode-ready requests, with bad calls that must leave the drafts untouched.
  void propose_drafts() {
    const int32_t L = s_.config().num_lookahead_tokens;
    EXPECT_THROW(s_.set_draft_tokens("unknown", {}), UnknownRequestError);
    for (const auto& id : s_.decode_ready_request_ids()) {
      if (rng_() % 4 == 0) continue;
      const Request& r = s_.get_request(id);
      if (rng_() % 16 == 0) {
        EXPECT_THROW(s_.set_draft_tokens(id, random_tokens(L + 1)), std::invalid_argument);
        ASSERT_TRUE(r.draft_token_ids().empty());
      }
      const int32_t count = static_cast<int32_t>(rng_() % (L + 1));
      const int64_t room = std::max<int64_t>(r.num_remaining_tokens(s_.config().max_model_len) - 1, 0);
      const int32_t kept = s_.set_draft_tokens(id, random_tokens(count));
      ASSERT_EQ(kept, std::min<int64_t>(count, room)) << id;
      drafts_clamped += count - kept;
    }
  }

  // Spec rows: input ids [last token, drafts...] at consecutive positions; logits at each of them.
  void check_spec_rows(const SchedulerOutput& out) {
    ASSERT_LE(out.total_num_scheduled_tokens, s_.config().max_num_batched_tokens);
    size_t num_logits = 0, d = 0;
    for (int32_t i = 0; i < out.num_reqs(); ++i) {
      const int32_t k = out.num_draft_tokens[i];
      num_logits += out.do_sample[i] ? 1 + k : 0;
      if (k == 0) continue;
      ++spec_rows;
      drafts_scheduled += k;
      const Request& r = s_.get_request(out.request_ids[i]);
      const int64_t t0 = out.query_start_loc[i];
      ASSERT_EQ(out.num_scheduled_tokens[i], 1 + k);
      ASSERT_TRUE(out.do_sample[i]);
      ASSERT_EQ(out.input_ids[t0], r.all_token_ids().back());
      for (int32_t j = 0; j < k; ++j) ASSERT_EQ(out.input_ids[t0 + 1 + j], out.draft_token_ids[d + j]);
      for (int32_t j = 0; j <= k; ++j) ASSERT_EQ(out.positions[t0 + j], r.num_computed_tokens() + j);
      d += static_cast<size_t>(k);
    }
    ASSERT_EQ(d, out.draft_token_ids.size());
    ASSERT_EQ(num_logits, out.logits_indices.size());
    for (const auto& kv : s_.requests()) ASSERT_TRUE(kv.second->draft_token_ids().empty()) << "drafts not consumed";
  }

  // Accepted tokens of a sampling row: a random prefix of its drafts plus one token; else legacy
  // lookahead (the caller writes the accepted tokens' KV) or one token. Truncated at max_tokens.
  std::vector<int64_t> accepted_tokens(const SchedulerOutput& out, size_t i, size_t draft_offset, bool base) {
    const int32_t L = s_.config().num_lookahead_tokens;
    const int32_t k = base ? out.num_draft_tokens[i] : 0;
    std::vector<int64_t> toks;
    if (k > 0) {
      const int32_t m = 1 + static_cast<int32_t>(rng_() % (k + 1));
      toks.assign(out.draft_token_ids.begin() + static_cast<int64_t>(draft_offset),
                  out.draft_token_ids.begin() + static_cast<int64_t>(draft_offset) + m - 1);
      drafts_accepted += m - 1;
      toks.push_back(static_cast<int64_t>(rng_() % 50));
    } else {
      toks = random_tokens(base && !use_drafts_ ? 1 + static_cast<int32_t>(rng_() % (L + 1)) : 1);
    }
    return toks;
  }

  void do_step() {
    if (use_drafts_) propose_drafts();
    auto out = s_.schedule();
    ++steps;
    check_spec_rows(*out);
    preemptions += static_cast<int64_t>(out->preempted_request_ids.size());
    for (int32_t i = 0; i < out->num_reqs(); ++i) {
      if (i > 0) ASSERT_EQ(out->num_scheduled_tokens[i] == 1 && out->num_scheduled_tokens[i - 1] != 1, false);
    }
    run_model(*out);
    const int32_t L = s_.config().num_lookahead_tokens;
    std::vector<int32_t> n;
    std::vector<int64_t> toks;
    std::vector<FinishedRequest> finished;
    std::vector<std::string> rows(out->request_ids);
    if (rng_() % 4 == 0) {  // n>1 sampling: fork a sampling row into the pending step
      for (int32_t i = 0; i < out->num_reqs(); ++i) {
        if (out->do_sample[i] && rng_() % 2 == 0) {
          const std::string child = "c" + std::to_string(next_id_++);
          s_.fork(out->request_ids[i], child);
          log_ += "fork " + out->request_ids[i] + "->" + child + " seq_len " + std::to_string(out->seq_lens[i]) + "; ";
          rows.push_back(child);
          ++forks;
          break;
        }
      }
    }
    size_t draft_offset = 0;
    for (size_t i = 0; i < rows.size(); ++i) {
      const bool base = i < out->request_ids.size();
      const bool sample = base ? out->do_sample[i] != 0 : true;
      const Request& r = s_.get_request(rows[i]);
      int32_t m = 0;
      if (sample) {
        auto accepted = accepted_tokens(*out, i, draft_offset, base);
        bool length = false;
        if (r.max_tokens() != Request::kUnlimitedTokens && r.num_output_tokens() + static_cast<int64_t>(accepted.size()) >= r.max_tokens()) {
          accepted.resize(static_cast<size_t>(r.max_tokens() - r.num_output_tokens()));  // a stop inside the run
          length = true;
        }
        m = static_cast<int32_t>(accepted.size());
        if (base && out->num_draft_tokens[i] == 0) {
          // Legacy lookahead: accepted tokens beyond the first had their KV written in the lookahead slots.
          const int64_t seq_len = out->seq_lens[i];  // children get no draft KV
          for (size_t g = 0; g < kv_.size(); ++g) {
            for (int32_t k = 0; k < L; ++k) {
              kv_[g][static_cast<size_t>(slot_of(r, seq_len + k, g))] = k < m - 1 ? accepted[k] : -1;
            }
          }
        }
        toks.insert(toks.end(), accepted.begin(), accepted.end());
        if (length || r.num_tokens() + m + L + 1 >= s_.config().max_model_len) {
          finished.emplace_back(rows[i], RequestStatus::FINISHED_LENGTH);
        } else if (rng_() % 20 == 0) {
          finished.emplace_back(rows[i], RequestStatus::FINISHED_STOPPED);
        }
      }
      if (base) draft_offset += static_cast<size_t>(out->num_draft_tokens[i]);
      n.push_back(m);
    }
    s_.update(out->step_id, n.data(), static_cast<int64_t>(n.size()), toks.data(), static_cast<int64_t>(toks.size()), finished);
    for (size_t g = 0; g < kv_.size(); ++g) check_kv_content(g);
  }

  // Every running request's cached positions the next query reads hold exactly its tokens; older
  // ones (sliding window) are null entries.
  void check_kv_content(size_t g) {
    const BlockManager& bm = s_.kv_cache().group(g);
    const int64_t bs = bm.block_size();
    for (const auto& kv : s_.requests()) {
      const Request& r = *kv.second;
      if (r.status() != RequestStatus::RUNNING) continue;
      const int64_t first = bm.first_live_block(r.num_computed_tokens());
      const std::vector<int32_t>& table = bm.block_table(r.seq_handle());
      for (int64_t j = 0; j < first; ++j) ASSERT_EQ(table[static_cast<size_t>(j)], bm.null_block()) << r.request_id();
      if (first > 0) ++dropped;
      const int64_t bound = bm.max_live_blocks(r.num_tokens() + s_.config().num_lookahead_tokens,
                                               s_.config().max_num_batched_tokens + s_.config().num_lookahead_tokens);
      ASSERT_LE(bm.num_live_blocks(r.seq_handle()), bound) << r.request_id();
      for (int64_t p = first * bs; p < r.num_computed_tokens(); ++p) {
        ASSERT_EQ(kv_[g][static_cast<size_t>(slot_of(r, p, g))], r.all_token_ids()[static_cast<size_t>(p)])
            << r.request_id() << " position " << p << " group " << g;
      }
    }
  }

  void check_invariants(size_t g) {
    const BlockManager& bm = s_.kv_cache().group(g);
    const BlockPool& pool = bm.pool();
    const int64_t bs = bm.block_size();
    std::vector<int32_t> holders(static_cast<size_t>(bm.num_blocks()), 0);
    for (const auto& kv : s_.requests()) {
      const Request& r = *kv.second;
      if (r.status() != RequestStatus::RUNNING) {
        ASSERT_EQ(r.seq_handle(), -1);
        continue;
      }
      const SeqBlocks& seq = bm.seq(r.seq_handle());
      ASSERT_GE(static_cast<int64_t>(seq.blocks.size()) * bs, r.num_computed_tokens());
      if (r.max_tokens() != Request::kUnlimitedTokens) ASSERT_LT(r.num_output_tokens(), r.max_tokens());
      for (int32_t b : seq.blocks) holders[static_cast<size_t>(b)] += b == bm.null_block() ? 0 : 1;
      for (int32_t j = 0; j < seq.num_hashed; ++j) {  // registered content matches the owner's tokens
        if (seq.blocks[static_cast<size_t>(j)] == bm.null_block()) continue;
        const KVBlock& blk = pool.block(seq.blocks[static_cast<size_t>(j)]);
        if (!blk.cached) continue;
        ASSERT_TRUE(std::equal(blk.token_ids.begin(), blk.token_ids.end(), r.all_token_ids().begin() + j * bs))
            << r.request_id() << " block index " << j << " id " << blk.id << " computed " << r.num_computed_tokens()
            << " tokens " << r.num_tokens() << " hashed " << seq.num_hashed << " table " << seq.blocks.size()
            << " blk " << blk.token_ids[0] << "," << blk.token_ids[1] << " req " << r.all_token_ids()[j * bs] << "," << r.all_token_ids()[j * bs + 1]
            << " log " << log_;
      }
    }
    ASSERT_EQ(bm.num_seqs(), s_.num_running());
    ASSERT_TRUE(bm.pending_cow_copies().empty());
    if (bm.null_block() >= 0) {
      ASSERT_EQ(holders[static_cast<size_t>(bm.null_block())], 0);
      holders[static_cast<size_t>(bm.null_block())] = 1;  // the manager's own reference
      ASSERT_FALSE(pool.block(bm.null_block()).cached);
    }
    int32_t free_count = 0, cached = 0;
    for (int32_t b = 0; b < bm.num_blocks(); ++b) {
      const KVBlock& blk = pool.block(b);
      ASSERT_EQ(blk.ref_count, holders[static_cast<size_t>(b)]) << "block " << b;
      ASSERT_EQ(blk.in_free_queue, blk.ref_count == 0) << "block " << b;
      free_count += blk.ref_count == 0 ? 1 : 0;
      if (blk.cached) {
        ++cached;
        ASSERT_EQ(pool.indexed_block(blk.hash.hash), b);
        ASSERT_EQ(hash_block_tokens(blk.parent_hash, blk.token_ids.data(), bs, blk.extra_key), blk.hash);
        for (int64_t k = 0; k < bs; ++k) {
          ASSERT_EQ(kv_[g][static_cast<size_t>(b * bs + k)], blk.token_ids[static_cast<size_t>(k)]);
        }
      }
    }
    ASSERT_EQ(free_count, bm.num_free_blocks());
    ASSERT_EQ(static_cast<int32_t>(pool.free_queue().to_vector().size()), free_count);
    ASSERT_EQ(cached, bm.num_cached_blocks());
  }

  Scheduler s_;
  std::mt19937 rng_;
  std::vector<std::vector<int64_t>> kv_;  // per group: the simulated content of every slot
  std::vector<std::vector<int64_t>> prefixes_;
  int64_t next_id_ = 0;
  std::string log_;
  bool use_drafts_;
};

void run_stress(const SchedulerConfig& c, const CacheConfig& k, uint32_t seed, int ops, bool use_drafts = false) {
  StressHarness h(c, k, seed, use_drafts);
  h.run(ops);
  if (use_drafts) {
    EXPECT_GT(h.spec_rows, 0);
    EXPECT_GT(h.drafts_accepted, 0);
    EXPECT_LT(h.drafts_accepted, h.drafts_scheduled);  // some rejected too
    EXPECT_GT(h.drafts_clamped, 0);
    std::printf("spec_rows=%lld drafts=%lld accepted=%lld clamped=%lld\n", static_cast<long long>(h.spec_rows),
                static_cast<long long>(h.drafts_scheduled), static_cast<long long>(h.drafts_accepted),
                static_cast<long long>(h.drafts_clamped));
  }
  EXPECT_GT(h.preemptions, 0);
  EXPECT_GT(h.prefix_hits(), 0);
  EXPECT_GT(h.forks, 0);
  EXPECT_GT(h.cow_copies, 0);
  bool window = k.sliding_window > 0;
  for (const KVCacheGroupConfig& g : k.extra_groups) window = window || g.sliding_window > 0;
  if (window) EXPECT_GT(h.dropped, 0);
  std::printf("steps=%lld preemptions=%lld prefix_hit_tokens=%lld forks=%lld cow=%lld dropped=%lld\n",
              static_cast<long long>(h.steps), static_cast<long long>(h.preemptions),
              static_cast<long long>(h.prefix_hits()), static_cast<long long>(h.forks),
              static_cast<long long>(h.cow_copies), static_cast<long long>(h.dropped));
}

TEST(Stress, FcfsNoLookahead) {
  SchedulerConfig c;
  c.max_num_seqs = 12;
  c.max_num_batched_tokens = 48;
  c.max_model_len = 96;
  CacheConfig k;
  k.num_blocks = 40;
  k.block_size = 4;
  run_stress(c, k, 1234, 50000);
}

TEST(Stress, PriorityLookaheadThreshold) {
  SchedulerConfig c;
  c.max_num_seqs = 10;
  c.max_num_batched_tokens = 40;
  c.max_model_len = 80;
  c.policy = "priority";
  c.num_lookahead_tokens = 2;
  c.long_prefill_token_threshold = 12;
  CacheConfig k;
  k.num_blocks = 48;
  k.block_size = 2;
  k.watermark = 0.05;
  run_stress(c, k, 99, 50000);
}

TEST(Stress, DraftTokens) {
  SchedulerConfig c;
  c.max_num_seqs = 10;
  c.max_num_batched_tokens = 32;
  c.max_model_len = 72;
  c.num_lookahead_tokens = 5;
  c.long_prefill_token_threshold = 16;
  CacheConfig k;
  k.num_blocks = 44;
  k.block_size = 4;
  k.watermark = 0.02;
  run_stress(c, k, 7, 50000, /*use_drafts=*/true);
}

TEST(Stress, DraftTokensPriorityBlockSize2) {
  SchedulerConfig c;
  c.max_num_seqs = 12;
  c.max_num_batched_tokens = 24;
  c.max_model_len = 64;
  c.policy = "priority";
  c.num_lookahead_tokens = 3;
  CacheConfig k;
  k.num_blocks = 64;
  k.block_size = 2;
  run_stress(c, k, 2024, 50000, /*use_drafts=*/true);
}

TEST(Stress, SlidingWindow) {
  SchedulerConfig c;
  c.max_num_seqs = 12;
  c.max_num_batched_tokens = 24;
  c.max_model_len = 96;
  c.long_prefill_token_threshold = 12;
  CacheConfig k;
  k.num_blocks = 30;
  k.block_size = 4;
  k.sliding_window = 7;
  run_stress(c, k, 4321, 50000);
}

TEST(Stress, SlidingWindowDraftsPriorityBlockSize2) {
  SchedulerConfig c;
  c.max_num_seqs = 10;
  c.max_num_batched_tokens = 24;
  c.max_model_len = 80;
  c.policy = "priority";
  c.num_lookahead_tokens = 3;
  CacheConfig k;
  k.num_blocks = 40;
  k.block_size = 2;
  k.watermark = 0.05;
  k.sliding_window = 5;
  run_stress(c, k, 77, 50000, /*use_drafts=*/true);
}

TEST(Stress, HybridFullAndSlidingGroups) {  // Gemma 2-like: a full group and a sliding group of its own
  SchedulerConfig c;
  c.max_num_seqs = 12;
  c.max_num_batched_tokens = 24;
  c.max_model_len = 96;
  c.long_prefill_token_threshold = 12;
  CacheConfig k;
  k.num_blocks = 44;
  k.block_size = 4;
  k.extra_groups = {{24, 7}};
  run_stress(c, k, 4242, 50000);
}

TEST(Stress, HybridSlidingFirstDraftsPriorityBlockSize2) {  // group 0 slides, groups 1 and 2 do not / slide wider
  SchedulerConfig c;
  c.max_num_seqs = 10;
  c.max_num_batched_tokens = 24;
  c.max_model_len = 80;
  c.policy = "priority";
  c.num_lookahead_tokens = 3;
  CacheConfig k;
  k.num_blocks = 30;
  k.block_size = 2;
  k.watermark = 0.05;
  k.sliding_window = 5;
  k.extra_groups = {{64, 0}, {40, 9}};
  run_stress(c, k, 78, 50000, /*use_drafts=*/true);
}

}  // namespace
}  // namespace pagellm
