// DDP gradient sync on the MPI backend (run by CTest under mpirun -np 2 and -np 4).
#include <mpi.h>

#include "ddp/ddp_checks.h"

namespace mxddp::testing {
namespace {

Communicator* g_comm = nullptr;

TEST(DdpMpi, ReduceScatterWithOverlap) {
  check_grad_sync(*g_comm, {.overlap_grad_reduce = true, .use_distributed_optimizer = true, .bucket_size = 300}, 3);
}
TEST(DdpMpi, AllReduceWithoutDistributedOptimizer) {
  check_grad_sync(*g_comm, {.overlap_grad_reduce = true, .bucket_size = 300}, 1);
}
TEST(DdpMpi, AverageInCollectiveBf16Grads) {
  check_grad_sync(*g_comm, {.grad_reduce_in_fp32 = false, .overlap_grad_reduce = true, .use_distributed_optimizer = true,
                            .bucket_size = 300, .average_in_collective = true}, 2);
}
TEST(DdpMpi, NoOverlapOneBucket) { check_grad_sync(*g_comm, {.use_distributed_optimizer = true}, 2); }
TEST(DdpMpi, FirstBucketIsInFlightBeforeLastGradReady) { check_first_bucket_in_flight_before_last_grad_ready(*g_comm); }

}  // namespace
}  // namespace mxddp::testing

int main(int argc, char** argv) {
  mxddp::MpiRuntime runtime(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  int failed = 0;
  {
    auto comm = mxddp::make_mpi_communicator();
    mxddp::testing::g_comm = comm.get();
    failed = RUN_ALL_TESTS();
    MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  }
  return failed;
}
