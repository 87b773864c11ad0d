// Scheduler: draft tokens for speculative decoding (set, schedule as spec rows, check on update).
#include <algorithm>

#include "core/scheduler.h"

namespace pagellm {

namespace {

bool decode_ready(const Request& r) {
  return r.status() == RequestStatus::RUNNING && r.num_computed_tokens() == r.num_tokens() - 1;
}

}  // namespace

void Scheduler::require_no_pending_step(const char* what) const {
  const PendingStep* p = oldest_pending();
  if (p != nullptr) {
    throw std::logic_error(std::string(what) + ": call update() for step " + std::to_string(p->step_id) + " first");
  }
}

int32_t Scheduler::set_draft_tokens(const std::string& request_id, std::vector<int64_t> draft_token_ids) {
  Request* r = find(request_id);
  if (r == nullptr) throw UnknownRequestError(request_id);
  const int64_t k = static_cast<int64_t>(draft_token_ids.size());
  if (k > config_.num_lookahead_tokens) {
    throw std::invalid_argument("set_draft_tokens: " + std::to_string(k) + " drafts for '" + request_id +
                                "', at most num_lookahead_tokens=" + std::to_string(config_.num_lookahead_tokens));
  }
  if (std::any_of(draft_token_ids.begin(), draft_token_ids.end(), [](int64_t t) { return t < 0; })) {
    throw std::invalid_argument("set_draft_tokens: draft token ids must be >= 0");
  }
  // One step at a time: drafts wait for the pending step's update(). Micro-batches: only a request of a
  // pending step must wait (its tokens are not known yet); the others are the next step's candidates.
  if (max_steps_in_flight_ == 1) {
    require_no_pending_step("set_draft_tokens");
  } else if (r->in_flight()) {
    throw std::logic_error("set_draft_tokens: '" + request_id + "' is in flight: call update() for its step first");
  }
  if (!decode_ready(*r)) {
    throw std::invalid_argument("set_draft_tokens: '" + request_id + "' is not decode-ready (status " +
                                to_string(r->status()) + ", computed " + std::to_string(r->num_computed_tokens()) +
                                " of " + std::to_string(r->num_tokens()) + " tokens)");
  }
  // The step emits up to k accepted drafts plus one more token: keep room for that one.
  const int64_t room = std::max<int64_t>(r->num_remaining_tokens(config_.max_model_len) - 1, 0);
  if (k > room) draft_token_ids.resize(static_cast<size_t>(room));
  const int32_t kept = static_cast<int32_t>(draft_token_ids.size());
  r->set_draft_token_ids(std::move(draft_token_ids));
  has_drafts_ |= kept > 0;
  return kept;
}

void Scheduler::set_num_lookahead_tokens(int32_t num_lookahead_tokens) {
  SchedulerConfig c = config_;
  c.num_lookahead_tokens = num_lookahead_tokens;
  c.validate();
  require_no_pending_step("set_num_lookahead_tokens");
  const int64_t usable = admissible_blocks();
  for (const auto& kv : requests_) {  // the admission check of add_request, redone for waiting prompts
    const Request& r = *kv.second;
    if (r.status() == RequestStatus::RUNNING) continue;
    if (admission_blocks(r.num_tokens(), num_lookahead_tokens) > usable) {
      throw std::invalid_argument("num_lookahead_tokens=" + std::to_string(num_lookahead_tokens) +
                                  " would leave waiting request '" + r.request_id() + "' unable to fit the KV cache");
    }
  }
  config_.num_lookahead_tokens = num_lookahead_tokens;
  clear_all_drafts();
}

void Scheduler::set_pending_draft_tokens(std::vector<int64_t> draft_token_ids) {
  if (pending_.empty()) throw std::logic_error("set_pending_draft_tokens: no step is pending");
  PendingStep& pending = oldest_pending() != nullptr ? *oldest_pending() : pending_.front();
  if (draft_token_ids.size() != pending.draft_token_ids.size()) {
    throw std::invalid_argument("set_pending_draft_tokens: " + std::to_string(draft_token_ids.size()) +
                                " draft ids, the pending step has " +
                                std::to_string(pending.draft_token_ids.size()));
  }
  if (std::any_of(draft_token_ids.begin(), draft_token_ids.end(), [](int64_t t) { return t < 0; })) {
    throw std::invalid_argument("set_pending_draft_tokens: draft token ids must be >= 0");
  }
  pending.draft_token_ids = std::move(draft_token_ids);
}

std::vector<std::string> Scheduler::decode_ready_request_ids() const {
  std::vector<std::string> ids;
  ids.reserve(running_.size());
  for (const Request* r : running_) {
    if (decode_ready(*r) && !r->in_flight()) ids.push_back(r->request_id());
  }
  return ids;
}

int32_t Scheduler::drafts_to_schedule(const Request& r, int64_t n, int64_t budget) const {
  const int64_t k = static_cast<int64_t>(r.draft_token_ids().size());
  if (k == 0 || n != 1 || r.num_computed_tokens() != r.num_tokens() - 1) return 0;
  return static_cast<int32_t>(std::max<int64_t>(std::min(k, budget - 1), 0));
}

void Scheduler::clear_all_drafts() {
  for (Request* r : running_) r->clear_draft_token_ids();
  has_drafts_ = false;
}

void Scheduler::validate_accepted_drafts(const PendingStep& pending, size_t row, const int64_t* tokens,
                                         int64_t m) const {
  const int32_t start = pending.draft_start[row];
  const int32_t k = pending.draft_start[row + 1] - start;
  // Tokens 0..m-2 were computed from the drafts' KV: they must be those drafts.
  for (int64_t j = 0; j + 1 < m && j < k; ++j) {
    if (tokens[j] != pending.draft_token_ids[static_cast<size_t>(start + j)]) {
      throw std::invalid_argument("update(): accepted token " + std::to_string(j) + " of row " + std::to_string(row) +
                                  " is " + std::to_string(tokens[j]) + " but draft " + std::to_string(j) + " was " +
                                  std::to_string(pending.draft_token_ids[static_cast<size_t>(start + j)]) +
                                  " (only the last accepted token may differ from the drafts)");
    }
  }
}

}  // namespace pagellm
