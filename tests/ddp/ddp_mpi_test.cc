// DDP gradient sync on the MPI backend (run by CTest under mpirun -np 2 and -np 4).
#include "mpi_main.h"
#include "ddp/ddp_checks.h"

namespace mxddp::testing {
namespace {

TEST(DdpMpi, ReduceScatterWithOverlap) {
  check_grad_sync(*g_mpi_comm, {.overlap_grad_reduce = true, .use_distributed_optimizer = true, .bucket_size = 300}, 3);
}
TEST(DdpMpi, AllReduceWithoutDistributedOptimizer) {
  check_grad_sync(*g_mpi_comm, {.overlap_grad_reduce = true, .bucket_size = 300}, 1);
}
TEST(DdpMpi, AverageInCollectiveBf16Grads) {
  check_grad_sync(*g_mpi_comm, {.grad_reduce_in_fp32 = false, .overlap_grad_reduce = true, .use_distributed_optimizer = true,
                            .bucket_size = 300, .average_in_collective = true}, 2);
}
TEST(DdpMpi, NoOverlapOneBucket) { check_grad_sync(*g_mpi_comm, {.use_distributed_optimizer = true}, 2); }
TEST(DdpMpi, FirstBucketIsInFlightBeforeLastGradReady) { check_first_bucket_in_flight_before_last_grad_ready(*g_mpi_comm); }

}  // namespace
}  // namespace mxddp::testing
