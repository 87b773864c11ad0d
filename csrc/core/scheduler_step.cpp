// Scheduler::schedule(): batch construction, preemption and the SchedulerOutput arrays.
#include <algorithm>
#include <chrono>
#include <cstring>

#include "core/scheduler.h"

namespace pagellm {

std::unique_ptr<SchedulerOutput> Scheduler::schedule() {
  const auto t0 = std::chrono::steady_clock::now();
  if (num_steps_in_flight() >= max_steps_in_flight_) {
    throw std::logic_error("schedule(): call update() for step " + std::to_string(oldest_pending()->step_id) +
                           " first");
  }
  pending_.erase(std::remove_if(pending_.begin(), pending_.end(), [](const PendingStep& p) { return p.rows.empty(); }),
                 pending_.end());
  // Finished requests no pending step references any more (rows of a step keep their in-flight mark).
  graveyard_.erase(std::remove_if(graveyard_.begin(), graveyard_.end(),
                                  [](const std::unique_ptr<Request>& r) { return !r->in_flight(); }),
                   graveyard_.end());
  int64_t budget = config_.max_num_batched_tokens;
  row_limit_ = config_.max_num_seqs;
  if (max_steps_in_flight_ > 1) {  // an even share of the live requests, so every micro-batch has rows
    const int64_t live =
        std::min<int64_t>(config_.max_num_seqs, static_cast<int64_t>(running_.size()) + waiting_.size());
    row_limit_ = static_cast<int32_t>(std::max<int64_t>(1, (live + max_steps_in_flight_ - 1) / max_steps_in_flight_));
  }
  std::vector<Row> rows;
  rows.reserve(running_.size() + 8);
  std::vector<std::string> preempted;
  schedule_running(budget, rows, preempted);
  if (preempted.empty()) schedule_waiting(budget, rows);  // no admissions in a step that preempted
  auto out = build_output(rows, preempted);
  if (has_drafts_) clear_all_drafts();  // drafts are for this step only
  last_schedule_us_ = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  total_schedule_us_ += last_schedule_us_;
  return out;
}

int64_t Scheduler::chunk_size(const Request& r, int64_t computed, int64_t budget) const {
  const int64_t remaining = r.num_tokens() - computed;
  if (!config_.enable_chunked_prefill) return remaining <= budget ? remaining : 0;
  int64_t n = remaining;
  if (config_.long_prefill_token_threshold > 0) n = std::min<int64_t>(n, config_.long_prefill_token_threshold);
  return std::min(n, budget);
}

void Scheduler::schedule_running(int64_t& budget, std::vector<Row>& rows, std::vector<std::string>& preempted) {
  const std::vector<Request*> snapshot = running_;  // preemption edits running_
  const int32_t lookahead = config_.num_lookahead_tokens;
  for (Request* r : snapshot) {
    if (budget <= 0 || static_cast<int32_t>(rows.size()) >= row_limit_) break;
    if (r->status() != RequestStatus::RUNNING || r->in_flight()) continue;  // preempted earlier; awaits update()
    const int64_t computed = r->num_computed_tokens();
    const int64_t n = chunk_size(*r, computed, budget);
    if (n <= 0) continue;
    const bool sample = computed + n == r->num_tokens();
    const int32_t k = has_drafts_ ? drafts_to_schedule(*r, n, budget) : 0;
    // A spec row's drafts take the first k of its L lookahead slots: the reservation is unchanged.
    bool scheduled = true;
    while (!bm_.append_slots(r->seq_handle(), computed, n + k, sample ? lookahead - k : 0)) {
      Request* victim = pick_victim();
      preempt(victim, budget, rows, preempted);
      if (victim == r) {
        scheduled = false;
        break;
      }
    }
    if (!scheduled) break;
    rows.push_back(Row{r, static_cast<int32_t>(n + k), sample, k});
    budget -= n + k;
  }
}

void Scheduler::schedule_waiting(int64_t& budget, std::vector<Row>& rows) {
  const int32_t lookahead = config_.num_lookahead_tokens;
  while (!waiting_.empty() && budget > 0 && static_cast<int32_t>(running_.size()) < config_.max_num_seqs &&
         static_cast<int32_t>(rows.size()) < row_limit_) {
    Request* r = waiting_.front();
    const std::vector<int64_t>& tokens = r->all_token_ids();
    const HybridPrefixMatch match = bm_.find_cached_prefix(tokens.data(), r->num_tokens(), r->extra_key());
    const int64_t computed = match.num_tokens(cache_config_.block_size);
    const int64_t n = chunk_size(*r, computed, budget);
    if (n <= 0) break;  // head of line does not fit the budget (chunked prefill off)
    const bool sample = computed + n == r->num_tokens();
    const int32_t h = bm_.allocate(r->request_id(), match, n, sample ? lookahead : 0, r->extra_key());
    if (h < 0) break;  // not enough free blocks above the watermark
    waiting_.pop_front();
    r->set_seq_handle(h);
    r->set_status(RequestStatus::RUNNING);
    r->set_num_computed_tokens(computed);
    r->set_num_cached_tokens(computed);
    running_.push_back(r);
    rows.push_back(Row{r, static_cast<int32_t>(n), sample, 0});
    budget -= n;
  }
}

Request* Scheduler::pick_victim() const {
  Request* victim = nullptr;
  for (Request* r : running_) {
    if (r->in_flight()) continue;  // a pending step writes its KV: never free its blocks under it
    if (victim == nullptr || r->priority() > victim->priority() ||
        (r->priority() == victim->priority() && r->arrival_time() >= victim->arrival_time())) {
      victim = r;
    }
  }
  return victim;
}

void Scheduler::preempt(Request* victim, int64_t& budget, std::vector<Row>& rows,
                        std::vector<std::string>& preempted) {
  bm_.free(victim->seq_handle());
  victim->set_seq_handle(-1);
  victim->set_status(RequestStatus::PREEMPTED);
  victim->set_num_computed_tokens(0);
  victim->add_preemption();
  victim->clear_draft_token_ids();
  remove_running(victim);
  waiting_.push_front(victim);
  preempted.push_back(victim->request_id());
  const auto it = std::find_if(rows.begin(), rows.end(), [victim](const Row& row) { return row.req == victim; });
  if (it != rows.end()) {
    budget += it->num_tokens;
    rows.erase(it);
  }
}

void Scheduler::fill_row_tokens(SchedulerOutput& out, const Row& row, int64_t t) const {
  const Request& r = *row.req;
  const int64_t c = r.num_computed_tokens();
  const int64_t* ids = r.all_token_ids().data();
  const int32_t* table = bm_.block_table(r.seq_handle()).data();
  const int64_t mask = cache_config_.block_size - 1;
  const int64_t num_real = row.num_tokens - row.num_drafts;  // tokens the request has; drafts follow
  std::copy_n(ids + c, num_real, out.input_ids.begin() + t);
  std::copy_n(r.draft_token_ids().begin(), row.num_drafts, out.input_ids.begin() + t + num_real);
  for (int64_t k = 0; k < row.num_tokens; ++k) {
    const int64_t p = c + k;
    out.positions[static_cast<size_t>(t + k)] = p;
    out.slot_mapping[static_cast<size_t>(t + k)] = (static_cast<int64_t>(table[p >> block_shift_]) << block_shift_) | (p & mask);
  }
  if (bm_.num_groups() > 1) fill_group_slots(out, row, t);
}

void Scheduler::fill_group_slots(SchedulerOutput& out, const Row& row, int64_t t) const {
  const int64_t c = row.req->num_computed_tokens();
  const int64_t mask = cache_config_.block_size - 1;
  for (size_t g = 1; g < bm_.num_groups(); ++g) {
    const int32_t* table = bm_.block_table(row.req->seq_handle(), g).data();
    int64_t* slots = out.group_slot_mappings[g - 1].data() + t;
    for (int64_t k = 0; k < row.num_tokens; ++k) {
      const int64_t p = c + k;
      slots[k] = (static_cast<int64_t>(table[p >> block_shift_]) << block_shift_) | (p & mask);
    }
  }
}

std::unique_ptr<SchedulerOutput> Scheduler::build_output(std::vector<Row>& rows, std::vector<std::string>& preempted) {
  std::stable_partition(rows.begin(), rows.end(), [](const Row& r) { return r.num_tokens == 1; });
  auto out = std::make_unique<SchedulerOutput>();
  const size_t R = rows.size();
  out->step_id = ++step_counter_;
  out->preempted_request_ids = std::move(preempted);
  out->request_ids.reserve(R);
  out->num_scheduled_tokens.resize(R);
  out->query_start_loc.resize(R + 1);
  out->num_computed_tokens.resize(R);
  out->seq_lens.resize(R);
  out->do_sample.resize(R);
  out->num_draft_tokens.resize(R);
  int64_t total = 0;
  int32_t max_blocks = 0;
  for (size_t i = 0; i < R; ++i) {
    const Row& row = rows[i];
    out->request_ids.push_back(row.req->request_id());
    out->num_scheduled_tokens[i] = row.num_tokens;
    out->query_start_loc[i] = static_cast<int32_t>(total);
    out->num_computed_tokens[i] = static_cast<int32_t>(row.req->num_computed_tokens());
    out->seq_lens[i] = out->num_computed_tokens[i] + row.num_tokens;
    out->do_sample[i] = row.sample ? 1 : 0;
    out->num_decode_reqs += row.num_tokens == 1 ? 1 : 0;
    out->num_draft_tokens[i] = row.num_drafts;
    total += row.num_tokens;
    max_blocks = std::max(max_blocks, static_cast<int32_t>(bm_.block_table(row.req->seq_handle()).size()));
    if (row.sample) {
      for (int64_t j = total - 1 - row.num_drafts; j < total; ++j) out->logits_indices.push_back(j);
    }
    if (row.num_drafts > 0) {
      const auto& d = row.req->draft_token_ids();
      out->draft_token_ids.insert(out->draft_token_ids.end(), d.begin(), d.begin() + row.num_drafts);
    }
  }
  out->query_start_loc[R] = static_cast<int32_t>(total);
  fill_token_arrays(*out, rows, max_blocks);
  record_pending(out->step_id, rows, out->draft_token_ids);
  return out;
}

void Scheduler::fill_token_arrays(SchedulerOutput& o, const std::vector<Row>& rows, int32_t max_blocks) {
  SchedulerOutput* out = &o;
  const size_t R = rows.size();
  const int64_t total = out->query_start_loc[R];
  out->total_num_scheduled_tokens = total;
  out->input_ids.resize(static_cast<size_t>(total));
  out->positions.resize(static_cast<size_t>(total));
  out->slot_mapping.resize(static_cast<size_t>(total));
  out->max_blocks_in_batch = max_blocks;
  out->block_tables.resize(R * static_cast<size_t>(max_blocks));  // uninitialized: every entry is written below
  const size_t num_extra = bm_.num_groups() - 1;  // a hybrid cache's groups 1..: same shapes, their own ids
  if (num_extra > 0) {
    out->group_slot_mappings.assign(num_extra, std::vector<int64_t>(static_cast<size_t>(total)));
    out->group_block_tables.resize(num_extra);
    for (auto& t : out->group_block_tables) t.resize(R * static_cast<size_t>(max_blocks));
  }
  for (size_t i = 0; i < R; ++i) {
    fill_row_tokens(*out, rows[i], out->query_start_loc[i]);
    const std::vector<int32_t>& table = bm_.block_table(rows[i].req->seq_handle());
    int32_t* dst = out->block_tables.data() + i * static_cast<size_t>(max_blocks);
    std::memcpy(dst, table.data(), table.size() * sizeof(int32_t));
    std::fill(dst + table.size(), dst + max_blocks, 0);
    for (size_t g = 1; g <= num_extra; ++g) {  // every group's table has group 0's length
      const std::vector<int32_t>& gt = bm_.block_table(rows[i].req->seq_handle(), g);
      int32_t* gdst = out->group_block_tables[g - 1].data() + i * static_cast<size_t>(max_blocks);
      std::memcpy(gdst, gt.data(), gt.size() * sizeof(int32_t));
      std::fill(gdst + gt.size(), gdst + max_blocks, 0);
    }
  }
  for (const GroupCowCopy& c : bm_.take_cow_copies()) {
    out->cow_copies.push_back(c.src);
    out->cow_copies.push_back(c.dst);
    if (num_extra > 0) out->cow_copy_groups.push_back(c.group);
  }
}

void Scheduler::record_pending(uint64_t step_id, const std::vector<Row>& rows,
                               const std::vector<int64_t>& draft_token_ids) {
  PendingStep& p = pending_.emplace_back();
  p.step_id = step_id;
  p.draft_start.assign(1, 0);
  p.draft_token_ids = draft_token_ids;
  p.num_base_rows = rows.size();
  for (const Row& row : rows) {
    row.req->set_in_flight(true);
    p.rows.push_back(row.req);
    p.num_tokens.push_back(row.num_tokens);
    p.sample.push_back(row.sample ? 1 : 0);
    p.draft_start.push_back(p.draft_start.back() + row.num_drafts);
  }
}

}  // namespace pagellm
