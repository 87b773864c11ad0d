// The thread pool behind pagellm::parallel_for (see thread_pool.h for the policy and why).
// Named *_cpu.cpp so the extension's source glob compiles it; torch-free.
#include "ops/common/thread_pool.h"
#include "ops/common/thread_pool_profile.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

namespace pagellm {
namespace {

thread_local bool tls_in_region = false;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>* word, int count) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, count, nullptr, nullptr, 0);
}

// The claim word: [epoch:32 | num_chunks:16 | next_chunk:16]. Epoch and chunk count travel with the
// counter so a worker still looking at an earlier region can never claim a chunk of a later one.
constexpr int kMaxChunks = 0xFFFF;
inline uint64_t pack_claim(uint32_t epoch, uint64_t num_chunks, uint64_t next) {
  return (static_cast<uint64_t>(epoch) << 32) | (num_chunks << 16) | next;
}

using Clock = std::chrono::steady_clock;

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

// One thread's home section of a region's chunks (home_sections): [epoch:32 | end:16 | next:16], chunks
// [next, end) unclaimed. The owner claims at next, the other threads at end - 1, so while nobody has to
// help, the owner's chunks run in range order on one thread. One cache line each: owners do not share.
struct alignas(64) SectionClaim {
  std::atomic<uint64_t> word{0};
};

// num_chunks chunks of length, `num_long` of them one longer (the last chunk clipped to the range). With
// num_sections > 1 (home sections: num_chunks a multiple of it) the long chunks are dealt evenly to the sections,
// first ones of each section first, so every thread's section holds the same number of indices (+-1); without,
// the first num_long chunks are the long ones.
struct ChunkPlan {
  int64_t num_chunks = 1, length = 1, num_long = 0, num_sections = 1;
  int64_t start(int64_t i) const {
    const int64_t per_section = num_chunks / num_sections, s = i / per_section, j = i % per_section;
    const int64_t q = num_long / num_sections, r = num_long % num_sections;
    return i * length + s * q + std::min(s, r) + std::min(j, q + (s < r ? 1 : 0));
  }
};

class ThreadPool {
 public:
  // Process-wide on purpose: the CPUs are a process resource, and every kernel must share one set of
  // workers. Never destroyed (workers may still sleep in a futex at exit).
  static ThreadPool& instance() {
    static ThreadPool* pool = new ThreadPool();
    return *pool;
  }

  void configure(const ThreadPoolSettings& s) {
    if (tls_in_region) throw std::logic_error("configure_thread_pool: called inside a parallel_for body");
    std::lock_guard<std::mutex> lk(run_mu_);
    stop_workers_locked();
    solo_until_ = {};
    backoff_ = {};
    settings_ = s;
    if (settings_.num_threads == 0) settings_.num_threads = static_cast<int>(allowed_cpus().size());
    num_threads_.store(settings_.num_threads, std::memory_order_relaxed);
    sections_.reset(new SectionClaim[settings_.num_threads]);
  }

  ThreadPoolSettings settings() {
    std::lock_guard<std::mutex> lk(run_mu_);
    return settings_;
  }

  int64_t num_stalls() {
    std::lock_guard<std::mutex> lk(run_mu_);
    return num_stalls_;
  }

  int num_threads() const { return num_threads_.load(std::memory_order_relaxed); }

