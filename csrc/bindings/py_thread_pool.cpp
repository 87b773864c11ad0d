// The thread pool's Python face: pagellm.threading_config validates and applies the settings through it.
#include "bindings/py_thread_pool.h"

#include <dlfcn.h>
#include <pybind11/stl.h>

#include "ops/common/parallel.h"
#include "ops/common/thread_pool.h"
#include "ops/common/thread_pool_profile.h"

namespace py = pybind11;

namespace pagellm {

void init_thread_pool_bindings(py::module_& m) {
  m.def("allowed_cpus", &allowed_cpus, "The CPUs this process may run on (sched_getaffinity), ascending.");
  m.def(
      "configure_thread_pool",
      [](int num_threads, bool bind, int spin_us, int chunks_per_thread, int max_backoff_ms, bool home_sections,
         int prefetch_kb) {
        py::gil_scoped_release release;  // waits for a running region to end
        configure_thread_pool(
            {num_threads, bind, spin_us, chunks_per_thread, max_backoff_ms, home_sections, prefetch_kb});
      },
      py::arg("num_threads"), py::arg("bind") = true, py::arg("spin_us") = ThreadPoolSettings{}.spin_us,
      py::arg("chunks_per_thread") = ThreadPoolSettings{}.chunks_per_thread,
      py::arg("max_backoff_ms") = ThreadPoolSettings{}.max_backoff_ms,
      py::arg("home_sections") = ThreadPoolSettings{}.home_sections,
      py::arg("prefetch_kb") = ThreadPoolSettings{}.prefetch_kb,
      "Sets the CPU kernels' thread pool (num_threads 0: one per allowed CPU); ValueError for values out of "
      "range. Workers restart on the next kernel.");
  m.def(
      "thread_pool_info",
      [] {
        const ThreadPoolSettings s = thread_pool_settings();
        py::dict d;
        d["enabled"] = cpu::use_thread_pool();  // False: PAGELLM_THREAD_POOL=0, kernels use at::parallel_for
        d["num_threads"] = s.num_threads;
        d["bind"] = s.bind;
        d["spin_us"] = s.spin_us;
        d["chunks_per_thread"] = s.chunks_per_thread;
        d["max_backoff_ms"] = s.max_backoff_ms;
        d["home_sections"] = s.home_sections;
        d["prefetch_kb"] = s.prefetch_kb;
        d["num_stalls"] = thread_pool_num_stalls();
        d["prefetched_bytes"] = thread_pool_prefetched_bytes();
        d["warmed_bytes"] = thread_pool_warmed_bytes();
        return d;
      },
      "The CPU kernels' thread pool settings (and whether the kernels use it).");
  m.def(
      "set_thread_pool_profiling",
      [](bool on) {
        py::gil_scoped_release release;  // waits for a running region to end
        set_thread_pool_profiling(on);
      },
      py::arg("on"),
      "Per-region accounting of the pool (busy / wait / join time per thread, by region body); on: counters reset. "
      "Off by default (two clock reads a chunk).");
  m.def(
      "thread_pool_profile",
      [] {
        const PoolProfile p = thread_pool_profile();
        py::dict d;
        d["enabled"] = p.enabled;
        d["worker_spin_ns"] = p.worker_spin_ns;
        d["worker_sleeps"] = p.worker_sleeps;
        d["wakes"] = p.wakes;
        py::list sites;
        for (const PoolSiteProfile& s : p.sites) {
          py::dict e;
          Dl_info info{};
          const bool found = dladdr(reinterpret_cast<const void*>(s.site), &info) != 0 && info.dli_fname;
          e["lib"] = found ? std::string(info.dli_fname) : std::string();  // for addr2line: lib + offset
          e["offset"] = found ? s.site - reinterpret_cast<uintptr_t>(info.dli_fbase) : s.site;
          e["regions"] = s.regions;
          e["solo_regions"] = s.solo_regions;
          e["wall_ns"] = s.wall_ns;
          e["solo_ns"] = s.solo_ns;
          e["caller_busy_ns"] = s.caller_busy_ns;
          e["worker_busy_ns"] = s.worker_busy_ns;
          e["caller_chunks"] = s.caller_chunks;
          e["worker_chunks"] = s.worker_chunks;
          e["caller_wait_ns"] = s.caller_wait_ns;
          e["worker_join_ns"] = s.worker_join_ns;
          e["worker_missed"] = s.worker_missed;
          sites.append(e);
        }
        d["sites"] = sites;
        return d;
      },
      "The pool's per-region accounting since set_thread_pool_profiling(True): totals and one dict per region body "
      "(its library and code offset, for addr2line).");
  m.def(
      "warm_ranges",
      [](const std::vector<std::pair<uintptr_t, int64_t>>& ranges) {
        std::vector<std::pair<const void*, int64_t>> named;
        named.reserve(ranges.size());
        for (auto [ptr, bytes] : ranges) named.emplace_back(reinterpret_cast<const void*>(ptr), bytes);
        warm_ranges(named);
      },
      py::arg("ranges"),
      "(address, bytes) ranges the idle pool workers prefetch whole while no kernel runs (replacing earlier ones; "
      "nothing with one thread): memory a later host phase reads. Prefetch only: a stale address never faults.");
}

}  // namespace pagellm
