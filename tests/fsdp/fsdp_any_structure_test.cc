// DDP and every FSDP strategy on model structures the reference GPT does not have (issue 30, point
// 1): the generic model of generic_model.h, against its serial reference, on the local backend.
//
// The defect that started it: wherever a unit reports the micro-batch's last grad_ready (every param
// in units, or the non-unit params all after the first unit), the hook schedule forgot that unit's
// reports before its post-backward checked them ("after_backward: param ... has not reported
// grad_ready"). AllParamsInUnits.* reproduces it on its own; GenericModel.* checks that the
// generated structures have what the matrix relies on.
//
// The matrix (AnyStructure.*): a test case per structure class (every param in units; non-unit
// params first, last, in the middle; a weight shared by the first and the last module) x mode (DDP
// with a replicated optimizer, DDP with the distributed optimizer, with and without MXFP8 params,
// FSDP no_shard, optim, optim_grads, optim_grads_params, the last with and without MXFP8 params).
// Each case runs every combination of 2 generated structures (seeds) x {units of 1-3 modules,
// fine-grained: a unit per module} x dp 1..4 x micro-batches 1 and 3 x overlap_grad_reduce on/off x
// overlap_param_gather on/off (DDP: with the distributed optimizer only) = 128 runs (64 for DDP
// with the replicated optimizer) of 3 iterations, 4,800 runs in all, about 16 s. Two axes
// are cycled instead, each on in half of a case's runs: param dtype f32 rather than bf16 (bf16 only
// with MXFP8, as the runtime requires), and a recompute of every unit in backward. Every structure
// has frozen params (never registered), a fully frozen module (no hooks), and a one-param unit.
// All comparisons are bit for bit: the reference forms each gradient in the order the run reduces
// it (a rank's micro-batches summed then reduced, or each reduced then summed; the ranks in rank
// order with the 1/dp prescale), and the local backend reduces in rank order.
//
// Under jitter (AnyStructureJitter.*): a case per structure class running DDP with the distributed
// optimizer (with and without MXFP8), each FSDP strategy and optim_grads_params MXFP8, each at dp 2
// and 4, 3 micro-batches, overlap on, fine-grained and recompute alternating, with the
// communicator's injected delay (up to 300 us before every all-gather and reduce-scatter, on the
// progress thread) and a sleep of up to 200 us after every module's forward: still bit for bit, and
// every rank issues FSDP's collectives in the same order.
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <string>
#include <tuple>
#include <utility>

#include <unistd.h>

#include "comm/recording_compute.h"
#include "fsdp/generic_model_run.h"
#include "fsdp/jittered_data_parallel.h"

