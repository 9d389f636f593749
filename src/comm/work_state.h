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

// What a stream-ordered engine's collective does for its Work (backend.h's EnqueuedCollective):
// wait() rethrows late_failure's error, then calls order_after; is_completed() asks finished.
struct StreamOrderHooks {
  std::function<void()> order_after;                 // the rank's compute stream waits for it
  std::function<bool()> finished;                    // whether the device is done with it
  std::function<std::exception_ptr()> late_failure;  // the engine's failure found since, or null
};

struct WorkState {
  std::mutex mutex;
  std::condition_variable done_cv;
  std::atomic<bool> done{false};  // release-stored after error is set, so readers see the error
  std::exception_ptr error;       // guarded by mutex; null on success
  // A stream-ordered engine's collective, set before complete(); empty for the engines that run
  // a collective to completion.
  StreamOrderHooks stream;

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
