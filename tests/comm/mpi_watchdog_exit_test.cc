// The watchdog's last resort (end_job_or_exit): a rank whose job abort cannot end it (MPI_Abort
// blocked on a launcher it cannot reach, as when a link to mpirun's host fails) ends itself after
// the grace, with the stall's exit status, and says so. No MPI here: the abort is a stand-in.
#include <chrono>
#include <thread>

#include <unistd.h>

#include <gtest/gtest.h>

#include "comm/mpi_watchdog.h"

namespace mxddp {
namespace {

using std::chrono::milliseconds;

class MpiWatchdogExit : public ::testing::Test {
 protected:
  // The watchdog's fallback is a thread; the fork-and-reexec style keeps the death tests sound.
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

TEST_F(MpiWatchdogExit, ARankWhoseAbortBlocksEndsItselfAfterTheGrace) {
  const auto blocked_abort = [] {
    for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
  };
  EXPECT_EXIT(end_job_or_exit("all_reduce #7 stalled", blocked_abort, milliseconds(100)),
              ::testing::ExitedWithCode(kMpiStallExitCode),
              "all_reduce #7 stalled\n.*the job's abort did not end this process within 100 ms.*exiting on its own "
              "\\(exit status 3\\)");
}

// An abort that returns (no MPI does; the rank still must not go on) ends the rank at once: with a
// grace of an hour, waiting for it would hang the test.
TEST_F(MpiWatchdogExit, AnAbortThatReturnsEndsTheRankAtOnce) {
  EXPECT_EXIT(end_job_or_exit("barrier #2 stalled", [] {}, milliseconds(std::chrono::hours(1))),
              ::testing::ExitedWithCode(kMpiStallExitCode), "barrier #2 stalled");
}

// The normal case: the abort ends the process (here with its own status) before the grace, and the
// fallback never speaks.
TEST_F(MpiWatchdogExit, AnAbortThatEndsTheProcessIsNotOverridden) {
  EXPECT_EXIT(end_job_or_exit("reduce_scatter #3 stalled", [] { ::_exit(7); }, milliseconds(60'000)),
              ::testing::ExitedWithCode(7), "reduce_scatter #3 stalled\n$");
}

}  // namespace
}  // namespace mxddp