namespace mxddp::testing {
namespace {

// A mode and whether its weights are MXFP8 (where the mode allows it).
struct ModeVariant {
  DpMode mode;
  bool mxfp8;
};
constexpr ModeVariant kModeVariants[] = {{DpMode::kDdp, false},          {DpMode::kDdpDistOpt, false},
                                         {DpMode::kDdpDistOpt, true},    {DpMode::kNoShard, false},
                                         {DpMode::kOptim, false},        {DpMode::kOptimGrads, false},
                                         {DpMode::kOptimGradsParams, false}, {DpMode::kOptimGradsParams, true}};

std::string variant_name(const ModeVariant& v) { return dp_mode_name(v.mode) + (v.mxfp8 ? "_mxfp8" : ""); }

// Runs c on dp local ranks against its reference (bit for bit).
void run_local_case(const GenericCase& c, const LocalOptions& options = {}, int64_t hook_sleep_us = 0) {
  const GenericModel model = generic_model_of(c);
  const auto want = generic_reference_of(c, model);
  std::vector<std::vector<FsdpCollective>> logs(static_cast<size_t>(c.run.dp));
  run_local(
      c.run.dp,
      [&](Communicator& comm) {
        std::function<std::unique_ptr<DataParallel>(std::unique_ptr<DataParallel>)> wrap;
        if (hook_sleep_us > 0)
          wrap = [&](std::unique_ptr<DataParallel> inner) -> std::unique_ptr<DataParallel> {
            return std::make_unique<JitteredDataParallel>(std::move(inner), hook_sleep_us, c.seed,
                                                          &logs[static_cast<size_t>(comm.rank())]);
          };
        run_generic_case(comm, c, model, want, /*tol=*/0, wrap);
      },
      options);
  for (int r = 1; r < c.run.dp; ++r)
    EXPECT_EQ(logs[static_cast<size_t>(r)], logs[0]) << c.name() << ": rank " << r << " issued FSDP's collectives in another order";
}

// ---- The generated structures ----

// Every generated structure has what the matrix relies on: its class's placement of non-unit
// modules, a one-param unit module, a frozen param inside a unit module, a fully frozen module, the
// tied weight read by two modules, and (fine-grained) one unit per module.
TEST(GenericModel, StructuresHaveWhatTheirClassPromises) {
  for (StructureClass structure : kStructureClasses)
    for (uint64_t seed : {1, 2, 3, 5, 11})
      for (bool fine_grained : {false, true}) {
        const GenericModel m = make_generic_model(structure, seed, fine_grained, /*mxfp8=*/true);
        SCOPED_TRACE(m.describe());
        std::string placement;  // per hooked block: 'u' unit, 'n' non-unit
        bool one_param_unit_module = false, frozen_in_unit = false, frozen_module = false;
        for (const GenericBlock& b : m.blocks) {
          if (b.hook_params.empty()) {
            frozen_module = true;
            continue;
          }
          placement += b.unit >= 0 ? 'u' : 'n';
          if (b.unit >= 0 && fine_grained) {
            EXPECT_EQ(b.modules.size(), 1u);
          }
          for (int mi : b.modules) {
            const GenericModule& mod = m.modules[static_cast<size_t>(mi)];
            if (b.unit >= 0 && mod.bias < 0 && mod.gain < 0) one_param_unit_module = true;
            for (int p : {mod.weight, mod.bias, mod.gain})
              if (p >= 0 && b.unit >= 0 && m.params[static_cast<size_t>(p)].frozen) frozen_in_unit = true;
          }
        }
        EXPECT_TRUE(one_param_unit_module);
        EXPECT_TRUE(frozen_in_unit);
        EXPECT_TRUE(frozen_module);
        const size_t first_u = placement.find('u'), last_u = placement.rfind('u');
        switch (structure) {
          case StructureClass::kAllInUnits: EXPECT_EQ(placement.find('n'), std::string::npos); break;
          case StructureClass::kNonUnitFirst: EXPECT_GT(first_u, 0u); EXPECT_EQ(last_u + 1, placement.size()); break;
          case StructureClass::kNonUnitLast: EXPECT_EQ(first_u, 0u); EXPECT_LT(last_u + 1, placement.size()); break;
          case StructureClass::kNonUnitMiddle:
            EXPECT_EQ(first_u, 0u);
            EXPECT_EQ(last_u + 1, placement.size());
            EXPECT_NE(placement.find('n'), std::string::npos);
            break;
          case StructureClass::kTiedFirstLast: {
            EXPECT_EQ(placement.front(), 'n');
            EXPECT_EQ(placement.back(), 'n');
            const int tied = m.modules.front().weight;
            EXPECT_EQ(m.modules.back().weight, tied);
            EXPECT_TRUE(m.specs[static_cast<size_t>(m.params[static_cast<size_t>(tied)].index)].shared_embedding);
            break;
          }
        }
        // The weights of unit modules are MXFP8 and nothing else is; no frozen param is registered.
        std::vector<bool> unit_weight(m.specs.size(), false);
        for (const GenericBlock& b : m.blocks)
          for (int mi : b.modules) {
            const GenericParam& w = m.params[static_cast<size_t>(m.modules[static_cast<size_t>(mi)].weight)];
            if (b.unit >= 0 && w.index >= 0) unit_weight[static_cast<size_t>(w.index)] = true;
          }
        for (size_t i = 0; i < m.specs.size(); ++i) EXPECT_EQ(m.specs[i].mxfp8, unit_weight[i]) << m.specs[i].name;
        for (const GenericParam& p : m.params) EXPECT_EQ(p.index < 0, p.frozen) << p.name;
      }
}

// ---- The defect, on its own ----

// Every param in a unit (so a unit reports the iteration's last grad_ready), every strategy, one
// and three micro-batches: before the fix the first unit's post-backward threw.
TEST(AllParamsInUnits, EveryStrategyTrainsToTheReference) {
  for (DpMode mode : {DpMode::kNoShard, DpMode::kOptim, DpMode::kOptimGrads, DpMode::kOptimGradsParams})
    for (int micro_batches : {1, 3}) {
      GenericCase c{.structure = StructureClass::kAllInUnits, .seed = 3, .mode = mode, .overlap_grad_reduce = true,
                    .overlap_param_gather = true};
      c.run.dp = 2;
      c.run.micro_batches = micro_batches;
      SCOPED_TRACE(c.name());
      run_local_case(c);
    }
}

// The readiness checks still catch a model's mistakes once a unit may report last: a param reported
// twice in one micro-batch, and a unit's post-backward before one of its params reported.
TEST(AllParamsInUnits, MisreportedGradsAreStillRefused) {
  const GenericModel model = make_generic_model(StructureClass::kAllInUnits, 3, /*fine_grained=*/true, false);
  const GenericInitialValues init(model);
  run_local(1, [&](Communicator& comm) {
    MemoryTracker tracker;
    FullyShardedDataParallel fsdp(comm, model.specs, model.units, FsdpConfig{}, tracker, init.views);
    DistributedOptimizer opt(fsdp, generic_optimizer_config(), tracker);
    DataParallelModelAccess access(fsdp);
    // A whole micro-batch first: the readiness state must be clean afterwards.
    opt.zero_grad();
    generic_forward_backward(model, access, 0, 0, 2, 0.5f, false);
    // A unit of two or more params (most modules have a bias), the last such in forward order.
    auto it = std::find_if(model.units.rbegin(), model.units.rend(), [](const std::vector<int>& u) { return u.size() > 1; });
    ASSERT_NE(it, model.units.rend()) << model.describe();
    const std::vector<int>& last_unit = *it;
    for (int p : last_unit) (void)fsdp.main_grad(p);
    fsdp.before_backward(last_unit);
    fsdp.grad_ready(last_unit.front());
    try {
      fsdp.grad_ready(last_unit.front());
      ADD_FAILURE() << "a second grad_ready in one micro-batch was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("grad_ready called twice for param '" + model.specs[static_cast<size_t>(last_unit.front())].name),
                std::string::npos)
          << e.what();
    }
    try {
      fsdp.after_backward(last_unit);
      ADD_FAILURE() << "a post-backward with a param unreported was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("after_backward: param '" + model.specs[static_cast<size_t>(last_unit[1])].name +
                                           "' has not reported grad_ready"),
                std::string::npos)
          << e.what();
    }
  });
}

