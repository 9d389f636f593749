// Under mpirun (2 and 4 processes): the NCCL unique id made by rank 0 reaches every rank intact
// (nccl_unique_id_over_mpi), a new one each time; then, where each rank has a GPU of its own, the
// ranks join one NCCL communicator and all-reduce over it. Without enough devices (CI, this VM)
// the join is skipped, saying why.
#include <cstring>
#include <vector>

#include <mpi.h>

#include <gtest/gtest.h>

#include <mxddp/nccl.h>

#include "mpi_main.h"

namespace mxddp::testing {
namespace {

// Every rank's id, gathered on every rank.
std::vector<NcclUniqueId> gather_ids(const NcclUniqueId& mine) {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::vector<NcclUniqueId> all(static_cast<size_t>(size));
  MPI_Allgather(mine.bytes.data(), static_cast<int>(mine.bytes.size()), MPI_CHAR, all.data(),
                static_cast<int>(mine.bytes.size()), MPI_CHAR, MPI_COMM_WORLD);
  return all;
}

TEST(NcclMpi, RankZerosIdReachesEveryRank) {
  const NcclUniqueId first = nccl_unique_id_over_mpi();
  for (const NcclUniqueId& id : gather_ids(first)) EXPECT_EQ(id, first);
  const NcclUniqueId second = nccl_unique_id_over_mpi();
  EXPECT_NE(second, first) << "a second call makes a new id";
  for (const NcclUniqueId& id : gather_ids(second)) EXPECT_EQ(id, second);
}

// Each rank takes the device of its rank on its host (launchers that give each rank one visible GPU
// make that device 0 everywhere); it runs where every host has a GPU for each of its ranks.
TEST(NcclMpi, RanksOnTheirOwnDevicesAllReduce) {
  int rank = 0, size = 0, local_rank = 0, local_size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm host_comm;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &host_comm);
  MPI_Comm_rank(host_comm, &local_rank);
  MPI_Comm_size(host_comm, &local_size);
  MPI_Comm_free(&host_comm);
  std::string why;
  const int devices = cuda_device_count(&why);
  const int enough = devices >= local_size ? 1 : 0;
  int all_enough = 0;
  MPI_Allreduce(&enough, &all_enough, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!all_enough)
    GTEST_SKIP() << local_size << " ranks on a host need a GPU each; rank " << rank << " sees " << devices
                 << (why.empty() ? "" : ": " + why);
  const NcclUniqueId id = nccl_unique_id_over_mpi();
  const std::unique_ptr<Communicator> comm = make_nccl_communicator(id, rank, size, {.device = local_rank});
  MemoryTracker tracker;
  const ComputeBuffer buffer = comm->compute().allocate(1024 * sizeof(float), MemoryCategory::kComm, tracker);
  std::vector<float> host(1024, static_cast<float>(rank + 1));
  comm->compute().copy_from_host(buffer.data(), host.data(), host.size() * sizeof(float));
  comm->all_reduce(buffer.view(DType::kF32, Shape{1024})).wait();
  comm->compute().copy_to_host(host.data(), buffer.data(), host.size() * sizeof(float));
  comm->compute().synchronize();
  const float want = static_cast<float>(size * (size + 1) / 2);
  for (float v : host) ASSERT_EQ(v, want);
}

}  // namespace
}  // namespace mxddp::testing
