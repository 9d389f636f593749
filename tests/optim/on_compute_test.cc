// DDP and the distributed optimizer on the compute of their communicator's rank (Communicator::
// compute(), LocalOptions::computes): the buffers, main params and states are allocated through
// it and every step's work and collective runs on it. Here the ranks' computes claim a device
// (tests/comm/recording_compute.h: host memory labelled cuda:5), so the device path runs on the CPU
// (the views it hands out, the checks of where buffers live, the norm and NaN flags staged through
// the communicator's memory, the MXFP8 copies of fp8_param_gather quantized through it) and must give
// the host run's bytes. FSDP on a device is tests/fsdp/fsdp_any_structure_test.cc's
// AnyStructureOnADevice.
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <unistd.h>

#include <mxddp/checkpoint.h>
#include <mxddp/fsdp.h>

#include "comm/recording_compute.h"
#include "core/error_of.h"
#include "optim/optim_checks.h"

namespace mxddp::testing {
namespace {

struct RankResult {
  std::vector<uint8_t> params;   // the model's params after the last sync: with fp8_param_gather
                                 // every MXFP8 param's data and scales, both orientations
  std::vector<uint8_t> buffer;   // the whole param buffer (none under reuse: it is the grads')
  std::vector<double> losses;    // this rank's
  std::vector<double> norms;     // the global grad norm of each step
  std::vector<int> nonfinite;    // nonfinite_grad_params() after the last step
  bool on_rank_compute = false;  // DDP's compute was the communicator's
};

// What a job keeps of its params: plain bf16, MXFP8 params (fp8_param_gather), or MXFP8 params
// gathered through the grad buffer (and reuse_grad_buf_for_mxfp8_param_ag).
enum class Params { kBf16, kMxfp8, kMxfp8Reuse };

DdpConfig config_for(Params params) {
  DdpConfig c = optim_ddp_config(/*overlap_param_gather=*/true);
  c.fp8_param_gather = params != Params::kBf16;
  c.reuse_grad_buf_for_mxfp8_param_ag = params == Params::kMxfp8Reuse;
  return c;
}

RankResult train(Communicator& comm, int steps, Params params = Params::kBf16) {
  MemoryTracker tracker;
  auto init = mlp_init();
  DistributedDataParallel ddp(comm, mlp_params(params != Params::kBf16), config_for(params), tracker, views_of(init));
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
  auto append = [&](std::vector<uint8_t>& to, const TensorView& v) {
    EXPECT_EQ(v.device, comm.device()) << v.to_string();
    const std::vector<uint8_t> bytes = bytes_on_host(ddp.compute(), v);
    to.insert(to.end(), bytes.begin(), bytes.end());
  };
  for (int p = 0; p < ddp.num_params(); ++p) {
    if (!ddp.is_mxfp8(p)) append(out.params, ddp.param(p));
    else
      for (QuantAxis axis : {QuantAxis::kRow, QuantAxis::kCol}) {
        append(out.params, ddp.mxfp8_param(p, axis).data);
        append(out.params, ddp.mxfp8_param(p, axis).scales);
      }
  }
  if (params != Params::kMxfp8Reuse) append(out.buffer, ddp.buffer().param_buffer());
  return out;
}

class OnRankCompute : public ::testing::TestWithParam<Params> {};

TEST_P(OnRankCompute, DdpAndTheOptimizerOnADevicesComputeGiveTheHostRunsBytes) {
  const Params params = GetParam();
  for (int dp : {2, 4}) {
    SCOPED_TRACE("dp " + std::to_string(dp));
    std::vector<RankResult> host(static_cast<size_t>(dp)), device(static_cast<size_t>(dp));
    run_local(dp, [&](Communicator& comm) { host[static_cast<size_t>(comm.rank())] = train(comm, 4, params); });
    const ClaimedDevice claimed(dp);
    run_local(dp, [&](Communicator& comm) { device[static_cast<size_t>(comm.rank())] = train(comm, 4, params); },
              claimed.options);
    for (int r = 0; r < dp; ++r) {
      const RankResult& a = host[static_cast<size_t>(r)];
      const RankResult& b = device[static_cast<size_t>(r)];
      EXPECT_TRUE(b.on_rank_compute) << "rank " << r;
      EXPECT_FALSE(a.params.empty());
      EXPECT_EQ(a.params, b.params) << "rank " << r;
      EXPECT_EQ(a.buffer, b.buffer) << "rank " << r;
      EXPECT_EQ(a.losses, b.losses) << "rank " << r;
      EXPECT_EQ(a.norms, b.norms) << "rank " << r << ": the norm's all-reduce, staged on the device";
      EXPECT_EQ(a.nonfinite, b.nonfinite) << "rank " << r;
      const RecordingCompute& c = *claimed.computes[static_cast<size_t>(r)];
      // The param and grad buffers, the main params, two states and the staged scalars at least.
      EXPECT_GE(c.allocations.load(), 5) << "rank " << r;
      EXPECT_GT(c.reduces.load(), 0) << "rank " << r << ": the grads were reduced on its compute";
      EXPECT_GT(c.copies.load(), 0) << "rank " << r << ": the params were gathered on its compute";
      // Each MXFP8 weight (three) in both orientations, at start and after every sync at least.
      if (params != Params::kBf16) EXPECT_GE(c.quantizes.load(), 3 * 2 * 5) << "rank " << r;
      else EXPECT_EQ(c.quantizes.load(), 0) << "rank " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Params, OnRankCompute,
                         ::testing::Values(Params::kBf16, Params::kMxfp8, Params::kMxfp8Reuse),
                         [](const ::testing::TestParamInfo<Params>& info) {
                           return std::string(info.param == Params::kBf16    ? "Bf16"
                                              : info.param == Params::kMxfp8 ? "Mxfp8"
                                                                             : "Mxfp8Reuse");
                         });

// Params that touch in the shard make one run for the grad norm and, where they share their group
// and step count, one update: a launch (or two) per run on a device rather than one per param.
// w0, w1, w2 [64, 64] (the decayed group) and b [64] (not decayed), every size 64-aligned, so the
// buffer holds w2, b, w1, w0 (reverse order) with no padding between them.
TEST(OnRankComputeRuns, TouchingParamsOfOneGroupAndStepCountUpdateAsOneRun) {
  const ClaimedDevice claimed(1);
  run_local(
      1,
      [&](Communicator& comm) {
        const std::vector<ParamSpec> specs = {{"w0", Shape{64, 64}}, {"w1", Shape{64, 64}}, {"b", Shape{64}},
                                              {"w2", Shape{64, 64}}};
        std::vector<std::vector<float>> init;
        std::vector<TensorView> views;
        for (const ParamSpec& spec : specs) init.emplace_back(static_cast<size_t>(spec.shape.numel()), 0.5f);
        for (size_t i = 0; i < specs.size(); ++i) views.push_back({init[i].data(), DType::kF32, specs[i].shape});
        MemoryTracker tracker;
        DistributedDataParallel ddp(comm, specs, DdpConfig{.use_distributed_optimizer = true}, tracker, views);
        DistributedOptimizer opt(ddp, {.lr = 1e-2f, .weight_decay = 0.1f}, tracker);
        const RecordingCompute& c = *claimed.computes[0];
        const ModelHooks hooks = ddp_hooks(ddp);
        ASSERT_EQ(ddp.main_grad(0).dtype, DType::kF32);  // what hooks.accumulate writes
        const auto step = [&](std::vector<int> frozen) {
          opt.zero_grad();
          for (int p = 0; p < ddp.num_params(); ++p) {
            hooks.accumulate(p, std::vector<float>(static_cast<size_t>(ddp.main_grad(p).numel()), 0.25f + 0.125f * p));
            hooks.grad_ready(p);
          }
          ddp.finish_grad_sync();
          const int updates = c.updates, runs = c.sum_of_squares_runs;
          opt.step({.frozen = std::move(frozen)});
          return std::pair{c.updates - updates, c.sum_of_squares_runs - runs};
        };
        // [w2] [b] [w1 w0]: the groups alternate.
        EXPECT_EQ(step({}), std::pair(3, 1));
        // w1 frozen: [w2] [b] [w0].
        EXPECT_EQ(step({1}), std::pair(3, 1));
        // w1 is now a step behind w0 (its bias correction differs): [w2] [b] [w1] [w0].
        EXPECT_EQ(step({}), std::pair(4, 1));
      },
      claimed.options);
}

// A checkpoint reads and writes the main params and states through the compute, so a run on a
// device saves what a host run saves and resumes from either: saved on the device after 3 of 6
// steps and resumed on the host, and saved on the host and resumed on the device, the last 3
// steps' losses and the final params equal the uninterrupted host run's.
TEST(OnRankComputeCheckpoint, SavedOnADeviceResumesOnTheHostAndBack) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / fmt::format("mxddp_on_compute_{}", ::getpid())).string();
  std::filesystem::remove_all(dir);
  struct Segment {
    std::vector<double> losses;
    std::vector<uint8_t> params;  // rank 0's, after the segment
  };
  auto segment = [&](bool on_device, int first, int last, bool load, bool save) {
    const ClaimedDevice claimed(on_device ? 2 : 0);
    Segment out;
    run_local(
        2,
        [&](Communicator& comm) {
          MemoryTracker tracker;
          auto init = mlp_init();
          DistributedDataParallel ddp(comm, mlp_params(true), config_for(Params::kMxfp8Reuse), tracker, views_of(init));
          DistributedOptimizer opt(ddp, {.lr = 1e-2f}, tracker);
          if (load) load_checkpoint(dir, opt);
          std::vector<double> losses;
          for (int s = first; s < last; ++s) losses.push_back(ddp_train_step(opt, s, kGlobalBatch));
          if (save) save_checkpoint(dir, opt, {.overwrite = true});
          opt.force_param_sync();
          if (comm.rank() != 0) return;
          out.losses = losses;
          for (int p = 0; p < ddp.num_params(); ++p) {
            const TensorView v = ddp.is_mxfp8(p) ? ddp.mxfp8_param(p, QuantAxis::kRow).data : ddp.param(p);
            const std::vector<uint8_t> bytes = bytes_on_host(ddp.compute(), v);
            out.params.insert(out.params.end(), bytes.begin(), bytes.end());
          }
        },
        claimed.options);
    return out;
  };
  const Segment whole = segment(/*on_device=*/false, 0, 6, false, false);
  const std::vector<double> last_three(whole.losses.begin() + 3, whole.losses.end());
  for (bool saved_on_device : {true, false}) {
    SCOPED_TRACE(saved_on_device ? "saved on cuda:5, resumed on the host" : "saved on the host, resumed on cuda:5");
    segment(saved_on_device, 0, 3, false, true);
    const Segment resumed = segment(!saved_on_device, 3, 6, true, false);
    EXPECT_EQ(resumed.losses, last_three);
    EXPECT_EQ(resumed.params, whole.params);
  }
  std::filesystem::remove_all(dir);
}

TEST(OnRankComputeRefusal, AnHsdpReplicaOnOtherMemoryIsRefusedNamingBoth) {
  RecordingCompute c0(Device::cuda(5)), c1(Device::cuda(5));
  LocalGroup group(2, {.timeout_ms = 10'000, .computes = {&c0, &c1}});
  Communicator& comm = group.communicator(0);
  MemoryTracker tracker;
  auto init = mlp_init();
  std::vector<std::vector<int>> units{{0, 1}, {2, 3}};
  // HSDP's replica all-reduce must reach the shard group's memory.
  LocalGroup host_replica(1);
  EXPECT_NE(error_of([&] {
              FullyShardedDataParallel(comm, mlp_params(), units, FsdpConfig{}, tracker, views_of(init),
                                       &host_replica.communicator(0));
            }).find("HSDP: the replica communicator's collectives run on cpu but the shard group's on cuda:5"),
            std::string::npos);
  EXPECT_EQ(tracker.usage().live(MemoryCategory::kGrads), 0) << "a refused wrapper leaves nothing allocated";
}

}  // namespace
}  // namespace mxddp::testing