// A micro-batch's backward ends the backward pass: with no non-unit module before the first unit
// (whose pre-forward used to be the only thing that reset the phase), the next micro-batch's units
// must be gathered as a forward gathers them, not taken for recomputes (which gather without
// prefetch and keep the values until the post-backward).
TEST(AllParamsInUnits, TheNextMicroBatchOpensAForwardPass) {
  const GenericModel model = make_generic_model(StructureClass::kAllInUnits, 3, /*fine_grained=*/false, false);
  const GenericInitialValues init(model);
  run_local(2, [&](Communicator& comm) {
    MemoryTracker tracker;
    FsdpConfig config;
    config.param_dtype = DType::kF32;
    config.overlap_param_gather = true;
    FullyShardedDataParallel fsdp(comm, model.specs, model.units, config, tracker, init.views);
    DistributedOptimizer opt(fsdp, generic_optimizer_config(), tracker);
    DataParallelModelAccess access(fsdp);
    opt.zero_grad();
    {
      auto scope = fsdp.no_sync();
      generic_forward_backward(model, access, 0, 0, 2, 0.5f, false);
    }
    generic_forward_backward(model, access, 0, 2, 2, 0.5f, false);
    fsdp.finish_grad_sync();
    int gathers = 0;
    for (const FsdpGatherEvent& e : fsdp_engine(fsdp).gather_events()) {
      gathers += e.kind == FsdpGatherEvent::Kind::kGather;
      EXPECT_NE(e.phase, FsdpPhase::kRecompute) << "group " << e.group << ": nothing recomputes here";
    }
    EXPECT_EQ(gathers, 4 * static_cast<int>(model.units.size()));  // each unit: forward and backward, twice
  });
}

