// The collective suite on the MPI backend: run by CTest as `mpirun -np 2` and `-np 4`. Each
// process is one rank; gtest runs in every process and any failing rank fails the run.
#include <mpi.h>

#include "comm/collective_checks.h"

namespace mxddp::testing {
namespace {

Communicator* g_comm = nullptr;

// On ranks other than 0 the default printer is removed; this keeps their failures visible.
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

class MpiCollectives : public ::testing::TestWithParam<DType> {};

TEST_P(MpiCollectives, EveryCollectiveMatchesSerialReference) { check_every_collective(*g_comm, GetParam()); }

INSTANTIATE_TEST_SUITE_P(DTypes, MpiCollectives, ::testing::Values(DType::kF32, DType::kBF16, DType::kU8),
                         [](const ::testing::TestParamInfo<DType>& info) { return std::string(dtype_name(info.param)); });

TEST(MpiBackend, AsyncCollectiveProgressesWhileCallerComputes) { check_async_progress_without_wait(*g_comm); }

TEST(MpiBackend, MismatchedCountsAndDTypesAreErrorsOnEveryRank) { check_mismatch_is_an_error(*g_comm); }

TEST(MpiBackend, StagingBuffersAreChargedToTheTracker) {
  MemoryTracker tracker;
  auto comm = make_mpi_communicator({.memory_tracker = &tracker});
  Buf buf(DType::kBF16, 1000);
  for (int64_t i = 0; i < 1000; ++i) buf.set(i, value_at(comm->rank(), i));
  comm->all_reduce(buf.view());
  EXPECT_EQ(tracker.usage().live(MemoryCategory::kComm), 1000 * 4);  // bf16 sums are staged in f32
}

TEST(MpiBackend, RanksMatchTheWorld) {
  EXPECT_EQ(g_comm->rank(), MpiRuntime::world_rank());
  EXPECT_EQ(g_comm->size(), MpiRuntime::world_size());
  EXPECT_EQ(g_comm->backend_name(), "mpi");
}

}  // namespace
}  // namespace mxddp::testing

int main(int argc, char** argv) {
  mxddp::MpiRuntime runtime(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  int failed = 0;
  {
    auto comm = mxddp::make_mpi_communicator();
    mxddp::testing::g_comm = comm.get();
    if (comm->rank() != 0) {
      // Keep failures visible on every rank, but only rank 0 prints the progress listing.
      auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
      delete listeners.Release(listeners.default_result_printer());
      listeners.Append(new mxddp::testing::FailurePrinter(comm->rank()));
    }
    failed = RUN_ALL_TESTS();
    // Agree on the verdict, so one failing rank fails the whole run's exit status.
    MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (comm->rank() == 0) std::printf("mpi suite on %d ranks: %s\n", comm->size(), failed ? "FAILED" : "passed");
  }
  return failed;
}
