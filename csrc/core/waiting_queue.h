// Ordered queue of requests waiting for admission (FCFS or priority).
#pragma once

#include <cstdint>
#include <set>

#include "core/request.h"

namespace pagellm {

// FCFS: insertion order (push_front puts a preempted request before everything else).
// Priority: (priority, arrival_time, insertion order); push_front behaves like push_back.
class WaitingQueue {
 public:
  // Orders by policy; priority_policy=false means FCFS.
  explicit WaitingQueue(bool priority_policy) : set_(Compare{priority_policy}) {}
  // Enqueues at the back (new arrival).
  void push_back(Request* r);
  // Enqueues at the front (preempted request resuming first).
  void push_front(Request* r);
  // First request to admit; nullptr when empty.
  Request* front() const { return set_.empty() ? nullptr : *set_.begin(); }
  // Removes the front request.
  void pop_front() { set_.erase(set_.begin()); }
  // Removes a queued request; false if absent.
  bool remove(Request* r) { return set_.erase(r) > 0; }
  // Number of queued requests.
  int32_t size() const { return static_cast<int32_t>(set_.size()); }
  // Whether empty.
  bool empty() const { return set_.empty(); }

 private:
  struct Compare {
    bool priority;
    // Strict weak order over queued requests.
    bool operator()(const Request* a, const Request* b) const {
      if (priority) {
        if (a->priority() != b->priority()) return a->priority() < b->priority();
        if (a->arrival_time() != b->arrival_time()) return a->arrival_time() < b->arrival_time();
      }
      return a->queue_order() < b->queue_order();
    }
  };
  std::set<Request*, Compare> set_;
  int64_t back_order_ = 0;
  int64_t front_order_ = 0;
};

inline void WaitingQueue::push_back(Request* r) {
  r->set_queue_order(++back_order_);
  set_.insert(r);
}

inline void WaitingQueue::push_front(Request* r) {
  r->set_queue_order(--front_order_);
  set_.insert(r);
}

}  // namespace pagellm