// Units listed in another order than the forward calls them (fine-grained units follow the module
// tree, which HF Llama's layers do not run in: their norms are registered after the attention and
// MLP they precede). Comparing unit indices took every unit after the first out-of-order one for a
// recompute and kept it gathered through backward; now a forward pass is each unit once, in any
// order, and from the second iteration the prefetch follows the order the first one ran.
TEST(UnitsOutOfTheirOrder, AreAForwardAndThePrefetchLearnsTheirOrder) {
  const GenericModel model = make_generic_model(StructureClass::kAllInUnits, 3, /*fine_grained=*/true, false);
  const GenericInitialValues init(model);
  const std::vector<std::vector<int>> reversed(model.units.rbegin(), model.units.rend());  // FSDP unit k: model's U-1-k
  const int num_units = static_cast<int>(model.units.size());
  ASSERT_GE(num_units, 3);
  run_local(2, [&](Communicator& comm) {
    MemoryTracker tracker;
    FsdpConfig config;
    config.param_dtype = DType::kF32;
    config.overlap_param_gather = true;
    FullyShardedDataParallel fsdp(comm, model.specs, reversed, config, tracker, init.views);
    DistributedOptimizer opt(fsdp, generic_optimizer_config(), tracker);
    DataParallelModelAccess access(fsdp);
    std::vector<int> call_order;  // FSDP's units in the order the forward calls them
    for (int u = num_units - 1; u >= 0; --u) call_order.push_back(u);
    for (int it = 0; it < 2; ++it) {
      fsdp_engine(fsdp).clear_gather_events();
      opt.zero_grad();
      generic_forward_backward(model, access, it, 0, 2, 0.5f, false);
      fsdp.finish_grad_sync();
      opt.step();
      std::vector<int> forward_gathers;
      int gathers = 0;
      for (const FsdpGatherEvent& e : fsdp_engine(fsdp).gather_events()) {
        gathers += e.kind == FsdpGatherEvent::Kind::kGather;
        EXPECT_NE(e.phase, FsdpPhase::kRecompute) << "iteration " << it << " group " << e.group;
        if (e.kind == FsdpGatherEvent::Kind::kGather && e.phase == FsdpPhase::kForward) forward_gathers.push_back(e.group);
      }
      EXPECT_EQ(gathers, 2 * num_units) << "iteration " << it << ": each unit gathered for forward and backward";
      // The first iteration prefetches in unit order (the order is not known yet); the second in the
      // order the first one ran.
      if (it == 1) EXPECT_EQ(forward_gathers, call_order);
      else EXPECT_NE(forward_gathers, call_order);
    }
  });
}

// ---- The matrix ----

class AnyStructure : public ::testing::TestWithParam<std::tuple<StructureClass, ModeVariant>> {};

TEST_P(AnyStructure, MatchesTheSerialReference) {
  const auto [structure, variant] = GetParam();
  int runs = 0;
  for (int seed : {1, 2})
    for (bool fine_grained : {false, true})
      for (int dp = 1; dp <= 4; ++dp)
        for (int micro_batches : {1, 3})
          for (bool grad_overlap : {false, true})
            for (bool param_overlap : {false, true}) {
              // DDP without the distributed optimizer has no param gather to overlap.
              if (param_overlap && variant.mode == DpMode::kDdp) continue;
              // The cycled axes: parities of different sets of the axes above, so each takes both
              // its values in half of the runs, with every structure class and every mode.
              const int b_dp = (dp - 1) & 1, b_mb = micro_batches == 3, b_seed = seed - 1;
              GenericCase c{.structure = structure,
                            .seed = static_cast<uint64_t>(seed),
                            .mode = variant.mode,
                            .fine_grained = fine_grained,
                            .mxfp8 = variant.mxfp8,
                            .overlap_grad_reduce = grad_overlap,
                            .overlap_param_gather = param_overlap};
              c.run.dp = dp;
              c.run.micro_batches = micro_batches;
              c.run.param_dtype = !variant.mxfp8 && (b_dp ^ b_mb ^ b_seed ^ grad_overlap) ? DType::kF32 : DType::kBF16;
              c.run.recompute = (((dp - 1) >> 1) ^ fine_grained ^ param_overlap ^ b_mb) != 0;
              SCOPED_TRACE(c.name() + " " + generic_model_of(c).describe());
              run_local_case(c);
              ++runs;
            }
  EXPECT_EQ(runs, variant.mode == DpMode::kDdp ? 64 : 128);
}

