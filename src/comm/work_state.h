// The shared completion state behind a Work handle: set once by the progress thread (or, for a
// stream-ordered engine, by the issuing thread once the collective is enqueued), read by any number
// of waiters.
#pragma once

#include <atomic>
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>

namespace mxddp::detail {

struct WorkState {
  std::mutex mutex;
  std::condition_variable done_cv;
  std::atomic<bool> done{false};  // release-stored after error is set, so readers see the error
  std::exception_ptr error;       // guarded by mutex; null on success
  // A stream-ordered engine's collective (backend.h's EnqueuedCollective), set before complete():
  // wait() rethrows late_failure's error, then calls order_after; is_completed() asks finished.
  // Empty for the engines that run a collective to completion.
  std::function<void()> order_after;
  std::function<bool()> finished;
  std::function<std::exception_ptr()> late_failure;

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
