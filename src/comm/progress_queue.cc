// ProgressQueue: see progress_queue.h. Work::wait/is_completed live here too, beside the state
// they read.
#include "progress_queue.h"

namespace mxddp {

Work::Work() = default;
Work::Work(std::shared_ptr<detail::WorkState> state) : state_(std::move(state)) {}

namespace {

// Each waiter gets its own copy of an mxddp::Error rather than the exception object stored in the
// state, which every waiter and the progress thread share and which is freed by whichever thread
// drops the last reference, possibly while another still reads its message.
[[noreturn]] void rethrow_copy(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    throw Error(e.message(), e.where());  // not the copy constructor: runtime_error shares its buffer
  }
}

}  // namespace

void Work::wait() const {
  if (!state_) return;
  {
    std::unique_lock lock(state_->mutex);
    state_->done_cv.wait(lock, [&] { return state_->done.load(std::memory_order_acquire); });
    if (state_->error) rethrow_copy(state_->error);
  }
  // A stream-ordered collective: enqueued, so the compute stream is ordered after it (the host does
  // not wait), unless its engine has failed since.
  const detail::StreamOrderHooks& stream = state_->stream;
  if (stream.late_failure)
    if (std::exception_ptr late = stream.late_failure()) rethrow_copy(late);
  if (stream.order_after) stream.order_after();
}

bool Work::is_completed() const {
  if (!state_) return true;
  if (!state_->done.load(std::memory_order_acquire)) return false;
  return !state_->stream.finished || state_->stream.finished();
}

ProgressQueue::ProgressQueue() : thread_([this] { loop(); }) {}

ProgressQueue::~ProgressQueue() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_cv_.notify_one();
  thread_.join();
}

Work ProgressQueue::submit(std::function<void()> task) {
  auto state = std::make_shared<detail::WorkState>();
  {
    std::lock_guard lock(mutex_);
    MXDDP_ASSERT(!stopping_);
    items_.push_back({std::move(task), state});
  }
  wake_cv_.notify_one();
  return Work(state);
}

void ProgressQueue::loop() {
  for (;;) {
    Item item;
    {
      std::unique_lock lock(mutex_);
      wake_cv_.wait(lock, [&] { return stopping_ || !items_.empty(); });
      if (items_.empty()) return;  // stopping, and everything submitted has run
      item = std::move(items_.front());
      items_.pop_front();
    }
    std::exception_ptr failure;
    try {
      item.task();
    } catch (...) {
      failure = std::current_exception();
    }
    item.state->complete(std::move(failure));
  }
}

}  // namespace mxddp