std::string structure_variant_name(const ::testing::TestParamInfo<std::tuple<StructureClass, ModeVariant>>& info) {
  return structure_class_name(std::get<0>(info.param)) + "_" + variant_name(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(StructureMode, AnyStructure,
                         ::testing::Combine(::testing::ValuesIn(kStructureClasses), ::testing::ValuesIn(kModeVariants)),
                         structure_variant_name);

// ---- Under jitter ----

class AnyStructureJitter : public ::testing::TestWithParam<StructureClass> {};

TEST_P(AnyStructureJitter, MatchesTheSerialReferenceUnderDelays) {
  const StructureClass structure = GetParam();
  int k = 0;
  for (const ModeVariant& v : kModeVariants) {
    if (v.mode == DpMode::kDdp) continue;  // its one collective, the all-reduce, is not delayed
    for (int dp : {2, 4}) {
      GenericCase c{.structure = structure, .seed = 5, .mode = v.mode, .fine_grained = k % 2 == 1, .mxfp8 = v.mxfp8,
                    .overlap_grad_reduce = true, .overlap_param_gather = true};
      c.run.dp = dp;
      c.run.micro_batches = 3;
      c.run.recompute = k % 3 == 0;
      ++k;
      LocalOptions options;
      options.injected_delay = {.min_us = 0, .max_us = 300, .seed = 100 + static_cast<uint64_t>(k)};
      SCOPED_TRACE(c.name() + " under jitter");
      run_local_case(c, options, /*hook_sleep_us=*/200);
    }
  }
}

// ---- On a device ----

class AnyStructureOnADevice : public ::testing::TestWithParam<StructureClass> {};

// The ranks' computes claim a device (tests/comm/recording_compute.h: host memory labelled cuda:5),
// so every FSDP strategy and DDP with the distributed optimizer, with and without MXFP8 params,
// take their device path here: every buffer allocated, zeroed, filled, quantized and folded
// through the communicator's compute, every view on cuda:5, the model's reads and writes through
// copies. The computes hand out poisoned pointers, so any direct host access to a buffer faults.
// Still bit for bit. Not here: DDP with the replicated optimizer (its test harness steps the
// params in host code).
TEST_P(AnyStructureOnADevice, MatchesTheSerialReference) {
  const StructureClass structure = GetParam();
  int k = 0;
  for (const ModeVariant& v : kModeVariants) {
    if (v.mode == DpMode::kDdp) continue;
    for (int dp : {2, 4}) {
      GenericCase c{.structure = structure, .seed = 7, .mode = v.mode, .fine_grained = k % 2 == 1, .mxfp8 = v.mxfp8,
                    .overlap_grad_reduce = k % 3 != 0, .overlap_param_gather = k % 3 != 1};
      c.run.dp = dp;
      c.run.micro_batches = k % 2 == 0 ? 3 : 1;
      c.run.recompute = k % 4 == 1;
      ++k;
      const ClaimedDevice claimed(dp);
      SCOPED_TRACE(c.name() + " on cuda:5");
      run_local_case(c, claimed.options);
      for (const auto& compute : claimed.computes) {
        EXPECT_GT(compute->allocations.load(), 0) << "the buffers were allocated on the rank's compute";
        EXPECT_GT(compute->reduces.load(), 0) << "the grads were reduced on the rank's compute";
        if (v.mxfp8) {
          EXPECT_GT(compute->quantizes.load(), 0) << "the MXFP8 copies were quantized on the rank's compute";
        }
      }
    }
  }
}

// HSDP on a device: a 2 x 2 grid (and 2 x 1, 1 x 2) whose ranks' computes claim cuda:5, both
// groups of a rank moving its bytes through its compute, under every FSDP strategy (MXFP8 params
// under optim_grads_params too). HSDP groups the gradient's sum ((g0 + g1) + (g2 + g3)) where the
// reference adds in rank order, so it is held to the reference within a bound (1e-6 with f32
// params, as hsdp_local_test.cc bounds the reference GPT's; 1e-4 with bf16 params, where a last-bit
// difference in a main param can flip the bf16 copy the next forward reads: 1.5e-5 measured), and
// to the same job on host memory bit for bit: every main param element every rank updated, after
// every iteration.
TEST(AnyStructureHsdp, OnADeviceGivesTheHostRunsBits) {
  const StructureClass structure = StructureClass::kTiedFirstLast;
  int k = 0;
  for (const ModeVariant& v : kModeVariants) {
    if (!is_fsdp(v.mode)) continue;
    for (const auto& [shard, replicas] : {std::pair{2, 2}, std::pair{2, 1}, std::pair{1, 2}}) {
      GenericCase c{.structure = structure, .seed = 3, .mode = v.mode, .fine_grained = k % 2 == 1, .mxfp8 = v.mxfp8,
                    .overlap_grad_reduce = k % 3 != 0, .overlap_param_gather = k % 3 != 1};
      c.run.dp = shard * replicas;
      c.run.micro_batches = k % 2 == 0 ? 3 : 1;
      c.run.param_dtype = v.mxfp8 || k % 2 == 1 ? DType::kBF16 : DType::kF32;  // MXFP8 needs bf16
      const double tol = c.run.param_dtype == DType::kF32 ? 1e-6 : 1e-4;
      ++k;
      SCOPED_TRACE(fmt::format("{} as {} x {} HSDP", c.name(), shard, replicas));
      const GenericModel model = generic_model_of(c);
      const auto want = generic_reference_of(c, model);
      const auto on_host = run_hsdp_generic_case(c, model, want, tol, shard, replicas);
      const ClaimedDevice claimed(c.run.dp);
      expect_same_updated_mains(on_host, run_hsdp_generic_case(c, model, want, tol, shard, replicas, claimed.options.computes));
      for (int r = 0; r < c.run.dp; ++r) {
        const RecordingCompute& compute = *claimed.computes[static_cast<size_t>(r)];
        EXPECT_GT(compute.allocations.load(), 0) << "rank " << r << ": the buffers were allocated on the rank's compute";
        EXPECT_GT(compute.reduces.load(), 0) << "rank " << r << ": the grads were reduced on the rank's compute";
      }
    }
  }
}

// Checkpoints move between a device and the host: every FSDP strategy (MXFP8 params under
// optim_grads_params too) and DDP with the distributed optimizer (with MXFP8 params too), dp 2 and
// 4, train 2 of 4 iterations on ranks whose computes claim cuda:5 and save; the same job loads that
// checkpoint on host memory and trains the other 2; and the other way round. The resumed run's main
// params equal the serial reference's after iterations 3 and 4, bit for bit, as an uninterrupted
// run's do. The save copies the device's main params and states to the host through the compute,
// and the load commits them through it (poisoned pointers: nothing may touch them directly).
TEST(AnyStructureCheckpoint, SavedOnADeviceResumesOnTheHostAndBack) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / fmt::format("mxddp_any_structure_ckpt_{}", ::getpid());
  int k = 0;
  for (const ModeVariant& v : kModeVariants) {
    if (v.mode == DpMode::kDdp) continue;  // the replicated optimizer has no checkpoint
    for (int dp : {2, 4}) {
      GenericCase c{.structure = k % 2 == 0 ? StructureClass::kNonUnitMiddle : StructureClass::kTiedFirstLast, .seed = 13,
                    .mode = v.mode, .fine_grained = k % 2 == 1, .mxfp8 = v.mxfp8, .overlap_grad_reduce = true,
                    .overlap_param_gather = k % 3 != 1};
      c.run.dp = dp;
      c.run.iterations = 4;
      c.run.micro_batches = k % 2 == 0 ? 2 : 1;
      ++k;
      const GenericModel model = generic_model_of(c);
      const auto want = generic_reference_of(c, model);
      for (bool saved_on_device : {true, false}) {
        SCOPED_TRACE(c.name() + (saved_on_device ? ": saved on cuda:5, resumed on the host" : ": saved on the host, resumed on cuda:5"));
        std::filesystem::remove_all(dir);
        auto segment = [&](bool on_device, int first, int end, bool load, bool save) {
          const ClaimedDevice claimed(on_device ? dp : 0);
          run_local(
              dp,
              [&](Communicator& comm) {
                run_generic_case(comm, c, model, want, /*tol=*/0, {},
                                 {.first_iteration = first, .end_iteration = end, .load_dir = load ? dir.string() : "",
                                  .save_dir = save ? dir.string() : ""});
              },
              claimed.options);
          for (const auto& compute : claimed.computes) {
            EXPECT_GT(compute->copies.load() + compute->reduces.load(), 0) << "the device run moved its bytes through its compute";
          }
        };
        segment(saved_on_device, 0, 2, /*load=*/false, /*save=*/true);
        segment(!saved_on_device, 2, 4, /*load=*/true, /*save=*/false);
      }
    }
  }
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Structure, AnyStructureOnADevice, ::testing::ValuesIn(kStructureClasses),
                         [](const ::testing::TestParamInfo<StructureClass>& info) { return structure_class_name(info.param); });

INSTANTIATE_TEST_SUITE_P(Structure, AnyStructureJitter, ::testing::ValuesIn(kStructureClasses),
                         [](const ::testing::TestParamInfo<StructureClass>& info) { return structure_class_name(info.param); });

}  // namespace
}  // namespace mxddp::testing