  void run(int64_t begin, int64_t end, int64_t grain, detail::ChunkBody body, int chunks_per_thread) {
    const int64_t range = end - begin;
    grain = std::max<int64_t>(grain, 1);
    if (tls_in_region) return body.fn(body.ctx, begin, end);
    if (range <= grain || num_threads() <= 1) return run_solo(begin, end, body, false);
    // One region at a time; a second thread arriving meanwhile runs its range inline.
    std::unique_lock<std::mutex> lk(run_mu_, std::try_to_lock);
    if (!lk.owns_lock()) return run_inline(begin, end, body);
    const int nthreads = settings_.num_threads;
    const int cpt = chunks_per_thread > 0 ? std::min(chunks_per_thread, 64) : settings_.chunks_per_thread;
    const ChunkPlan plan = plan_chunks(range, grain, nthreads, cpt);
    const int64_t num_chunks = plan.num_chunks;
    if (num_chunks <= 1) return run_solo(begin, end, body, true);
    const auto t_start = Clock::now();
    if (t_start < solo_until_) return run_solo(begin, end, body, true);
    if (!started_) start_workers_locked();
    profiling_ = profiling_on_.load(std::memory_order_relaxed);
    if (profiling_) open_region_profile();

    body_ = body;
    begin_ = begin;
    end_ = end;
    plan_ = plan;
    error_ = nullptr;
    failed_.store(false, std::memory_order_relaxed);
    chunks_done_.store(0, std::memory_order_relaxed);
    const uint32_t epoch = epoch_.load(std::memory_order_relaxed) + 1;
    claim_.store(pack_claim(epoch, num_chunks, 0), std::memory_order_release);
    if (settings_.home_sections) {
      for (int t = 0; t < nthreads; ++t) {
        const uint64_t first = t * num_chunks / nthreads, last = (t + 1) * num_chunks / nthreads;
        sections_[t].word.store(pack_claim(epoch, last, first), std::memory_order_release);
      }
    }
    epoch_.store(epoch, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      futex_wake(&epoch_, static_cast<int>(std::min<int64_t>(nthreads - 1, num_chunks - 1)));
      if (profiling_) wakes_.fetch_add(1, std::memory_order_relaxed);
    }
    tls_in_region = true;
    const int64_t own_chunks = work(epoch, 0);
    tls_in_region = false;
    const auto t_own_done = Clock::now();
    wait_done(num_chunks);
    const auto t_end = Clock::now();
    note_stall(num_chunks, own_chunks, t_start, t_own_done, t_end);
    if (profiling_) close_region_profile(body, own_chunks, t_own_done, t_end);
    if (error_) std::rethrow_exception(error_);
  }

  void set_profiling(bool on) {
    if (tls_in_region) throw std::logic_error("set_thread_pool_profiling: called inside a parallel_for body");
    std::lock_guard<std::mutex> lk(run_mu_);
    std::lock_guard<std::mutex> plk(prof_mu_);
    profiling_on_.store(on, std::memory_order_relaxed);
    if (!on) return;
    sites_.clear();
    spin_ns_.store(0);
    sleeps_.store(0);
    wakes_.store(0);
  }

  PoolProfile profile() {
    std::lock_guard<std::mutex> plk(prof_mu_);
    PoolProfile p;
    p.enabled = profiling_on_.load(std::memory_order_relaxed);
    p.worker_spin_ns = spin_ns_.load();
    p.worker_sleeps = sleeps_.load();
    p.wakes = wakes_.load();
    p.sites = sites_;
    return p;
  }

  // How a region's range is cut. When it holds at least one grain per thread, every thread gets the same
  // number of chunks (up to chunks_per_thread each) of equal length (+-1), the longer ones dealt evenly to
  // the threads' home sections: the caller waits for the slowest thread, and an odd count leaves one thread
  // a whole chunk more (a 576 x 576 bf16 projection at linear_small_m's 256 KiB grain made three chunks on
  // two threads, so one thread streamed two thirds of the weight), as did the long chunks all in the first
  // sections (the GEMM's 18 work items of a 64-row o_proj as 3, 3, 2, 2 | 2, 2, 2, 2: 10 items against 8).
  // Shorter ranges keep chunks of grain, the last one shorter.
  static ChunkPlan plan_chunks(int64_t range, int64_t grain, int64_t nthreads, int64_t chunks_per_thread) {
    const int64_t fit = range / grain;  // chunks of at least grain
    if (fit >= nthreads) {
      const int64_t per_thread = std::min<int64_t>(kMaxChunks / nthreads, std::min(chunks_per_thread, fit / nthreads));
      const int64_t n = nthreads * per_thread;
      return {n, range / n, range % n, nthreads};
    }
    const int64_t want = std::min((range + grain - 1) / grain, nthreads * chunks_per_thread);
    const int64_t chunk = std::max(grain, (range + want - 1) / want);
    return {(range + chunk - 1) / chunk, chunk, 0, 1};
  }

