// The shared-memory all-reduce with N threads standing in for ranks: sums against a plain loop in rank
// order (bit-identical on every rank), chunking, half precision, a missing peer's timeout, no leaked name;
// the all-gather against a rank-order concatenation, interleaved with all-reduces.
#include "ops/comm/shm_allreduce.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>
#include <fcntl.h>

#include <cstring>
#include <exception>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace pagellm {
namespace {

std::string unique_name(const char* tag) {
  static int counter = 0;
  return "/pagellm-test-" + std::string(tag) + "-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
}

bool name_exists(const std::string& name) {
  int fd = shm_open(name.c_str(), O_RDONLY, 0600);
  if (fd < 0) return false;
  close(fd);
  return true;
}

// Runs body(rank, comm) on world threads, each with its own communicator; rethrows the first error.
template <typename Body>
void run_ranks(const std::string& name, int world, const ShmAllReduceOptions& options, Body body) {
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(world);
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        ShmAllReduce comm(name, r, world, options);
        body(r, comm);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

std::vector<std::vector<float>> random_inputs(int world, int64_t numel, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist;
  std::vector<std::vector<float>> xs(world, std::vector<float>(numel));
  for (auto& x : xs)
    for (auto& v : x) v = dist(gen);
  return xs;
}

class ShmAllReduceFloat : public ::testing::TestWithParam<std::tuple<int, int64_t, int64_t>> {};

TEST_P(ShmAllReduceFloat, MatchesRankOrderSumOnEveryRankBitForBit) {
  const auto [world, numel, slot_bytes] = GetParam();
  const auto inputs = random_inputs(world, numel, 7u + world);
  std::vector<float> expected = inputs[0];
  for (int r = 1; r < world; ++r)
    for (int64_t i = 0; i < numel; ++i) expected[i] += inputs[r][i];
  std::vector<std::vector<float>> outputs = inputs;
  const std::string name = unique_name("f32");
  ShmAllReduceOptions options;
  options.slot_bytes = slot_bytes;
  run_ranks(name, world, options, [&](int r, ShmAllReduce& comm) {
    for (int rep = 0; rep < 3; ++rep) {  // repeated calls: the round counters and both buffers
      outputs[r] = inputs[r];
      comm.all_reduce(outputs[r].data(), numel, ShmDtype::kFloat32);
    }
  });
  for (int r = 0; r < world; ++r)
    ASSERT_EQ(0, std::memcmp(outputs[r].data(), expected.data(), numel * sizeof(float))) << "rank " << r;
  EXPECT_FALSE(name_exists(name));
}

INSTANTIATE_TEST_SUITE_P(Sizes, ShmAllReduceFloat,
                         ::testing::Values(std::make_tuple(2, 2048, int64_t{1} << 20),
                                           std::make_tuple(3, 1, int64_t{64}),
                                           std::make_tuple(3, 1037, int64_t{256}),  // 5 chunks, a short last one
                                           std::make_tuple(4, 100000, int64_t{4096}),
                                           std::make_tuple(1, 33, int64_t{64})));

TEST(ShmAllReduceStress, ManySmallRoundsStayInStep) {
  // back-to-back rounds with no work between them: a rank running ahead would corrupt a slot
  const int world = 3;
  const int rounds = 3000;
  std::vector<int> bad(world, 0);
  run_ranks(unique_name("stress"), world, {}, [&](int r, ShmAllReduce& comm) {
    for (int k = 0; k < rounds; ++k) {
      float x[5];
      for (int i = 0; i < 5; ++i) x[i] = static_cast<float>(k * 7 + i + 100 * r);
      comm.all_reduce(x, 5, ShmDtype::kFloat32);
      for (int i = 0; i < 5; ++i) bad[r] += x[i] != static_cast<float>(3 * (k * 7 + i) + 300);
    }
  });
  for (int r = 0; r < world; ++r) EXPECT_EQ(bad[r], 0) << "rank " << r;
}

class ShmAllGather : public ::testing::TestWithParam<std::tuple<int, int64_t, int64_t>> {};

TEST_P(ShmAllGather, ConcatenatesInRankOrderOnEveryRank) {
  const auto [world, numel, slot_bytes] = GetParam();
  const auto inputs = random_inputs(world, numel, 11u + world);
  std::vector<float> expected;
  for (const auto& x : inputs) expected.insert(expected.end(), x.begin(), x.end());
  std::vector<std::vector<float>> outputs(world, std::vector<float>(world * numel, -1.0f));
  ShmAllReduceOptions options;
  options.slot_bytes = slot_bytes;
  const std::string name = unique_name("gather");
  run_ranks(name, world, options, [&](int r, ShmAllReduce& comm) {
    for (int rep = 0; rep < 3; ++rep) {  // interleaved with all-reduces: one round counter for both
      comm.all_gather(inputs[r].data(), outputs[r].data(), numel * static_cast<int64_t>(sizeof(float)));
      float x[3] = {1.0f, 2.0f, static_cast<float>(r)};
      comm.all_reduce(x, 3, ShmDtype::kFloat32);
      ASSERT_EQ(x[0], static_cast<float>(world));
    }
  });
  for (int r = 0; r < world; ++r)
    ASSERT_EQ(0, std::memcmp(outputs[r].data(), expected.data(), expected.size() * sizeof(float))) << "rank " << r;
  EXPECT_FALSE(name_exists(name));
}

INSTANTIATE_TEST_SUITE_P(Sizes, ShmAllGather,
                         ::testing::Values(std::make_tuple(2, 321, int64_t{1} << 20),
                                           std::make_tuple(3, 1037, int64_t{256}),  // 17 rounds, a short last one
                                           std::make_tuple(4, 1, int64_t{64}),
                                           std::make_tuple(1, 33, int64_t{64})));

TEST(ShmAllGatherErrors, OverlapAndNegativeSizeAreRefused) {
  run_ranks(unique_name("gather-bad"), 1, {}, [](int, ShmAllReduce& comm) {
    std::vector<char> buf(64);
    EXPECT_THROW(comm.all_gather(buf.data(), buf.data() + 8, 16), std::invalid_argument);
    EXPECT_THROW(comm.all_gather(buf.data(), buf.data() + 32, -1), std::invalid_argument);
  });
}

uint16_t to_bf16(float f) {  // truncation is enough to make inputs
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

float from_bf16(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST(ShmAllReduceHalf, Bf16AccumulatesInFloatAndRoundsOnce) {
  const int world = 3;
  const int64_t numel = 3001;
  const auto floats = random_inputs(world, numel, 11);
  std::vector<std::vector<uint16_t>> inputs(world, std::vector<uint16_t>(numel));
  for (int r = 0; r < world; ++r)
    for (int64_t i = 0; i < numel; ++i) inputs[r][i] = to_bf16(floats[r][i]);
  auto outputs = inputs;
  ShmAllReduceOptions options;
  options.slot_bytes = 1024;
  run_ranks(unique_name("bf16"), world, options, [&](int r, ShmAllReduce& comm) {
    comm.all_reduce(outputs[r].data(), numel, ShmDtype::kBFloat16);
  });
  for (int64_t i = 0; i < numel; ++i) {
    float acc = from_bf16(inputs[0][i]);
    for (int r = 1; r < world; ++r) acc += from_bf16(inputs[r][i]);
    uint32_t u;
    std::memcpy(&u, &acc, 4);
    const auto rounded = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // nearest even
    ASSERT_EQ(outputs[0][i], rounded) << i;
    for (int r = 1; r < world; ++r) ASSERT_EQ(outputs[r][i], outputs[0][i]) << "rank " << r << " element " << i;
  }
}

TEST(ShmAllReduceHalf, Fp16SumOfExactValuesIsExact) {
  const int world = 2;
  std::vector<std::vector<_Float16>> xs(world, std::vector<_Float16>(777));
  for (int r = 0; r < world; ++r)
    for (size_t i = 0; i < xs[r].size(); ++i) xs[r][i] = static_cast<_Float16>((static_cast<int>(i) % 64) - 32 + r);
  auto outputs = xs;
  run_ranks(unique_name("fp16"), world, {}, [&](int r, ShmAllReduce& comm) {
    comm.all_reduce(outputs[r].data(), static_cast<int64_t>(outputs[r].size()), ShmDtype::kFloat16);
  });
  for (size_t i = 0; i < xs[0].size(); ++i)
    for (int r = 0; r < world; ++r)
      ASSERT_EQ(static_cast<float>(outputs[r][i]), static_cast<float>(xs[0][i]) + static_cast<float>(xs[1][i]));
}

TEST(ShmAllReduceErrors, MissingPeerTimesOutNamingTheRank) {
  const std::string name = unique_name("timeout");
  ShmAllReduceOptions options;
  options.timeout_s = 0.3;
  {
    ShmAllReduce rank0(name, 0, 2, options);  // rank 1 never comes
    std::vector<float> x(16, 1.0f);
    try {
      rank0.all_reduce(x.data(), 16, ShmDtype::kFloat32);
      FAIL() << "expected a timeout";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("for rank 1"), std::string::npos) << e.what();
    }
    // broken from now on: the next call fails at once with the same reason
    EXPECT_THROW(rank0.all_reduce(x.data(), 16, ShmDtype::kFloat32), std::runtime_error);
    EXPECT_TRUE(name_exists(name));  // not every rank attached yet
  }
  EXPECT_FALSE(name_exists(name));  // the creator removed it
}

TEST(ShmAllReduceErrors, AttachWithoutCreatorTimesOut) {
  ShmAllReduceOptions options;
  options.timeout_s = 0.2;
  EXPECT_THROW(ShmAllReduce(unique_name("nocreator"), 1, 2, options), std::runtime_error);
}

TEST(ShmAllReduceErrors, BadArgumentsAreRefused) {
  EXPECT_THROW(ShmAllReduce("no-slash", 0, 2), std::invalid_argument);
  EXPECT_THROW(ShmAllReduce(unique_name("bad"), 2, 2), std::invalid_argument);
  EXPECT_THROW(ShmAllReduce(unique_name("bad"), 0, 0), std::invalid_argument);
  ShmAllReduceOptions options;
  options.slot_bytes = 100;
  EXPECT_THROW(ShmAllReduce(unique_name("bad"), 0, 2, options), std::invalid_argument);
}

TEST(ShmAllReduceErrors, MismatchedGeometryIsRefused) {
  const std::string name = unique_name("geometry");
  ShmAllReduce rank0(name, 0, 2);
  ShmAllReduceOptions other;
  other.slot_bytes = 4096;
  other.timeout_s = 1.0;
  EXPECT_THROW(ShmAllReduce(name, 1, 2, other), std::runtime_error);
}

}  // namespace
}  // namespace pagellm
