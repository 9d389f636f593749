// plan_fsdp_memory with num_distributed_optimizer_instances (HSDP) is exact: a real HSDP run on a
// shard x replica grid of local ranks, driven as plan.h states (units in forward order, each
// unit's grads reported in decreasing registration index in backward), holds on every rank what
// the plan says, per category, live and peak, after the first iteration and in the steady state;
// and the plan is FSDP's at the shard group's size, not at dp.
#include <optional>
#include <string>

#include <gtest/gtest.h>

#include <mxddp/fsdp.h>
#include <mxddp/optim.h>
#include <mxddp/plan.h>

#include "fsdp/hsdp_grid.h"
#include "plan/expect_same_usage.h"

namespace mxddp::testing {
namespace {

// Three units of a weight and a bias each, sizes that pad differently at shard 2 and at dp 4.
struct SmallModel {
  std::vector<ParamSpec> specs;
  std::vector<std::vector<int>> units;
  std::vector<FsdpHookedModule> hooked;
  SmallModel() {
    const int64_t rows[] = {24, 40, 17};
    for (int u = 0; u < 3; ++u) {
      specs.push_back(ParamSpec{.name = fmt::format("layers.{}.weight", u), .shape = Shape{rows[u], 19}});
      specs.push_back(ParamSpec{.name = fmt::format("layers.{}.bias", u), .shape = Shape{rows[u]}});
      units.push_back({2 * u, 2 * u + 1});
      hooked.push_back(FsdpHookedModule{.params = units.back(), .unit = u});
    }
  }
};

struct Measured {
  MemoryUsage first, steady;
};

Measured measure(Communicator& comm, Communicator* replica, const SmallModel& m, const FsdpConfig& fc,
                 int micro_batches) {
  MemoryTracker tracker;
  std::vector<std::vector<float>> init;
  std::vector<TensorView> views;
  for (const ParamSpec& p : m.specs) init.emplace_back(static_cast<size_t>(p.shape.numel()), 0.5f);
  for (size_t i = 0; i < init.size(); ++i) views.push_back({init[i].data(), DType::kF32, m.specs[i].shape});
  FullyShardedDataParallel fsdp(comm, m.specs, m.units, fc, tracker, views, replica);
  DistributedOptimizer opt(fsdp, OptimizerConfig{.lr = 1e-2f}, tracker);
  Measured out;
  for (int it = 0; it < 3; ++it) {
    opt.zero_grad();
    for (int mb = 0; mb < micro_batches; ++mb) {
      std::optional<DataParallel::NoSyncScope> scope;
      if (mb + 1 < micro_batches) scope.emplace(fsdp);
      for (const std::vector<int>& unit : m.units) {
        fsdp.before_forward(unit);
        fsdp.after_forward(unit);
      }
      for (size_t u = m.units.size(); u-- > 0;) {
        const std::vector<int>& unit = m.units[u];
        fsdp.before_backward(unit);
        for (auto p = unit.rbegin(); p != unit.rend(); ++p) {
          fsdp.main_grad(*p);
          fsdp.grad_ready(*p);
        }
        fsdp.after_backward(unit);
      }
    }
    fsdp.finish_grad_sync();
    opt.step();
    if (it == 0) {
      out.first = tracker.usage();
      tracker.reset_peaks();
    }
  }
  out.steady = tracker.usage();
  return out;
}

TEST(HsdpPlan, EqualsTheRunOnEveryRankAndIsFsdpsAtTheShardGroupSize) {
  const SmallModel m;
  int runs = 0;
  for (ShardingStrategy s : {ShardingStrategy::kNoShard, ShardingStrategy::kOptim, ShardingStrategy::kOptimGrads,
                             ShardingStrategy::kOptimGradsParams})
    for (bool overlap : {false, true})
      for (int micro_batches : {1, 3})
        for (auto [shard, replicas] : {std::pair{2, 2}, std::pair{1, 4}}) {
          FsdpConfig fc;
          fc.data_parallel_sharding_strategy = s;
          fc.overlap_grad_reduce = fc.overlap_param_gather = overlap;
          fc.grad_reduce_in_fp32 = runs % 2 == 0;
          const int dp = shard * replicas;
          const std::string what = fmt::format("{} overlap {} mb {} {} x {} f32 grads {}", sharding_strategy_name(s),
                                               overlap, micro_batches, shard, replicas, fc.grad_reduce_in_fp32);
          const MemoryPlan plan =
              plan_fsdp_memory(m.specs, m.units, m.hooked, fc, OptimizerType::kAdam,
                               {.dp = dp, .micro_batches = micro_batches, .num_distributed_optimizer_instances = replicas});
          EXPECT_EQ(plan.dp, dp) << what;
          EXPECT_EQ(plan.num_distributed_optimizer_instances, replicas) << what;
          const MemoryPlan at_shard = plan_fsdp_memory(m.specs, m.units, m.hooked, fc, OptimizerType::kAdam,
                                                       {.dp = shard, .micro_batches = micro_batches});
          if (shard == 1 && fsdp_shards_grads(s)) {
            // FSDP on one rank in all keeps its grads in the shard (FsdpStoragePlan::grads_in_shard);
            // HSDP's shard group of one still holds each micro-batch's whole grads for the replica
            // all-reduce. Every other category is FSDP's at the shard group's size.
            EXPECT_GT(plan.steady.peak(MemoryCategory::kGrads), at_shard.steady.peak(MemoryCategory::kGrads)) << what;
            for (int k = 0; k < kNumMemoryCategories; ++k) {
              if (const auto c = static_cast<MemoryCategory>(k); c != MemoryCategory::kGrads) {
                EXPECT_EQ(plan.steady.peak(c), at_shard.steady.peak(c)) << what << ": " << memory_category_name(c);
              }
            }
          } else {
            expect_same_usage(plan.steady, at_shard.steady, what + ": plan vs FSDP's plan at the shard group's size");
          }
          if (s != ShardingStrategy::kNoShard) {
            const MemoryPlan at_dp = plan_fsdp_memory(m.specs, m.units, m.hooked, fc, OptimizerType::kAdam,
                                                      {.dp = dp, .micro_batches = micro_batches});
            EXPECT_GT(plan.steady.total_peak_bytes, at_dp.steady.total_peak_bytes)
                << what << ": HSDP keeps bigger shards than FSDP over every rank";
          }
          std::vector<Measured> ranks(static_cast<size_t>(dp));
          run_grid(shard, replicas, [&](Communicator& c, Communicator& r, int rank) {
            ranks[static_cast<size_t>(rank)] = measure(c, &r, m, fc, micro_batches);
          });
          for (int r = 0; r < dp; ++r) {
            const Measured& x = ranks[static_cast<size_t>(r)];
            expect_same_usage(plan.steady, x.steady, fmt::format("{} rank {} steady state", what, r));
            expect_same_usage(plan.overall, max_peaks(x.first, x.steady), fmt::format("{} rank {} overall", what, r));
          }
          if (::testing::Test::HasFailure()) return;
          ++runs;
        }
  EXPECT_EQ(runs, 32);
}

TEST(HsdpPlan, RefusesInstancesThatDoNotDivideDpAndUnplannedMpiStaging) {
  const SmallModel m;
  FsdpConfig fc;
  auto error = [&](const MemoryPlanOptions& o) -> std::string {
    try {
      plan_fsdp_memory(m.specs, m.units, m.hooked, fc, OptimizerType::kAdam, o);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(error({.dp = 4, .num_distributed_optimizer_instances = 3}).find(
                "num_distributed_optimizer_instances 3 is not valid at dp 4: a divisor of dp"),
            std::string::npos);
  EXPECT_NE(error({.dp = 4, .num_distributed_optimizer_instances = 0}).find("num_distributed_optimizer_instances 0"),
            std::string::npos);
  fc.grad_reduce_in_fp32 = false;
  EXPECT_NE(error({.dp = 4, .mpi_backend = true, .num_distributed_optimizer_instances = 2}).find("is not planned"),
            std::string::npos);
  fc.grad_reduce_in_fp32 = true;
  EXPECT_EQ(error({.dp = 4, .mpi_backend = true, .num_distributed_optimizer_instances = 2}), "");
}

}  // namespace
}  // namespace mxddp::testing
