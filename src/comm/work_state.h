// The shared completion state behind a Work handle: set once by the progress thread, read by any
// number of waiters.
#pragma once

#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>

namespace mxddp::detail {

struct WorkState {
  std::mutex mutex;
  std::condition_variable done_cv;
  std::atomic<bool> done{false};  // release-stored after error is set, so readers see the error
  std::exception_ptr error;       // guarded by mutex; null on success

  void complete(std::exception_ptr failure) {
    {
      std::lock_guard lock(mutex);
      error = std::move(failure);
      done.store(true, std::memory_order_release);
    }
    done_cv.notify_all();
  }
};

}  // namespace mxddp::detail
