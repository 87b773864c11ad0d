// Scheduler: request lifecycle (add, abort, fork, finish) and update().
#include "core/scheduler.h"

#include <algorithm>
#include <chrono>

namespace pagellm {

namespace {

// Validates both configs before the block manager allocates anything.
const CacheConfig& checked(const SchedulerConfig& config, const CacheConfig& cache_config) {
  config.validate();
  cache_config.validate();
  return cache_config;
}

double micros_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

Scheduler::Scheduler(const SchedulerConfig& config, const CacheConfig& cache_config)
    : config_(config),
      cache_config_(checked(config, cache_config)),
      bm_(cache_config.groups(), cache_config.block_size, cache_config.enable_prefix_caching, cache_config.watermark),
      waiting_(config.priority_policy()) {
  while ((1 << block_shift_) < cache_config.block_size) ++block_shift_;
  running_.reserve(static_cast<size_t>(config.max_num_seqs));
}

void Scheduler::add_request(const std::string& request_id, std::vector<int64_t> prompt_token_ids,
                            double arrival_time, int32_t priority, uint64_t extra_key, int64_t max_tokens) {
  const int64_t n = static_cast<int64_t>(prompt_token_ids.size());
  if (n == 0) throw std::invalid_argument("prompt_token_ids must not be empty");
  if (max_tokens < 1 && max_tokens != Request::kUnlimitedTokens) {
    throw std::invalid_argument("max_tokens must be >= 1 or -1 (unlimited) (got " + std::to_string(max_tokens) + ")");
  }
  if (n > config_.max_model_len) {
    throw std::invalid_argument("prompt has " + std::to_string(n) + " tokens, more than max_model_len=" +
                                std::to_string(config_.max_model_len));
  }
  if (!config_.enable_chunked_prefill && n > config_.max_num_batched_tokens) {
    throw std::invalid_argument("prompt has " + std::to_string(n) +
                                " tokens, more than max_num_batched_tokens=" +
                                std::to_string(config_.max_num_batched_tokens) + " (chunked prefill is off)");
  }
  for (size_t g = 0; g < bm_.num_groups(); ++g) {
    const int64_t blocks = admission_blocks(n, config_.num_lookahead_tokens, g);
    const int64_t usable = admissible_blocks(g);
    if (blocks > usable) {
      throw std::invalid_argument("prompt needs " + std::to_string(blocks) + " KV blocks" +
                                  (g > 0 ? " of group " + std::to_string(g) : std::string()) + " but only " +
                                  std::to_string(usable) + " can be admitted");
    }
  }
  if (requests_.count(request_id)) throw std::invalid_argument("duplicate request id '" + request_id + "'");
  auto req = std::make_unique<Request>(request_id, std::move(prompt_token_ids), arrival_time, priority, extra_key,
                                       max_tokens);
  waiting_.push_back(req.get());
  requests_.emplace(request_id, std::move(req));
}

int64_t Scheduler::admission_blocks(int64_t num_tokens, int32_t num_lookahead, size_t g) const {
  int64_t chunk = num_tokens;  // the longest step a prompt of num_tokens can take
  if (config_.enable_chunked_prefill) {
    chunk = std::min<int64_t>(chunk, config_.max_num_batched_tokens);
    if (config_.long_prefill_token_threshold > 0) chunk = std::min<int64_t>(chunk, config_.long_prefill_token_threshold);
  }
  return bm_.group(g).max_live_blocks(num_tokens + num_lookahead, chunk + num_lookahead);
}

int64_t Scheduler::admissible_blocks(size_t g) const {
  const BlockManager& bm = bm_.group(g);
  return bm.num_blocks() - bm.num_reserved_blocks() - bm.watermark_blocks();
}

bool Scheduler::abort(const std::string& request_id) {
  Request* r = find(request_id);
  if (r == nullptr) return false;
  finish_request(r, RequestStatus::FINISHED_ABORTED);
  return true;
}

void Scheduler::set_max_steps_in_flight(int32_t n) {
  if (n < 1 || n > 64) {
    throw std::invalid_argument("max_steps_in_flight must be in [1, 64] (got " + std::to_string(n) + ")");
  }
  require_no_pending_step("set_max_steps_in_flight");
  max_steps_in_flight_ = n;
}

int32_t Scheduler::num_steps_in_flight() const {
  return static_cast<int32_t>(std::count_if(pending_.begin(), pending_.end(),
                                            [](const PendingStep& p) { return !p.rows.empty(); }));
}

const Scheduler::PendingStep* Scheduler::oldest_pending() const {
  for (const PendingStep& p : pending_) {
    if (!p.rows.empty()) return &p;
  }
  return nullptr;
}

void Scheduler::close_pending(std::deque<PendingStep>::iterator it) {
  for (Request* r : it->rows) r->set_in_flight(false);  // finished rows too: graveyard_ may drop them now
  pending_.erase(it);
}

std::vector<std::string> Scheduler::abort_pending_step(uint64_t step_id) {
  std::vector<std::string> aborted;
  PendingStep* oldest = oldest_pending();
  if (step_id == 0 && oldest == nullptr && !pending_.empty()) step_id = pending_.front().step_id;
  if (step_id == 0 && oldest != nullptr) step_id = oldest->step_id;
  const auto it = std::find_if(pending_.begin(), pending_.end(),
                               [step_id](const PendingStep& p) { return p.step_id == step_id; });
  if (it == pending_.end()) return aborted;
  for (Request* r : it->rows) {  // rows finished since schedule() still live in graveyard_
    if (is_finished(r->status())) continue;
    aborted.push_back(r->request_id());
    finish_request(r, RequestStatus::FINISHED_ABORTED);
  }
  close_pending(it);
  return aborted;
}

void Scheduler::fork(const std::string& parent_id, const std::string& child_id) {
  Request* p = find(parent_id);
  if (p == nullptr) throw UnknownRequestError(parent_id);
  if (requests_.count(child_id)) throw std::invalid_argument("fork: duplicate request id '" + child_id + "'");
  if (p->status() != RequestStatus::RUNNING) {
    throw std::invalid_argument(std::string("fork: parent must be RUNNING (is ") + to_string(p->status()) + ")");
  }
  int64_t row = -1;
  PendingStep* step = oldest_pending();
  if (step != nullptr) {
    const auto it = std::find(step->rows.begin(), step->rows.end(), p);
    if (it != step->rows.end()) row = it - step->rows.begin();
  }
  if (row >= 0 && !step->sample[static_cast<size_t>(row)]) {
    throw std::invalid_argument("fork: parent is mid-prefill in the pending step (no sampled token)");
  }
  if (row < 0 && p->in_flight()) {
    throw std::invalid_argument("fork: parent's step is in flight behind the oldest pending step");
  }
  if (row < 0 && p->num_computed_tokens() != p->num_tokens() - 1) {
    throw std::invalid_argument("fork: parent is mid-prefill (num_computed_tokens != num_tokens - 1)");
  }
  auto child = std::make_unique<Request>(p->clone_as(child_id));
  child->set_seq_handle(bm_.fork(p->seq_handle(), child_id));
  running_.push_back(child.get());
  if (row >= 0) {
    child->set_in_flight(true);
    step->rows.push_back(child.get());
    step->num_tokens.push_back(step->num_tokens[static_cast<size_t>(row)]);
    step->sample.push_back(1);
  }
  requests_.emplace(child_id, std::move(child));
}

void Scheduler::validate_update(const PendingStep& pending, const int32_t* num_new, int64_t num_rows,
                                const int64_t* new_token_ids, int64_t num_new_token_ids,
                                const std::vector<FinishedRequest>& finished) const {
  if (num_rows != static_cast<int64_t>(pending.rows.size())) {
    throw std::invalid_argument("num_new_tokens has " + std::to_string(num_rows) + " entries, expected " +
                                std::to_string(pending.rows.size()) + " (scheduled rows + forked children)");
  }
  for (const auto& f : finished) {
    if (!is_finished(f.second)) {
      throw std::invalid_argument(std::string("finished status must be FINISHED_* (got ") + to_string(f.second) + ")");
    }
  }
  int64_t total = 0;
  const int64_t max_accept = 1 + config_.num_lookahead_tokens;
  for (int64_t i = 0; i < num_rows; ++i) {
    const int64_t m = num_new[i];
    const Request* r = pending.rows[static_cast<size_t>(i)];
    const bool sample = pending.sample[static_cast<size_t>(i)] != 0;
    const auto where = [i, m]() { return "num_new_tokens[" + std::to_string(i) + "]=" + std::to_string(m); };
    const size_t row = static_cast<size_t>(i);
    const int32_t k = row < pending.num_base_rows ? pending.draft_start[row + 1] - pending.draft_start[row] : 0;
    const int64_t row_max = row < pending.num_base_rows ? (k > 0 ? 1 + k : max_accept) : 1;
    if (m < 0 || (!sample && m != 0) || m > row_max) {
      throw std::invalid_argument(where() + ": must be 0 for a non-sampling row, else in [1, " +
                                  std::to_string(row_max) + "]");
    }
    if (sample && m == 0 && r->status() == RequestStatus::RUNNING) {
      const bool fin = std::any_of(finished.begin(), finished.end(),
                                   [r](const FinishedRequest& f) { return f.first == r->request_id(); });
      if (!fin) throw std::invalid_argument(where() + ": a sampling row needs >= 1 token unless it finishes");
    }
    total += m;
  }
  if (total != num_new_token_ids) {
    throw std::invalid_argument("new_token_ids has " + std::to_string(num_new_token_ids) +
                                " entries but num_new_tokens sums to " + std::to_string(total));
  }
  if (pending.draft_token_ids.empty()) return;
  const int64_t* tok = new_token_ids;
  for (size_t i = 0; i < pending.num_base_rows; ++i) {
    if (pending.rows[i]->status() == RequestStatus::RUNNING) validate_accepted_drafts(pending, i, tok, num_new[i]);
    tok += num_new[i];
  }
}

void Scheduler::update(uint64_t step_id, const int32_t* num_new, int64_t num_rows, const int64_t* new_token_ids,
                       int64_t num_new_token_ids, const std::vector<FinishedRequest>& finished) {
  const auto t0 = std::chrono::steady_clock::now();
  // The oldest step with rows, or a step without rows before it (nothing to apply but `finished`).
  auto it = pending_.begin();
  while (it != pending_.end() && it->step_id != step_id && it->rows.empty()) ++it;
  if (it == pending_.end() || it->step_id != step_id) {
    throw std::invalid_argument("update(): output of step " + std::to_string(step_id) +
                                " is not the oldest pending step (each step is updated exactly once, in order)");
  }
  const PendingStep& pending = *it;
  validate_update(pending, num_new, num_rows, new_token_ids, num_new_token_ids, finished);
  const int64_t* tok = new_token_ids;
  for (int64_t i = 0; i < num_rows; ++i) {
    Request* r = pending.rows[static_cast<size_t>(i)];
    const int64_t m = num_new[i];
    if (r->status() == RequestStatus::RUNNING) {  // skip rows aborted since schedule()
      // A finishing spec row that keeps no token wrote KV past its tokens: never cache beyond them.
      int64_t computed = std::min(r->num_computed_tokens() + pending.num_tokens[static_cast<size_t>(i)],
                                  r->num_tokens());
      if (m > 0) {
        r->append_output_tokens(tok, m);
        computed = r->num_tokens() - 1;  // every accepted token's KV is written except the newest
      }
      r->set_num_computed_tokens(computed);
      bm_.cache_full_blocks(r->seq_handle(), r->all_token_ids().data(), computed);
      if (config_.num_lookahead_tokens > 0 && pending.sample[static_cast<size_t>(i)]) {
        bm_.shrink(r->seq_handle(), r->num_tokens());  // drop slots of rejected drafts
      }
      bm_.drop_outside_window(r->seq_handle(), computed);  // after caching: the blocks stay findable
    }
    tok += m;
  }
  for (const auto& f : finished) {
    Request* r = find(f.first);
    if (r != nullptr) finish_request(r, f.second);
  }
  pending_.erase(pending_.begin(), it);  // steps without rows before it
  close_pending(pending_.begin());
  last_update_us_ = micros_since(t0);
  total_update_us_ += last_update_us_;
}

const Request& Scheduler::get_request(const std::string& request_id) const {
  const Request* r = find(request_id);
  if (r == nullptr) throw UnknownRequestError(request_id);
  return *r;
}

Request* Scheduler::find(const std::string& id) const {
  const auto it = requests_.find(id);
  return it == requests_.end() ? nullptr : it->second.get();
}

void Scheduler::finish_request(Request* r, RequestStatus status) {
  if (r->status() == RequestStatus::RUNNING) {
    remove_running(r);
  } else {
    waiting_.remove(r);
  }
  if (r->seq_handle() >= 0) bm_.free(r->seq_handle());
  r->set_seq_handle(-1);
  r->set_status(status);
  auto it = requests_.find(r->request_id());
  graveyard_.push_back(std::move(it->second));  // rows of a pending step may still point at it
  requests_.erase(it);
}

void Scheduler::remove_running(Request* r) {
  const auto it = std::find(running_.begin(), running_.end(), r);
  if (it != running_.end()) running_.erase(it);
}

}  // namespace pagellm
