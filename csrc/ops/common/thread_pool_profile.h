// The thread pool's per-region accounting (thread_pool.h's pool; off by default): where the threads work, wait and
// join, per region body. Its own header so the kernels, which include thread_pool.h, do not depend on it.
#pragma once

#include <cstdint>
#include <vector>

namespace pagellm {

// Per-region accounting, for finding where the threads wait (off by default: it reads the clock twice a chunk).
// One entry per region body (`site`: the body's code address, one per kernel lambda), counted by the thread that
// opens the region. Times in ns of steady_clock.
struct PoolSiteProfile {
  uintptr_t site = 0;
  int64_t regions = 0;         // regions split across the pool
  int64_t solo_regions = 0;    // regions run whole on the caller (shorter than a grain per thread, stall backoff)
  int64_t wall_ns = 0;         // the caller's time in the split regions, open to last chunk done
  int64_t solo_ns = 0;         // ... in the solo ones
  int64_t caller_busy_ns = 0;  // inside the chunks' bodies, the caller / the workers (split regions)
  int64_t worker_busy_ns = 0;
  int64_t caller_chunks = 0, worker_chunks = 0;
  int64_t caller_wait_ns = 0;  // the caller after its last chunk, waiting for the workers' chunks
  int64_t worker_join_ns = 0;  // region open -> a worker's first chunk (summed over the regions a worker joined)
  int64_t worker_missed = 0;   // split regions in which no worker ran a chunk
};

struct PoolProfile {
  bool enabled = false;
  int64_t worker_spin_ns = 0;  // workers polling for the next region (between regions)
  int64_t worker_sleeps = 0;   // futex waits after the spin ran out
  int64_t wakes = 0;           // regions that woke a sleeping worker
  std::vector<PoolSiteProfile> sites;
};

// Turns the accounting on (counters reset) or off. Not callable inside a parallel_for body (std::logic_error).
void set_thread_pool_profiling(bool on);

// The counters since profiling was last turned on.
PoolProfile thread_pool_profile();

}  // namespace pagellm