  int64_t prefetched_bytes() const { return prefetched_bytes_.load(std::memory_order_relaxed); }

  // prefetch_next: fields are atomics because a worker may read them while the caller replaces them; a
  // torn (pointer, length) pair only prefetches the wrong bytes.
  void set_prefetch(const void* ptr, int64_t bytes) {
    prefetch_ptr_.store(reinterpret_cast<uintptr_t>(ptr), std::memory_order_relaxed);
    prefetch_bytes_.store(std::max<int64_t>(bytes, 0), std::memory_order_relaxed);
    prefetch_gen_.fetch_add(1, std::memory_order_release);
  }

  int64_t warmed_bytes() const { return warmed_bytes_.load(std::memory_order_relaxed); }

  // warm_ranges: the ranges and a new generation under warm_mu_, then an empty region (no claimable chunk: every
  // claim word keeps its older epoch) wakes the workers, whose loop warms before it waits again. A region running on
  // another thread holds run_mu_: its workers warm once it ends, no wake needed.
  void set_warm(const std::vector<std::pair<const void*, int64_t>>& ranges) {
    if (tls_in_region || num_threads() <= 1) return;
    {
      std::lock_guard<std::mutex> lk(warm_mu_);
      warm_ranges_.clear();
      for (auto [ptr, bytes] : ranges) {
        if (ptr != nullptr && bytes > 0) warm_ranges_.emplace_back(reinterpret_cast<uintptr_t>(ptr), bytes);
      }
      warm_gen_.fetch_add(1, std::memory_order_release);
      if (warm_ranges_.empty()) return;  // a cancel: workers drop their cursors when they next look
    }
    std::unique_lock<std::mutex> lk(run_mu_, std::try_to_lock);
    if (!lk.owns_lock() || !started_) return;
    epoch_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake(&epoch_, INT_MAX);
  }

  void after_fork_in_child() {
    // Only the forking thread exists in the child: forget the workers (their stacks are gone with them).
    workers_.clear();
    started_ = false;
    sleepers_.store(0);
  }

 private:
  ThreadPool() {
    settings_.num_threads = static_cast<int>(allowed_cpus().size());
    num_threads_.store(settings_.num_threads);
    sections_.reset(new SectionClaim[settings_.num_threads]);
    pthread_atfork(nullptr, nullptr, [] { instance().after_fork_in_child(); });
  }

  void run_inline(int64_t begin, int64_t end, detail::ChunkBody body) {
    tls_in_region = true;
    try {
      body.fn(body.ctx, begin, end);
    } catch (...) {
      tls_in_region = false;
      throw;
    }
    tls_in_region = false;
  }

  // A region run whole on the calling thread (as a region: nested parallel_for inline) or, for a range too
  // short to split, as a plain call; timed as a solo region of its site when profiling.
  void run_solo(int64_t begin, int64_t end, detail::ChunkBody body, bool as_region) {
    if (!profiling_on_.load(std::memory_order_relaxed)) {
      return as_region ? run_inline(begin, end, body) : body.fn(body.ctx, begin, end);
    }
    const int64_t t0 = now_ns();
    as_region ? run_inline(begin, end, body) : body.fn(body.ctx, begin, end);
    const int64_t t1 = now_ns();
    std::lock_guard<std::mutex> plk(prof_mu_);
    PoolSiteProfile& s = site_profile(body);
    ++s.solo_regions;
    s.solo_ns += t1 - t0;
  }

