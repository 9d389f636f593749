// plan_fsdp_memory (plan.h) is exact: a real FullyShardedDataParallel and DistributedOptimizer on
// the local backend, driven through a generated module structure exactly as the Python package's
// FullyShardedDataParallel drives the C++ one (the call sequence plan.h states), holds on every rank
// what the plan says, per category, live and peak, after the first iteration and in the steady
// state, and gathers at most the plan's bytes per slot, byte for byte.
//
// The matrix (FsdpMemoryPlan.*): a case per structure class of tests/fsdp/generic_model.h (every
// param in units; non-unit modules first, in the middle, last; a tied non-unit weight read by the
// first and the last module) x strategy (no_shard, optim, optim_grads, optim_grads_params, the last
// also with MXFP8 weights); each case runs 2 seeds x {units of 1-3 modules, fine-grained: a unit per
// module} x dp {2, 4} x overlap_grad_reduce x overlap_param_gather x micro-batches {1, 3} = 64 runs
// of 3 iterations. Cycled over a case's runs: param dtype f32 / bf16 (bf16 with MXFP8), grads in
// f32 or the param dtype, Adam / SGD / no optimizer, fsdp_double_buffer, a small
// suggested_communication_unit_size. Also: a long accumulation (7 micro-batches, the plan replays
// 4) with a tight reduce-scatter queue; the mpi backend's staging arithmetic; bad hooked modules
// refused, naming what is wrong.
#include <algorithm>
#include <memory>
#include <set>
#include <tuple>

#include <gtest/gtest.h>

#include <mxddp/comm.h>
#include <mxddp/fsdp.h>
#include <mxddp/optim.h>
#include <mxddp/plan.h>

#include "comm/recording_compute.h"
#include "fsdp/generic_model.h"
#include "plan/expect_same_usage.h"

