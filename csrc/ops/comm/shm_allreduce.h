// A shared-memory all-reduce for the tensor-parallel ranks of one host (torch-free).
//
// Why: gloo's all-reduce over loopback TCP costs ~0.6 ms per call, which dominates a decode step's
// dozens of [1, hidden] all-reduces. Same-host ranks can instead meet in one POSIX shm segment.
//
// The segment (named by a per-group token the driver hands to every rank):
//   header: magic, world size, slot bytes, attach count; per rank (own cache line): `arrived` round
//           counter, `waiters` count, pid
//   data:   two buffers x world_size slots of slot_bytes each
// One round (a chunk of at most slot_bytes): a rank copies its chunk into its slot of buffer
// (round & 1), publishes `arrived = round`, waits for every peer's `arrived` to reach the round, then
// sums the slots in rank order (fp32 accumulation for bf16 / fp16), so every rank gets bit-identical
// results. Two buffers make that the only wait: a peer that reached round r has finished reading
// round r - 1's buffer, so round r + 1 may overwrite it.
// Waiting: a short spin, then futex sleeps (a busy machine must not burn the peer's CPU), with the
// peer's liveness checked between sleeps. A wait past `timeout_s`, or a peer whose process is gone,
// raises std::runtime_error naming that rank; the communicator is then unusable.
// The name is unlinked as soon as every rank has attached (nothing can leak after set-up); before
// that, the creator's destructor or `ShmAllReduce::unlink` (the driver's clean-up) removes it.
// The all-gather (the vocab-parallel LM head's logits) uses the same slots and round counter: a rank
// copies its chunk of bytes in, publishes, waits, then copies every rank's slot out in rank order, so
// all-reduces and all-gathers may interleave freely as long as every rank issues the same sequence.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace pagellm {

enum class ShmDtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

struct ShmAllReduceOptions {
  int64_t slot_bytes = int64_t{1} << 20;  // per-rank chunk size; larger tensors go in several rounds
  double timeout_s = 60.0;                // the longest one wait (attach or a peer's chunk) may take
  int spin_us = 100;                      // how long a waiter polls before it sleeps on the futex
};

class ShmAllReduce {
 public:
  static constexpr int kMaxRanks = 64;

  // Rank 0 creates the segment `name` (fails if it exists); the other ranks attach to it, waiting up to
  // timeout_s for it to appear. std::invalid_argument for bad arguments, std::runtime_error for OS errors.
  ShmAllReduce(const std::string& name, int rank, int world_size, const ShmAllReduceOptions& options = {});
  ~ShmAllReduce();  // unmaps; the creator also unlinks the name if it is still there
  ShmAllReduce(const ShmAllReduce&) = delete;
  ShmAllReduce& operator=(const ShmAllReduce&) = delete;

  // In place: data[0, numel) becomes the element-wise sum over the ranks. Every rank calls it with the
  // same numel and dtype, in the same order. Not thread-safe per communicator.
  void all_reduce(void* data, int64_t numel, ShmDtype dtype);

  // out[r * nbytes, (r + 1) * nbytes) = rank r's `in` (nbytes each), for every rank r: a rank-ordered
  // concatenation of raw bytes. `in` and `out` must not overlap. Same calling rules as all_reduce.
  void all_gather(const void* in, void* out, int64_t nbytes);

  // Removes the segment's name (no error if it is already gone).
  static void unlink(const std::string& name);

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  int64_t slot_bytes() const { return options_.slot_bytes; }
  const std::string& name() const { return name_; }
  // True once every rank attached (the name is then unlinked).
  bool all_attached() const;

 private:
  struct Segment;
  void create_segment();
  void attach_segment();
  void finish_attach(std::chrono::steady_clock::time_point deadline);
  void publish(uint32_t round);
  void wait_for_rank(int peer, uint32_t round);
  [[noreturn]] void fail(const std::string& why);
  void exchange(const char* chunk, int64_t bytes, uint32_t round);  // copy into my slot, publish, wait
  void reduce_chunk(void* out, int64_t offset_bytes, int64_t count, ShmDtype dtype, int buffer);
  char* slot(int buffer, int rank) const;
  static size_t data_offset();  // where the slots start: the header rounded up to a page

  std::string name_;
  int rank_;
  int world_size_;
  ShmAllReduceOptions options_;
  Segment* segment_ = nullptr;
  size_t mapped_bytes_ = 0;
  uint32_t round_ = 0;
  bool attached_all_ = false;
  std::string broken_;  // why the communicator is unusable; empty while healthy
};

}  // namespace pagellm