  PoolSiteProfile& site_profile(detail::ChunkBody body) {  // prof_mu_ held
    const auto site = reinterpret_cast<uintptr_t>(body.fn);
    for (PoolSiteProfile& s : sites_) {
      if (s.site == site) return s;
    }
    sites_.push_back({});
    sites_.back().site = site;
    return sites_.back();
  }

  // The region's worker-side counters, written by the workers before they mark a chunk done.
  void open_region_profile() {
    region_open_ns_ = now_ns();
    region_caller_busy_ns_ = 0;
    region_worker_busy_ns_.store(0, std::memory_order_relaxed);
    region_worker_chunks_.store(0, std::memory_order_relaxed);
    region_first_join_ns_.store(INT64_MAX, std::memory_order_relaxed);
  }

  void close_region_profile(detail::ChunkBody body, int64_t own_chunks, Clock::time_point own_done,
                            Clock::time_point end) {
    const int64_t worker_chunks = region_worker_chunks_.load(std::memory_order_relaxed);
    const int64_t join = region_first_join_ns_.load(std::memory_order_relaxed);
    std::lock_guard<std::mutex> plk(prof_mu_);
    PoolSiteProfile& s = site_profile(body);
    ++s.regions;
    s.wall_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(end.time_since_epoch()).count() - region_open_ns_;
    s.caller_busy_ns += region_caller_busy_ns_;
    s.worker_busy_ns += region_worker_busy_ns_.load(std::memory_order_relaxed);
    s.caller_chunks += own_chunks;
    s.worker_chunks += worker_chunks;
    s.caller_wait_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(end - own_done).count();
    if (worker_chunks > 0) {
      s.worker_join_ns += join - region_open_ns_;
    } else {
      ++s.worker_missed;
    }
  }

  // A worker the OS has preempted (or that shares its core with a busy process) makes the caller wait
  // for the chunk it holds: on a busy machine, a time slice. When the caller waited longer than doing
  // the workers' chunks itself would have taken (its own time per chunk), the workers cost more than
  // they gave: regions run on the caller alone for a while (5 ms, doubling up to max_backoff_ms while
  // it keeps happening; a region where they helped resets it).
  // Waits shorter than this beyond the expected are not stalls: waking a sleeping worker (futex) costs
  // 0.1-0.3 ms on a VM, and counting that (50 us here before) put a quiet machine's decode on one thread
  // for 5 ms at a time (~15 % slower TPOT); a preempted worker costs a time slice, milliseconds.
  static constexpr std::chrono::microseconds kStallSlack{1000};

  void note_stall(int64_t num_chunks, int64_t own_chunks, Clock::time_point start, Clock::time_point own_done,
                  Clock::time_point end) {
    if (settings_.max_backoff_ms <= 0 || own_chunks == 0) return;
    const auto per_chunk = (own_done - start) / own_chunks;
    if (end - own_done <= (num_chunks - own_chunks) * per_chunk + kStallSlack) {
      backoff_ = Clock::duration::zero();
      return;
    }
    const Clock::duration max_backoff = std::chrono::milliseconds(settings_.max_backoff_ms);
    backoff_ = std::min(max_backoff, std::max<Clock::duration>(2 * backoff_, std::chrono::milliseconds(5)));
    solo_until_ = end + backoff_;
    ++num_stalls_;
  }

  // Claims one chunk of region `epoch` from a claim word [epoch | end:16 | next:16]: the one at next
  // (from_end false) or at end - 1; -1 when none is left or the word belongs to another region.
  static int64_t claim(std::atomic<uint64_t>& word, uint32_t epoch, bool from_end) {
    uint64_t w = word.load(std::memory_order_acquire);
    for (;;) {
      if (static_cast<uint32_t>(w >> 32) != epoch) return -1;
      const uint64_t end = (w >> 16) & 0xFFFF, next = w & 0xFFFF;
      if (next >= end) return -1;
      const uint64_t taken = from_end ? w - (uint64_t{1} << 16) : w + 1;
      if (word.compare_exchange_weak(w, taken, std::memory_order_acq_rel, std::memory_order_acquire)) {
        return static_cast<int64_t>(from_end ? end - 1 : next);
      }
    }
  }

