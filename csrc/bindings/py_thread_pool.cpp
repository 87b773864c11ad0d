// The thread pool's Python face: pagellm.threading_config validates and applies the settings through it.
#include "bindings/py_thread_pool.h"

#include <pybind11/stl.h>

#include "ops/common/parallel.h"
#include "ops/common/thread_pool.h"

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
