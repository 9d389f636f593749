// The MPI backend's watchdog: bounds how long a rank waits on its peers inside MPI, and ends a
// confirmed stall by printing what it waited for and aborting the job.
//
// A blocking MPI call cannot be given a deadline and MPI cannot cancel a collective, so a peer
// that stops (SIGSTOP, a hung driver, a livelocked host) would hold every other rank inside MPI
// forever. Two tools, one per phase of an MPI collective (see mpi_backend.cc):
//   - wait_or_abort: a wait on nonblocking requests with a no-progress deadline, for the arrival
//     exchange, where each completed request tells which peer arrived. It tests for 50 us, then
//     sleeps between tests (a quarter of the time waited so far, 10 us to 1 ms), so a rank waiting
//     for a late peer leaves the cores to the ranks still computing (issue 44);
//   - CallWatchdog: a thread that watches the blocking MPI collective the progress thread is in and
//     aborts once it has run for timeout_ms. The data phase stays a blocking call because
//     OpenMPI's nonblocking collectives (libnbc) run all_reduce 1.5 to 1.9x slower than its
//     blocking ones on this project's machines (2 ranks, 1 KiB to 64 MiB).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <mpi.h>

namespace mxddp {

// The exit status the job ends with when the watchdog aborts it (passed to MPI_Abort; mpirun
// exits with it).
inline constexpr int kMpiStallExitCode = 3;

// A timeout above this many milliseconds is treated as this (100 years): steady_clock counts int64
// nanoseconds, and a larger deadline would overflow into the past.
inline constexpr int64_t kMpiWaitMsMax = int64_t{100} * 365 * 24 * 3600 * 1000;

// Waits until every request in `requests` completed (each becomes MPI_REQUEST_NULL). Every
// completion is progress: on_complete(index) is told of it and the deadline restarts. If no
// request completes for timeout_ms, prints describe_stall() on stderr and aborts the job (see
// abort_job_on_stall); it never returns then. indices is scratch of at least requests.size().
// Throws Error if MPI reports an error.
void wait_or_abort(std::span<MPI_Request> requests, std::span<int> indices, int64_t timeout_ms,
                   const std::function<void(int index)>& on_complete,
                   const std::function<std::string()>& describe_stall);

// Watches one blocking call at a time. The progress thread brackets each call with watch(); a
// thread of the watchdog's own checks every tick and, when a call has run for timeout_ms, prints
// describe_stall(collective, seq) on stderr and aborts the job (abort_job_on_stall) from there
// (MPI_THREAD_MULTIPLE allows it while the progress thread is inside MPI). The fast path is one
// uncontended lock and a clock read at each end of a call.
class CallWatchdog {
 public:
  using Describe = std::function<std::string(std::string_view collective, uint64_t seq)>;
  CallWatchdog(int64_t timeout_ms, Describe describe_stall);
  ~CallWatchdog();  // stops and joins the thread
  CallWatchdog(const CallWatchdog&) = delete;
  CallWatchdog& operator=(const CallWatchdog&) = delete;

  class Watched {  // ends the watch when it goes out of scope
   public:
    explicit Watched(CallWatchdog& dog) : dog_(dog) {}
    ~Watched() { dog_.end(); }
    Watched(const Watched&) = delete;
    Watched& operator=(const Watched&) = delete;

   private:
    CallWatchdog& dog_;
  };
  // collective must outlive the watch (collective_name's strings are static).
  [[nodiscard]] Watched watch(std::string_view collective, uint64_t seq);

 private:
  void end();
  void loop();

  using Clock = std::chrono::steady_clock;
  const Clock::duration timeout_;
  const Clock::duration tick_;
  const Describe describe_stall_;
  std::mutex mutex_;
  std::condition_variable stop_cv_;
  bool stopping_ = false;        // guarded by mutex_
  bool active_ = false;          // guarded by mutex_: a call is being watched
  Clock::time_point started_;    // guarded by mutex_
  std::string_view collective_;  // guarded by mutex_
  uint64_t seq_ = 0;             // guarded by mutex_
  std::thread thread_;           // started last, after every member it reads exists
};

// How long a rank gives MPI_Abort to end it before it ends itself (see end_job_or_exit). OpenMPI's
// abort goes through the local daemon to mpirun and back; on one host that takes well under a
// second, and when mpirun is unreachable (a failed link, a failed host) it never comes back. 10 s
// keeps a cut-off rank's end within the watchdog's timeout + 20 s that multihost runs promise
// (docs/multihost.md), with room for a slow but working abort.
inline constexpr std::chrono::milliseconds kMpiAbortGrace{10'000};

// Prints message on stderr, then calls abort_job (which should end the process, and with it the
// job). If this process still runs grace later (abort_job blocked, e.g. MPI_Abort waiting on a
// launcher it cannot reach), a thread armed before abort_job prints that on stderr and ends the
// process with _exit(kMpiStallExitCode): no destructors or atexit handlers, which could block in
// MPI too. If abort_job returns, the process ends the same way at once.
[[noreturn]] void end_job_or_exit(const std::string& message, const std::function<void()>& abort_job,
                                  std::chrono::milliseconds grace);

// Prints message on stderr and ends the whole job with MPI_Abort(MPI_COMM_WORLD,
// kMpiStallExitCode), or this rank alone after kMpiAbortGrace: MpiRuntime::abort_job with the
// watchdog's exit status. Library code must not end the process; this is the one documented
// exception: a stalled collective cannot be cancelled (its requests still own the caller's buffers
// and every later collective on the communicator would pair with the wrong peer call), so throwing
// an Error would leave this rank unable to communicate and every peer still hung. Aborting is the
// only exit that frees all ranks, and it is what a job scheduler needs to restart the job.
[[noreturn]] void abort_job_on_stall(const std::string& message);

// "1, 3": ranks for messages.
std::string format_ranks(const std::vector<int>& ranks);

}  // namespace mxddp