  // Chunk i of the current region: claimed by this thread, so the caller waits for it and the fields
  // below are this region's.
  void run_chunk(int64_t i, bool caller) {
    const int64_t b = begin_ + plan_.start(i), e = std::min(end_, begin_ + plan_.start(i + 1));
    const int64_t t0 = profiling_ ? now_ns() : 0;
    if (!failed_.load(std::memory_order_relaxed)) {
      try {
        body_.fn(body_.ctx, b, e);
      } catch (...) {
        std::lock_guard<std::mutex> lk(error_mu_);
        if (!error_) error_ = std::current_exception();
        failed_.store(true, std::memory_order_relaxed);
      }
    }
    if (profiling_) {
      const int64_t t1 = now_ns();
      if (caller) {
        region_caller_busy_ns_ += t1 - t0;
      } else {
        region_worker_busy_ns_.fetch_add(t1 - t0, std::memory_order_relaxed);
        region_worker_chunks_.fetch_add(1, std::memory_order_relaxed);
        int64_t first = region_first_join_ns_.load(std::memory_order_relaxed);
        while (t0 < first && !region_first_join_ns_.compare_exchange_weak(first, t0, std::memory_order_relaxed)) {
        }
      }
    }
    chunks_done_.fetch_add(1, std::memory_order_acq_rel);
  }

  // Claims and runs chunks of region `epoch` until none is left (or a later region started); how many.
  // `self`: this thread's home section (the caller 0, worker i i).
  int64_t work(uint32_t epoch, int self) {
    int64_t done = 0;
    if (!settings_.home_sections) {
      for (int64_t i; (i = claim(claim_, epoch, false)) >= 0; ++done) run_chunk(i, self == 0);
      return done;
    }
    const int nthreads = settings_.num_threads;
    for (int64_t i; (i = claim(sections_[self].word, epoch, false)) >= 0; ++done) run_chunk(i, self == 0);
    for (int d = 1; d < nthreads; ++d) {  // then help the others, from their sections' ends
      std::atomic<uint64_t>& word = sections_[(self + d) % nthreads].word;
      for (int64_t i; (i = claim(word, epoch, true)) >= 0; ++done) run_chunk(i, self == 0);
    }
    return done;
  }

  // The caller's wait for chunks that workers hold: spin briefly, then yield the core (a preempted
  // worker on this core gets to finish its chunk).
  void wait_done(int64_t num_chunks) {
    int spins = 0;
    while (chunks_done_.load(std::memory_order_acquire) < num_chunks) {
      if (++spins < 2000) {
        cpu_relax();
      } else {
        sched_yield();
      }
    }
  }

