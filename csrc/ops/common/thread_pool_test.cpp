// The CPU kernels' thread pool: every index exactly once, chunk sizes, nesting, exceptions, settings.
#include "ops/common/thread_pool.h"
#include "ops/common/thread_pool_profile.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

namespace pagellm {
namespace {

struct Calls {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  std::set<std::thread::id> threads;
};

// Runs parallel_for over [begin, end) and checks the contract: disjoint chunks covering every index
// once, each >= grain except at most one shorter (the last).
Calls check_cover(int64_t begin, int64_t end, int64_t grain, int chunks_per_thread = 0) {
  Calls calls;
  std::mutex mu;
  std::vector<std::atomic<int>> hits(static_cast<size_t>(std::max<int64_t>(end - begin, 0)));
  parallel_for(begin, end, grain, [&](int64_t b, int64_t e) {
    EXPECT_LT(b, e);
    for (int64_t i = b; i < e; ++i) hits[i - begin].fetch_add(1);
    std::lock_guard<std::mutex> lk(mu);
    calls.ranges.emplace_back(b, e);
    calls.threads.insert(std::this_thread::get_id());
  }, chunks_per_thread);
  for (size_t i = 0; i < hits.size(); ++i) EXPECT_EQ(hits[i].load(), 1) << "index " << begin + i;
  int short_chunks = 0;
  for (auto [b, e] : calls.ranges) short_chunks += (e - b < grain) ? 1 : 0;
  EXPECT_LE(short_chunks, 1);
  return calls;
}

class ThreadPoolTest : public ::testing::Test {
 protected:
  void SetUp() override { saved_ = thread_pool_settings(); }
  void TearDown() override { configure_thread_pool(saved_); }
  ThreadPoolSettings saved_;
};

TEST_F(ThreadPoolTest, CoversEveryIndexOnceForManyShapes) {
  for (bool home_sections : {true, false}) {
    for (int nthreads : {2, 3, 4}) {
      configure_thread_pool({nthreads, false, 50, 4, 200, home_sections});
      for (int64_t n : {1, 2, 3, 7, 16, 100, 1000, 4097}) {
        for (int64_t grain : {1, 3, 16, 64, 5000}) check_cover(10, 10 + n, grain);
      }
    }
  }
}

// With home sections each thread starts at the first chunk of its own contiguous section and runs it in
// range order; what it then takes from another thread's section comes from that section's end.
TEST_F(ThreadPoolTest, HomeSectionsRunInRangeOrderPerThread) {
  configure_thread_pool({2, false, 1000, 4, 0, true});  // no stall backoff: every region uses the pool
  bool worker_ran = false;
  for (int round = 0; round < 40; ++round) {
    std::mutex mu;
    std::map<std::thread::id, std::vector<int64_t>> begins;  // each thread's chunks, in the order it ran them
    parallel_for(0, 80, 10, [&](int64_t b, int64_t e) {  // 8 chunks of 10: [0, 40) the caller's, [40, 80) the worker's
      EXPECT_EQ(e - b, 10);
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      std::lock_guard<std::mutex> lk(mu);
      begins[std::this_thread::get_id()].push_back(b);
    });
    for (const auto& [id, v] : begins) {
      const bool caller = id == std::this_thread::get_id();
      worker_ran |= !caller;
      const int64_t home = caller ? 0 : 40;
      ASSERT_FALSE(v.empty());
      size_t k = 0;
      for (; k < v.size() && v[k] >= home && v[k] < home + 40; ++k) EXPECT_EQ(v[k], home + 10 * static_cast<int64_t>(k));
      if (caller) {
        EXPECT_EQ(v[0], 0) << "the caller starts at chunk 0";
      }
      for (size_t j = k; j < v.size(); ++j) {
        EXPECT_TRUE(v[j] < home || v[j] >= home + 40) << "a home chunk after a stolen one";
        if (j > k) {
          EXPECT_EQ(v[j], v[j - 1] - 10) << "stolen chunks come from the section's end, descending";
        }
      }
      if (!caller) {
        EXPECT_EQ(v[0], 40) << "the worker starts at its section's first chunk";
      }
    }
  }
  EXPECT_TRUE(worker_ran);
}

TEST_F(ThreadPoolTest, EmptyAndShortRangesRunInline) {
  configure_thread_pool({4, false, 50, 4});
  int calls = 0;
  parallel_for(5, 5, 1, [&](int64_t, int64_t) { ++calls; });
  parallel_for(5, 3, 1, [&](int64_t, int64_t) { ++calls; });
  EXPECT_EQ(calls, 0);
  const Calls c = check_cover(0, 10, 10);
  ASSERT_EQ(c.ranges.size(), 1u);
  EXPECT_EQ(c.ranges[0], std::make_pair(int64_t{0}, int64_t{10}));
}

TEST_F(ThreadPoolTest, OneThreadIsOneInlineCall) {
  configure_thread_pool({1, true, 50, 4});
  EXPECT_EQ(thread_pool_num_threads(), 1);
  const Calls c = check_cover(0, 1000, 1);
  ASSERT_EQ(c.ranges.size(), 1u);
  EXPECT_EQ(*c.threads.begin(), std::this_thread::get_id());
}

TEST_F(ThreadPoolTest, ChunksAtMostThreadsTimesChunksPerThread) {
  configure_thread_pool({3, false, 50, 2});
  const Calls c = check_cover(0, 600, 1);
  EXPECT_EQ(c.ranges.size(), 6u);
  EXPECT_LE(c.threads.size(), 3u);
}

// A range holding at least one grain per thread splits into the same number of equal chunks per
// thread (the slowest thread sets the region's time); shorter ranges keep chunks of at least grain.
TEST_F(ThreadPoolTest, ChunksSplitEvenlyAcrossThreads) {
  configure_thread_pool({2, false, 50, 4});
  auto lengths = [](const Calls& c) {
    std::vector<int64_t> v;
    for (auto [b, e] : c.ranges) v.push_back(e - b);
    std::sort(v.begin(), v.end());
    return v;
  };
  // SmolLM2-135M's o_proj at linear_small_m's grain (144 tiles of 4 rows, grain 56): two chunks, not three
  EXPECT_EQ(lengths(check_cover(0, 144, 56)), (std::vector<int64_t>{72, 72}));
  // its down_proj (grain 21): six chunks of 24, not seven of 21
  EXPECT_EQ(lengths(check_cover(0, 144, 21)), (std::vector<int64_t>(6, 24)));
  // at most chunks_per_thread each
  EXPECT_EQ(lengths(check_cover(0, 800, 10)), (std::vector<int64_t>(8, 100)));
  // less than a grain per thread: chunks of at least grain, as before
  EXPECT_EQ(lengths(check_cover(0, 100, 56)), (std::vector<int64_t>{44, 56}));
  configure_thread_pool({3, false, 50, 4});
  EXPECT_EQ(lengths(check_cover(0, 7, 2)), (std::vector<int64_t>{2, 2, 3}));
}

// The chunks one longer than the rest are dealt evenly to the home sections: each thread's own section holds
// the same number of indices (+-1), so with equal speeds nobody waits a whole chunk for the other.
TEST_F(ThreadPoolTest, LongChunksAreDealtEvenlyToTheSections) {
  auto section_sums = [](const Calls& c, int nthreads) {
    std::vector<std::pair<int64_t, int64_t>> r = c.ranges;
    std::sort(r.begin(), r.end());
    std::vector<int64_t> sums(nthreads, 0);
    const size_t per = r.size() / nthreads;
    for (size_t i = 0; i < r.size(); ++i) sums[i / per] += r[i].second - r[i].first;
    return sums;
  };
  configure_thread_pool({2, false, 50, 4});
  // the GEMM's 18 items of a 64-row o_proj / down_proj: 3, 2, 2, 2 | 3, 2, 2, 2 (was 3, 3, 2, 2 | 2, 2, 2, 2)
  EXPECT_EQ(section_sums(check_cover(0, 18, 1), 2), (std::vector<int64_t>{9, 9}));
  EXPECT_EQ(section_sums(check_cover(0, 30, 1), 2), (std::vector<int64_t>{15, 15}));  // qkv: 30 items
  EXPECT_EQ(section_sums(check_cover(0, 31, 1), 2), (std::vector<int64_t>{16, 15}));
  configure_thread_pool({3, false, 50, 4});
  EXPECT_EQ(section_sums(check_cover(5, 5 + 40, 1), 3), (std::vector<int64_t>{14, 13, 13}));
  EXPECT_EQ(section_sums(check_cover(0, 1000, 7), 3), (std::vector<int64_t>{334, 333, 333}));
}

// A region's own chunks_per_thread replaces the pool's setting (at most 64 per thread).
TEST_F(ThreadPoolTest, ARegionCanAskForMoreChunks) {
  configure_thread_pool({2, false, 50, 4});
  EXPECT_EQ(check_cover(0, 18, 1).ranges.size(), 8u);       // the pool's 4 per thread
  EXPECT_EQ(check_cover(0, 18, 1, 16).ranges.size(), 18u);  // one item each
  EXPECT_EQ(check_cover(0, 960, 1, 16).ranges.size(), 32u);
  EXPECT_EQ(check_cover(0, 10000, 1, 1000).ranges.size(), 128u);
  EXPECT_EQ(check_cover(0, 7, 2, 16).ranges.size(), 2u);  // chunks of at least grain: one per thread fits
}

TEST_F(ThreadPoolTest, WorkersShareTheWork) {
  configure_thread_pool({2, false, 1000, 4});
  // Chunks that take a while: the worker must claim some of them.
  std::mutex mu;
  std::set<std::thread::id> seen;
  for (int round = 0; round < 50 && seen.size() < 2; ++round) {
    parallel_for(0, 8, 1, [&](int64_t, int64_t) {
      std::this_thread::sleep_for(std::chrono::microseconds(300));
      std::lock_guard<std::mutex> lk(mu);
      seen.insert(std::this_thread::get_id());
    });
  }
  EXPECT_EQ(seen.size(), 2u);
}

TEST_F(ThreadPoolTest, NestedCallsRunInline) {
  configure_thread_pool({4, false, 50, 4});
  std::vector<std::atomic<int>> hits(64 * 64);
  parallel_for(0, 64, 1, [&](int64_t b, int64_t e) {
    EXPECT_TRUE(in_thread_pool_region());
    EXPECT_EQ(thread_pool_num_threads(), 1);
    for (int64_t i = b; i < e; ++i) {
      int inner_calls = 0;
      parallel_for(0, 64, 1, [&](int64_t ib, int64_t ie) {
        ++inner_calls;
        for (int64_t j = ib; j < ie; ++j) hits[i * 64 + j].fetch_add(1);
      });
      EXPECT_EQ(inner_calls, 1);
    }
  });
  EXPECT_FALSE(in_thread_pool_region());
  for (auto& h : hits) EXPECT_EQ(h.load(), 1);
}

TEST_F(ThreadPoolTest, FirstExceptionPropagatesAndPoolStaysUsable) {
  configure_thread_pool({4, false, 50, 4});
  EXPECT_THROW(parallel_for(0, 1000, 1, [&](int64_t b, int64_t e) {
                 if (b <= 500 && 500 < e) throw std::runtime_error("chunk with 500");
               }),
               std::runtime_error);
  EXPECT_FALSE(in_thread_pool_region());
  check_cover(0, 1000, 1);  // the next region still covers everything
}

TEST_F(ThreadPoolTest, ConcurrentCallersEachCoverTheirRange) {
  configure_thread_pool({2, false, 50, 4});
  std::vector<std::thread> callers;
  for (int t = 0; t < 4; ++t) {
    callers.emplace_back([] {
      for (int r = 0; r < 200; ++r) check_cover(0, 257, 1);
    });
  }
  for (auto& t : callers) t.join();
}

TEST_F(ThreadPoolTest, ManyTinyRegionsDoNotHang) {
  configure_thread_pool({2, true, 0, 4});  // spin 0: workers sleep at once, every region wakes them
  std::atomic<int64_t> sum{0};
  for (int r = 0; r < 20000; ++r) {
    parallel_for(0, 4, 1, [&](int64_t b, int64_t e) { sum.fetch_add(e - b); });
  }
  EXPECT_EQ(sum.load(), 80000);
}

TEST_F(ThreadPoolTest, SettingsAreValidatedBeforeAnythingChanges) {
  configure_thread_pool({3, false, 50, 4});
  EXPECT_THROW(configure_thread_pool({-1, true, 50, 4}), std::invalid_argument);
  EXPECT_THROW(configure_thread_pool({2000, true, 50, 4}), std::invalid_argument);
  EXPECT_THROW(configure_thread_pool({2, true, -5, 4}), std::invalid_argument);
  EXPECT_THROW(configure_thread_pool({2, true, 50, 0}), std::invalid_argument);
  EXPECT_THROW(configure_thread_pool({2, true, 50, 4, -1}), std::invalid_argument);
  EXPECT_THROW(configure_thread_pool({2, true, 50, 4, 200, true, -1}), std::invalid_argument);
  EXPECT_THROW(configure_thread_pool({2, true, 50, 4, 200, true, 70000}), std::invalid_argument);
  EXPECT_EQ(thread_pool_settings().num_threads, 3);
  configure_thread_pool({0, true, 50, 4});
  EXPECT_EQ(thread_pool_settings().num_threads, static_cast<int>(allowed_cpus().size()));
}

TEST_F(ThreadPoolTest, AllowedCpusAreTheAffinityMask) {
  const std::vector<int> cpus = allowed_cpus();
  ASSERT_FALSE(cpus.empty());
  EXPECT_TRUE(std::is_sorted(cpus.begin(), cpus.end()));
  EXPECT_LE(cpus.size(), std::thread::hardware_concurrency() ? std::thread::hardware_concurrency() : cpus.size());
}

TEST_F(ThreadPoolTest, AStalledWorkerSendsTheNextRegionsToTheCallerAlone) {
  configure_thread_pool({2, false, 1000, 4, 50});
  const int64_t stalls_before = thread_pool_num_stalls();
  const auto caller = std::this_thread::get_id();
  // The worker's chunks take 20 ms, the caller's 0.1 ms: the caller waits long for the worker.
  bool stalled = false;
  for (int round = 0; round < 50 && !stalled; ++round) {
    parallel_for(0, 8, 1, [&](int64_t, int64_t) {
      const bool on_caller = std::this_thread::get_id() == caller;
      std::this_thread::sleep_for(on_caller ? std::chrono::microseconds(100) : std::chrono::microseconds(20000));
    });
    stalled = thread_pool_num_stalls() > stalls_before;
  }
  ASSERT_TRUE(stalled);
  const Calls c = check_cover(0, 64, 1);  // within the 5 ms back-off: the caller alone, still every index
  EXPECT_EQ(c.threads.size(), 1u);
  EXPECT_EQ(*c.threads.begin(), caller);
}

// Runs small regions (idle gaps in between) until `bytes` more than `since` were prefetched, at most `rounds` times.
static void run_regions_until_prefetched(int64_t since, int64_t bytes, int rounds) {
  for (int round = 0; round < rounds && thread_pool_prefetched_bytes() - since < bytes; ++round) {
    check_cover(0, 64, 1);
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

// prefetch_next: an idle worker prefetches the first prefetch_kb / 2 of both halves of the named range (the
// two threads' home sections) between regions; a range that is not mapped memory is only prefetched, never read.
TEST_F(ThreadPoolTest, IdleWorkersPrefetchTheirShareOfTheNamedRange) {
  configure_thread_pool({2, false, 1000, 4, 0, true, 64});
  std::vector<char> buf(1 << 20);
  const int64_t before = thread_pool_prefetched_bytes();
  prefetch_next(buf.data(), static_cast<int64_t>(buf.size()));
  run_regions_until_prefetched(before, 64 << 10, 200);
  EXPECT_EQ(thread_pool_prefetched_bytes() - before, 64 << 10) << "prefetch_kb over the two halves, once";
  prefetch_next(reinterpret_cast<const void*>(uintptr_t{64}), int64_t{1} << 40);  // unmapped: must not fault
  for (int round = 0; round < 20; ++round) check_cover(0, 64, 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
  configure_thread_pool({3, false, 1000, 4, 0, true, 48});  // three sections, dealt to two workers
  const int64_t three = thread_pool_prefetched_bytes();
  prefetch_next(buf.data(), static_cast<int64_t>(buf.size()));
  run_regions_until_prefetched(three, 48 << 10, 400);
  EXPECT_EQ(thread_pool_prefetched_bytes() - three, 48 << 10) << "16 KiB of each of the three sections";
  configure_thread_pool({2, false, 1000, 4, 0, true, 0});  // off: nothing more is prefetched
  const int64_t off = thread_pool_prefetched_bytes();
  prefetch_next(buf.data(), static_cast<int64_t>(buf.size()));
  for (int round = 0; round < 20; ++round) check_cover(0, 64, 1);
  EXPECT_EQ(thread_pool_prefetched_bytes(), off);
}

// warm_ranges: the workers prefetch every named byte once, woken from their sleep with no region to run; regions
// meanwhile still cover every index; one thread (or a call inside a body) warms nothing.
TEST_F(ThreadPoolTest, WarmRangesArePrefetchedWholeByIdleWorkers) {
  std::vector<char> a(300001), b(77777);
  const std::vector<std::pair<const void*, int64_t>> ranges{{a.data(), 300001}, {nullptr, 64}, {b.data(), 77777}};
  for (int threads : {2, 3}) {
    configure_thread_pool({threads, false, 50, 4});
    check_cover(0, 64, 1);  // start the workers, then let them fall asleep
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    const int64_t before = thread_pool_warmed_bytes();
    warm_ranges(ranges);
    for (int i = 0; i < 2000 && thread_pool_warmed_bytes() - before < 377778; ++i) {
      std::this_thread::sleep_for(std::chrono::microseconds(500));
    }
    EXPECT_EQ(thread_pool_warmed_bytes() - before, 377778) << threads << " threads: both ranges, once";
    warm_ranges({{reinterpret_cast<const void*>(uintptr_t{64}), int64_t{1} << 26}});  // unmapped: must not fault
    for (int round = 0; round < 50; ++round) check_cover(0, 1000, 1);
  }
  warm_ranges({});  // stop the unmapped range
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
  configure_thread_pool({2, false, 50, 4});
  check_cover(0, 64, 1);
  const int64_t inside_before = thread_pool_warmed_bytes();
  parallel_for(0, 2, 1, [&](int64_t, int64_t) { warm_ranges(ranges); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(thread_pool_warmed_bytes(), inside_before) << "refused inside a body";
  configure_thread_pool({1, false, 50, 4});
  const int64_t one = thread_pool_warmed_bytes();
  warm_ranges(ranges);
  check_cover(0, 64, 1);
  EXPECT_EQ(thread_pool_warmed_bytes(), one) << "one thread: no worker warms";
}

TEST_F(ThreadPoolTest, ConfigureInsideABodyIsRefused) {
  configure_thread_pool({2, false, 50, 4});
  std::atomic<int> refused{0};
  parallel_for(0, 8, 1, [&](int64_t, int64_t) {
    try {
      configure_thread_pool({1, false, 50, 4});
    } catch (const std::logic_error&) {
      refused.fetch_add(1);
    }
  });
  EXPECT_GE(refused.load(), 1);
  EXPECT_EQ(thread_pool_settings().num_threads, 2);
}

// The accounting: split regions and solo ones counted by body, each chunk's time on the thread that ran it, the
// counters reset when turned on, nothing counted while off.
TEST_F(ThreadPoolTest, ProfilingCountsRegionsByBody) {
  configure_thread_pool({2, false, 1000, 4, 0, true});
  set_thread_pool_profiling(true);
  auto sleepy = [](int64_t, int64_t) { std::this_thread::sleep_for(std::chrono::microseconds(300)); };
  for (int i = 0; i < 5; ++i) parallel_for(0, 8, 1, sleepy);
  int64_t short_calls = 0;
  parallel_for(0, 3, 10, [&](int64_t, int64_t) { ++short_calls; });  // shorter than a grain: solo
  const PoolProfile p = thread_pool_profile();
  EXPECT_TRUE(p.enabled);
  ASSERT_EQ(p.sites.size(), 2u);
  const PoolSiteProfile& split = p.sites[0];
  EXPECT_EQ(split.regions, 5);
  EXPECT_EQ(split.solo_regions, 0);
  EXPECT_EQ(split.caller_chunks + split.worker_chunks, 5 * 8);
  EXPECT_GE(split.caller_busy_ns + split.worker_busy_ns, 5 * 8 * 300'000);
  EXPECT_GE(split.wall_ns, (split.caller_busy_ns + split.worker_busy_ns) / 2);
  EXPECT_LE(split.caller_busy_ns, split.wall_ns);
  EXPECT_LE(split.caller_wait_ns, split.wall_ns);
  EXPECT_EQ(p.sites[1].regions, 0);
  EXPECT_EQ(p.sites[1].solo_regions, 1);
  EXPECT_EQ(short_calls, 1);
  set_thread_pool_profiling(false);
  parallel_for(0, 8, 1, sleepy);
  EXPECT_EQ(thread_pool_profile().sites[0].regions, 5) << "off: nothing counted";
  set_thread_pool_profiling(true);
  EXPECT_TRUE(thread_pool_profile().sites.empty()) << "on again: reset";
  set_thread_pool_profiling(false);
}

}  // namespace
}  // namespace pagellm
