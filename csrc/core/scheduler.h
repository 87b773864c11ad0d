// Iteration-level continuous-batching scheduler (unified prefill/decode, chunked prefill, preemption
// by recompute, prefix caching, fork for n>1 sampling, spec-decode lookahead slots).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/block_manager.h"
#include "core/kv_cache_coordinator.h"
#include "core/request.h"
#include "core/scheduler_config.h"
#include "core/scheduler_output.h"
#include "core/waiting_queue.h"

namespace pagellm {

// Thrown for a request id the scheduler does not know (Python: KeyError).
class UnknownRequestError : public std::out_of_range {
 public:
  // Builds "unknown request '<id>'".
  explicit UnknownRequestError(const std::string& id) : std::out_of_range("unknown request '" + id + "'") {}
};

// A request finished by the caller in update(): (request id, FINISHED_* status).
using FinishedRequest = std::pair<std::string, RequestStatus>;

// Step protocol: optionally set_draft_tokens(); out = schedule(); run the model (apply out.cow_copies
// first); optionally fork(); update(out, ...). A step with rows is "pending" until its update();
// schedule() refuses to run while max_steps_in_flight (default 1) are pending. Single-threaded.
// Pipeline micro-batches (max_steps_in_flight > 1): schedule() hands out further steps over disjoint
// requests before the earlier ones are updated; a request of a pending step is "in flight" and neither
// scheduled again nor preempted until its step's update(). Steps are updated in the order scheduled.
// Speculative decoding: num_lookahead_tokens (L) is the most drafts a request may get per step. Every
// sampling row reserves L slots after its token; a spec row's k <= L drafts occupy the first k of them.
class Scheduler {
 public:
  // Throws std::invalid_argument naming an invalid config field.
  Scheduler(const SchedulerConfig& config, const CacheConfig& cache_config);

  // Queues a new request. max_tokens bounds its outputs (Request::kUnlimitedTokens = up to
  // max_model_len); it only clamps drafts, the caller still decides when the request finishes.
  // Throws std::invalid_argument (state untouched) for an empty prompt, a prompt longer than
  // max_model_len (or max_num_batched_tokens without chunked prefill, or the KV cache), a live
  // duplicate id or max_tokens neither >= 1 nor kUnlimitedTokens.
  void add_request(const std::string& request_id, std::vector<int64_t> prompt_token_ids,
                   double arrival_time, int32_t priority = 0, uint64_t extra_key = 0,
                   int64_t max_tokens = Request::kUnlimitedTokens);
  // Gives a running, decode-ready request (num_computed == num_tokens - 1) draft tokens for the next
  // schedule() (an empty list clears them). Drafts beyond what the request may still produce (its
  // max_tokens and max_model_len, less the bonus token) are dropped; returns the number kept. The next
  // schedule() consumes every request's drafts, scheduled or not (a preempted request drops them); a
  // budget too small for all of them keeps a prefix. Throws UnknownRequestError for an unknown id,
  // std::invalid_argument for more than num_lookahead_tokens drafts, a negative token id or a request
  // that is not decode-ready, std::logic_error while a step is pending (with max_steps_in_flight > 1:
  // while the request's own step is pending); state is untouched then.
  int32_t set_draft_tokens(const std::string& request_id, std::vector<int64_t> draft_token_ids);
  // Changes the most drafts per request and step (the lookahead slots reserved per sampling row).
  // Drops every request's drafts. Throws std::invalid_argument outside [0, 256] or if a waiting
  // request's prompt would no longer fit the KV cache, std::logic_error while a step is pending.
  void set_num_lookahead_tokens(int32_t num_lookahead_tokens);
  // Tree speculation: replaces the pending step's recorded drafts (flat, each row's count unchanged)
  // before update(), so a row whose accepted path was not its leading drafts can commit it: the caller
  // puts that path first (and moved its KV into the row's first lookahead slots). Throws
  // std::invalid_argument for another total count or a negative id, std::logic_error with no pending step.
  void set_pending_draft_tokens(std::vector<int64_t> draft_token_ids);
  // Lets schedule() hand out up to n steps before their update() (pipeline micro-batches; 1 = one step
  // at a time). Throws std::invalid_argument outside [1, 64], std::logic_error while a step is pending.
  void set_max_steps_in_flight(int32_t n);
  // The most steps with rows that may await update() at once.
  int32_t max_steps_in_flight() const { return max_steps_in_flight_; }
  // Steps with rows awaiting update().
  int32_t num_steps_in_flight() const;
  // Ids of the running requests that are decode-ready (may take drafts) and not in flight, in running order.
  std::vector<std::string> decode_ready_request_ids() const;
  // Builds the next batch (see SchedulerOutput) from requests not in flight. Throws std::logic_error if
  // max_steps_in_flight steps with scheduled rows await update().
  std::unique_ptr<SchedulerOutput> schedule();
  // Applies the model results of the oldest pending step (step_id). Row i of num_new_tokens is the number of tokens
  // accepted for scheduled row i (0 for non-sampling prefill chunks, 1 for a normal sample,
  // 1..1+k for a spec row with k drafts, whose first m - 1 tokens must equal its first drafts;
  // 1..1+num_lookahead_tokens for another sampling row whose lookahead KV the caller wrote itself),
  // followed by one entry per child forked into the step (0 or 1: the drafts' KV was written for the
  // parent only). Slots of rejected drafts are freed; num_computed_tokens becomes num_tokens - 1, so
  // prefix-cache hashes only ever cover accepted tokens.
  // new_token_ids holds those tokens back to back. Then finishes the `finished` requests.
  // Throws std::invalid_argument (state untouched) on inconsistent input.
  void update(uint64_t step_id, const int32_t* num_new_tokens, int64_t num_rows,
              const int64_t* new_token_ids, int64_t num_new_token_ids,
              const std::vector<FinishedRequest>& finished);
  // Aborts a live request and frees its blocks at once (also while its step is in flight: that step's
  // update() skips the row); false if unknown or already finished.
  bool abort(const std::string& request_id);
  // Closes pending step step_id (0: the oldest) without applying it (its model run or sampling failed):
  // every request still live among its rows (scheduled, or forked into it) is aborted and its blocks
  // freed, so no KV written by the failed step is ever cached or reused. Other pending steps stay.
  // Returns the ids aborted; a no-op when no such step is pending.
  std::vector<std::string> abort_pending_step(uint64_t step_id = 0);
  // Creates child_id as a RUNNING copy of parent_id sharing its blocks. Allowed when the parent is
  // RUNNING and either (a) it is a sampling row (decode or last prefill chunk) of the oldest pending step:
  // the child joins that step as an extra row, or (b) it is not in flight and is decode-ready
  // (num_computed == num_tokens - 1). Throws UnknownRequestError / std::invalid_argument otherwise.
  void fork(const std::string& parent_id, const std::string& child_id);

