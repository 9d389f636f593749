// MPI processes sharing one GPU (issue 42, where NCCL refuses two ranks on one device): under
// mpirun at 2 and 4 processes, each rank keeps its buffers on device 0 under a CUDA compute on a
// stream of its own, and the mpi communicator stages every collective through page-locked host
// memory (MpiOptions::compute). The collectives' job and DDP with the distributed optimizer (bf16
// and MXFP8 params) must give the bits the same processes give on host memory (a NaN may carry the
// device's payload). Without a device on every rank, every rank skips, saying why.
#include <string>

#include <mpi.h>

#include <gtest/gtest.h>

#include <mxddp/comm.h>
#include <mxddp/cuda.h>

#include "cuda/device_jobs.h"
#include "mpi_main.h"

namespace mxddp::testing {
namespace {

// Empty if every rank sees a device; else why not (the same on every rank, so that all skip).
std::string why_not_every_rank_has_a_device() {
  std::string why;
  const int mine = cuda_device_count(&why) > 0 ? 1 : 0;
  int all = 0;
  MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (all) return "";
  return "a rank sees no CUDA device" + (why.empty() ? std::string() : ": " + why);
}

// This rank on device 0, its stream and compute, and an mpi communicator staged from it.
struct StagedRank {
  StagedRank() : compute(make_cuda_compute(stream.get())), comm(make_mpi_communicator({.compute = compute.get()})) {}
  OwnedCudaStream stream;
  std::unique_ptr<Compute> compute;
  std::unique_ptr<Communicator> comm;
};

TEST(CudaStagedMpi, CollectivesGiveTheHostRunsBytes) {
  if (const std::string why = why_not_every_rank_has_a_device(); !why.empty()) GTEST_SKIP() << why;
  const std::vector<uint8_t> on_host = run_job(*g_mpi_comm, cpu_compute());
  StagedRank gpu;
  EXPECT_EQ(gpu.comm->device(), Device::cuda(0));
  expect_same_job_bytes(on_host, run_job(*gpu.comm, *gpu.compute), g_mpi_comm->size());
}

TEST(CudaStagedMpi, DdpAndTheDistributedOptimizerGiveTheHostRunsBits) {
  if (const std::string why = why_not_every_rank_has_a_device(); !why.empty()) GTEST_SKIP() << why;
  for (bool mxfp8_reuse : {false, true}) {
    SCOPED_TRACE(mxfp8_reuse ? "MXFP8 params gathered through the grad buffer" : "bf16 params");
    const DdpResult host = train_ddp(*g_mpi_comm, cpu_compute(), mxfp8_reuse);
    StagedRank gpu;
    const DdpResult device = train_ddp(*gpu.comm, *gpu.compute, mxfp8_reuse);
    EXPECT_TRUE(host.params == device.params) << "the params differ";
    ASSERT_EQ(host.norms.size(), device.norms.size());
    for (size_t s = 0; s < host.norms.size(); ++s) EXPECT_NEAR(host.norms[s], device.norms[s], 1e-9 * host.norms[s]) << "step " << s;
  }
}

}  // namespace
}  // namespace mxddp::testing