  static void* worker_entry(void* arg) {
    auto* start = static_cast<WorkerStart*>(arg);
    ThreadPool& pool = *start->pool;
    const int cpu = start->cpu, index = start->index;
    const uint32_t first_epoch = start->epoch;
    delete start;
    pthread_setname_np(pthread_self(), "pagellm-pool");
    if (cpu >= 0) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(cpu, &set);
      pthread_setaffinity_np(pthread_self(), sizeof(set), &set);  // best effort: unpinned on failure
    }
    pool.worker_loop(first_epoch, index);
    return nullptr;
  }

  // A worker's progress through its part of the prefetch_next range.
  struct PrefetchCursor {
    uint64_t gen = 0;
    uintptr_t base = 0;
    uint64_t bytes = 0;
    int section = 0;  // the home section being prefetched
    uintptr_t next = 0, end = 0;
  };

  // Prefetches the rest of this worker's part of the named range, 1 KiB at a time (a region that opens
  // waits at most that long for this worker), until it is done or a region after `seen` opens. The part:
  // the first prefetch_kb / num_threads of each home section the range will be cut into, the sections
  // dealt round-robin to the workers, the caller's (section 0) first. Every section, not only the
  // worker's own: a region whose sections are single chunks (a 576 x 576 projection) lasts as long as
  // its slowest section, so a head start on one of them alone gains nothing.
  void prefetch_share(uint32_t seen, int index, PrefetchCursor& c) {
    const int nthreads = settings_.num_threads;
    const uint64_t gen = prefetch_gen_.load(std::memory_order_acquire);
    if (gen != c.gen) {
      c = PrefetchCursor{gen, prefetch_ptr_.load(std::memory_order_relaxed),
                         static_cast<uint64_t>(prefetch_bytes_.load(std::memory_order_relaxed)),
                         index - 1 - (nthreads - 1), 0, 0};
    }
    const uint64_t per_section = uint64_t(settings_.prefetch_kb) * 1024 / nthreads;
    constexpr uintptr_t kStep = 1024, kLine = 64;
    for (;;) {
      if (c.next >= c.end) {  // the next of this worker's sections, if any
        if (c.section + (nthreads - 1) >= nthreads) return;
        c.section += nthreads - 1;
        const uintptr_t first = (c.base + c.bytes * c.section / nthreads) & ~uintptr_t{63};
        c.next = first;
        c.end = std::min<uintptr_t>(c.base + c.bytes * (c.section + 1) / nthreads, first + per_section);
        continue;
      }
      if (epoch_.load(std::memory_order_relaxed) != seen) return;
      const uintptr_t stop = std::min(c.end, c.next + kStep);
      for (uintptr_t p = c.next; p < stop; p += kLine) __builtin_prefetch(reinterpret_cast<const void*>(p), 0, 2);
      prefetched_bytes_.fetch_add(static_cast<int64_t>(stop - c.next), std::memory_order_relaxed);
      c.next = stop;
    }
  }

  // A worker's part of the warm_ranges ranges: [next, end) pieces, the one at `piece` in progress.
  struct WarmCursor {
    uint64_t gen = 0;
    std::vector<std::pair<uintptr_t, uintptr_t>> pieces;
    size_t piece = 0;
  };

  // Prefetches the rest of this worker's part of the warm ranges (the index-th (num_threads - 1)-th of their
  // concatenation), 1 KiB at a time, until it is done or a region after `seen` opens.
  void warm_share(uint32_t seen, int index, WarmCursor& c) {
    const uint64_t gen = warm_gen_.load(std::memory_order_acquire);
    if (gen != c.gen) {
      std::lock_guard<std::mutex> lk(warm_mu_);
      c = WarmCursor{warm_gen_.load(std::memory_order_relaxed), {}, 0};
      uint64_t total = 0;
      for (auto [ptr, bytes] : warm_ranges_) total += bytes;
      const uint64_t workers = std::max(settings_.num_threads - 1, 1);
      const uint64_t lo = total * (index - 1) / workers, hi = total * index / workers;
      uint64_t at = 0;  // offset of the current range in the concatenation
      for (auto [ptr, bytes] : warm_ranges_) {
        const uint64_t b = std::max(lo, at), e = std::min(hi, at + bytes);
        if (b < e) c.pieces.emplace_back(ptr + (b - at), ptr + (e - at));
        at += bytes;
      }
    }
    constexpr uintptr_t kStep = 1024, kLine = 64;
    for (; c.piece < c.pieces.size(); ++c.piece) {
      auto& [next, end] = c.pieces[c.piece];
      while (next < end) {
        if (epoch_.load(std::memory_order_relaxed) != seen) return;
        const uintptr_t stop = std::min(end, next + kStep);
        for (uintptr_t p = next & ~(kLine - 1); p < stop; p += kLine) {
          __builtin_prefetch(reinterpret_cast<const void*>(p), 0, 2);
        }
        warmed_bytes_.fetch_add(static_cast<int64_t>(stop - next), std::memory_order_relaxed);
        next = stop;
      }
    }
  }

  void worker_loop(uint32_t seen, int index) {
    const auto spin = std::chrono::microseconds(settings_.spin_us);  // fixed while this worker lives
    const bool prefetch = settings_.prefetch_kb > 0;
    PrefetchCursor cursor;
    WarmCursor warm;
    tls_in_region = true;  // a body run here that calls parallel_for runs inline
    for (;;) {
      if (prefetch) prefetch_share(seen, index, cursor);
      warm_share(seen, index, warm);
      const auto spin_start = std::chrono::steady_clock::now();
      const auto deadline = spin_start + spin;
      const bool profiling = profiling_on_.load(std::memory_order_relaxed);
      bool slept = false;
      int polls = 0;
      while (epoch_.load(std::memory_order_acquire) == seen) {
        cpu_relax();
        if (++polls % 64 != 0 || std::chrono::steady_clock::now() < deadline) continue;
        if (profiling && !slept) note_spin(spin_start, true);
        slept = true;
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        if (epoch_.load(std::memory_order_seq_cst) == seen) futex_wait(&epoch_, seen);
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
      }
      if (profiling && !slept) note_spin(spin_start, false);
      seen = epoch_.load(std::memory_order_acquire);
      if (stop_.load(std::memory_order_acquire)) return;
      work(seen, index);
    }
  }

  void note_spin(std::chrono::steady_clock::time_point start, bool sleeping) {
    spin_ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count(),
                       std::memory_order_relaxed);
    if (sleeping) sleeps_.fetch_add(1, std::memory_order_relaxed);
  }

  void start_workers_locked() {
    const std::vector<int> cpus = allowed_cpus();
    stop_.store(false);
    for (int i = 1; i < settings_.num_threads; ++i) {
      auto* start = new WorkerStart{this, settings_.bind ? cpus[i % cpus.size()] : -1, epoch_.load(), i};
      pthread_t t;
      if (pthread_create(&t, nullptr, &ThreadPool::worker_entry, start) != 0) {
        delete start;
        break;  // fewer workers: the caller and the others still cover every chunk
      }
      workers_.push_back(t);
    }
    started_ = true;
  }

  void stop_workers_locked() {
    if (!started_) return;
    stop_.store(true, std::memory_order_release);
    epoch_.fetch_add(1, std::memory_order_seq_cst);
    futex_wake(&epoch_, INT_MAX);
    for (pthread_t t : workers_) pthread_join(t, nullptr);
    workers_.clear();
    started_ = false;
  }

  struct WorkerStart {
    ThreadPool* pool;
    int cpu;
    uint32_t epoch;
    int index;  // its home section
  };

  Clock::time_point solo_until_{};  // regions before this run on the caller alone (note_stall)
  Clock::duration backoff_{};
  int64_t num_stalls_ = 0;
  std::mutex run_mu_;  // held by the thread running a region, and by configure
  ThreadPoolSettings settings_;
  std::atomic<int> num_threads_{1};
  std::vector<pthread_t> workers_;
  bool started_ = false;
  std::atomic<bool> stop_{false};
  std::atomic<uint32_t> epoch_{0};  // futex word: bumped per region (and to stop the workers)
  std::atomic<int> sleepers_{0};
  std::atomic<uintptr_t> prefetch_ptr_{0};  // prefetch_next's range, and a count of its calls
  std::atomic<int64_t> prefetch_bytes_{0};
  std::atomic<uint64_t> prefetch_gen_{0};
  std::atomic<int64_t> prefetched_bytes_{0};
  std::mutex warm_mu_;  // guards warm_ranges_ (the caller writes, workers copy their part)
  std::vector<std::pair<uintptr_t, uint64_t>> warm_ranges_;
  std::atomic<uint64_t> warm_gen_{0};
  std::atomic<int64_t> warmed_bytes_{0};
  std::atomic<uint64_t> claim_{0};            // the region's chunks, one counter (home_sections false)
  std::unique_ptr<SectionClaim[]> sections_;  // one per thread (home_sections true)
  std::atomic<int64_t> chunks_done_{0};
  std::atomic<bool> failed_{false};
  std::mutex error_mu_;
  std::exception_ptr error_;
  detail::ChunkBody body_{};
  int64_t begin_ = 0, end_ = 0;
  ChunkPlan plan_{};
  // set_thread_pool_profiling: the switch, this region's snapshot of it (read by the workers after the epoch),
  // the region's counters, and per-site totals (prof_mu_).
  std::atomic<bool> profiling_on_{false};
  bool profiling_ = false;
  int64_t region_open_ns_ = 0, region_caller_busy_ns_ = 0;
  std::atomic<int64_t> region_worker_busy_ns_{0}, region_worker_chunks_{0}, region_first_join_ns_{0};
  std::atomic<int64_t> spin_ns_{0}, sleeps_{0}, wakes_{0};
  std::mutex prof_mu_;
  std::vector<PoolSiteProfile> sites_;
};

}  // namespace

