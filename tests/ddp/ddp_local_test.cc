// DDP on the local backend: gradient sync at 1..8 ranks against the serial reference, across the
// config space; overlap proven; errors; no_sync; broadcast.
#include "ddp/ddp_checks.h"

namespace mxddp::testing {
namespace {

struct Case {
  const char* name;
  DdpConfig cfg;
};

const Case kCases[] = {
    {"distopt_overlap", {.overlap_grad_reduce = true, .use_distributed_optimizer = true, .bucket_size = 300}},
    {"distopt_no_overlap", {.use_distributed_optimizer = true}},
    {"allreduce_overlap", {.overlap_grad_reduce = true, .bucket_size = 300}},
    {"distopt_force_all_reduce",
     {.overlap_grad_reduce = true, .use_distributed_optimizer = true, .bucket_size = 300, .force_all_reduce = true}},
    {"distopt_average_in_collective",
     {.overlap_grad_reduce = true, .use_distributed_optimizer = true, .bucket_size = 300, .average_in_collective = true}},
    {"distopt_bf16_grads_grouped",
     {.grad_reduce_in_fp32 = false, .overlap_grad_reduce = true, .use_distributed_optimizer = true, .bucket_size = 300,
      .buckets_per_group = 2}},
};

class DdpLocal : public ::testing::TestWithParam<std::tuple<int, int, int>> {};

TEST_P(DdpLocal, GradSyncMatchesSerialReference) {
  const auto [ranks, case_index, micro] = GetParam();
  const DdpConfig cfg = kCases[case_index].cfg;
  run_local(ranks, [&](Communicator& comm) { check_grad_sync(comm, cfg, micro); });
}

INSTANTIATE_TEST_SUITE_P(
    RanksConfigsMicroBatches, DdpLocal,
    ::testing::Combine(::testing::Values(1, 2, 3, 4, 8), ::testing::Range(0, 6), ::testing::Values(1, 3)),
    [](const ::testing::TestParamInfo<std::tuple<int, int, int>>& info) {
      return fmt::format("ranks{}_{}_micro{}", std::get<0>(info.param), kCases[std::get<1>(info.param)].name,
                         std::get<2>(info.param));
    });

TEST(DdpLocal, FirstBucketIsInFlightBeforeLastGradReady) {
  for (int ranks : {2, 4}) run_local(ranks, check_first_bucket_in_flight_before_last_grad_ready);
}

TEST(DdpLocal, LayoutIsIdenticalOnEveryRank) {
  std::vector<ParamLayout> layouts(4);
  run_local(4, [&](Communicator& comm) {
    MemoryTracker tracker;
    DistributedDataParallel ddp(comm, small_model(), {.overlap_grad_reduce = true, .use_distributed_optimizer = true, .bucket_size = 300}, tracker);
    layouts[static_cast<size_t>(comm.rank())] = ddp.buffer().layout();
  });
  for (const ParamLayout& l : layouts) {
    ASSERT_EQ(l.buckets.size(), layouts[0].buckets.size());
    for (size_t b = 0; b < l.buckets.size(); ++b) EXPECT_EQ(l.buckets[b].range, layouts[0].buckets[b].range);
    for (size_t p = 0; p < l.params.size(); ++p) EXPECT_EQ(l.params[p].range, layouts[0].params[p].range);
  }
}

TEST(DdpLocal, NanCheckNamesBucketParamsAndRank) {
  run_local(2, [](Communicator& comm) {
    MemoryTracker tracker;
    DistributedDataParallel ddp(comm, small_model(),
                                {.overlap_grad_reduce = true, .use_distributed_optimizer = true, .bucket_size = 300,
                                 .check_for_nan_in_grad = true},
                                tracker);
    ddp.zero_grad_buffer();
    const int victim = ddp.buffer().param_index("l1.b");
    ddp.main_grad(victim).data_as<float>()[3] = std::nanf("");
    try {
      for (int p = ddp.num_params() - 1; p >= 0; --p) ddp.grad_ready(p);
      ADD_FAILURE() << "a NaN gradient went into a collective";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(fmt::format("rank {}: NaN or Inf in the gradients of bucket {}", comm.rank(),
                                      ddp.buffer().layout().params[static_cast<size_t>(victim)].bucket)),
                std::string::npos) << what;
      EXPECT_NE(what.find("l1.b"), std::string::npos) << what;
    }
  });
}

TEST(DdpLocal, FinishBeforeEveryGradIsReadyNamesTheMissingParams) {
  run_local(2, [](Communicator& comm) {
    MemoryTracker tracker;
    DistributedDataParallel ddp(comm, small_model(), {.overlap_grad_reduce = true, .use_distributed_optimizer = true}, tracker);
    ddp.zero_grad_buffer();
    for (int p = ddp.num_params() - 1; p >= 2; --p) ddp.grad_ready(p);
    try {
      ddp.finish_grad_sync();
      ADD_FAILURE() << "finish_grad_sync accepted missing gradients";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("2 param(s) never reported grad_ready: 'embed', 'l0.w'"), std::string::npos)
          << e.what();
    }
  });
}

TEST(DdpLocal, GradReadyTwiceIsAnError) {
  run_local(1, [](Communicator& comm) {
    MemoryTracker tracker;
    DistributedDataParallel ddp(comm, small_model(), {}, tracker);
    ddp.grad_ready(3);
    try {
      ddp.grad_ready(3);
      ADD_FAILURE() << "second grad_ready accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("grad_ready called twice for param 'l1.w' (index 3)"), std::string::npos) << e.what();
    }
    EXPECT_THROW(ddp.grad_ready(99), Error);
  });
}

TEST(DdpLocal, FinishInsideNoSyncIsAnError) {
  run_local(1, [](Communicator& comm) {
    MemoryTracker tracker;
    DistributedDataParallel ddp(comm, small_model(), {}, tracker);
    auto scope = ddp.no_sync();
    EXPECT_THROW(ddp.finish_grad_sync(), Error);
  });
}

TEST(DdpLocal, BroadcastParamsCopiesRankZero) {
  run_local(3, [](Communicator& comm) {
    MemoryTracker tracker;
    std::vector<std::vector<float>> values;
    std::vector<TensorView> init;
    for (const ParamSpec& s : small_model()) {
      values.emplace_back(static_cast<size_t>(s.shape.numel()), static_cast<float>(comm.rank() + 1));
      init.push_back({values.back().data(), DType::kF32, s.shape});
    }
    DistributedDataParallel ddp(comm, small_model(), {.use_distributed_optimizer = true}, tracker, init);
    ddp.broadcast_params();
    for (int p = 0; p < ddp.num_params(); ++p)
      for (int64_t e = 0; e < ddp.param(p).numel(); ++e) ASSERT_EQ(read(ddp.param(p), e), 1.0f);
  });
}

TEST(DdpLocal, ZeroGradBufferZeroesEverything) {
  run_local(2, [](Communicator& comm) {
    MemoryTracker tracker;
    DistributedDataParallel ddp(comm, small_model(), {.use_distributed_optimizer = true}, tracker);
    backward(ddp, comm.rank(), 0);
    ddp.finish_grad_sync();
    ddp.zero_grad_buffer();
    const TensorView all = ddp.buffer().grad_buffer();
    for (int64_t i = 0; i < all.numel(); ++i) ASSERT_EQ(all.data_as<float>()[i], 0.0f);
  });
}

}  // namespace
}  // namespace mxddp::testing
