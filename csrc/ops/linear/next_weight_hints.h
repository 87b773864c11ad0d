// Which weight a batch-1 decode streams next, learned from the order of the calls themselves.
//
// A decode step calls the same projections in the same order every step (qkv, o, gate_up, down per layer,
// then the LM head, then the first layer again). Each M = 1 linear call records its weight as the successor
// of the previous call's, and looks up the successor its own weight had last time: the weight the step will
// most likely stream next. linear_small_m hands that range to the thread pool (prefetch_next), whose idle
// worker prefetches it while the caller runs the small ops in between. Learning from the calls keeps the
// model code and the step graph unaware of it, and works eagerly and in replay alike. A wrong guess (another
// model's step, a changed batch) costs only prefetched bytes: nothing here is ever read through.
// Torch-free; one table per calling thread (the engine thread), so no locks.
#pragma once

#include <cstdint>

namespace pagellm::cpu {

struct WeightRange {
  const void* ptr = nullptr;
  int64_t bytes = 0;
};

class NextWeightHints {
 public:
  // Records `w` as the successor of the previous call's weight; returns the successor `w` had last time
  // (ptr nullptr when none is known).
  WeightRange advance(WeightRange w) {
    if (last_ != nullptr) slot(last_) = {last_, w};
    last_ = w.ptr;
    const Slot& s = slot(w.ptr);
    return s.key == w.ptr ? s.next : WeightRange{};
  }

  // The calling thread's table.
  static NextWeightHints& for_this_thread() {
    static thread_local NextWeightHints hints;
    return hints;
  }

 private:
  struct Slot {
    const void* key = nullptr;
    WeightRange next;
  };
  // Direct-mapped by address: more than a big model's projections per step; a collision only loses a hint.
  static constexpr int kSlots = 1024;

  Slot& slot(const void* p) {
    const uint64_t h = (reinterpret_cast<uintptr_t>(p) >> 6) * 0x9E3779B97F4A7C15ull;
    return slots_[h >> (64 - 10)];
  }

  Slot slots_[kSlots];
  const void* last_ = nullptr;
};

}  // namespace pagellm::cpu
