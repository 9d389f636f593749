// The MPI watchdog's deadline without a stall, run by CTest as `mpirun -np 2` and `-np 4`: ranks
// that are late but keep arriving within timeout_ms of each other are progress, never a stall. (A
// real stall ends the job with MPI_Abort, which a gtest process cannot survive to report; those
// cases are tests/comm/mpi_stall.sh.)
#include <chrono>
#include <thread>

#include <gtest/gtest.h>

#include "mpi_main.h"

namespace mxddp::testing {
namespace {

constexpr int64_t kTimeoutMs = 1000;

float all_reduce_one(Communicator& comm, float value) {
  comm.all_reduce(TensorView{&value, DType::kF32, Shape{1}, Device::cpu()});
  return value;
}

TEST(MpiWatchdog, ARankLateWithinTheTimeoutIsNotAStall) {
  auto comm = make_mpi_communicator({.timeout_ms = kTimeoutMs});
  if (comm->rank() == comm->size() - 1) std::this_thread::sleep_for(std::chrono::milliseconds(kTimeoutMs / 2));
  EXPECT_EQ(all_reduce_one(*comm, 1.0f), static_cast<float>(comm->size()));
}

// Rank r arrives at 0.6 * timeout * r: the last one (1.8 timeouts late at 4 ranks) is later than
// the timeout, but every wait between two arrivals is shorter, and each arrival is progress.
TEST(MpiWatchdog, EachArrivalRestartsTheDeadline) {
  auto comm = make_mpi_communicator({.timeout_ms = kTimeoutMs});
  std::this_thread::sleep_for(std::chrono::milliseconds(kTimeoutMs * 6 / 10 * comm->rank()));
  EXPECT_EQ(all_reduce_one(*comm, 1.0f), static_cast<float>(comm->size()));
}

TEST(MpiWatchdog, TimeoutMustBePositive) {
  EXPECT_THROW(make_mpi_communicator({.timeout_ms = 0}), Error);
}

}  // namespace
}  // namespace mxddp::testing