std::vector<int> allowed_cpus() {
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
    }
  }
  if (cpus.empty()) cpus.push_back(0);  // unknown: behave as one CPU
  return cpus;
}

void configure_thread_pool(const ThreadPoolSettings& s) {
  auto require = [](bool ok, const std::string& what) {
    if (!ok) throw std::invalid_argument("configure_thread_pool: " + what);
  };
  require(s.num_threads >= 0 && s.num_threads <= 1024,
          "num_threads must be in [0, 1024] (0: one per allowed CPU), got " + std::to_string(s.num_threads));
  require(s.spin_us >= 0 && s.spin_us <= 1000000, "spin_us must be in [0, 1000000], got " + std::to_string(s.spin_us));
  require(s.max_backoff_ms >= 0 && s.max_backoff_ms <= 10000,
          "max_backoff_ms must be in [0, 10000], got " + std::to_string(s.max_backoff_ms));
  require(s.prefetch_kb >= 0 && s.prefetch_kb <= 65536,
          "prefetch_kb must be in [0, 65536], got " + std::to_string(s.prefetch_kb));
  require(s.chunks_per_thread >= 1 && s.chunks_per_thread <= 64,
          "chunks_per_thread must be in [1, 64], got " + std::to_string(s.chunks_per_thread));
  ThreadPool::instance().configure(s);
}

