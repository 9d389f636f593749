// FSDP's fine-grained param gather (issue 12 parts 1 and 2, BF16 params): the policy decision over
// every input, losses equal to the unit-per-layer gather bit for bit under every recompute, each
// gather released once (a recompute's gather included) with no unit gathered at finish_grad_sync,
// and the peak gathered bytes derived from the param shapes and the prefetch budget.
#include <algorithm>
#include <tuple>

#include <mxddp/fsdp.h>
#include <mxddp/fsdp_fine_grained.h>

#include "fsdp/fsdp_engine.h"

#include "fsdp/fsdp_util.h"

namespace mxddp::testing {
namespace {

// ---- The policy ---------------------------------------------------------------------------------

std::string error_of(const FineGrainedParamGatherInputs& in) {
  try {
    decide_fine_grained_param_gather(in);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

// Every recompute setting GptModelOptions accepts: none, full, selective with each non-empty set.
std::vector<std::pair<RecomputeGranularity, RecomputeModules>> every_recompute() {
  std::vector<std::pair<RecomputeGranularity, RecomputeModules>> all = {{RecomputeGranularity::kNone, {}},
                                                                        {RecomputeGranularity::kFull, {}}};
  const RecomputeModule modules[] = {RecomputeModule::kCoreAttn, RecomputeModule::kMlp, RecomputeModule::kLayernorm};
  for (int mask = 1; mask < 8; ++mask) {
    RecomputeModules set;
    for (int i = 0; i < 3; ++i)
      if (mask & (1 << i)) set.insert(modules[i]);
    all.emplace_back(RecomputeGranularity::kSelective, set);
  }
  return all;
}

// The rules as issue 12 states them, checked against the function over all 2 x 3 x 2 x 9 inputs.
TEST(FineGrainedPolicy, EveryCombinationChoosesAsSpecified) {
  int cases = 0, refused = 0;
  for (FineGrainedParamGatherPolicy policy : {FineGrainedParamGatherPolicy::kMegatron, FineGrainedParamGatherPolicy::kRecomputeAware})
    for (std::optional<bool> flag : {std::optional<bool>(), std::optional<bool>(true), std::optional<bool>(false)})
      for (bool mxfp8 : {false, true})
        for (const auto& [granularity, modules] : every_recompute()) {
          ++cases;
          const FineGrainedParamGatherInputs in{.policy = policy, .flag = flag, .mxfp8_param_gather = mxfp8,
                                                .recompute_granularity = granularity, .recompute_modules = modules};
          const bool reruns_weights = granularity == RecomputeGranularity::kSelective &&
                                      (modules.contains(RecomputeModule::kMlp) || modules.contains(RecomputeModule::kLayernorm));
          const bool required = policy == FineGrainedParamGatherPolicy::kMegatron ? mxfp8 : mxfp8 && reruns_weights;
          const std::string what = fmt::format("{} flag {} mxfp8 {} {} {}", fine_grained_param_gather_policy_name(policy),
                                               flag ? (*flag ? "on" : "off") : "unset", mxfp8,
                                               recompute_granularity_name(granularity), recompute_modules_names(modules));
          if (required && flag == false) {
            ++refused;
            const std::string message = error_of(in);
            EXPECT_NE(message.find("--no-megatron-fsdp-enable-fine-grained-param-gather is not valid"), std::string::npos)
                << what << ": " << message;
            EXPECT_NE(message.find(fine_grained_param_gather_policy_name(policy)), std::string::npos) << what;
            continue;
          }
          const FineGrainedParamGatherDecision d = decide_fine_grained_param_gather(in);
          EXPECT_EQ(d.on, required || flag == true) << what;
          EXPECT_EQ(d.required, required) << what;
          EXPECT_EQ(d.reason.starts_with(d.on ? "on: " : "off: "), true) << what << ": " << d.reason;
        }
  EXPECT_EQ(cases, 2 * 3 * 2 * 9);
  // megatron: mxfp8 (any recompute, 9); recompute-aware: mxfp8 with mlp or layernorm (6 of the 9).
  EXPECT_EQ(refused, 9 + 6);
}

TEST(FineGrainedPolicy, TheTwoPoliciesDifferWhereIssue12SaysTheyDo) {
  FineGrainedParamGatherInputs in{.mxfp8_param_gather = true, .recompute_granularity = RecomputeGranularity::kFull};
  // Full recompute re-runs the unit's own hook: recompute-aware leaves it to the flag, Megatron forces it.
  in.policy = FineGrainedParamGatherPolicy::kRecomputeAware;
  EXPECT_FALSE(decide_fine_grained_param_gather(in).on);
  in.policy = FineGrainedParamGatherPolicy::kMegatron;
  EXPECT_TRUE(decide_fine_grained_param_gather(in).on);
  // core_attn has no weights: not required; mlp is.
  in.policy = FineGrainedParamGatherPolicy::kRecomputeAware;
  in.recompute_granularity = RecomputeGranularity::kSelective;
  in.recompute_modules = {RecomputeModule::kCoreAttn};
  EXPECT_FALSE(decide_fine_grained_param_gather(in).on);
  in.recompute_modules = {RecomputeModule::kCoreAttn, RecomputeModule::kMlp};
  EXPECT_TRUE(decide_fine_grained_param_gather(in).required);
  // BF16 params: never required, the flag decides under either policy.
  in.mxfp8_param_gather = false;
  for (auto policy : {FineGrainedParamGatherPolicy::kMegatron, FineGrainedParamGatherPolicy::kRecomputeAware}) {
    in.policy = policy;
    in.flag = std::nullopt;
    EXPECT_FALSE(decide_fine_grained_param_gather(in).on);
    in.flag = true;
    EXPECT_TRUE(decide_fine_grained_param_gather(in).on);
    in.flag = false;
    EXPECT_FALSE(decide_fine_grained_param_gather(in).on);
  }
}

TEST(FineGrainedPolicy, TrainConfigRefusesTheFlagWithoutFsdpAndBadPolicyNames) {
  TrainConfig c = fsdp_config(ShardingStrategy::kOptimGradsParams, true);
  c.fsdp.megatron_fsdp_enable_fine_grained_param_gather = true;
  EXPECT_NO_THROW(c.validate(2));
  EXPECT_TRUE(c.model_options().fine_grained_param_gather);
  c.use_megatron_fsdp = false;  // DDP gathers buckets: the flag would silently do nothing
  EXPECT_THROW(c.validate(2), Error);
  EXPECT_FALSE(c.model_options().fine_grained_param_gather);
  EXPECT_THROW(parse_fine_grained_param_gather_policy("always"), Error);
  EXPECT_EQ(parse_fine_grained_param_gather_policy("recompute-aware"), FineGrainedParamGatherPolicy::kRecomputeAware);
  EXPECT_EQ(FsdpConfig{}.fine_grained_param_gather_policy, FineGrainedParamGatherPolicy::kRecomputeAware);
}

// ---- Units ----------------------------------------------------------------------------------------

TEST(FineGrainedUnits, SixSubmodulesPerLayerCoverTheLayerUnitsInOrder) {
  const GptConfig model{.num_layers = 3, .hidden_size = 32, .num_attention_heads = 2, .seq_length = 16};
  const auto layers = gpt_fsdp_units(model, false);
  const auto fine = gpt_fsdp_units(model, true);
  ASSERT_EQ(fine.size(), 6 * layers.size());
  const auto specs = gpt_param_specs(model);
  for (size_t l = 0; l < layers.size(); ++l) {
    std::vector<int> joined;
    for (size_t k = 0; k < 6; ++k) {
      const std::vector<int>& unit = fine[6 * l + k];
      ASSERT_EQ(unit.size(), 2u);
      EXPECT_TRUE(specs[static_cast<size_t>(unit[0])].name.ends_with(".weight")) << specs[static_cast<size_t>(unit[0])].name;
      EXPECT_TRUE(specs[static_cast<size_t>(unit[1])].name.ends_with(".bias")) << specs[static_cast<size_t>(unit[1])].name;
      joined.insert(joined.end(), unit.begin(), unit.end());
    }
    EXPECT_EQ(joined, layers[l]);
  }
}

// ---- Losses: fine-grained equals the unit-per-layer gather bitwise ---------------------------------

const Recompute kRecomputes[] = {
    {"none", RecomputeGranularity::kNone, {}},
    {"full", RecomputeGranularity::kFull, {}},
    {"selective_mlp", RecomputeGranularity::kSelective, {RecomputeModule::kMlp}},
    {"selective_all", RecomputeGranularity::kSelective,
     {RecomputeModule::kCoreAttn, RecomputeModule::kMlp, RecomputeModule::kLayernorm}},
};

class FineGrainedParity : public ::testing::TestWithParam<std::tuple<int, int>> {};

// Smaller units change the buckets (and their padding) and when each reduce-scatter runs, never
// what an element sums: the local backend reduces each element over the ranks in rank order with
// the same 1/dp prescale, micro-batches fold into the shard per element, and Adam is per element.
// Only the global norm's f64 partial sums follow the bucket boundaries, so with clipping off the
// losses are equal bit for bit (with clipping they would agree to the norm's rounding).
TEST_P(FineGrainedParity, LossesEqualTheUnitPerLayerGatherBitwise) {
  const auto [recompute, dp] = GetParam();
  const Recompute& r = kRecomputes[recompute];
  TrainConfig c = fsdp_config(ShardingStrategy::kOptimGradsParams, true);
  c.recompute_granularity = r.granularity;
  c.recompute_modules = r.modules;
  c.micro_batch_size = 2;
  c.global_batch_size = 2 * dp * 2;  // two micro-batches: the first under no_sync
  c.optimizer.clip_grad = 0;
  c.eval_iters = 1;  // an evaluation pass too (forward only, its gathers released)
  const TrainResult off = train_local(dp, c);
  c.fsdp.megatron_fsdp_enable_fine_grained_param_gather = true;
  const TrainResult on = train_local(dp, c);
  ASSERT_EQ(off.steps.size(), 3u);
  EXPECT_EQ(losses(on), losses(off));
  ASSERT_EQ(on.evals.size(), off.evals.size());
  for (size_t i = 0; i < on.evals.size(); ++i) EXPECT_EQ(on.evals[i].loss, off.evals[i].loss);
}

INSTANTIATE_TEST_SUITE_P(RecomputeDp, FineGrainedParity, ::testing::Combine(::testing::Range(0, 4), ::testing::Values(1, 2, 4)),
                         [](const ::testing::TestParamInfo<std::tuple<int, int>>& info) {
                           return fmt::format("{}_dp{}", kRecomputes[std::get<0>(info.param)].name, std::get<1>(info.param));
                         });

// The other strategies take the smaller units too (their buckets and reductions follow the units).
TEST(FineGrained, OtherStrategiesKeepTheirLossesBitwise) {
  for (ShardingStrategy s : {ShardingStrategy::kNoShard, ShardingStrategy::kOptim, ShardingStrategy::kOptimGrads}) {
    TrainConfig c = fsdp_config(s, true);
    c.recompute_granularity = RecomputeGranularity::kSelective;
    c.recompute_modules = {RecomputeModule::kMlp};
    c.global_batch_size = 2 * 2 * 2;
    c.optimizer.clip_grad = 0;
    const std::vector<double> off = losses(train_local(2, c));
    c.fsdp.megatron_fsdp_enable_fine_grained_param_gather = true;
    EXPECT_EQ(losses(train_local(2, c)), off) << sharding_strategy_name(s);
  }
}

// ---- The gather / release protocol, driven by hand ------------------------------------------------

// Per group and slot, the events alternate gather, release, ... and end released.
void expect_each_gather_released_once(const std::vector<FsdpGatherEvent>& events, int groups, const std::string& what) {
  std::vector<std::array<int, kGatherSlots>> held(static_cast<size_t>(groups), {0, 0, 0});
  for (const FsdpGatherEvent& e : events) {
    ASSERT_GE(e.group, 0);
    ASSERT_LT(e.group, groups);
    int& h = held[static_cast<size_t>(e.group)][static_cast<size_t>(e.slot)];
    if (e.kind == FsdpGatherEvent::Kind::kGather) {
      EXPECT_EQ(h, 0) << what << ": group " << e.group << " " << gather_slot_name(e.slot) << " gathered twice";
      h = 1;
    } else {
      EXPECT_EQ(h, 1) << what << ": group " << e.group << " " << gather_slot_name(e.slot) << " released without a gather";
      h = 0;
    }
  }
  for (int g = 0; g < groups; ++g)
    for (int s = 0; s < kGatherSlots; ++s)
      EXPECT_EQ(held[static_cast<size_t>(g)][static_cast<size_t>(s)], 0) << what << ": group " << g << " slot " << s << " still held";
}

TEST(FineGrained, EveryGatherIsReleasedOnceAndNoUnitIsGatheredAtFinish) {
  const GptConfig model{.num_layers = 3, .hidden_size = 32, .num_attention_heads = 2, .seq_length = 16};
  const int units = 6 * model.num_layers, micro = 2, iters = 3;
  set_compute_threads(1);
  for (const Recompute& r : kRecomputes)
    for (bool overlap : {false, true})
      run_local(2, [&](Communicator& comm) {
        const std::string what = fmt::format("recompute {}, overlap {}", r.name, overlap);
        FsdpConfig fc;
        fc.overlap_grad_reduce = fc.overlap_param_gather = overlap;
        HandDrivenFsdpGpt run(
            comm, model, fc,
            {.recompute_granularity = r.granularity, .recompute_modules = r.modules, .fine_grained_param_gather = true});
        auto& [tracker, pool, specs, init, fsdp, opt, gpt, data, tokens] = run;
        ASSERT_EQ(fsdp.num_units(), units);
        int recompute_gathers = 0;
        for (int it = 0; it < iters; ++it) {
          opt.zero_grad();
          for (int m = 0; m < micro; ++m) {
            forward_backward_micro_batch(fsdp, gpt, data, it, m, tokens);
            EXPECT_EQ(fsdp_engine(fsdp).units_gathered(), 0) << what << ": a unit outlived its post-backward";
          }
          EXPECT_EQ(fsdp_engine(fsdp).units_gathered(), 0) << what << ": gathered at finish_grad_sync";
          fsdp.finish_grad_sync();
          EXPECT_FALSE(fsdp_engine(fsdp).anything_gathered()) << what;
          EXPECT_EQ(tracker.usage().live(MemoryCategory::kGathered), 0) << what;
          opt.step();
        }
        expect_each_gather_released_once(fsdp_engine(fsdp).gather_events(), units + 1, what);
        // A recompute's gather is kept for the unit's backward, so each unit is still gathered once
        // per pass: (2 passes x 18 units x 2 micro-batches + the non-unit params) x 3 iterations.
        EXPECT_EQ(fsdp_engine(fsdp).gathers_started(), (2 * units * micro + 1) * iters) << what;
        EXPECT_EQ(fsdp_engine(fsdp).gathers_started(), fsdp_engine(fsdp).releases_done()) << what;
        // Every backward gather (a recompute's pre-forward, a pre-backward or its prefetch) is the
        // unit's only one in that pass, so there are as many as units x micro-batches.
        for (const FsdpGatherEvent& e : fsdp_engine(fsdp).gather_events())
          recompute_gathers += e.kind == FsdpGatherEvent::Kind::kGather && e.phase != FsdpPhase::kForward;
        EXPECT_EQ(recompute_gathers, units * micro * iters) << what << ": one backward gather per unit and micro-batch";
        fsdp_engine(fsdp).clear_gather_events();
        opt.force_param_sync();
        gpt.evaluate(tokens.data(), 2);
        EXPECT_FALSE(fsdp_engine(fsdp).anything_gathered()) << what;
        expect_each_gather_released_once(fsdp_engine(fsdp).gather_events(), units + 1, what + ", evaluation");
        for (const FsdpGatherEvent& e : fsdp_engine(fsdp).gather_events()) EXPECT_EQ(e.phase, FsdpPhase::kForward) << what << ", evaluation";
      });
}

// ---- Peak gathered bytes, from the shapes ---------------------------------------------------------

// Each unit's bucket elements (forward order) and the non-unit params', from the FSDP layout of
// these units: what a gather of each allocates.
struct UnitNumel {
  std::vector<int64_t> units;
  int64_t non_unit = 0;
};

UnitNumel unit_numel(const GptConfig& model, int dp, const std::vector<std::vector<int>>& units) {
  const std::vector<ParamSpec> specs = gpt_param_specs(model);
  std::vector<int> unit(specs.size(), -1);
  for (size_t u = 0; u < units.size(); ++u)
    for (int p : units[u]) unit[static_cast<size_t>(p)] = static_cast<int>(u);
  const ParamLayout layout = compute_param_layout(specs, {.dp = dp, .use_distributed_optimizer = true, .param_unit = unit});
  UnitNumel n;
  n.units.assign(units.size(), 0);
  for (const BucketPlacement& b : layout.buckets) {
    const int u = unit[static_cast<size_t>(b.params.front())];
    (u < 0 ? n.non_unit : n.units[static_cast<size_t>(u)]) += b.range.size();
  }
  return n;
}

// FsdpConfig's default: suggested_communication_unit_size is twice the average unit, the
// prefetch budget half of it.
int64_t default_budget(const UnitNumel& n) {
  int64_t sum = 0;
  for (int64_t u : n.units) sum += u;
  return 2 * sum / static_cast<int64_t>(n.units.size()) / 2;
}

// The most unit elements gathered at once with prefetch and no recompute: at a unit's pre-hook, the
// unit and the longest run of the units after it in that pass's order whose elements fit the
// budget (forward and backward give the same runs, mirrored).
int64_t peak_units(const std::vector<int64_t>& n, int64_t budget) {
  int64_t peak = 0;
  const int count = static_cast<int>(n.size());
  for (int step : {1, -1})
    for (int u = 0; u < count; ++u) {
      int64_t run = 0;
      for (int v = u + step; v >= 0 && v < count && run + n[static_cast<size_t>(v)] <= budget; v += step)
        run += n[static_cast<size_t>(v)];
      peak = std::max(peak, n[static_cast<size_t>(u)] + run);
    }
  return peak;
}

TEST(FineGrained, PeakGatheredBytesFallByWhatTheShapesImply) {
  const int dp = 2;
  const int64_t elem = 2;  // bf16 params
  TrainConfig c = fsdp_config(ShardingStrategy::kOptimGradsParams, true);
  c.global_batch_size = 2 * dp * 2;
  const UnitNumel layers = unit_numel(c.model, dp, gpt_fsdp_units(c.model, false));
  const UnitNumel fine = unit_numel(c.model, dp, gpt_fsdp_units(c.model, true));
  ASSERT_EQ(layers.non_unit, fine.non_unit);
  auto run = [&](bool fine_grained) {
    TrainConfig k = c;
    k.fsdp.megatron_fsdp_enable_fine_grained_param_gather = fine_grained;
    const TrainResult r = train_local(dp, k);
    std::vector<int64_t> peaks;
    for (const RankMemory& m : r.memory_by_rank) peaks.push_back(m.overall.peak(MemoryCategory::kGathered));
    return peaks;
  };
  auto expect_all = [&](const std::vector<int64_t>& peaks, int64_t want, const std::string& what) {
    for (int64_t p : peaks) EXPECT_EQ(p, want) << what;
  };

  // No recompute, each granularity's default budget (Megatron's rule, from its own units).
  {
    const int64_t want_off = elem * (layers.non_unit + peak_units(layers.units, default_budget(layers)));
    const int64_t want_on = elem * (fine.non_unit + peak_units(fine.units, default_budget(fine)));
    ASSERT_LT(want_on, want_off);
    c.fsdp.suggested_communication_unit_size = std::nullopt;
    const auto off = run(false), on = run(true);
    expect_all(off, want_off, "default budget, off");
    expect_all(on, want_on, "default budget, on");
    EXPECT_EQ(off.front() - on.front(), want_off - want_on);
  }
  // No prefetch (a budget of 0 elements): the largest unit; fine-grained saves a layer less its
  // largest submodule.
  c.fsdp.suggested_communication_unit_size = 1;
  {
    const int64_t want_off = elem * (layers.non_unit + *std::ranges::max_element(layers.units));
    const int64_t want_on = elem * (fine.non_unit + *std::ranges::max_element(fine.units));
    expect_all(run(false), want_off, "no prefetch, off");
    expect_all(run(true), want_on, "no prefetch, on");
  }
  // Selective mlp recompute, no prefetch: the recompute's fc1 gather is kept through fc2's
  // backward, so the peak is fc1 + fc2 of a layer (units 4 and 5 of its six).
  c.recompute_granularity = RecomputeGranularity::kSelective;
  c.recompute_modules = {RecomputeModule::kMlp};
  {
    int64_t mlp = 0;
    for (int l = 0; l < c.model.num_layers; ++l)
      mlp = std::max(mlp, fine.units[static_cast<size_t>(6 * l + 4)] + fine.units[static_cast<size_t>(6 * l + 5)]);
    expect_all(run(false), elem * (layers.non_unit + *std::ranges::max_element(layers.units)), "selective mlp, off");
    expect_all(run(true), elem * (fine.non_unit + mlp), "selective mlp, on");
  }
}

}  // namespace
}  // namespace mxddp::testing
