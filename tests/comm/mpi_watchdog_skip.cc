// The MPI watchdog's arrival tracking, run by tests/comm/mpi_stall.sh under mpirun -np 3: the last
// rank reaches all_reduce #1 late but within the timeout (which must not abort), then skips
// barrier #2 for far longer than the timeout. Ranks 0 and 1 must end the job naming barrier #2 and
// the last rank only (with the consistency exchange; argument "unchecked" turns it off, and then
// every peer is named). Not a gtest: the expected outcome is MPI_Abort, which ends every process.
#include <chrono>
#include <cstdio>
#include <string_view>
#include <thread>

#include <mxddp/comm.h>

int main(int argc, char** argv) {
  mxddp::MpiRuntime runtime(&argc, &argv);
  const bool unchecked = argc > 1 && std::string_view(argv[1]) == "unchecked";
  constexpr int64_t kTimeoutMs = 1000;
  auto comm = mxddp::make_mpi_communicator({.check_consistency = !unchecked, .timeout_ms = kTimeoutMs});
  const bool last = comm->rank() == comm->size() - 1;

  float x = 1.0f;
  if (last) std::this_thread::sleep_for(std::chrono::milliseconds(kTimeoutMs / 2));
  comm->all_reduce(mxddp::TensorView{&x, mxddp::DType::kF32, mxddp::Shape{1}, {}});
  std::printf("rank %d: all_reduce #1 gave %g\n", comm->rank(), x);
  std::fflush(stdout);

  if (last) std::this_thread::sleep_for(std::chrono::seconds(60));
  comm->barrier();
  std::printf("rank %d: barrier #2 completed\n", comm->rank());
  return 0;
}