  // Requests waiting (new or preempted).
  int32_t num_waiting() const { return waiting_.size(); }
  // Requests running.
  int32_t num_running() const { return static_cast<int32_t>(running_.size()); }
  // Whether any request is waiting or running.
  bool has_unfinished_requests() const { return !requests_.empty(); }
  // Live request by id; throws UnknownRequestError (finished requests are forgotten).
  const Request& get_request(const std::string& request_id) const;
  // All live requests.
  const std::unordered_map<std::string, std::unique_ptr<Request>>& requests() const { return requests_; }
  // The KV block manager of group 0 (the only one unless the cache is hybrid).
  const BlockManager& block_manager() const { return bm_.group(0); }
  // Every KV-cache group's block manager.
  const KVCacheCoordinator& kv_cache() const { return bm_; }
  // Drops every cached prefix hash (see BlockManager::reset_prefix_cache).
  bool reset_prefix_cache() { return bm_.reset_prefix_cache(); }
  // The scheduler config.
  const SchedulerConfig& config() const { return config_; }
  // The cache config.
  const CacheConfig& cache_config() const { return cache_config_; }
  // Whether a step awaits update() (a step without rows counts until the next schedule()).
  bool has_pending_step() const { return !pending_.empty(); }

  // C++ time of the last schedule() call, microseconds.
  double last_schedule_us() const { return last_schedule_us_; }
  // C++ time of the last update() call, microseconds.
  double last_update_us() const { return last_update_us_; }
  // Cumulative C++ time of schedule() calls, microseconds.
  double total_schedule_us() const { return total_schedule_us_; }
  // Cumulative C++ time of update() calls, microseconds.
  double total_update_us() const { return total_update_us_; }
  // Number of schedule() calls.
  int64_t num_steps() const { return static_cast<int64_t>(step_counter_); }

 private:
  // One scheduled row while the batch is being built.
  struct Row {
    Request* req;
    int32_t num_tokens;  // query length (1 + num_drafts for a spec row)
    bool sample;
    int32_t num_drafts;  // the first num_drafts of req's drafts ride in this row
  };
  // The step between schedule() and update().
  struct PendingStep {
    uint64_t step_id = 0;
    std::vector<Request*> rows;
    std::vector<int32_t> num_tokens;
    std::vector<uint8_t> sample;
    std::vector<int32_t> draft_start;    // [num_base_rows + 1] offsets of each base row's drafts
    std::vector<int64_t> draft_token_ids;
    size_t num_base_rows = 0;  // rows from schedule(); later rows are children forked into the step
  };

