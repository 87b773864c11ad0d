// What the CPU kernels call to split work across threads: pagellm's own pool (thread_pool.h), or
// ATen's OpenMP at::parallel_for when PAGELLM_THREAD_POOL=0 (read once; kept for A/B comparisons such
// as benchmarks/bench_contention.py). Same contract as at::parallel_for, see thread_pool.h.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "ops/common/thread_pool.h"

namespace pagellm::cpu {

// False when PAGELLM_THREAD_POOL=0: the kernels go back to at::parallel_for.
inline bool use_thread_pool() {
  static const bool enabled = [] {
    const char* v = std::getenv("PAGELLM_THREAD_POOL");
    return !(v && std::strcmp(v, "0") == 0);
  }();
  return enabled;
}

// chunks_per_thread: pagellm::parallel_for's per-region chunk cap (0: the pool's setting); ignored by
// at::parallel_for.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f, int chunks_per_thread = 0) {
  if (use_thread_pool()) {
    pagellm::parallel_for(begin, end, grain, f, chunks_per_thread);
  } else {
    at::parallel_for(begin, end, grain, f);
  }
}

// Threads a parallel_for splits work across, the caller included (for sizing work items).
inline int64_t num_threads() {
  return use_thread_pool() ? pagellm::thread_pool_num_threads() : at::get_num_threads();
}

}  // namespace pagellm::cpu
