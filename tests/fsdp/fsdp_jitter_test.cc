// FSDP under jitter, the way FSDP2's parity tests flush races: every rank sleeps a random time of
// its own before each all-gather and reduce-scatter (on the communicator's progress thread, so the
// collectives start late while compute goes on) and after each module's forward. The losses must
// still be DDP's, and every rank must have issued the same collectives in the same order as an
// undisturbed run: the order comes from the program, never from timing.
#include <chrono>
#include <string>
#include <tuple>

#include "fsdp/fsdp_util.h"
#include "fsdp/jittered_data_parallel.h"

namespace mxddp::testing {
namespace {

struct JitteredRun {
  std::vector<double> losses;
  std::vector<std::vector<FsdpCollective>> log_by_rank;  // [dp], FSDP only
};

// max_sleep_us 0: the plain run. Otherwise comm and hook delays up to it, drawn per rank.
JitteredRun train_jittered(int dp, const TrainConfig& config, int64_t max_sleep_us, uint64_t seed) {
  set_compute_threads(1);
  JitteredRun run;
  run.log_by_rank.resize(static_cast<size_t>(dp));
  std::vector<TrainResult> results(static_cast<size_t>(dp));
  LocalOptions options;
  options.injected_delay = {.min_us = 0, .max_us = max_sleep_us, .seed = seed};
  run_local(
      dp,
      [&](Communicator& comm) {
        const size_t r = static_cast<size_t>(comm.rank());
        TrainCallbacks callbacks;
        callbacks.wrap_data_parallel = [&](std::unique_ptr<DataParallel> inner) -> std::unique_ptr<DataParallel> {
          return std::make_unique<JitteredDataParallel>(std::move(inner), max_sleep_us, seed, &run.log_by_rank[r]);
        };
        results[r] = train(comm, config, callbacks);
      },
      options);
  run.losses = losses(results.front());
  return run;
}

class FsdpJitter : public ::testing::TestWithParam<std::tuple<ShardingStrategy, bool, int, int>> {};

TEST_P(FsdpJitter, LossesAndCollectiveOrderHold) {
  const auto [strategy, overlap, dp, accum] = GetParam();
  TrainConfig c = fsdp_config(strategy, overlap);
  c.micro_batch_size = 2;
  c.global_batch_size = 2 * dp * accum;
  c.optimizer.clip_grad = 0;  // as in FsdpParity: bitwise where the reduction order is DDP's
  constexpr int64_t kMaxSleepUs = 400;
  const uint64_t seed = 1000 * static_cast<uint64_t>(strategy) + 10 * dp + accum;

  const std::vector<double> ddp = train_jittered(dp, as_ddp(c), 0, seed).losses;
  const JitteredRun calm = train_jittered(dp, c, 0, seed);
  const JitteredRun jittered = train_jittered(dp, c, kMaxSleepUs, seed);

  // Timing changes nothing a rank computes: the jittered FSDP run is the calm one bit for bit.
  EXPECT_EQ(jittered.losses, calm.losses) << "jitter changed FSDP's losses";
  const bool same_reduction = accum == 1 || strategy == ShardingStrategy::kNoShard || strategy == ShardingStrategy::kOptim;
  if (same_reduction) EXPECT_EQ(jittered.losses, ddp);
  else expect_close(jittered.losses, ddp, 1e-6, "fsdp under jitter vs ddp, micro-batches reduced one by one");

  ASSERT_FALSE(calm.log_by_rank[0].empty());
  for (int r = 0; r < dp; ++r) {
    EXPECT_EQ(jittered.log_by_rank[static_cast<size_t>(r)], calm.log_by_rank[0])
        << "rank " << r << " issued its collectives in another order under jitter";
    EXPECT_EQ(calm.log_by_rank[static_cast<size_t>(r)], calm.log_by_rank[0]) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(StrategyOverlapDpMicro, FsdpJitter,
                         ::testing::Combine(::testing::ValuesIn(kStrategies), ::testing::Bool(), ::testing::Values(2, 4),
                                            ::testing::Values(1, 3)),
                         strategy_overlap_dp_micro_name);

// DDP's own overlap under the same jitter: its losses do not move either.
TEST(DdpJitter, LossesUnchangedUnderJitter) {
  for (int dp : {2, 4}) {
    TrainConfig c = as_ddp(fsdp_config(ShardingStrategy::kOptim, true));
    c.micro_batch_size = 2;
    c.global_batch_size = 2 * dp * 3;
    EXPECT_EQ(train_jittered(dp, c, 400, 7).losses, train_jittered(dp, c, 0, 7).losses) << "dp " << dp;
  }
}

// The delay really happens where it is injected, and a bad range is refused with its values.
TEST(CollectiveDelay, SleepsBeforeSelectedCollectivesOnly) {
  LocalOptions options;
  options.injected_delay = {.min_us = 100'000, .max_us = 100'000};  // all_gather and reduce_scatter
  run_local(
      2,
      [](Communicator& comm) {
        std::vector<float> a(4, 1.0f), b(8);
        using Clock = std::chrono::steady_clock;
        auto t0 = Clock::now();
        comm.all_reduce(TensorView{a.data(), DType::kF32, {4}});
        const double all_reduce_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
        t0 = Clock::now();
        comm.all_gather(TensorView{a.data(), DType::kF32, {4}}, TensorView{b.data(), DType::kF32, {8}});
        const double all_gather_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
        EXPECT_GE(all_gather_ms, 100.0);
        EXPECT_LT(all_reduce_ms, 100.0) << "all_reduce is not selected by default";
      },
      options);
  options.injected_delay = {.min_us = 10, .max_us = 5};
  try {
    LocalGroup group(2, options);
    FAIL() << "an inverted range was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[10, 5] us"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace mxddp::testing