  // Live request or nullptr.
  Request* find(const std::string& id) const;
  // Grows running requests by one decode token or their next prefill chunk.
  void schedule_running(int64_t& budget, std::vector<Row>& rows, std::vector<std::string>& preempted);
  // Admits waiting requests while blocks, seats and budget allow.
  void schedule_waiting(int64_t& budget, std::vector<Row>& rows);
  // Tokens of r to compute this step given `computed` and the budget (0 = cannot schedule).
  int64_t chunk_size(const Request& r, int64_t computed, int64_t budget) const;
  // Running request not in flight with the largest (priority, arrival_time); latest in running order on ties.
  Request* pick_victim() const;
  // Preempts by recompute: frees blocks, resets progress, requeues at the front, unschedules.
  void preempt(Request* victim, int64_t& budget, std::vector<Row>& rows, std::vector<std::string>& preempted);
  // Fills the output arrays (decodes first) and records the pending step.
  std::unique_ptr<SchedulerOutput> build_output(std::vector<Row>& rows, std::vector<std::string>& preempted);
  // Fills the flat token arrays, block tables and copy-on-write pairs.
  void fill_token_arrays(SchedulerOutput& out, const std::vector<Row>& rows, int32_t max_blocks);
  // Queues the rows (and their drafts, flat) of the step that update() will apply; marks them in flight.
  void record_pending(uint64_t step_id, const std::vector<Row>& rows, const std::vector<int64_t>& draft_token_ids);
  // Fills the per-token arrays of one row starting at flat token index t.
  void fill_row_tokens(SchedulerOutput& out, const Row& row, int64_t t) const;
  // Drafts of a decode-ready r that fit the budget (0 if none or r is not decode-ready).
  int32_t drafts_to_schedule(const Request& r, int64_t n, int64_t budget) const;
  // Drops the drafts of every running request after schedule() consumed them.
  void clear_all_drafts();
  // The oldest pending step with rows (nullptr if none).
  const PendingStep* oldest_pending() const;
  PendingStep* oldest_pending() { return const_cast<PendingStep*>(std::as_const(*this).oldest_pending()); }
  // Removes pending step `it`, clearing its rows' in-flight marks.
  void close_pending(std::deque<PendingStep>::iterator it);
  // Checks update() arguments without changing anything; throws std::invalid_argument.
  void validate_update(const PendingStep& p, const int32_t* num_new, int64_t num_rows, const int64_t* new_token_ids,
                       int64_t num_new_token_ids, const std::vector<FinishedRequest>& finished) const;
  // Checks that a spec row's accepted tokens start with its drafts; throws std::invalid_argument.
  void validate_accepted_drafts(const PendingStep& p, size_t row, const int64_t* tokens, int64_t m) const;
  // Throws std::logic_error naming `what` while a step with rows awaits update().
  void require_no_pending_step(const char* what) const;
  // Most blocks of group g a prompt of num_tokens holds at once (its longest chunk, the window, the lookahead).
  int64_t admission_blocks(int64_t num_tokens, int32_t num_lookahead, size_t g = 0) const;
  // Blocks of group g admission may hand out: all but the reserved null block and the watermark.
  int64_t admissible_blocks(size_t g = 0) const;
  // A hybrid cache's slot mappings of groups 1.. for one row starting at flat token index t.
  void fill_group_slots(SchedulerOutput& out, const Row& row, int64_t t) const;
  // Finishes a live request with a FINISHED_* status and frees its blocks.
  void finish_request(Request* r, RequestStatus status);
  // Removes r from the running list.
  void remove_running(Request* r);

  SchedulerConfig config_;
  CacheConfig cache_config_;
  KVCacheCoordinator bm_;  // one BlockManager per KV-cache group (usually one)
  std::unordered_map<std::string, std::unique_ptr<Request>> requests_;
  std::vector<std::unique_ptr<Request>> graveyard_;  // finished, possibly still rows of a pending step
  WaitingQueue waiting_;
  std::vector<Request*> running_;
  std::deque<PendingStep> pending_;  // in schedule() order; a step without rows is dropped by the next schedule()
  int32_t max_steps_in_flight_ = 1;
  int32_t row_limit_ = 0;  // rows this schedule() may take: max_num_seqs, or a micro-batch's share of it
  uint64_t step_counter_ = 0;
  int32_t block_shift_ = 0;
  bool has_drafts_ = false;  // some request holds drafts (keeps schedule() free of a loop otherwise)
  double last_schedule_us_ = 0, last_update_us_ = 0, total_schedule_us_ = 0, total_update_us_ = 0;
};

}  // namespace pagellm