namespace mxddp::testing {
namespace {

// The modules whose hooks run, as mxddp.torch's fsdp_units lists them for this structure: a unit
// (its modules share one module's hooks, as a torch unit module holds its submodules) or a
// non-unit module with its registered params; a fully frozen module has none and no hooks.
std::vector<FsdpHookedModule> hooked_modules_of(const GenericModel& m) {
  std::vector<FsdpHookedModule> hooked;
  for (const GenericBlock& b : m.blocks)
    if (!b.hook_params.empty()) hooked.push_back({b.hook_params, b.unit});
  return hooked;
}

// The calls of one micro-batch, as plan.h states them: forward, the non-unit params' pre-forward
// (all of them at once), then each unit module's pre- and post-forward; backward, the hooked
// modules in reverse, a unit with its backward hooks around its params' reports (highest
// registration index first), a non-unit module with the reports of the params it is the first
// reader of (in reverse list order; with sharded grads held back until the last) and no hooks.
// A recompute region's re-run comes as backward reaches its last module: after that module's
// pre-backward (plan.h's order: a layer ending in a residual add) or before it (a layer whose
// last op saved a tensor).
enum class ReRun { kAfterPreBackward, kBeforePreBackward };

// fused: [param] (empty: none) its modules add its gradient into main_grad in their backward
// (gradient accumulation fusion): a non-unit one takes main_grad at its last reader's backward and
// reports at its first reader's, never held back.
void drive_micro_batch(FullyShardedDataParallel& fsdp, const std::vector<FsdpHookedModule>& hooked,
                       int num_params, ReRun re_run = ReRun::kAfterPreBackward,
                       const std::vector<bool>& fused = {}) {
  std::vector<int> first_reader(static_cast<size_t>(num_params), -1);
  std::vector<int> last_reader(static_cast<size_t>(num_params), -1);
  for (size_t j = 0; j < hooked.size(); ++j)
    for (int p : hooked[j].params) {
      if (first_reader[static_cast<size_t>(p)] < 0) first_reader[static_cast<size_t>(p)] = static_cast<int>(j);
      last_reader[static_cast<size_t>(p)] = static_cast<int>(j);
    }
  auto is_fused = [&](int p) { return !fused.empty() && fused[static_cast<size_t>(p)]; };
  std::vector<int> non_unit;
  size_t held_back_max = 0;
  for (int p = 0; p < num_params; ++p)
    if (hooked[static_cast<size_t>(first_reader[static_cast<size_t>(p)])].unit < 0) {
      non_unit.push_back(p);
      if (!is_fused(p)) ++held_back_max;
    }
  if (!non_unit.empty()) fsdp.before_forward(non_unit);
  for (const FsdpHookedModule& h : hooked) {
    if (h.unit < 0) continue;
    fsdp.before_forward(h.params);
    fsdp.after_forward(h.params);
  }
  // Sharded grads: the non-unit reports held back until the last arrives, then handed over together.
  const bool defer = fsdp_shards_grads(fsdp.config().data_parallel_sharding_strategy);
  std::vector<int> held;
  for (size_t j = hooked.size(); j-- > 0;) {
    const FsdpHookedModule& h = hooked[j];
    const int region = h.recompute_region;
    const bool region_ends = region >= 0 && (j + 1 == hooked.size() || hooked[j + 1].recompute_region != region);
    auto rerun_region = [&] {
      size_t first = j;
      while (first > 0 && hooked[first - 1].recompute_region == region) --first;
      for (size_t k = first; k <= j; ++k) {
        fsdp.before_forward(hooked[k].params);
        fsdp.after_forward(hooked[k].params);
      }
    };
    if (region_ends && re_run == ReRun::kBeforePreBackward) rerun_region();
    if (h.unit >= 0) {
      fsdp.before_backward(h.params);
      if (region_ends && re_run == ReRun::kAfterPreBackward) rerun_region();
      std::vector<int> reports = h.params;
      std::sort(reports.rbegin(), reports.rend());
      for (int p : reports) {
        fsdp.main_grad(p);
        fsdp.grad_ready(p);
      }
      fsdp.after_backward(h.params);
      continue;
    }
    for (auto it = h.params.rbegin(); it != h.params.rend(); ++it)
      if (is_fused(*it) && last_reader[static_cast<size_t>(*it)] == static_cast<int>(j)) fsdp.main_grad(*it);
    for (auto it = h.params.rbegin(); it != h.params.rend(); ++it) {
      if (first_reader[static_cast<size_t>(*it)] != static_cast<int>(j)) continue;
      if (is_fused(*it)) {
        fsdp.main_grad(*it);  // this reader's dW, added in (allocated at the last reader's)
        fsdp.grad_ready(*it);
        continue;
      }
      if (!defer) {
        fsdp.main_grad(*it);
        fsdp.grad_ready(*it);
        continue;
      }
      held.push_back(*it);
      if (held.size() < held_back_max) continue;
      for (int p : held) fsdp.main_grad(p);
      for (int p : held) fsdp.grad_ready(p);
    }
  }
}

struct Measured {
  MemoryUsage first;   // from construction through the first iteration
  MemoryUsage steady;  // the iterations after it
  std::array<int64_t, kGatherSlots> peak_gathered_bytes{};
};

// Builds the FSDP (and the optimizer) on this rank and runs `iterations` iterations as plan.h
// states them.
Measured measure(Communicator& comm, const GenericModel& model, const std::vector<FsdpHookedModule>& hooked,
                 const FsdpConfig& fc, std::optional<OptimizerType> opt, int micro_batches, int iterations,
                 ReRun re_run, const std::vector<bool>& fused = {}) {
  MemoryTracker tracker;
  std::vector<std::vector<float>> init;
  std::vector<TensorView> views;
  for (int p : model.param_of_spec) init.push_back(model.params[static_cast<size_t>(p)].init);
  for (size_t i = 0; i < init.size(); ++i) views.push_back({init[i].data(), DType::kF32, model.specs[i].shape});
  FullyShardedDataParallel fsdp(comm, model.specs, model.units, fc, tracker, views);
  std::optional<DistributedOptimizer> optimizer;
  if (opt) optimizer.emplace(fsdp, OptimizerConfig{.optimizer = *opt, .lr = 1e-2f}, tracker);
  Measured out;
  for (int it = 0; it < iterations; ++it) {
    if (optimizer) optimizer->zero_grad();
    else fsdp.zero_grad_buffer();
    for (int m = 0; m < micro_batches; ++m) {
      if (m + 1 < micro_batches) {
        auto scope = fsdp.no_sync();
        drive_micro_batch(fsdp, hooked, static_cast<int>(model.specs.size()), re_run, fused);
      } else {
        drive_micro_batch(fsdp, hooked, static_cast<int>(model.specs.size()), re_run, fused);
      }
    }
    fsdp.finish_grad_sync();
    if (optimizer) optimizer->step();
    if (it == 0) {
      out.first = tracker.usage();
      tracker.reset_peaks();
    }
  }
  out.steady = tracker.usage();
  for (int s = 0; s < kGatherSlots; ++s) out.peak_gathered_bytes[static_cast<size_t>(s)] = fsdp.peak_gathered_bytes(static_cast<GatherSlot>(s));
  return out;
}

// Plans, runs on dp local ranks, and compares every rank with the plan. Returns whether all agreed.
// on_device: the ranks' computes claim a device (tests/comm/recording_compute.h), so FSDP's and the
// optimizer's bytes are device bytes, planned with data_parallel_place device.
bool plan_equals_run(const GenericModel& model, const FsdpConfig& fc, std::optional<OptimizerType> opt, int dp,
                     int micro_batches, const std::string& what,
                     const std::vector<FsdpHookedModule>* hooked_given = nullptr,
                     ReRun re_run = ReRun::kAfterPreBackward, const std::vector<bool>& fused = {}, bool on_device = false) {
  const std::vector<FsdpHookedModule> hooked = hooked_given ? *hooked_given : hooked_modules_of(model);
  const MemoryPlan plan = plan_fsdp_memory(
      model.specs, model.units, hooked, fc, opt,
      {.dp = dp, .micro_batches = micro_batches, .fused_grads = fused,
       .data_parallel_place = on_device ? MemoryPlace::kDevice : MemoryPlace::kHost});
  const ClaimedDevice claimed(on_device ? dp : 0);
  std::vector<Measured> ranks(static_cast<size_t>(dp));
  run_local(
      dp,
      [&](Communicator& comm) {
        ranks[static_cast<size_t>(comm.rank())] =
            measure(comm, model, hooked, fc, opt, micro_batches, /*iterations=*/3, re_run, fused);
      },
      claimed.options);
  for (int r = 0; r < dp; ++r) {
    const Measured& m = ranks[static_cast<size_t>(r)];
    expect_same_usage(plan.steady, m.steady, fmt::format("{} rank {} steady state", what, r));
    expect_same_usage(plan.overall, max_peaks(m.first, m.steady), fmt::format("{} rank {} overall", what, r));
    EXPECT_EQ(plan.peak_gathered_bytes_by_slot, m.peak_gathered_bytes) << what << " rank " << r << ": peak gathered";
  }
  return !::testing::Test::HasFailure();
}

struct StrategyVariant {
  ShardingStrategy strategy;
  bool mxfp8;
};
constexpr StrategyVariant kVariants[] = {{ShardingStrategy::kNoShard, false},
                                         {ShardingStrategy::kOptim, false},
                                         {ShardingStrategy::kOptimGrads, false},
                                         {ShardingStrategy::kOptimGradsParams, false},
                                         {ShardingStrategy::kOptimGradsParams, true}};

class FsdpMemoryPlan : public ::testing::TestWithParam<std::tuple<StructureClass, int>> {};

TEST_P(FsdpMemoryPlan, EqualsTheRunOnEveryRank) {
  const auto [structure, variant_index] = GetParam();
  const StrategyVariant v = kVariants[variant_index];
  int runs = 0;
  std::set<std::optional<OptimizerType>> optimizers;
  for (uint64_t seed : {1, 2})
    for (bool fine : {false, true}) {
      const GenericModel model = make_generic_model(structure, seed, fine, v.mxfp8);
      for (int dp : {2, 4})
        for (bool grad_overlap : {false, true})
          for (bool param_overlap : {false, true})
            for (int micro_batches : {1, 3}) {
              FsdpConfig fc;
              fc.data_parallel_sharding_strategy = v.strategy;
              fc.overlap_grad_reduce = grad_overlap;
              fc.overlap_param_gather = param_overlap;
              fc.param_dtype = v.mxfp8 || runs % 2 == 1 ? DType::kBF16 : DType::kF32;
              fc.grad_reduce_in_fp32 = runs % 3 != 0;
              fc.fsdp_double_buffer = runs % 4 == 1;
              if (runs % 3 == 2) fc.suggested_communication_unit_size = 200;
              const std::optional<OptimizerType> opt = runs % 5 == 4   ? std::nullopt
                                                       : runs % 5 == 3 ? std::optional{OptimizerType::kSgd}
                                                                       : std::optional{OptimizerType::kAdam};
              const std::string what =
                  fmt::format("{} {}{} seed {}{} dp {} grad_overlap {} param_overlap {} mb {} {} f32grads {} double {} "
                              "unit {} opt {}",
                              model.describe(), sharding_strategy_name(v.strategy), v.mxfp8 ? " mxfp8" : "", seed,
                              fine ? " fine" : "", dp, grad_overlap, param_overlap, micro_batches,
                              dtype_name(fc.param_dtype), fc.grad_reduce_in_fp32, fc.fsdp_double_buffer,
                              fc.suggested_communication_unit_size.value_or(-1),
                              opt ? std::string(optimizer_name(*opt)) : std::string("none"));
              if (!plan_equals_run(model, fc, opt, dp, micro_batches, what)) {
                ADD_FAILURE() << "stopping at the first run that differs";
                return;
              }
              ++runs;
              optimizers.insert(opt);
            }
    }
  EXPECT_EQ(runs, 64);
  EXPECT_EQ(optimizers.size(), 3u) << "Adam, SGD and no optimizer";
}

INSTANTIATE_TEST_SUITE_P(
    StructuresAndStrategies, FsdpMemoryPlan,
    ::testing::Combine(::testing::ValuesIn(kStructureClasses), ::testing::Range(0, static_cast<int>(std::size(kVariants)))),
    [](const ::testing::TestParamInfo<std::tuple<StructureClass, int>>& info) {
      const StrategyVariant v = kVariants[std::get<1>(info.param)];
      return structure_class_name(std::get<0>(info.param)) + "_" + std::string(sharding_strategy_name(v.strategy)) +
             (v.mxfp8 ? "_mxfp8" : "");
    });

// On a device (the ranks' computes claim cuda:5): every strategy's bytes, MXFP8 ones included, are
// device bytes, and the plan with data_parallel_place device says so to the byte, per place.
TEST(FsdpMemoryPlanOnADevice, EveryStrategyEqualsTheRunsDeviceBytes) {
  for (const StrategyVariant& v : kVariants) {
    const GenericModel model = make_generic_model(StructureClass::kNonUnitMiddle, 3, /*fine_grained=*/false, v.mxfp8);
    FsdpConfig fc;
    fc.data_parallel_sharding_strategy = v.strategy;
    fc.overlap_grad_reduce = true;
    fc.overlap_param_gather = true;
    fc.param_dtype = DType::kBF16;
    const std::string what = fmt::format("{}{} on cuda:5", sharding_strategy_name(v.strategy), v.mxfp8 ? " mxfp8" : "");
    ASSERT_TRUE(plan_equals_run(model, fc, OptimizerType::kAdam, 2, 2, what, nullptr, ReRun::kAfterPreBackward, {},
                                /*on_device=*/true));
    const MemoryPlan plan = plan_fsdp_memory(model.specs, model.units, hooked_modules_of(model), fc, OptimizerType::kAdam,
                                             {.dp = 2, .micro_batches = 2, .data_parallel_place = MemoryPlace::kDevice});
    EXPECT_GT(plan.overall.at(MemoryPlace::kDevice).total_peak_bytes, 0) << what;
    EXPECT_EQ(plan.overall.at(MemoryPlace::kHost).total_peak_bytes, 0) << what << ": no model, no mpi staging";
  }
}

// The gathers are real where params are sharded: the plan's gathered peaks are not zero there (so
// the equality above compares something), and fine-grained units gather less at once.
TEST(FsdpMemoryPlanGathers, ShardedParamsGatherAndFineGrainedGathersLess) {
  const GenericModel coarse = make_generic_model(StructureClass::kNonUnitMiddle, 3, false, false);
  const GenericModel fine = make_generic_model(StructureClass::kNonUnitMiddle, 3, true, false);
  FsdpConfig fc;
  fc.param_dtype = DType::kF32;
  const MemoryPlan c = plan_fsdp_memory(coarse.specs, coarse.units, hooked_modules_of(coarse), fc, OptimizerType::kAdam, {.dp = 2});
  const MemoryPlan f = plan_fsdp_memory(fine.specs, fine.units, hooked_modules_of(fine), fc, OptimizerType::kAdam, {.dp = 2});
  EXPECT_GT(c.peak_gathered_bytes_by_slot[0], 0);
  EXPECT_GT(c.overall.peak(MemoryCategory::kGathered), 0);
  EXPECT_LE(f.peak_gathered_bytes_by_slot[0], c.peak_gathered_bytes_by_slot[0]);
  fc.data_parallel_sharding_strategy = ShardingStrategy::kOptim;
  const MemoryPlan o = plan_fsdp_memory(coarse.specs, coarse.units, hooked_modules_of(coarse), fc, OptimizerType::kAdam, {.dp = 2});
  EXPECT_EQ(o.overall.peak(MemoryCategory::kGathered), 0) << "optim keeps whole params: nothing to gather";
}

// Seven micro-batches (the plan replays four) with a reduce-scatter queue of 150 elements, so
// reductions wait on each other within and across micro-batches: still the run's bytes.
TEST(FsdpMemoryPlanGathers, LongAccumulationWithATightQueueEqualsTheRun) {
  for (const StrategyVariant& v : kVariants) {
    const GenericModel model = make_generic_model(StructureClass::kNonUnitLast, 5, false, v.mxfp8);
    FsdpConfig fc;
    fc.data_parallel_sharding_strategy = v.strategy;
    fc.overlap_grad_reduce = fc.overlap_param_gather = true;
    fc.suggested_communication_unit_size = 150;
    fc.param_dtype = v.mxfp8 ? DType::kBF16 : DType::kF32;
    ASSERT_TRUE(plan_equals_run(model, fc, OptimizerType::kAdam, 3, 7,
                                fmt::format("{}{} mb 7", sharding_strategy_name(v.strategy), v.mxfp8 ? " mxfp8" : "")));
  }
}

// With the mpi backend the plan adds, as comm from the first reduction on, the backend's staging
// of the largest bucket's bf16 reduction (reduce-scattered: its shard; all-reduced under no_shard:
// all of it), and nothing else changes.
TEST(FsdpMemoryPlanGathers, MpiStagingIsTheLargestBucketsReduction) {
  const GenericModel model = make_generic_model(StructureClass::kTiedFirstLast, 4, false, false);
  for (ShardingStrategy s : {ShardingStrategy::kNoShard, ShardingStrategy::kOptimGradsParams}) {
    FsdpConfig fc;
    fc.data_parallel_sharding_strategy = s;
    fc.overlap_grad_reduce = true;
    fc.grad_reduce_in_fp32 = false;  // bf16 grads: the backend widens them to f32
    const int dp = 4;
    const auto hooked = hooked_modules_of(model);
    const MemoryPlan local = plan_fsdp_memory(model.specs, model.units, hooked, fc, OptimizerType::kAdam, {.dp = dp});
    const MemoryPlan mpi =
        plan_fsdp_memory(model.specs, model.units, hooked, fc, OptimizerType::kAdam, {.dp = dp, .mpi_backend = true});
    const ParamLayout layout = fsdp_param_layout(model.specs, fsdp_unit_of_param(model.specs.size(), model.units), dp, false);
    int64_t staging = 0;
    for (const BucketPlacement& b : layout.buckets) {
      const bool rs = s != ShardingStrategy::kNoShard;
      staging = std::max(staging, mpi_staging_bytes(rs, DType::kBF16, rs ? b.range.size() / dp : b.range.size(), dp));
    }
    ASSERT_GT(staging, 0);
    EXPECT_EQ(local.overall.live(MemoryCategory::kComm), 0);
    EXPECT_EQ(mpi.overall.live(MemoryCategory::kComm), staging) << sharding_strategy_name(s);
    EXPECT_EQ(mpi.steady.peak(MemoryCategory::kComm), staging);
    for (int k = 0; k < kNumMemoryCategories; ++k) {
      if (static_cast<MemoryCategory>(k) == MemoryCategory::kComm) continue;
      EXPECT_EQ(mpi.overall.peak_bytes[static_cast<size_t>(k)], local.overall.peak_bytes[static_cast<size_t>(k)]);
    }
    EXPECT_EQ(mpi.steady.total_live_bytes, local.steady.total_live_bytes + staging);
  }
}

// Activation recompute: a region of consecutive fine-grained units re-run together in backward (a
// torch.utils.checkpoint around a layer) keeps them all gathered through the region's backward.
// The plan replays the re-run after the region's last pre-backward; the run drives it in both
// orders torch may call them in. That order holds what the plan says; the other too without MXFP8,
// and with it at most that (plan.h). Regions are runs of two or three
// consecutive unit modules; without overlap the re-run must change the gathered peaks (MXFP8: the
// values slot of the biases; the row-wise copies go at each re-run's post-forward), or the equality
// proves nothing.
TEST(FsdpMemoryPlanRecompute, RegionsReRunInEitherOrderEqualTheRun) {
  for (StructureClass structure : {StructureClass::kAllInUnits, StructureClass::kNonUnitMiddle})
    for (bool mxfp8 : {false, true}) {
      const GenericModel model = make_generic_model(structure, 6, /*fine_grained=*/true, mxfp8);
      std::vector<FsdpHookedModule> hooked = hooked_modules_of(model);
      int region = 0, in_region = 0;
      for (size_t j = 0; j < hooked.size(); ++j) {
        if (hooked[j].unit < 0) {  // a non-unit module ends the region before it
          if (in_region > 0) ++region;
          in_region = 0;
          continue;
        }
        hooked[j].recompute_region = region;
        if (++in_region == 2 + region % 2) {
          ++region;
          in_region = 0;
        }
      }
      ASSERT_GE(region + (in_region > 0 ? 1 : 0), 2) << model.describe();  // regions made
      for (bool overlap : {false, true})
        for (int micro_batches : {1, 3}) {
          FsdpConfig fc;
          fc.overlap_grad_reduce = fc.overlap_param_gather = overlap;
          fc.param_dtype = mxfp8 ? DType::kBF16 : DType::kF32;
          const MemoryPlan without = plan_fsdp_memory(model.specs, model.units, hooked_modules_of(model), fc,
                                                      OptimizerType::kAdam, {.dp = 2, .micro_batches = micro_batches});
          const MemoryPlan with = plan_fsdp_memory(model.specs, model.units, hooked, fc, OptimizerType::kAdam,
                                                   {.dp = 2, .micro_batches = micro_batches});
          if (!overlap) {  // (with overlap the backward's prefetch may gather a region's units anyway)
            EXPECT_NE(with.peak_gathered_bytes_by_slot, without.peak_gathered_bytes_by_slot) << model.describe();
          }
          for (ReRun order : {ReRun::kAfterPreBackward, ReRun::kBeforePreBackward}) {
            const std::string what = fmt::format("{}{} overlap {} mb {} re-run {} pre-backward", model.describe(),
                                                 mxfp8 ? " mxfp8" : "", overlap, micro_batches,
                                                 order == ReRun::kBeforePreBackward ? "before" : "after");
            if (!mxfp8 || order == ReRun::kAfterPreBackward) {
              ASSERT_TRUE(plan_equals_run(model, fc, OptimizerType::kAdam, 2, micro_batches, what, &hooked, order));
              continue;
            }
            Measured m;
            run_local(2, [&](Communicator& comm) {
              Measured r = measure(comm, model, hooked, fc, OptimizerType::kAdam, micro_batches, 3, order);
              if (comm.rank() == 0) m = r;
            });
            for (int slot = 0; slot < kGatherSlots; ++slot)
              EXPECT_LE(m.peak_gathered_bytes[static_cast<size_t>(slot)],
                        with.peak_gathered_bytes_by_slot[static_cast<size_t>(slot)]) << what << " slot " << slot;
            EXPECT_LT(m.steady.peak(MemoryCategory::kGathered), with.steady.peak(MemoryCategory::kGathered)) << what;
          }
        }
    }
}

// Gradient accumulation fusion: fused non-unit params take their unsharded grads where backward
// first reaches them and are not held back; every other param as before. Each structure with
// non-unit params (a tied one read first and last among them), each strategy: the run holds what
// the plan says, and where the tied weight's last reader comes first in backward with sharded
// grads the plan differs from the unfused one (the non-unit bucket's grads come there, not after
// the first reader), or the equality would show nothing.
TEST(FsdpMemoryPlanFusion, FusedNonUnitGradsEqualTheRun) {
  for (StructureClass structure : {StructureClass::kNonUnitFirst, StructureClass::kNonUnitMiddle,
                                   StructureClass::kNonUnitLast, StructureClass::kTiedFirstLast})
    for (const StrategyVariant& v : kVariants) {
      if (v.mxfp8) continue;
      const GenericModel model = make_generic_model(structure, 8, false, false);
      const std::vector<FsdpHookedModule> hooked = hooked_modules_of(model);
      std::vector<bool> fused(model.specs.size(), false);
      std::vector<int> first_reader(model.specs.size(), -1);
      for (size_t j = 0; j < hooked.size(); ++j)
        for (int p : hooked[j].params)
          if (first_reader[static_cast<size_t>(p)] < 0) first_reader[static_cast<size_t>(p)] = static_cast<int>(j);
      int fused_count = 0;
      for (size_t p = 0; p < fused.size(); ++p)  // every other non-unit param, the tied one among them
        if (hooked[static_cast<size_t>(first_reader[p])].unit < 0 && (p % 2 == 0 || model.specs[p].shared_embedding))
          fused[p] = true, ++fused_count;
      ASSERT_GT(fused_count, 0) << model.describe();
      for (int micro_batches : {1, 3}) {
        FsdpConfig fc;
        fc.data_parallel_sharding_strategy = v.strategy;
        fc.overlap_grad_reduce = fc.overlap_param_gather = micro_batches == 3;
        fc.param_dtype = DType::kF32;
        const std::string what = fmt::format("{} {} fused mb {}", model.describe(), sharding_strategy_name(v.strategy),
                                             micro_batches);
        ASSERT_TRUE(plan_equals_run(model, fc, OptimizerType::kAdam, 2, micro_batches, what, &hooked,
                                    ReRun::kAfterPreBackward, fused));
        if (fsdp_shards_grads(v.strategy) && structure == StructureClass::kTiedFirstLast) {
          const MemoryPlan unfused = plan_fsdp_memory(model.specs, model.units, hooked, fc, OptimizerType::kAdam,
                                                      {.dp = 2, .micro_batches = micro_batches});
          const MemoryPlan with = plan_fsdp_memory(model.specs, model.units, hooked, fc, OptimizerType::kAdam,
                                                   {.dp = 2, .micro_batches = micro_batches, .fused_grads = fused});
          EXPECT_NE(with.overall.peak_bytes, unfused.overall.peak_bytes) << what;
        }
      }
    }
}

// Hooked modules that break plan.h's rules are refused, naming what is wrong.
TEST(FsdpMemoryPlanGathers, RefusesHookedModulesThatBreakTheRules) {
  const std::vector<ParamSpec> params = {{"embed", Shape{16, 8}}, {"l0.w", Shape{8, 8}}, {"l0.b", Shape{8}},
                                         {"l1.w", Shape{8, 8}}, {"head", Shape{8}}};
  const std::vector<std::vector<int>> units = {{1, 2}, {3}};
  const std::vector<FsdpHookedModule> good = {{{0}, -1}, {{1, 2}, 0}, {{3}, 1}, {{4}, -1}};
  const FsdpConfig fc;
  EXPECT_NO_THROW(plan_fsdp_memory(params, units, good, fc, OptimizerType::kAdam, {.dp = 2}));
  auto refused = [&](const std::vector<FsdpHookedModule>& hooked, const std::string& says, MemoryPlanOptions o = {.dp = 2}) {
    try {
      plan_fsdp_memory(params, units, hooked, fc, OptimizerType::kAdam, o);
      ADD_FAILURE() << "not refused: " << says;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  refused({{{0}, -1}, {{1, 2}, 0}, {{3}, 1}}, "param 'head' is in no hooked module");
  // Units in another order than theirs are a forward that calls them so (the schedule follows it).
  EXPECT_NO_THROW(plan_fsdp_memory(params, units, {{{0}, -1}, {{3}, 1}, {{1, 2}, 0}, {{4}, -1}}, fc,
                                   OptimizerType::kAdam, {.dp = 2}));
  refused({{{0}, -1}, {{1, 2}, 0}, {{1, 2}, 0}, {{3}, 1}, {{4}, -1}}, "hooked module 2 is unit 0, which an earlier hooked module is");
  refused({{{0}, -1}, {{1}, 0}, {{3}, 1}, {{4, 2}, -1}}, "names 1 of unit 0's 2 params");
  refused({{{0, 1}, -1}, {{1, 2}, 0}, {{3}, 1}, {{4}, -1}}, "names param 'l0.w' of unit 0");
  refused({{{0}, -1}, {{1, 2}, 0}, {{3}, 1}, {{4}, 2}}, "hooked module 3 has unit 2; valid: -1");
  refused({{{0}, -1}, {{1, 2}, 0}, {{3}, 1}, {{4, 4}, -1}}, "names param 'head' twice");
  refused({{{0}, -1}, {{1, 2}, 0}, {{3}, 1}, {{}, -1}}, "hooked module 3 names no params");
  refused({{{0}, -1}, {{1, 2}, 0}, {{3}, 1}, {{9}, -1}}, "names param 9; valid: 0..4");
  refused({{{0}, -1}, {{1, 2}, 0}, {{4}, -1}}, "unit 1 has no hooked module");
  refused({{{0}, -1}, {{1, 2}, 0, 0}, {{4}, -1}, {{3}, 1, 0}}, "hooked module 3 is in recompute region 0, which other "
                                                              "modules ended before it");
  refused({{{0}, -1}, {{1, 2}, 0, -2}, {{3}, 1}, {{4}, -1}}, "hooked module 1 has recompute region -2");
  refused(good, "micro_batches 0 is not valid", {.dp = 2, .micro_batches = 0});
  refused(good, "fused_grads has 2 flags for 5 params", {.dp = 2, .fused_grads = {true, false}});
  refused(good, "dp 0 is not valid", {.dp = 0});
  EXPECT_THROW(plan_fsdp_memory(params, {}, good, fc, std::nullopt, {.dp = 2}), Error) << "FSDP needs a unit";
}

}  // namespace
}  // namespace mxddp::testing
