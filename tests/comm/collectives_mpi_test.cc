// The collective suite on the MPI backend: run by CTest as `mpirun -np 2` and `-np 4`. Each
// process is one rank; gtest runs in every process and any failing rank fails the run.
#include "mpi_main.h"
#include "comm/collective_checks.h"

namespace mxddp::testing {
namespace {

class MpiCollectives : public ::testing::TestWithParam<DType> {};

TEST_P(MpiCollectives, EveryCollectiveMatchesSerialReference) { check_every_collective(*g_mpi_comm, GetParam()); }

INSTANTIATE_TEST_SUITE_P(DTypes, MpiCollectives, ::testing::Values(DType::kF32, DType::kBF16, DType::kU8),
                         [](const ::testing::TestParamInfo<DType>& info) { return std::string(dtype_name(info.param)); });

TEST(MpiBackend, AsyncCollectiveProgressesWhileCallerComputes) { check_async_progress_without_wait(*g_mpi_comm); }

TEST(MpiBackend, MismatchedCountsAndDTypesAreErrorsOnEveryRank) { check_mismatch_is_an_error(*g_mpi_comm); }

TEST(MpiBackend, StagingBuffersAreChargedToTheTracker) {
  MemoryTracker tracker;
  auto comm = make_mpi_communicator({.memory_tracker = &tracker});
  Buf buf(DType::kBF16, 1000);
  for (int64_t i = 0; i < 1000; ++i) buf.set(i, value_at(comm->rank(), i));
  comm->all_reduce(buf.view());
  EXPECT_EQ(tracker.usage().live(MemoryCategory::kComm), 1000 * 4);  // bf16 sums are staged in f32
}

TEST(MpiBackend, RanksMatchTheWorld) {
  EXPECT_EQ(g_mpi_comm->rank(), MpiRuntime::world_rank());
  EXPECT_EQ(g_mpi_comm->size(), MpiRuntime::world_size());
  EXPECT_EQ(g_mpi_comm->backend_name(), "mpi");
}

}  // namespace
}  // namespace mxddp::testing
