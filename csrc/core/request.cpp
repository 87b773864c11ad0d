#include "core/request.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

namespace pagellm {

const char* to_string(RequestStatus s) {
  switch (s) {
    case RequestStatus::WAITING: return "WAITING";
    case RequestStatus::RUNNING: return "RUNNING";
    case RequestStatus::PREEMPTED: return "PREEMPTED";
    case RequestStatus::FINISHED_STOPPED: return "FINISHED_STOPPED";
    case RequestStatus::FINISHED_LENGTH: return "FINISHED_LENGTH";
    case RequestStatus::FINISHED_ABORTED: return "FINISHED_ABORTED";
  }
  return "UNKNOWN";
}

Request::Request(std::string request_id, std::vector<int64_t> prompt_token_ids, double arrival_time,
                 int32_t priority, uint64_t extra_key, int64_t max_tokens)
    : request_id_(std::move(request_id)),
      token_ids_(std::move(prompt_token_ids)),
      num_prompt_tokens_(static_cast<int64_t>(token_ids_.size())),
      arrival_time_(arrival_time),
      priority_(priority),
      extra_key_(extra_key),
      max_tokens_(max_tokens) {
  if (token_ids_.empty()) throw std::invalid_argument("prompt_token_ids must not be empty");
  if (max_tokens < 1 && max_tokens != kUnlimitedTokens) {
    throw std::invalid_argument("max_tokens must be >= 1 or -1 (unlimited) (got " + std::to_string(max_tokens) + ")");
  }
}

int64_t Request::num_remaining_tokens(int64_t max_model_len) const {
  int64_t n = max_model_len - num_tokens();
  if (max_tokens_ != kUnlimitedTokens) n = std::min(n, max_tokens_ - num_output_tokens());
  return std::max<int64_t>(n, 0);
}

std::vector<int64_t> Request::prompt_token_ids() const {
  return std::vector<int64_t>(token_ids_.begin(), token_ids_.begin() + num_prompt_tokens_);
}

std::vector<int64_t> Request::output_token_ids() const {
  return std::vector<int64_t>(token_ids_.begin() + num_prompt_tokens_, token_ids_.end());
}

Request Request::clone_as(const std::string& new_id) const {
  Request r(*this);
  r.request_id_ = new_id;
  r.seq_handle_ = -1;
  r.num_preemptions_ = 0;
  r.draft_token_ids_.clear();
  return r;
}

}  // namespace pagellm
