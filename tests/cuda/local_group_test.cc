// The local backend on device memory: 2 and 4 ranks as threads on one GPU, each with its own stream
// and CUDA compute (LocalOptions::computes) and another for its collectives (comm_computes; once
// without), run every collective on device buffers, then DDP and
// the distributed optimizer train on them (their buffers on the communicator's compute); the
// results must be the bits the same jobs give on host memory (the CPU's kernels). Needs a device:
// device_main.cc skips (77) saying why where there is none.
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include <mxddp/comm.h>
#include <mxddp/compute.h>
#include <mxddp/cuda.h>
#include <mxddp/ddp.h>
#include <mxddp/optim.h>

#include "cuda/cuda_ranks.h"
#include "cuda/device_jobs.h"

namespace mxddp::testing {
namespace {

// Runs job on `ranks` ranks on the host (cpu_compute) and on the device (a stream and CUDA compute
// per rank, and one more of each for its collectives unless !comm_streams); returns what each
// rank's job returned, host runs first.
template <typename Result, typename Job>
std::pair<std::vector<Result>, std::vector<Result>> host_and_device(int ranks, Job job, bool comm_streams = true) {
  std::vector<Result> on_host(static_cast<size_t>(ranks)), on_device(static_cast<size_t>(ranks));
  run_local(ranks, [&](Communicator& comm) { on_host[static_cast<size_t>(comm.rank())] = job(comm, cpu_compute()); });
  const CudaRanks gpu(ranks, comm_streams);
  run_local(ranks, [&](Communicator& comm) {
    EXPECT_EQ(comm.device(), Device::cuda(0));
    on_device[static_cast<size_t>(comm.rank())] = job(comm, *gpu.computes[static_cast<size_t>(comm.rank())]);
  }, gpu.options);
  return {std::move(on_host), std::move(on_device)};
}

// Every rank's result on the host and on the device; equal bytes, except that a NaN may carry the
// device's own payload.
void expect_device_matches_host(int ranks, bool comm_streams = true) {
  const auto [on_host, on_device] = host_and_device<std::vector<uint8_t>>(ranks, run_job, comm_streams);
  for (int r = 0; r < ranks; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    expect_same_job_bytes(on_host[static_cast<size_t>(r)], on_device[static_cast<size_t>(r)], ranks);
  }
}

TEST(CudaLocalGroup, TwoRanksOnOneDeviceMatchTheHostRun) { expect_device_matches_host(2); }
TEST(CudaLocalGroup, FourRanksOnOneDeviceMatchTheHostRun) { expect_device_matches_host(4); }
// The same on the ranks' own streams, each synchronized around its collectives (no comm streams).
TEST(CudaLocalGroup, TwoRanksWithoutCommStreamsMatchTheHostRun) { expect_device_matches_host(2, false); }

// The update is bit-exact on the device (compute_test), the grads' reduction too, so the params
// are the host's bytes; the norm (not used: no clipping) differs only by its order of additions.
// With MXFP8 params the quantization is bit-exact too (cuda_kernels_test), so their copies are.
TEST(CudaLocalGroup, DdpAndTheDistributedOptimizerOnOneDeviceMatchTheHostRun) {
  for (int ranks : {2, 4})
    for (bool mxfp8_reuse : {false, true}) {
      SCOPED_TRACE(std::to_string(ranks) + " ranks" +
                   (mxfp8_reuse ? ", MXFP8 params gathered through the grad buffer" : ""));
      const auto [host, device] = host_and_device<DdpResult>(
          ranks, [&](Communicator& comm, Compute& compute) { return train_ddp(comm, compute, mxfp8_reuse); });
      for (int r = 0; r < ranks; ++r) {
        const DdpResult& a = host[static_cast<size_t>(r)];
        const DdpResult& b = device[static_cast<size_t>(r)];
        EXPECT_TRUE(a.params == b.params) << "rank " << r << ": the params differ";
        ASSERT_EQ(a.norms.size(), b.norms.size());
        for (size_t s = 0; s < a.norms.size(); ++s) EXPECT_NEAR(a.norms[s], b.norms[s], 1e-9 * a.norms[s]) << "step " << s;
      }
    }
}

}  // namespace
}  // namespace mxddp::testing
