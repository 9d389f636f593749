// ProgressQueue: one thread per communicator that runs its collectives in issue order. This is
// what makes an asynchronous collective advance while the caller computes, and what keeps every
// rank's collectives in the same order whether they were issued blocking or not.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include <mxddp/comm.h>

#include "work_state.h"

namespace mxddp {

class ProgressQueue {
 public:
  ProgressQueue();
  ~ProgressQueue();  // runs what was already submitted, then joins
  ProgressQueue(const ProgressQueue&) = delete;
  ProgressQueue& operator=(const ProgressQueue&) = delete;

  // Queues task; the returned Work completes when it has run, carrying any exception it threw.
  Work submit(std::function<void()> task);

 private:
  struct Item {
    std::function<void()> task;
    std::shared_ptr<detail::WorkState> state;
  };
  void loop();

  std::mutex mutex_;
  std::condition_variable wake_cv_;
  std::deque<Item> items_;  // guarded by mutex_
  bool stopping_ = false;   // guarded by mutex_
  std::thread thread_;      // started last, after every member it reads exists
};

}  // namespace mxddp
