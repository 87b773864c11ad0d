// pybind11 bindings of the pure C++ core (no torch): RequestStatus, Request, BlockManager,
// SchedulerOutput (zero-copy numpy views) and Scheduler.
#include "bindings/py_core.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <chrono>
#include <optional>

#include "core/block_manager.h"
#include "core/scheduler.h"

namespace py = pybind11;

namespace pagellm {
namespace {

// Read-only-ownership numpy view of a vector owned by `owner` (the Python SchedulerOutput).
template <typename T, typename Alloc>
py::array view(py::handle owner, const std::vector<T, Alloc>& v, std::vector<py::ssize_t> shape,
               const py::dtype& dt = py::dtype::of<T>()) {
  if (v.empty()) return py::array(dt, shape);
  return py::array(dt, shape, v.data(), owner);
}

// Defines a read-only numpy-view property over a vector member of SchedulerOutput.
template <typename T, typename Alloc, typename ShapeFn>
void def_view(py::class_<SchedulerOutput>& cls, const char* name, std::vector<T, Alloc> SchedulerOutput::*member,
              ShapeFn shape, const char* dtype = nullptr) {
  cls.def_property_readonly(name, [member, shape, dtype](py::object self) {
    const SchedulerOutput& o = self.cast<const SchedulerOutput&>();
    return view(self, o.*member, shape(o), dtype ? py::dtype(dtype) : py::dtype::of<T>());
  });
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

BlockManager::Handle seq_handle(const BlockManager& bm, const std::string& id) {
  const BlockManager::Handle h = bm.handle(id);
  if (h < 0) throw UnknownRequestError(id);
  return h;
}

// Number of new tokens to allocate: -1 = everything after the cached prefix.
int64_t resolve_new(const std::vector<int64_t>& t, const PrefixMatch& m, int32_t bs, int64_t num_new) {
  return num_new < 0 ? static_cast<int64_t>(t.size()) - m.num_tokens(bs) : num_new;
}

void bind_request(py::module_& m) {
  py::enum_<RequestStatus>(m, "RequestStatus")
      .value("WAITING", RequestStatus::WAITING)
      .value("RUNNING", RequestStatus::RUNNING)
      .value("PREEMPTED", RequestStatus::PREEMPTED)
      .value("FINISHED_STOPPED", RequestStatus::FINISHED_STOPPED)
      .value("FINISHED_LENGTH", RequestStatus::FINISHED_LENGTH)
      .value("FINISHED_ABORTED", RequestStatus::FINISHED_ABORTED)
      .def_property_readonly("is_finished", [](RequestStatus s) { return is_finished(s); });

  py::class_<Request>(m, "Request", "Snapshot of a request's scheduling state (a copy).")
      .def_property_readonly("request_id", &Request::request_id)
      .def_property_readonly("prompt_token_ids", &Request::prompt_token_ids)
      .def_property_readonly("output_token_ids", &Request::output_token_ids)
      .def_property_readonly("num_prompt_tokens", &Request::num_prompt_tokens)
      .def_property_readonly("num_tokens", &Request::num_tokens)
      .def_property_readonly("num_computed_tokens", &Request::num_computed_tokens)
      .def_property_readonly("status", &Request::status)
      .def_property_readonly("arrival_time", &Request::arrival_time)
      .def_property_readonly("priority", &Request::priority)
      .def_property_readonly("extra_key", &Request::extra_key)
      .def_property_readonly("num_preemptions", &Request::num_preemptions)
      .def_property_readonly("in_flight", &Request::in_flight)
      .def_property_readonly("num_cached_tokens", &Request::num_cached_tokens)
      .def_property_readonly("max_tokens", [](const Request& r) -> std::optional<int64_t> {
            if (r.max_tokens() == Request::kUnlimitedTokens) return std::nullopt;
            return r.max_tokens();
          })
      .def_property_readonly("draft_token_ids", &Request::draft_token_ids)
      .def("__repr__", [](const Request& r) {
        return "<Request " + r.request_id() + " " + to_string(r.status()) + " computed=" +
               std::to_string(r.num_computed_tokens()) + "/" + std::to_string(r.num_tokens()) + ">";
      });
}

void bind_block_manager(py::module_& m) {
  using BM = BlockManager;
  py::class_<BM>(m, "BlockManager", "Paged KV block manager (prefix caching, fork, copy-on-write).")
      .def(py::init<int32_t, int32_t, bool, double, int32_t>(), py::arg("num_blocks"), py::arg("block_size") = 16,
           py::arg("enable_prefix_caching") = true, py::arg("watermark") = 0.01, py::arg("sliding_window") = 0)
      .def("can_allocate", [](const BM& bm, const std::vector<int64_t>& t, int64_t num_new, int32_t la, uint64_t ek) {
            const PrefixMatch pm = bm.find_cached_prefix(t.data(), static_cast<int64_t>(t.size()), ek);
            return bm.can_allocate(pm, resolve_new(t, pm, bm.block_size(), num_new), la);
          }, py::arg("token_ids"), py::arg("num_new_tokens") = -1, py::arg("num_lookahead_tokens") = 0, py::arg("extra_key") = 0)
      .def("allocate", [](BM& bm, const std::string& id, const std::vector<int64_t>& t, int64_t num_new, int32_t la,
                          uint64_t ek) -> std::optional<int64_t> {
            const PrefixMatch pm = bm.find_cached_prefix(t.data(), static_cast<int64_t>(t.size()), ek);
            if (bm.allocate(id, pm, resolve_new(t, pm, bm.block_size(), num_new), la, ek) < 0) return std::nullopt;
            return pm.num_tokens(bm.block_size());
          }, py::arg("request_id"), py::arg("token_ids"), py::arg("num_new_tokens") = -1,
          py::arg("num_lookahead_tokens") = 0, py::arg("extra_key") = 0,
          "Allocates blocks for a new sequence; returns its prefix-cache hit tokens, or None if it does not fit.")
      .def("append_slots", [](BM& bm, const std::string& id, int64_t computed, int64_t num_new, int32_t la) {
            return bm.append_slots(seq_handle(bm, id), computed, num_new, la);
          }, py::arg("request_id"), py::arg("num_computed_tokens"), py::arg("num_new_tokens"), py::arg("num_lookahead_tokens") = 0)
      .def("cache_full_blocks", [](BM& bm, const std::string& id, const std::vector<int64_t>& t, int64_t computed) {
            if (computed < 0 || computed > static_cast<int64_t>(t.size())) {
              throw std::invalid_argument("num_computed_tokens must be in [0, len(token_ids)]");
            }
            bm.cache_full_blocks(seq_handle(bm, id), t.data(), computed);
          }, py::arg("request_id"), py::arg("token_ids"), py::arg("num_computed_tokens"))
      .def("shrink", [](BM& bm, const std::string& id, int64_t n) { bm.shrink(seq_handle(bm, id), n); },
           py::arg("request_id"), py::arg("num_slots"))
      .def("free", py::overload_cast<const std::string&>(&BM::free), py::arg("request_id"))
      .def("fork", [](BM& bm, const std::string& p, const std::string& c) { bm.fork(seq_handle(bm, p), c); },
           py::arg("parent_id"), py::arg("child_id"))
      .def("get_block_table", [](const BM& bm, const std::string& id) { return bm.block_table(seq_handle(bm, id)); },
           py::arg("request_id"))
      .def("num_live_blocks", [](const BM& bm, const std::string& id) { return bm.num_live_blocks(seq_handle(bm, id)); },
           py::arg("request_id"), "Table entries holding a real block (not the null block of a sliding window).")
      .def("drop_outside_window", [](BM& bm, const std::string& id, int64_t computed) {
            bm.drop_outside_window(seq_handle(bm, id), computed);
          }, py::arg("request_id"), py::arg("num_computed_tokens"))
      .def("take_cow_copies", &BM::take_cow_copies)
      .def("get_ref_count", [](const BM& bm, int32_t b) {
            if (b < 0 || b >= bm.num_blocks()) throw std::invalid_argument("block id out of range");
            return bm.pool().block(b).ref_count;
          }, py::arg("block_id"))
      .def("reset_prefix_cache", &BM::reset_prefix_cache)
      .def_property_readonly("num_blocks", &BM::num_blocks)
      .def_property_readonly("block_size", &BM::block_size)
      .def_property_readonly("sliding_window", &BM::sliding_window)
      .def_property_readonly("null_block", &BM::null_block)
      .def_property_readonly("num_free_blocks", &BM::num_free_blocks)
      .def_property_readonly("usage", &BM::usage)
      .def_property_readonly("num_cached_blocks", &BM::num_cached_blocks)
      .def_property_readonly("num_tail_waste_slots", &BM::num_tail_waste_slots)
      .def_property_readonly("watermark_blocks", &BM::watermark_blocks)
      .def_property_readonly("prefix_cache_queries", &BM::prefix_cache_queries)
      .def_property_readonly("prefix_cache_hits", &BM::prefix_cache_hits)
      .def_property_readonly("num_seqs", &BM::num_seqs);
}

void bind_output(py::module_& m) {
  using SO = SchedulerOutput;
  auto cls = py::class_<SO>(m, "SchedulerOutput", "One step's batch; arrays are zero-copy views owned by this object.");
  cls.def_readonly("step_id", &SO::step_id)
      .def_readonly("request_ids", &SO::request_ids)
      .def_readonly("preempted_request_ids", &SO::preempted_request_ids)
      .def_readonly("num_decode_reqs", &SO::num_decode_reqs)
      .def_readonly("total_num_scheduled_tokens", &SO::total_num_scheduled_tokens)
      .def_readonly("max_blocks_in_batch", &SO::max_blocks_in_batch)
      .def_property_readonly("num_reqs", &SO::num_reqs)
      .def("__len__", &SO::num_reqs);
  using Shape = std::vector<py::ssize_t>;
  const auto rows = [](const SO& o) { return static_cast<py::ssize_t>(o.num_reqs()); };
  const auto toks = [](const SO& o) { return static_cast<py::ssize_t>(o.total_num_scheduled_tokens); };
  def_view(cls, "num_scheduled_tokens", &SO::num_scheduled_tokens, [=](const SO& o) { return Shape{rows(o)}; });
  def_view(cls, "query_start_loc", &SO::query_start_loc, [=](const SO& o) { return Shape{rows(o) + 1}; });
  def_view(cls, "num_computed_tokens", &SO::num_computed_tokens, [=](const SO& o) { return Shape{rows(o)}; });
  def_view(cls, "seq_lens", &SO::seq_lens, [=](const SO& o) { return Shape{rows(o)}; });
  def_view(cls, "input_ids", &SO::input_ids, [=](const SO& o) { return Shape{toks(o)}; });
  def_view(cls, "positions", &SO::positions, [=](const SO& o) { return Shape{toks(o)}; });
  def_view(cls, "slot_mapping", &SO::slot_mapping, [=](const SO& o) { return Shape{toks(o)}; });
  def_view(cls, "block_tables", &SO::block_tables,
           [=](const SO& o) { return Shape{rows(o), static_cast<py::ssize_t>(o.max_blocks_in_batch)}; });
  def_view(cls, "do_sample", &SO::do_sample, [=](const SO& o) { return Shape{rows(o)}; }, "bool");
  def_view(cls, "num_draft_tokens", &SO::num_draft_tokens, [=](const SO& o) { return Shape{rows(o)}; });
  def_view(cls, "draft_token_ids", &SO::draft_token_ids,
           [](const SO& o) { return Shape{static_cast<py::ssize_t>(o.draft_token_ids.size())}; });
  def_view(cls, "logits_indices", &SO::logits_indices,
           [](const SO& o) { return Shape{static_cast<py::ssize_t>(o.logits_indices.size())}; });
  def_view(cls, "cow_copies", &SO::cow_copies,
           [](const SO& o) { return Shape{static_cast<py::ssize_t>(o.num_cow_copies()), 2}; });
  // A hybrid KV cache's groups: group 0's arrays are slot_mapping / block_tables; cow_copy_groups is empty
  // with one group (every pair is group 0's).
  def_view(cls, "cow_copy_groups", &SO::cow_copy_groups,
           [](const SO& o) { return Shape{static_cast<py::ssize_t>(o.cow_copy_groups.size())}; });
  cls.def_property_readonly("num_kv_cache_groups",
                            [](const SO& o) { return static_cast<int64_t>(o.group_slot_mappings.size()) + 1; });
  const auto check_group = [](const SO& o, int64_t g) {
    if (g < 0 || g > static_cast<int64_t>(o.group_slot_mappings.size())) {
      throw py::index_error("no KV-cache group " + std::to_string(g));
    }
  };
  cls.def("group_slot_mapping", [=](py::object self, int64_t g) {
        const SO& o = self.cast<const SO&>();
        check_group(o, g);
        return view(self, g == 0 ? o.slot_mapping : o.group_slot_mappings[static_cast<size_t>(g - 1)], Shape{toks(o)});
      }, py::arg("group"));
  cls.def("group_block_tables", [=](py::object self, int64_t g) {
        const SO& o = self.cast<const SO&>();
        check_group(o, g);
        const Shape shape{rows(o), static_cast<py::ssize_t>(o.max_blocks_in_batch)};
        return view(self, g == 0 ? o.block_tables : o.group_block_tables[static_cast<size_t>(g - 1)], shape);
      }, py::arg("group"));
}

std::unique_ptr<Scheduler> make_scheduler(int32_t max_num_seqs, int32_t max_num_batched_tokens, int32_t max_model_len,
                                          bool chunked, const std::string& policy, int32_t long_prefill,
                                          int32_t lookahead, int32_t num_blocks, int32_t block_size, bool prefix_caching,
                                          double watermark, int32_t sliding_window,
                                          const std::vector<std::pair<int32_t, int32_t>>& extra_groups) {
  SchedulerConfig c;
  c.max_num_seqs = max_num_seqs;
  c.max_num_batched_tokens = max_num_batched_tokens;
  c.max_model_len = max_model_len;
  c.enable_chunked_prefill = chunked;
  c.policy = policy;
  c.long_prefill_token_threshold = long_prefill;
  c.num_lookahead_tokens = lookahead;
  CacheConfig k;
  k.num_blocks = num_blocks;
  k.block_size = block_size;
  k.enable_prefix_caching = prefix_caching;
  k.watermark = watermark;
  k.sliding_window = sliding_window;
  for (const auto& g : extra_groups) k.extra_groups.push_back({g.first, g.second});
  return std::make_unique<Scheduler>(c, k);
}

void update(Scheduler& s, const SchedulerOutput& out,
            py::array_t<int32_t, py::array::c_style | py::array::forcecast> num_new,
            py::array_t<int64_t, py::array::c_style | py::array::forcecast> new_ids,
            const std::vector<FinishedRequest>& finished) {
  if (num_new.ndim() != 1 || new_ids.ndim() != 1) throw std::invalid_argument("update() arrays must be 1-D");
  s.update(out.step_id, num_new.data(), num_new.shape(0), new_ids.data(), new_ids.shape(0), finished);
}

void bind_scheduler(py::module_& m) {
  py::class_<Scheduler>(m, "Scheduler", "Continuous-batching scheduler over a paged KV cache.")
      .def(py::init(&make_scheduler), py::arg("max_num_seqs") = 256, py::arg("max_num_batched_tokens") = 2048,
           py::arg("max_model_len") = 8192, py::arg("enable_chunked_prefill") = true, py::arg("policy") = "fcfs",
           py::arg("long_prefill_token_threshold") = 0, py::arg("num_lookahead_tokens") = 0,
           py::arg("num_blocks") = 1024, py::arg("block_size") = 16, py::arg("enable_prefix_caching") = true,
           py::arg("watermark") = 0.01, py::arg("sliding_window") = 0,
           py::arg("extra_groups") = std::vector<std::pair<int32_t, int32_t>>())
      .def("add_request", [](Scheduler& s, const std::string& id, std::vector<int64_t> prompt, std::optional<double> arrival,
                             int32_t priority, uint64_t extra_key, std::optional<int64_t> max_tokens) {
            s.add_request(id, std::move(prompt), arrival ? *arrival : now_seconds(), priority, extra_key,
                          max_tokens ? *max_tokens : Request::kUnlimitedTokens);
          }, py::arg("request_id"), py::arg("prompt_token_ids"), py::arg("arrival_time") = py::none(),
          py::arg("priority") = 0, py::arg("extra_key") = 0, py::arg("max_tokens") = py::none())
      .def("set_draft_tokens", &Scheduler::set_draft_tokens, py::arg("request_id"), py::arg("draft_token_ids"))
      .def("set_num_lookahead_tokens", &Scheduler::set_num_lookahead_tokens, py::arg("num_lookahead_tokens"))
      .def("set_pending_draft_tokens", &Scheduler::set_pending_draft_tokens, py::arg("draft_token_ids"))
      .def("decode_ready_request_ids", &Scheduler::decode_ready_request_ids)
      .def("schedule", &Scheduler::schedule)
      .def("update", &update, py::arg("output"), py::arg("num_new_tokens"), py::arg("new_token_ids"),
           py::arg("finished") = std::vector<FinishedRequest>())
      .def("abort", &Scheduler::abort, py::arg("request_id"))
      .def("abort_pending_step", &Scheduler::abort_pending_step, py::arg("step_id") = 0)
      .def_property_readonly("has_pending_step", &Scheduler::has_pending_step)
      .def("set_max_steps_in_flight", &Scheduler::set_max_steps_in_flight, py::arg("n"))
      .def_property_readonly("max_steps_in_flight", &Scheduler::max_steps_in_flight)
      .def_property_readonly("num_steps_in_flight", &Scheduler::num_steps_in_flight)
      .def("fork", &Scheduler::fork, py::arg("parent_id"), py::arg("child_id"))
      .def("has_unfinished_requests", &Scheduler::has_unfinished_requests)
      .def("get_request", [](const Scheduler& s, const std::string& id) { return s.get_request(id); }, py::arg("request_id"))
      .def("get_request_status", [](const Scheduler& s, const std::string& id) { return s.get_request(id).status(); },
           py::arg("request_id"))
      .def("get_num_computed_tokens", [](const Scheduler& s, const std::string& id) {
            return s.get_request(id).num_computed_tokens();
          }, py::arg("request_id"))
      .def("get_output_token_ids", [](const Scheduler& s, const std::string& id) {
            return s.get_request(id).output_token_ids();
          }, py::arg("request_id"))
      .def("get_block_table", [](const Scheduler& s, const std::string& id, size_t g) {
            const Request& r = s.get_request(id);
            return r.seq_handle() < 0 ? std::vector<int32_t>() : s.kv_cache().group(g).block_table(r.seq_handle());
          }, py::arg("request_id"), py::arg("group") = 0)
      .def("get_num_live_blocks", [](const Scheduler& s, const std::string& id, size_t g) -> int64_t {
            const Request& r = s.get_request(id);
            return r.seq_handle() < 0 ? 0 : s.kv_cache().group(g).num_live_blocks(r.seq_handle());
          }, py::arg("request_id"), py::arg("group") = 0)
      .def_property_readonly("num_kv_cache_groups", [](const Scheduler& s) { return s.kv_cache().num_groups(); })
      .def_property_readonly("num_reserved_blocks",
                             [](const Scheduler& s) { return s.kv_cache().num_reserved_blocks(); })
      .def("group_num_free_blocks",
           [](const Scheduler& s, size_t g) { return s.kv_cache().group(g).num_free_blocks(); }, py::arg("group"))
      .def("group_num_blocks", [](const Scheduler& s, size_t g) { return s.kv_cache().group(g).num_blocks(); },
           py::arg("group"))
      .def("reset_prefix_cache", &Scheduler::reset_prefix_cache)
      .def_property_readonly("sliding_window", [](const Scheduler& s) { return s.cache_config().sliding_window; })
      .def_property_readonly("null_block", [](const Scheduler& s) { return s.block_manager().null_block(); })
      .def_property_readonly("num_lookahead_tokens", [](const Scheduler& s) { return s.config().num_lookahead_tokens; })
      .def_property_readonly("num_waiting", &Scheduler::num_waiting)
      .def_property_readonly("num_running", &Scheduler::num_running)
      .def_property_readonly("num_free_blocks", [](const Scheduler& s) { return s.kv_cache().num_free_blocks(); })
      .def_property_readonly("num_blocks", [](const Scheduler& s) { return s.kv_cache().num_blocks(); })
      .def_property_readonly("usage", [](const Scheduler& s) { return s.kv_cache().usage(); })
      .def_property_readonly("num_cached_blocks", [](const Scheduler& s) { return s.kv_cache().num_cached_blocks(); })
      .def_property_readonly("num_tail_waste_slots", [](const Scheduler& s) { return s.kv_cache().num_tail_waste_slots(); })
      .def_property_readonly("prefix_cache_queries", [](const Scheduler& s) { return s.kv_cache().prefix_cache_queries(); })
      .def_property_readonly("prefix_cache_hits", [](const Scheduler& s) { return s.kv_cache().prefix_cache_hits(); })
      .def_property_readonly("last_schedule_us", &Scheduler::last_schedule_us)
      .def_property_readonly("last_update_us", &Scheduler::last_update_us)
      .def_property_readonly("total_schedule_us", &Scheduler::total_schedule_us)
      .def_property_readonly("total_update_us", &Scheduler::total_update_us)
      .def_property_readonly("num_steps", &Scheduler::num_steps);
}

}  // namespace

void init_core_bindings(py::module_& m) {
  static py::exception<UnknownRequestError> unused(m, "_UnknownRequestError");  // keeps a name for the type
  (void)unused;
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const UnknownRequestError& e) {
      PyErr_SetString(PyExc_KeyError, e.what());
    }
  });
  bind_request(m);
  bind_block_manager(m);
  bind_output(m);
  bind_scheduler(m);
}

}  // namespace pagellm
