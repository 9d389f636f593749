// DDP and the distributed optimizer on the compute of their communicator's rank (Communicator::
// compute(), LocalOptions::computes): the buffers, main params and states are allocated through
// it and every step's work and collective runs on it. Here the ranks' computes claim a device
// (tests/comm/recording_compute.h: host memory labelled cuda:5), so the device path runs on the CPU
// (the views it hands out, the checks of where buffers live, the norm and NaN flags staged through
// the communicator's memory) and must give the host run's bytes. What is not on a device yet is
// refused naming the device: MXFP8 params and FSDP.
#include <memory>
#include <string>
#include <vector>

#include <mxddp/fsdp.h>

#include "comm/recording_compute.h"
#include "core/error_of.h"
#include "optim/optim_checks.h"

namespace mxddp::testing {
namespace {

struct RankResult {
  std::vector<char> params;      // the whole param buffer after the last sync
  std::vector<double> losses;    // this rank's
  std::vector<double> norms;     // the global grad norm of each step
  std::vector<int> nonfinite;    // nonfinite_grad_params() after the last step
  bool on_rank_compute = false;  // DDP's compute was the communicator's
};

RankResult train(Communicator& comm, int steps) {
  MemoryTracker tracker;
  auto init = mlp_init();
  DistributedDataParallel ddp(comm, mlp_params(), optim_ddp_config(/*overlap_param_gather=*/true), tracker,
                              views_of(init));
  DistributedOptimizer opt(ddp, {.lr = 1e-2f, .clip_grad = 0.05f}, tracker);
  RankResult out;
  out.on_rank_compute = &ddp.compute() == &comm.compute();
  const int local = kGlobalBatch / comm.size();
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    out.losses.push_back(forward_backward(ddp_hooks(ddp), s, comm.rank() * local, local));
    ddp.finish_grad_sync();
    out.norms.push_back(opt.step().grad_norm);
  }
  out.nonfinite = opt.nonfinite_grad_params();
  opt.force_param_sync();
  const TensorView all = ddp.buffer().param_buffer();
  EXPECT_EQ(all.device, comm.device());
  out.params.resize(all.nbytes());
  ddp.compute().copy_to_host(out.params.data(), all.data, all.nbytes());
  return out;
}

TEST(OnRankCompute, DdpAndTheOptimizerOnADevicesComputeGiveTheHostRunsBytes) {
  for (int dp : {2, 4}) {
    SCOPED_TRACE("dp " + std::to_string(dp));
    std::vector<RankResult> host(static_cast<size_t>(dp)), device(static_cast<size_t>(dp));
    run_local(dp, [&](Communicator& comm) { host[static_cast<size_t>(comm.rank())] = train(comm, 4); });
    std::vector<std::unique_ptr<RecordingCompute>> computes;
    LocalOptions options;
    for (int r = 0; r < dp; ++r) {
      computes.push_back(std::make_unique<RecordingCompute>(Device::cuda(5)));
      options.computes.push_back(computes.back().get());
    }
    run_local(dp, [&](Communicator& comm) { device[static_cast<size_t>(comm.rank())] = train(comm, 4); }, options);
    for (int r = 0; r < dp; ++r) {
      const RankResult& a = host[static_cast<size_t>(r)];
      const RankResult& b = device[static_cast<size_t>(r)];
      EXPECT_TRUE(b.on_rank_compute) << "rank " << r;
      EXPECT_EQ(a.params, b.params) << "rank " << r;
      EXPECT_EQ(a.losses, b.losses) << "rank " << r;
      EXPECT_EQ(a.norms, b.norms) << "rank " << r << ": the norm's all-reduce, staged on the device";
      EXPECT_EQ(a.nonfinite, b.nonfinite) << "rank " << r;
      const RecordingCompute& c = *computes[static_cast<size_t>(r)];
      // The param and grad buffers, the main params, two states and the staged scalars at least.
      EXPECT_GE(c.allocations.load(), 5) << "rank " << r;
      EXPECT_GT(c.reduces.load(), 0) << "rank " << r << ": the grads were reduced on its compute";
      EXPECT_GT(c.copies.load(), 0) << "rank " << r << ": the params were gathered on its compute";
    }
  }
}

TEST(OnRankCompute, WhatIsNotOnADeviceYetIsRefusedNamingIt) {
  RecordingCompute c0(Device::cuda(5)), c1(Device::cuda(5));
  LocalGroup group(2, {.timeout_ms = 10'000, .computes = {&c0, &c1}});
  Communicator& comm = group.communicator(0);
  MemoryTracker tracker;
  DdpConfig fp8 = optim_ddp_config();
  fp8.fp8_param_gather = true;
  EXPECT_NE(error_of([&] { DistributedDataParallel(comm, mlp_params(), fp8, tracker); })
                .find("fp8_param_gather on cuda:5: MXFP8 params are kept and quantized in host memory only"),
            std::string::npos);
  std::vector<std::vector<int>> units{{0, 1}, {2, 3}};
  EXPECT_NE(error_of([&] { FullyShardedDataParallel(comm, mlp_params(), units, FsdpConfig{}, tracker, {}, nullptr); })
                .find("FSDP on cuda:5: its storage and gathers are in host memory so far"),
            std::string::npos);
  EXPECT_EQ(tracker.usage().live(MemoryCategory::kGrads), 0) << "a refused wrapper leaves nothing allocated";
}

}  // namespace
}  // namespace mxddp::testing
