// A local group's ranks on the current GPU, as the device tests run them: a stream and a CUDA
// compute per rank, by default a second stream and compute per rank for its collectives
// (LocalOptions::comm_computes), and the LocalOptions that hand them to run_local (with a timeout
// that leaves room for a first kernel launch). Must outlive the group.
#pragma once

#include <memory>
#include <vector>

#include <mxddp/comm.h>
#include <mxddp/compute.h>
#include <mxddp/cuda.h>

namespace mxddp::testing {

struct CudaRanks {
  // comm_streams: each rank's collectives move their bytes on a stream of their own.
  explicit CudaRanks(int ranks, bool comm_streams = true)
      : streams(static_cast<size_t>(ranks)), comm_streams(comm_streams ? static_cast<size_t>(ranks) : 0) {
    for (auto& s : streams) {
      computes.push_back(make_cuda_compute(s.get()));
      options.computes.push_back(computes.back().get());
    }
    for (auto& s : this->comm_streams) {
      comm_computes.push_back(make_cuda_compute(s.get()));
      options.comm_computes.push_back(comm_computes.back().get());
    }
  }
  std::vector<OwnedCudaStream> streams;          // [rank]
  std::vector<std::unique_ptr<Compute>> computes;  // [rank], each on its rank's stream
  std::vector<OwnedCudaStream> comm_streams;     // [rank] or none
  std::vector<std::unique_ptr<Compute>> comm_computes;  // [rank] or none, each on its rank's comm stream
  LocalOptions options{.timeout_ms = 60'000};
};

}  // namespace mxddp::testing
