// pagellm's CPU thread pool: one persistent set of workers that every CPU kernel's parallel_for runs on.
//
// Why not at::parallel_for (OpenMP): its workers spin between regions and each takes one fixed slice of
// the range, so on a machine where another process is busy the OS parks a spinning worker on the busy
// core and every region waits a whole time slice for that worker's slice (batch-1 decode went 37x slower
// with one busy process on 2 cores). Here:
//   * the range is cut into several chunks per thread, claimed dynamically by the caller and the workers
//     alike, so a worker the OS does not run simply claims nothing and the others finish the range; a
//     preempted worker delays only the chunk it holds;
//   * (home_sections) each thread first claims, in order, the chunks of its own contiguous section of the
//     range (thread t: the t-th of num_threads), then takes the others' remaining chunks from their ends:
//     a weight stream at batch 1 then reads one contiguous run per thread, which the hardware and the
//     kernels' software prefetch (rows ahead, past a chunk's end) follow, instead of interleaved chunks;
//   * workers join a region only while it is open: the caller never waits for a worker that has not
//     started, only for chunks already claimed;
//   * idle workers spin briefly (the gaps between one decode step's kernels) and then sleep on a futex,
//     so they do not burn a core another process needs, and the scheduler treats them as interactive;
//   * when the caller still had to wait long for a worker's chunk (the OS preempted it), the next
//     regions run on the caller alone for a few milliseconds, doubling while it keeps happening, so a
//     busy machine costs at most what one thread would;
//   * (prefetch_kb) a worker left idle between regions (while the caller runs a layer's small ops) prefetches
//     the first bytes of each thread's home section of the memory the caller named with prefetch_next (the
//     next projection's weight), so the DRAM keeps streaming through the step's non-streaming parts; it
//     stops as soon as a region opens;
//   * (warm_ranges) idle workers prefetch the whole of memory the caller names for a later host phase;
//   * with bind, each worker is pinned to one CPU of the process's affinity mask (sched_getaffinity);
//     the calling thread is never pinned (threads it creates later would inherit the mask).
// Torch-free (tested by thread_pool_test.cpp without torch); csrc/ops/common/parallel.h is what kernels use.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace pagellm {

struct ThreadPoolSettings {
  int num_threads = 0;    // threads a parallel_for uses, the caller included; 0: one per allowed CPU
  bool bind = true;       // pin worker i to the (i + 1)-th allowed CPU (wrapping around)
  int spin_us = 50;       // how long an idle worker polls for the next region before it sleeps
  int chunks_per_thread = 4;  // a region is cut into at most num_threads * this many chunks
  int max_backoff_ms = 200;   // after stalls on a preempted worker, regions run on the caller alone for up
                              // to this long (5 ms, doubling while stalls continue); 0: never
  bool home_sections = true;  // each thread claims its own contiguous section's chunks first (false: all
                              // threads claim from one counter in range order, interleaved)
  int prefetch_kb = 0;        // how much of a prefetch_next range the idle workers prefetch (KiB, all home
                              // sections together; 256 ~ what DRAM delivers in a layer's gap, well inside
                              // L2); 0: never (the default until a quiet-machine A/B shows a gain: loaded
                              // runs in session 15 hinted at a loss, benchmarks/README.md)
};

// The CPUs this process may run on (sched_getaffinity), ascending; never empty.
std::vector<int> allowed_cpus();

// Replaces the settings (num_threads 0 resolved to allowed_cpus().size()); the workers restart lazily on
// the next parallel_for. Throws std::invalid_argument (nothing changed) for num_threads outside
// [0, 1024], spin_us outside [0, 1000000], chunks_per_thread outside [1, 64] or max_backoff_ms outside
// [0, 10000]. Not callable from inside
// a parallel_for body (throws std::logic_error).
void configure_thread_pool(const ThreadPoolSettings& settings);

// The current settings, num_threads resolved.
ThreadPoolSettings thread_pool_settings();

// Threads a parallel_for splits work across, the caller included (1 inside a parallel_for body).
int thread_pool_num_threads();

// Regions so far where the caller waited on a preempted worker and fell back to running alone.
int64_t thread_pool_num_stalls();

// True on a thread that is running a parallel_for body (there, parallel_for runs inline).
bool in_thread_pool_region();

// Names the memory the next regions will stream, [ptr, ptr + bytes) (the next projection's weight): from
// the next region on, the workers, when they have no chunk to run, prefetch the first prefetch_kb / n of
// each of the n threads' home sections of it (the i-th n-th of the range: what thread i will stream),
// stopping whenever a region opens and resuming after it, until a later prefetch_next replaces the range. Prefetch instructions only: a stale
// or wrong range costs bandwidth, never a fault, and changes no result.
void prefetch_next(const void* ptr, int64_t bytes);

// Bytes the workers have prefetched for prefetch_next so far (all ranges together).
int64_t thread_pool_prefetched_bytes();

// Names memory the calling thread will read soon, after work that streams none (a speculative proposer's head
// weights, needed a host phase after the target's forward evicted them): the workers prefetch the whole of every
// [ptr, ptr + bytes) into the caches while no region runs, in order, the total split evenly between them (a sleeping
// worker is woken), pausing while a region runs; a later call replaces the ranges. Nothing with one thread or
// inside a parallel_for body. Prefetch instructions only: a stale range costs bandwidth, never a fault.
void warm_ranges(const std::vector<std::pair<const void*, int64_t>>& ranges);

// Bytes the workers have prefetched for warm_ranges so far.
int64_t thread_pool_warmed_bytes();

namespace detail {
// A non-owning reference to the body: fn(ctx, begin, end).
struct ChunkBody {
  void (*fn)(const void* ctx, int64_t begin, int64_t end);
  const void* ctx;
};
// Runs body over [begin, end) in chunks of >= grain indices (except the last) on the pool, at most
// chunks_per_thread per thread (0: the pool's setting).
void run_parallel(int64_t begin, int64_t end, int64_t grain, ChunkBody body, int chunks_per_thread);
}  // namespace detail

// at::parallel_for's contract: f(b, e) is called on disjoint sub-ranges that together cover
// [begin, end) exactly once, each at least grain long except possibly the last; inline (one call
// f(begin, end)) when the range is shorter than grain, the pool has one thread, or the caller is
// already inside a parallel_for body; the first exception a body throws is rethrown here after every
// started chunk has finished (the chunks not yet started are skipped). Unlike at::parallel_for, one
// thread may call f several times (a thread's calls are not one contiguous range). chunks_per_thread > 0
// replaces the pool's setting for this region (at most 64): a range of many equal work items that are cheap
// to split (the many-row GEMM's) asks for more, shorter chunks, so the chunk a thread is left waiting on at
// the end of the region is short.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f, int chunks_per_thread = 0) {
  if (begin >= end) return;
  const detail::ChunkBody body{[](const void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); },
                               &f};
  detail::run_parallel(begin, end, grain, body, chunks_per_thread);
}

}  // namespace pagellm
