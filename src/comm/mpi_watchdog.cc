// The MPI backend's watchdog: see mpi_watchdog.h.
#include "mpi_watchdog.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include <unistd.h>

#include <mxddp/comm.h>
#include <mxddp/core.h>

namespace mxddp {

namespace {

// Past this long without a completion the loop sleeps between tests: a wait that long is waiting
// on a peer (still computing, or descheduled), not on a message in flight, and the core belongs to
// this rank's compute threads and to whatever else shares the machine. Yielding instead (as this
// loop did) keeps the thread runnable: it burns an idle core whole, and on a busy one it is picked
// again and again, each time taking the core (and a context switch) from a thread with work to do
// (issue 44). Before it the loop only tests, so a peer that arrives within microseconds costs no
// added latency.
constexpr auto kSpinBeforeSleep = std::chrono::microseconds(50);
// Each sleep is a quarter of the time waited since the last completion, within [kSleepMin,
// kSleepMax]. A peer's arrival is then noticed at most one sleep late: a quarter more on a short
// wait, kSleepMax on a long one (a step's waits are milliseconds to seconds), plus the kernel's
// timer slack (50 us by default) on each sleep.
constexpr auto kSleepMin = std::chrono::microseconds(10);
constexpr auto kSleepMax = std::chrono::microseconds(1000);

// A gap this long between two polls means this rank itself was not running (stopped, descheduled,
// its VM paused); that time is left out of the idle time. Otherwise a rank continued after SIGSTOP
// would find its deadline long past and blame peers whose messages it simply had not looked at yet.
constexpr auto kPollGapNotCounted = std::chrono::milliseconds(100);

}  // namespace

void wait_or_abort(std::span<MPI_Request> requests, std::span<int> indices, int64_t timeout_ms,
                   const std::function<void(int index)>& on_complete,
                   const std::function<std::string()>& describe_stall) {
  MXDDP_ASSERT(indices.size() >= requests.size());
  const auto timeout = std::chrono::milliseconds(std::clamp<int64_t>(timeout_ms, 0, kMpiWaitMsMax));
  auto last_progress = std::chrono::steady_clock::now();
  auto last_poll = last_progress;
  for (;;) {
    int completed = 0;
    const int rc = MPI_Testsome(static_cast<int>(requests.size()), requests.data(), &completed, indices.data(),
                                MPI_STATUSES_IGNORE);
    if (rc != MPI_SUCCESS) [[unlikely]] {
      char text[MPI_MAX_ERROR_STRING];
      int len = 0;
      if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
      MXDDP_FAIL("MPI error in MPI_Testsome: {} (rc {})", std::string_view(text, static_cast<size_t>(len)), rc);
    }
    if (completed == MPI_UNDEFINED) return;  // no active request left
    const auto now = std::chrono::steady_clock::now();
    if (now - last_poll > kPollGapNotCounted) last_progress += now - last_poll;
    last_poll = now;
    if (completed > 0) {
      for (int i = 0; i < completed; ++i) on_complete(indices[static_cast<size_t>(i)]);
      last_progress = now;
      continue;
    }
    const auto idle = now - last_progress;
    if (idle >= timeout) abort_job_on_stall(describe_stall());
    if (idle >= kSpinBeforeSleep) {
      // The deadline check above runs after every sleep, and a sleep is at most 1 ms: the watchdog
      // still fires within timeout_ms + 1 ms of the last progress.
      std::this_thread::sleep_for(std::clamp<std::chrono::steady_clock::duration>(idle / 4, kSleepMin, kSleepMax));
    }
  }
}

CallWatchdog::CallWatchdog(int64_t timeout_ms, Describe describe_stall)
    : timeout_(std::chrono::milliseconds(std::clamp<int64_t>(timeout_ms, 0, kMpiWaitMsMax))),
      // A stall ends within timeout + tick; ticks of at most 100 ms keep that close to the timeout
      // and cost nothing measurable.
      tick_(std::clamp<Clock::duration>(timeout_ / 4, std::chrono::milliseconds(1), std::chrono::milliseconds(100))),
      describe_stall_(std::move(describe_stall)),
      thread_([this] { loop(); }) {}

CallWatchdog::~CallWatchdog() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  stop_cv_.notify_one();
  thread_.join();
}

CallWatchdog::Watched CallWatchdog::watch(std::string_view collective, uint64_t seq) {
  std::lock_guard lock(mutex_);
  active_ = true;
  started_ = Clock::now();
  collective_ = collective;
  seq_ = seq;
  return Watched(*this);
}

void CallWatchdog::end() {
  std::lock_guard lock(mutex_);
  active_ = false;
}

void CallWatchdog::loop() {
  std::unique_lock lock(mutex_);
  auto last_wake = Clock::now();
  for (;;) {
    stop_cv_.wait_for(lock, tick_, [&] { return stopping_; });
    if (stopping_) return;
    const auto now = Clock::now();
    // As in wait_or_abort: time this process was not running does not count against the peers.
    if (now - last_wake > tick_ + kPollGapNotCounted) started_ += now - last_wake - tick_;
    last_wake = now;
    if (active_ && now - started_ >= timeout_) abort_job_on_stall(describe_stall_(collective_, seq_));
  }
}

void end_job_or_exit(const std::string& message, const std::function<void()>& abort_job,
                     std::chrono::milliseconds grace) {
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
  // Armed before the abort, which may never return. Detached: nothing joins it, the process ends.
  // The text is formatted now: after the grace the heap may be in any state (another thread could
  // hold the allocator's lock inside a blocked MPI call).
  const std::string fallback = fmt::format(
      "mxddp: mpi watchdog: the job's abort did not end this process within {} ms (the launcher is "
      "unreachable?); exiting on its own (exit status {})\n",
      grace.count(), kMpiStallExitCode);
  std::thread([grace, fallback] {
    std::this_thread::sleep_for(grace);
    // write(2): async-signal-safe and lock-free, unlike stdio (whose lock a blocked thread may hold).
    [[maybe_unused]] const ssize_t n = ::write(STDERR_FILENO, fallback.data(), fallback.size());
    ::_exit(kMpiStallExitCode);
  }).detach();
  abort_job();
  // MPI_Abort does not return; if an MPI ever did, this rank still must not go on.
  ::_exit(kMpiStallExitCode);
}

void abort_job_on_stall(const std::string& message) { MpiRuntime::abort_job(message, kMpiStallExitCode); }

std::string format_ranks(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) out += fmt::format("{}{}", out.empty() ? "" : ", ", r);
  return out;
}

}  // namespace mxddp