ThreadPoolSettings thread_pool_settings() { return ThreadPool::instance().settings(); }

int thread_pool_num_threads() { return tls_in_region ? 1 : ThreadPool::instance().num_threads(); }

bool in_thread_pool_region() { return tls_in_region; }

int64_t thread_pool_num_stalls() { return ThreadPool::instance().num_stalls(); }

void prefetch_next(const void* ptr, int64_t bytes) { ThreadPool::instance().set_prefetch(ptr, bytes); }

int64_t thread_pool_prefetched_bytes() { return ThreadPool::instance().prefetched_bytes(); }

void warm_ranges(const std::vector<std::pair<const void*, int64_t>>& ranges) {
  ThreadPool::instance().set_warm(ranges);
}

int64_t thread_pool_warmed_bytes() { return ThreadPool::instance().warmed_bytes(); }

void set_thread_pool_profiling(bool on) { ThreadPool::instance().set_profiling(on); }

PoolProfile thread_pool_profile() { return ThreadPool::instance().profile(); }

namespace detail {
void run_parallel(int64_t begin, int64_t end, int64_t grain, ChunkBody body, int chunks_per_thread) {
  ThreadPool::instance().run(begin, end, grain, body, chunks_per_thread);
}
}  // namespace detail

}  // namespace pagellm
