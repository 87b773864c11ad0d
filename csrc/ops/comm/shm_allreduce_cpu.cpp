// The shared-memory all-reduce (see shm_allreduce.h for the protocol and why).
// Named *_cpu.cpp so the extension's source glob compiles it; torch-free.
#include "ops/comm/shm_allreduce.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <new>
#include <stdexcept>
#include <thread>

namespace pagellm {
namespace {

constexpr uint32_t kMagic = 0x70614152;  // "paAR": written last by the creator, once the header is ready
constexpr size_t kDataAlign = 4096;
constexpr int64_t kBlock = 1024;  // half-precision elements accumulated in fp32 per pass

using Clock = std::chrono::steady_clock;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Shared (not PRIVATE) futexes: the waiters live in other processes.
void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, long timeout_ns) {
  timespec ts{0, timeout_ns};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

inline bool reached(uint32_t value, uint32_t round) { return static_cast<int32_t>(value - round) >= 0; }

bool process_gone(int32_t pid) { return pid > 0 && kill(pid, 0) != 0 && errno == ESRCH; }

inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, as c10::BFloat16 does.
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float fp16_to_float(uint16_t h) {
  _Float16 v;
  std::memcpy(&v, &h, 2);
  return static_cast<float>(v);
}

inline uint16_t float_to_fp16(float f) {
  _Float16 v = static_cast<_Float16>(f);  // round to nearest even
  uint16_t h;
  std::memcpy(&h, &v, 2);
  return h;
}

template <float (*Load)(uint16_t), uint16_t (*Store)(float)>
void sum_half_slots(uint16_t* out, const char* const* slots, int world, int64_t count) {
  float acc[kBlock];
  for (int64_t start = 0; start < count; start += kBlock) {
    const int64_t n = std::min(kBlock, count - start);
    const auto* first = reinterpret_cast<const uint16_t*>(slots[0]) + start;
    for (int64_t i = 0; i < n; ++i) acc[i] = Load(first[i]);
    for (int r = 1; r < world; ++r) {
      const auto* p = reinterpret_cast<const uint16_t*>(slots[r]) + start;
      for (int64_t i = 0; i < n; ++i) acc[i] += Load(p[i]);
    }
    for (int64_t i = 0; i < n; ++i) out[start + i] = Store(acc[i]);
  }
}

void sum_float_slots(float* out, const char* const* slots, int world, int64_t count) {
  const auto* first = reinterpret_cast<const float*>(slots[0]);
  for (int64_t i = 0; i < count; ++i) out[i] = first[i];
  for (int r = 1; r < world; ++r) {
    const auto* p = reinterpret_cast<const float*>(slots[r]);
    for (int64_t i = 0; i < count; ++i) out[i] += p[i];
  }
}

int64_t element_size(ShmDtype dtype) {
  switch (dtype) {
    case ShmDtype::kFloat32: return 4;
    case ShmDtype::kBFloat16:
    case ShmDtype::kFloat16: return 2;
  }
  throw std::invalid_argument("shm all-reduce: dtype must be float32, bfloat16 or float16");
}

}  // namespace

struct alignas(64) ShmRankSlot {
  std::atomic<uint32_t> arrived;  // the last round whose chunk this rank published
  std::atomic<uint32_t> waiters;  // peers sleeping on `arrived` (the publisher wakes them only then)
  std::atomic<int32_t> pid;       // set when the rank attached; checked by a waiting peer
};

struct ShmAllReduce::Segment {
  std::atomic<uint32_t> magic;
  int32_t world_size;
  int64_t slot_bytes;
  std::atomic<int32_t> num_attached;
  alignas(64) ShmRankSlot ranks[kMaxRanks];
};


ShmAllReduce::ShmAllReduce(const std::string& name, int rank, int world_size, const ShmAllReduceOptions& options)
    : name_(name), rank_(rank), world_size_(world_size), options_(options) {
  static_assert(std::atomic<uint32_t>::is_always_lock_free, "the segment's counters must be lock-free");
  if (name.empty() || name[0] != '/' || name.size() > 200 || name.find('/', 1) != std::string::npos)
    throw std::invalid_argument("shm all-reduce: name must be '/' followed by 1-199 characters without '/', got '" + name + "'");
  if (world_size < 1 || world_size > kMaxRanks)
    throw std::invalid_argument("shm all-reduce: world_size must be in [1, " + std::to_string(kMaxRanks) + "], got " + std::to_string(world_size));
  if (rank < 0 || rank >= world_size)
    throw std::invalid_argument("shm all-reduce: rank must be in [0, " + std::to_string(world_size) + "), got " + std::to_string(rank));
  if (options.slot_bytes < 64 || options.slot_bytes > (int64_t{1} << 30) || options.slot_bytes % 64 != 0)
    throw std::invalid_argument("shm all-reduce: slot_bytes must be a multiple of 64 in [64, 2^30], got " + std::to_string(options.slot_bytes));
  if (!(options.timeout_s > 0))
    throw std::invalid_argument("shm all-reduce: timeout_s must be > 0, got " + std::to_string(options.timeout_s));
  if (options.spin_us < 0 || options.spin_us > 1000000)
    throw std::invalid_argument("shm all-reduce: spin_us must be in [0, 1000000], got " + std::to_string(options.spin_us));
  mapped_bytes_ = data_offset() + 2 * static_cast<size_t>(world_size) * static_cast<size_t>(options.slot_bytes);
  if (rank == 0) {
    create_segment();
  } else {
    attach_segment();
  }
}

void ShmAllReduce::create_segment() {
  int fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw std::runtime_error("shm all-reduce: cannot create " + name_ + ": " + std::strerror(errno));
  if (ftruncate(fd, static_cast<off_t>(mapped_bytes_)) != 0) {
    const int err = errno;
    close(fd);
    shm_unlink(name_.c_str());
    throw std::runtime_error("shm all-reduce: cannot size " + name_ + ": " + std::strerror(err));
  }
  void* p = mmap(nullptr, mapped_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(name_.c_str());
    throw std::runtime_error("shm all-reduce: cannot map " + name_ + ": " + std::strerror(err));
  }
  segment_ = new (p) Segment();  // the file is zero-filled: counters start at round 0
  segment_->world_size = world_size_;
  segment_->slot_bytes = options_.slot_bytes;
  segment_->ranks[0].pid.store(static_cast<int32_t>(getpid()));
  segment_->num_attached.store(1);
  segment_->magic.store(kMagic, std::memory_order_release);
  if (world_size_ == 1) {
    shm_unlink(name_.c_str());
    attached_all_ = true;
  }
}

void ShmAllReduce::attach_segment() {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                          std::chrono::duration<double>(options_.timeout_s));
  int fd = -1;
  while (true) {  // rank 0 may not have created (or sized) it yet
    fd = shm_open(name_.c_str(), O_RDWR, 0600);
    struct stat st {};
    if (fd >= 0 && fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) >= mapped_bytes_) break;
    if (fd >= 0) close(fd);
    if (Clock::now() > deadline)
      throw std::runtime_error("shm all-reduce: rank " + std::to_string(rank_) + " waited more than " +
                               std::to_string(options_.timeout_s) + " s for rank 0 to create " + name_);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  void* p = mmap(nullptr, mapped_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (p == MAP_FAILED) throw std::runtime_error("shm all-reduce: cannot map " + name_ + ": " + std::strerror(err));
  segment_ = static_cast<Segment*>(p);
  try {
    finish_attach(deadline);
  } catch (...) {  // the constructor throws: no destructor will unmap
    munmap(segment_, mapped_bytes_);
    segment_ = nullptr;
    throw;
  }
}

void ShmAllReduce::finish_attach(std::chrono::steady_clock::time_point deadline) {
  while (segment_->magic.load(std::memory_order_acquire) != kMagic) {
    if (Clock::now() > deadline) fail("rank 0 never finished creating the segment");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (segment_->world_size != world_size_ || segment_->slot_bytes != options_.slot_bytes)
    fail("the segment was created for world_size " + std::to_string(segment_->world_size) + ", slot_bytes " +
         std::to_string(segment_->slot_bytes) + "; this rank asked for " + std::to_string(world_size_) + ", " +
         std::to_string(options_.slot_bytes));
  segment_->ranks[rank_].pid.store(static_cast<int32_t>(getpid()));
  if (segment_->num_attached.fetch_add(1) + 1 == world_size_) {
    shm_unlink(name_.c_str());  // everyone holds a mapping: the name is no longer needed
    attached_all_ = true;
  }
}

ShmAllReduce::~ShmAllReduce() {
  if (segment_ != nullptr) {
    if (rank_ == 0 && !all_attached()) shm_unlink(name_.c_str());
    munmap(segment_, mapped_bytes_);
  }
}

void ShmAllReduce::unlink(const std::string& name) { shm_unlink(name.c_str()); }

bool ShmAllReduce::all_attached() const {
  return attached_all_ || (segment_ != nullptr && segment_->num_attached.load() >= world_size_);
}

size_t ShmAllReduce::data_offset() { return (sizeof(Segment) + kDataAlign - 1) / kDataAlign * kDataAlign; }

char* ShmAllReduce::slot(int buffer, int rank) const {
  return reinterpret_cast<char*>(segment_) + data_offset() +
         (static_cast<size_t>(buffer) * world_size_ + rank) * static_cast<size_t>(options_.slot_bytes);
}

void ShmAllReduce::fail(const std::string& why) {
  broken_ = "shm all-reduce " + name_ + " (rank " + std::to_string(rank_) + " of " + std::to_string(world_size_) +
            "): " + why + "; the communicator is unusable";
  throw std::runtime_error(broken_);
}

void ShmAllReduce::publish(uint32_t round) {
  ShmRankSlot& me = segment_->ranks[rank_];
  me.arrived.store(round, std::memory_order_seq_cst);
  // seq_cst store then load pairs with the waiter's increment-then-recheck: one of us sees the other
  if (me.waiters.load(std::memory_order_seq_cst) != 0) futex_wake_all(&me.arrived);
}

void ShmAllReduce::wait_for_rank(int peer, uint32_t round) {
  ShmRankSlot& other = segment_->ranks[peer];
  if (reached(other.arrived.load(std::memory_order_acquire), round)) return;
  const auto start = Clock::now();
  const auto spin_end = start + std::chrono::microseconds(options_.spin_us);
  for (int i = 0;; ++i) {
    if (reached(other.arrived.load(std::memory_order_acquire), round)) return;
    if ((i & 63) == 63 && Clock::now() >= spin_end) break;
    cpu_relax();
  }
  const auto deadline = start + std::chrono::duration<double>(options_.timeout_s);
  while (true) {
    other.waiters.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t seen = other.arrived.load(std::memory_order_seq_cst);
    if (!reached(seen, round)) futex_wait(&other.arrived, seen, 50 * 1000 * 1000);  // 50 ms slices
    other.waiters.fetch_sub(1, std::memory_order_seq_cst);
    if (reached(other.arrived.load(std::memory_order_acquire), round)) return;
    const int32_t pid = other.pid.load();
    if (process_gone(pid))
      fail("rank " + std::to_string(peer) + " (pid " + std::to_string(pid) + ") exited before round " +
           std::to_string(round));
    if (Clock::now() > deadline)
      fail("waited more than " + std::to_string(options_.timeout_s) + " s for rank " + std::to_string(peer) +
           (pid > 0 ? " (pid " + std::to_string(pid) + ")" : " (never attached)") + " at round " +
           std::to_string(round));
  }
}

void ShmAllReduce::reduce_chunk(void* out, int64_t offset_bytes, int64_t count, ShmDtype dtype, int buffer) {
  const char* slots[kMaxRanks];
  for (int r = 0; r < world_size_; ++r) slots[r] = slot(buffer, r);
  char* dst = static_cast<char*>(out) + offset_bytes;
  switch (dtype) {
    case ShmDtype::kFloat32:
      sum_float_slots(reinterpret_cast<float*>(dst), slots, world_size_, count);
      break;
    case ShmDtype::kBFloat16:
      sum_half_slots<bf16_to_float, float_to_bf16>(reinterpret_cast<uint16_t*>(dst), slots, world_size_, count);
      break;
    case ShmDtype::kFloat16:
      sum_half_slots<fp16_to_float, float_to_fp16>(reinterpret_cast<uint16_t*>(dst), slots, world_size_, count);
      break;
  }
}

void ShmAllReduce::exchange(const char* chunk, int64_t bytes, uint32_t round) {
  std::memcpy(slot(static_cast<int>(round & 1u), rank_), chunk, static_cast<size_t>(bytes));
  publish(round);
  for (int peer = 0; peer < world_size_; ++peer) {
    if (peer != rank_) wait_for_rank(peer, round);
  }
}

void ShmAllReduce::all_reduce(void* data, int64_t numel, ShmDtype dtype) {
  if (!broken_.empty()) throw std::runtime_error(broken_);
  const int64_t esize = element_size(dtype);
  if (numel < 0) throw std::invalid_argument("shm all-reduce: numel must be >= 0, got " + std::to_string(numel));
  if (numel > 0 && data == nullptr) throw std::invalid_argument("shm all-reduce: data is null");
  if (world_size_ == 1 || numel == 0) return;
  const int64_t chunk = options_.slot_bytes / esize;
  for (int64_t start = 0; start < numel; start += chunk) {
    const int64_t count = std::min(chunk, numel - start);
    const uint32_t round = ++round_;
    exchange(static_cast<char*>(data) + start * esize, count * esize, round);
    reduce_chunk(data, start * esize, count, dtype, static_cast<int>(round & 1u));
  }
}

void ShmAllReduce::all_gather(const void* in, void* out, int64_t nbytes) {
  if (!broken_.empty()) throw std::runtime_error(broken_);
  if (nbytes < 0) throw std::invalid_argument("shm all-gather: nbytes must be >= 0, got " + std::to_string(nbytes));
  if (nbytes > 0 && (in == nullptr || out == nullptr)) throw std::invalid_argument("shm all-gather: a buffer is null");
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  const int64_t out_bytes = nbytes * world_size_;
  if (nbytes > 0 && src < dst + out_bytes && dst < src + nbytes)
    throw std::invalid_argument("shm all-gather: in and out overlap");
  if (world_size_ == 1 || nbytes == 0) {
    if (nbytes > 0) std::memcpy(dst, src, static_cast<size_t>(nbytes));
    return;
  }
  for (int64_t start = 0; start < nbytes; start += options_.slot_bytes) {
    const int64_t bytes = std::min(options_.slot_bytes, nbytes - start);
    const uint32_t round = ++round_;
    exchange(src + start, bytes, round);
    const int buffer = static_cast<int>(round & 1u);
    for (int r = 0; r < world_size_; ++r)
      std::memcpy(dst + r * nbytes + start, slot(buffer, r), static_cast<size_t>(bytes));
  }
}

}  // namespace pagellm
