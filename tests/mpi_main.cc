// main() for the MPI test suites: see mpi_main.h. Only rank 0 prints gtest's progress listing;
// the other ranks print their failures, tagged with the rank.
#include "mpi_main.h"

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <vector>

#include <gtest/gtest.h>

namespace mxddp::testing {

Communicator* g_mpi_comm = nullptr;

std::string shared_temp_dir(const std::string& stem) {
  const std::string dir = (std::filesystem::temp_directory_path() / fmt::format("{}_{}", stem, ::getpid())).string();
  std::vector<char> name(256, '\0');
  MXDDP_CHECK(dir.size() < name.size(), "temp path '{}' is longer than {} bytes", dir, name.size() - 1);
  std::copy(dir.begin(), dir.end(), name.begin());
  g_mpi_comm->broadcast(TensorView{name.data(), DType::kU8, Shape{static_cast<int64_t>(name.size())}, Device::cpu()},
                        {.root = 0});
  return name.data();
}

namespace {
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (result.failed())
      std::printf("[rank %d] FAILURE %s:%d\n%s\n", rank_, result.file_name() ? result.file_name() : "?",
                  result.line_number(), result.summary());
  }

 private:
  int rank_;
};
}  // namespace

}  // namespace mxddp::testing

int main(int argc, char** argv) {
  mxddp::MpiRuntime runtime(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  int failed = 0;
  {
    auto comm = mxddp::make_mpi_communicator();
    mxddp::testing::g_mpi_comm = comm.get();
    if (comm->rank() != 0) {
      auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
      delete listeners.Release(listeners.default_result_printer());
      listeners.Append(new mxddp::testing::FailurePrinter(comm->rank()));
    }
    failed = RUN_ALL_TESTS();
    // Agree on the verdict, so one failing rank fails the whole run's exit status.
    MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (comm->rank() == 0) std::printf("mpi suite on %d ranks: %s\n", comm->size(), failed ? "FAILED" : "passed");
    mxddp::testing::g_mpi_comm = nullptr;
  }
  return failed;
}
