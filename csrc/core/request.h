// One generation request as seen by the scheduler.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace pagellm {

// Lifecycle of a request.
enum class RequestStatus : int8_t {
  WAITING = 0,
  RUNNING = 1,
  PREEMPTED = 2,
  FINISHED_STOPPED = 3,
  FINISHED_LENGTH = 4,
  FINISHED_ABORTED = 5,
};

// True for the FINISHED_* statuses.
inline bool is_finished(RequestStatus s) { return s >= RequestStatus::FINISHED_STOPPED; }
// Upper-case name of a status ("RUNNING", ...).
const char* to_string(RequestStatus s);

// A request: prompt + generated tokens and the scheduling state. The tokens to compute are
// all_token_ids()[num_computed_tokens():] (after a preemption the outputs are re-prefilled too).
class Request {
 public:
  // max_tokens: most output tokens the caller will accept (kUnlimitedTokens = up to max_model_len).
  static constexpr int64_t kUnlimitedTokens = -1;

  // Throws std::invalid_argument for an empty prompt or max_tokens neither >= 1 nor kUnlimitedTokens.
  Request(std::string request_id, std::vector<int64_t> prompt_token_ids, double arrival_time,
          int32_t priority = 0, uint64_t extra_key = 0, int64_t max_tokens = kUnlimitedTokens);

  // Request id.
  const std::string& request_id() const { return request_id_; }
  // Prompt followed by generated tokens.
  const std::vector<int64_t>& all_token_ids() const { return token_ids_; }
  // Copy of the prompt tokens.
  std::vector<int64_t> prompt_token_ids() const;
  // Copy of the generated tokens.
  std::vector<int64_t> output_token_ids() const;
  // Prompt length.
  int64_t num_prompt_tokens() const { return num_prompt_tokens_; }
  // Generated token count.
  int64_t num_output_tokens() const { return num_tokens() - num_prompt_tokens_; }
  // Prompt + generated token count.
  int64_t num_tokens() const { return static_cast<int64_t>(token_ids_.size()); }
  // Appends generated tokens.
  void append_output_tokens(const int64_t* tokens, int64_t n) { token_ids_.insert(token_ids_.end(), tokens, tokens + n); }

  // Tokens whose KV is in the cache.
  int64_t num_computed_tokens() const { return num_computed_tokens_; }
  // Sets the computed token count.
  void set_num_computed_tokens(int64_t n) { num_computed_tokens_ = n; }
  // Current status.
  RequestStatus status() const { return status_; }
  // Sets the status.
  void set_status(RequestStatus s) { status_ = s; }
  // Whether the status is FINISHED_*.
  bool finished() const { return is_finished(status_); }
  // Arrival time (seconds, caller's clock).
  double arrival_time() const { return arrival_time_; }
  // Priority: lower value = scheduled first (policy "priority").
  int32_t priority() const { return priority_; }
  // Extra key mixed into prefix hashes (cache salt / LoRA id; 0 = none).
  uint64_t extra_key() const { return extra_key_; }
  // Times this request was preempted.
  int32_t num_preemptions() const { return num_preemptions_; }
  // Counts one preemption.
  void add_preemption() { ++num_preemptions_; }
  // Prompt tokens served by the prefix cache at the last admission.
  int64_t num_cached_tokens() const { return num_cached_tokens_; }
  // Sets the prefix hit count.
  void set_num_cached_tokens(int64_t n) { num_cached_tokens_ = n; }

  // Block-manager handle while it holds blocks, else -1.
  int32_t seq_handle() const { return seq_handle_; }
  // Sets the block-manager handle.
  void set_seq_handle(int32_t h) { seq_handle_ = h; }
  // Tie-break order inside the waiting queue.
  int64_t queue_order() const { return queue_order_; }
  // Sets the waiting-queue order.
  void set_queue_order(int64_t o) { queue_order_ = o; }
  // Most output tokens (kUnlimitedTokens = no limit but max_model_len).
  int64_t max_tokens() const { return max_tokens_; }
  // Output tokens it may still produce: min(max_tokens - outputs, max_model_len - tokens), >= 0.
  int64_t num_remaining_tokens(int64_t max_model_len) const;
  // Draft tokens proposed for the next step (speculative decoding); empty = none.
  const std::vector<int64_t>& draft_token_ids() const { return draft_token_ids_; }
  // Sets the drafts for the next step (the scheduler validates and clamps them).
  void set_draft_token_ids(std::vector<int64_t> drafts) { draft_token_ids_ = std::move(drafts); }
  // Drops the drafts (consumed by schedule(), or lost to a preemption).
  void clear_draft_token_ids() { draft_token_ids_.clear(); }
  // Whether a scheduled step of this request awaits update() (pipeline micro-batches: not scheduled again
  // until then, since its next step needs that step's token and progress).
  bool in_flight() const { return in_flight_; }
  // Sets the in-flight mark (schedule() sets it, update() / abort_pending_step() clear it).
  void set_in_flight(bool v) { in_flight_ = v; }
  // Copy of this request under a new id (for fork): same tokens, state, priority and arrival; no drafts.
  Request clone_as(const std::string& new_id) const;

 private:
  std::string request_id_;
  std::vector<int64_t> token_ids_;
  int64_t num_prompt_tokens_;
  int64_t num_computed_tokens_ = 0;
  RequestStatus status_ = RequestStatus::WAITING;
  double arrival_time_;
  int32_t priority_;
  uint64_t extra_key_;
  int64_t max_tokens_;
  std::vector<int64_t> draft_token_ids_;
  int32_t num_preemptions_ = 0;
  int64_t num_cached_tokens_ = 0;
  int32_t seq_handle_ = -1;
  int64_t queue_order_ = 0;
  bool in_flight_ = false;
};

}  // namespace pagellm
