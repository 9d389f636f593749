// A local group's ranks on the current GPU, as the device tests run them: a stream and a CUDA
// compute per rank, and the LocalOptions that hand them to run_local (with a timeout that leaves
// room for a first kernel launch). Must outlive the group.
#pragma once

#include <memory>
#include <vector>

#include <mxddp/comm.h>
#include <mxddp/compute.h>
#include <mxddp/cuda.h>

namespace mxddp::testing {

struct CudaRanks {
  explicit CudaRanks(int ranks) : streams(static_cast<size_t>(ranks)) {
    for (auto& s : streams) {
      computes.push_back(make_cuda_compute(s.get()));
      options.computes.push_back(computes.back().get());
    }
  }
  std::vector<OwnedCudaStream> streams;          // [rank]
  std::vector<std::unique_ptr<Compute>> computes;  // [rank], each on its rank's stream
  LocalOptions options{.timeout_ms = 60'000};
};

}  // namespace mxddp::testing
