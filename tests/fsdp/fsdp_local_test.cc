// FSDP on the local backend: parity with DDP + the distributed optimizer across strategy x overlap
// x dp x micro-batches, the exact resting bytes of each strategy and the peak gathered bytes under
// each prefetch budget, one release per gather, nothing gathered at finish_grad_sync, params read
// only inside their hooks, and checkpoints that move between FSDP and DDP at other dp sizes.
#include <tuple>

#include <mxddp/fsdp.h>

#include "fsdp/fsdp_engine.h"

#include "fsdp/fsdp_util.h"

namespace mxddp::testing {
namespace {

// ---- Parity with DDP ----------------------------------------------------------------------------

class FsdpParity : public ::testing::TestWithParam<std::tuple<ShardingStrategy, bool, int, int>> {};

// Without clipping the update never reads the global norm, whose f64 sum runs over other shard
// boundaries than DDP's. Then every strategy whose gradient reduction is DDP's (no_shard and
// optim; optim_grads* at one micro-batch, or on one rank, where the grads accumulate in the shard)
// gives DDP's losses bitwise: the local backend reduces each element in rank order with the same
// 1/dp prescale. optim_grads* with several micro-batches on several ranks sum reduced micro-batches
// instead of reducing the summed ones: within 1e-6 relative.
TEST_P(FsdpParity, LossesMatchDdp) {
  const auto [strategy, overlap, dp, accum] = GetParam();
  TrainConfig c = fsdp_config(strategy, overlap);
  c.micro_batch_size = 2;
  c.global_batch_size = 2 * dp * accum;
  c.optimizer.clip_grad = 0;
  const std::vector<double> ddp = losses(train_local(dp, as_ddp(c)));
  const std::vector<double> fsdp = losses(train_local(dp, c));
  const bool same_reduction =
      accum == 1 || dp == 1 || strategy == ShardingStrategy::kNoShard || strategy == ShardingStrategy::kOptim;
  if (same_reduction) EXPECT_EQ(fsdp, ddp);
  else expect_close(fsdp, ddp, 1e-6, "fsdp vs ddp, micro-batches reduced one by one");
}

INSTANTIATE_TEST_SUITE_P(StrategyOverlapDpMicro, FsdpParity,
                         ::testing::Combine(::testing::ValuesIn(kStrategies), ::testing::Bool(), ::testing::Values(1, 2, 3, 4),
                                            ::testing::Values(1, 3)),
                         strategy_overlap_dp_micro_name);

// With clipping the norm's partial sums are grouped by other shards: the losses agree to 1e-6.
TEST(Fsdp, ClippedLossesWithinOneInAMillionOfDdp) {
  for (ShardingStrategy s : kStrategies) {
    TrainConfig c = fsdp_config(s, true);
    c.optimizer.clip_grad = 0.05f;  // small enough to clip every step
    c.global_batch_size = 2 * 2 * 2;
    const TrainResult fsdp = train_local(2, c);
    const TrainResult ddp = train_local(2, as_ddp(c));
    expect_close(losses(fsdp), losses(ddp), 1e-6, std::string(sharding_strategy_name(s)).c_str());
    for (size_t i = 0; i < fsdp.steps.size(); ++i) EXPECT_NEAR(fsdp.steps[i].grad_norm, ddp.steps[i].grad_norm, 1e-6 * ddp.steps[i].grad_norm);
  }
}

// ---- Memory, exactly ----------------------------------------------------------------------------

struct ExpectedBytes {
  int64_t params = 0, grads = 0, main = 0, state = 0, unit_bucket_max = 0, non_unit = 0;
};

// What each rank keeps, from the layout: full or shard per buffer as the strategy says (bf16
// params, f32 grads and main params, Adam's two moments).
ExpectedBytes expected_bytes(const GptConfig& model, ShardingStrategy s, int dp) {
  const std::vector<ParamSpec> specs = gpt_param_specs(model);
  std::vector<int> unit(specs.size(), -1);
  const auto units = gpt_fsdp_units(model);
  for (size_t u = 0; u < units.size(); ++u)
    for (int p : units[u]) unit[static_cast<size_t>(p)] = static_cast<int>(u);
  const ParamLayout layout =
      compute_param_layout(specs, {.dp = dp, .use_distributed_optimizer = true, .param_unit = unit});
  ExpectedBytes e;
  for (const BucketPlacement& b : layout.buckets) {
    const int64_t g = b.range.size(), shard = g / dp;
    const bool params_sharded = s == ShardingStrategy::kOptimGradsParams;
    const bool grads_sharded = params_sharded || s == ShardingStrategy::kOptimGrads;
    const int64_t main = s == ShardingStrategy::kNoShard ? g : shard;
    e.params += 2 * (params_sharded ? shard : g);
    e.grads += 4 * (grads_sharded ? shard : g);
    e.main += 4 * main;
    e.state += 8 * main;
    if (unit[static_cast<size_t>(b.params.front())] >= 0) e.unit_bucket_max = std::max(e.unit_bucket_max, 2 * g);
    else e.non_unit += 2 * g;
  }
  return e;
}

TEST(Fsdp, RestingBytesPerRankAreExact) {
  for (int dp : {1, 2, 3, 4})
    for (ShardingStrategy s : kStrategies) {
      TrainConfig c = fsdp_config(s, true);
      c.global_batch_size = 2 * dp;
      const TrainResult r = train_local(dp, c);
      const ExpectedBytes e = expected_bytes(c.model, s, dp);
      for (const RankMemory& m : r.memory_by_rank) {
        const std::string what = fmt::format("{} at dp {}", sharding_strategy_name(s), dp);
        EXPECT_EQ(m.steady.live(MemoryCategory::kParams), e.params) << what;
        EXPECT_EQ(m.steady.live(MemoryCategory::kGrads), e.grads) << what;
        EXPECT_EQ(m.steady.live(MemoryCategory::kMainParams), e.main) << what;
        EXPECT_EQ(m.steady.live(MemoryCategory::kOptimizerState), e.state) << what;
        EXPECT_EQ(m.steady.live(MemoryCategory::kGathered), 0) << what << ": nothing gathered at rest";
      }
      // The table in fsdp.h, bytes per param per rank, up to the padding (which only adds).
      const double n = static_cast<double>(c.model.num_params());
      const double table[] = {18.0, 6.0 + 12.0 / dp, 2.0 + 16.0 / dp, 18.0 / dp};
      const double got = static_cast<double>(e.params + e.grads + e.main + e.state) / n;
      const double want = table[static_cast<int>(s)];
      EXPECT_GE(got, want - 1e-9) << sharding_strategy_name(s) << " dp " << dp;
      EXPECT_LE(got, want * 1.15) << sharding_strategy_name(s) << " dp " << dp << ": padding beyond 15%";
    }
}

TEST(Fsdp, PeakGatheredBytesFollowTheBudget) {
  const int dp = 2;
  TrainConfig c = fsdp_config(ShardingStrategy::kOptimGradsParams, true);
  c.global_batch_size = 2 * dp * 2;
  c.eval_iters = 1;  // an evaluation pass gathers too
  const ExpectedBytes e = expected_bytes(c.model, ShardingStrategy::kOptimGradsParams, dp);
  const int64_t unit_numel = e.unit_bucket_max / 2;
  struct Case {
    const char* what;
    std::optional<int64_t> unit_size;
    bool double_buffer;
    int units_held;
  };
  const Case cases[] = {
      {"default budget (one unit ahead)", std::nullopt, false, 2},
      {"no prefetch budget", 1, false, 1},
      {"budget of every unit, double buffer", 1'000'000'000, true, 2},
      {"budget of every unit", 1'000'000'000, false, 3},
  };
  for (const Case& k : cases) {
    c.fsdp.suggested_communication_unit_size = k.unit_size;
    c.fsdp.fsdp_double_buffer = k.double_buffer;
    const TrainResult r = train_local(dp, c);
    for (const RankMemory& m : r.memory_by_rank) {
      EXPECT_EQ(m.overall.peak(MemoryCategory::kGathered), e.non_unit + k.units_held * 2 * unit_numel) << k.what;
      EXPECT_EQ(m.steady.live(MemoryCategory::kGathered), 0) << k.what;
    }
  }
}

// On one rank, as Megatron-FSDP when its data-parallel size is 1, nothing is distributed: a unit's
// gather is its shard in place, and its grads go straight into the grad shard. Nothing is gathered
// and no grads are held beyond the shard, at any moment; on two ranks both are (the contrast).
TEST(Fsdp, OnOneRankTheShardsAreTheGathersAndTheGrads) {
  for (ShardingStrategy s : {ShardingStrategy::kOptimGrads, ShardingStrategy::kOptimGradsParams})
    for (int dp : {1, 2}) {
      TrainConfig c = fsdp_config(s, true);
      c.global_batch_size = 2 * dp * 2;  // two micro-batches
      const TrainResult r = train_local(dp, c);
      const std::string what = fmt::format("{} at dp {}", sharding_strategy_name(s), dp);
      for (const RankMemory& m : r.memory_by_rank) {
        const bool gathers = s == ShardingStrategy::kOptimGradsParams && dp > 1;
        EXPECT_EQ(m.overall.peak(MemoryCategory::kGathered) > 0, gathers) << what;
        const int64_t grads_at_rest = m.steady.live(MemoryCategory::kGrads);
        if (dp == 1) EXPECT_EQ(m.overall.peak(MemoryCategory::kGrads), grads_at_rest) << what << ": no transient grads";
        else EXPECT_GT(m.overall.peak(MemoryCategory::kGrads), grads_at_rest) << what << ": a micro-batch's whole grads";
      }
    }
  // No collective moves a unit's params or grads on one rank.
  const GptConfig model{.num_layers = 2, .hidden_size = 32, .num_attention_heads = 2, .seq_length = 16};
  set_compute_threads(1);
  run_local(1, [&](Communicator& comm) {
    FsdpConfig fc;
    fc.overlap_grad_reduce = fc.overlap_param_gather = true;
    HandDrivenFsdpGpt run(comm, model, fc);
    auto& [tracker, pool, specs, init, fsdp, opt, gpt, data, tokens] = run;
    for (int it = 0; it < 2; ++it) {
      opt.zero_grad();
      for (int m = 0; m < 2; ++m) forward_backward_micro_batch(fsdp, gpt, data, it, m, tokens);
      fsdp.finish_grad_sync();
      opt.step();
    }
    EXPECT_GT(fsdp_engine(fsdp).gathers_started(), 0) << "the hooks still gather (in place)";
    for (const FsdpCollective& x : fsdp_engine(fsdp).collective_log())
      EXPECT_TRUE(x.kind != FsdpCollective::Kind::kAllGather && x.kind != FsdpCollective::Kind::kReduceScatter)
          << "bucket " << x.bucket;
  });
}

// A unit whose post-backward never ran has grads its reduction never took: finish_grad_sync says
// so, naming the bucket, on several ranks (its unsharded grads still held) and on one (where they
// went straight into the shard, and only the missed hook tells).
TEST(Fsdp, GradsOfAUnitWhosePostBackwardNeverRanAreRefusedAtTheSync) {
  std::vector<ParamSpec> specs;
  std::vector<std::vector<int>> units;
  for (int u = 0; u < 2; ++u) {
    specs.push_back(ParamSpec{.name = fmt::format("layers.{}.weight", u), .shape = Shape{8, 16}});
    units.push_back({u});
  }
  for (int dp : {1, 2})
    for (ShardingStrategy s : {ShardingStrategy::kOptimGrads, ShardingStrategy::kOptimGradsParams})
      run_local(dp, [&](Communicator& comm) {
        MemoryTracker tracker;
        std::vector<std::vector<float>> init(specs.size(), std::vector<float>(8 * 16, 0.5f));
        std::vector<TensorView> views;
        for (size_t i = 0; i < init.size(); ++i) views.push_back({init[i].data(), DType::kF32, specs[i].shape});
        FsdpConfig fc;
        fc.data_parallel_sharding_strategy = s;
        FullyShardedDataParallel fsdp(comm, specs, units, fc, tracker, views);
        for (const std::vector<int>& unit : units) {
          fsdp.before_forward(unit);
          fsdp.after_forward(unit);
        }
        for (int u = 1; u >= 0; --u) {
          fsdp.before_backward(units[static_cast<size_t>(u)]);
          fsdp.main_grad(u);
          fsdp.grad_ready(u);
          if (u == 1) fsdp.after_backward(units[1]);  // unit 0's post-backward is missed
        }
        const std::string what = fmt::format("{} at dp {}", sharding_strategy_name(s), dp);
        try {
          fsdp.finish_grad_sync();
          ADD_FAILURE() << what << ": finish_grad_sync took grads that were never reduced";
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("param 'layers.0.weight'"), std::string::npos) << what << ": " << e.what();
        }
      });
}

// ---- The gather / release protocol, driven by hand ----------------------------------------------

TEST(Fsdp, EveryGatherIsReleasedOnceAndNothingIsGatheredAtFinish) {
  const GptConfig model{.num_layers = 3, .hidden_size = 32, .num_attention_heads = 2, .seq_length = 16};
  set_compute_threads(1);
  for (bool overlap : {false, true})
    run_local(2, [&](Communicator& comm) {
      FsdpConfig fc;
      fc.overlap_grad_reduce = fc.overlap_param_gather = overlap;
      HandDrivenFsdpGpt run(comm, model, fc);
      auto& [tracker, pool, specs, init, fsdp, opt, gpt, data, tokens] = run;
      // Outside its hooks a sharded param has no storage: reading it is an error, not stale data.
      EXPECT_THROW(fsdp.param(GptParamIds(model).layer(1, kQkvW)), Error);
      for (int it = 0; it < 3; ++it) {
        opt.zero_grad();
        for (int m = 0; m < 2; ++m) {
          forward_backward_micro_batch(fsdp, gpt, data, it, m, tokens);
        }
        fsdp.finish_grad_sync();
        EXPECT_FALSE(fsdp_engine(fsdp).anything_gathered());
        EXPECT_EQ(fsdp_engine(fsdp).gathers_started(), fsdp_engine(fsdp).releases_done());
        EXPECT_EQ(tracker.usage().live(MemoryCategory::kGathered), 0);
        opt.step();
      }
      // Forward and backward re-gather each unit once per micro-batch, and the non-unit params
      // once per iteration (kept through backward): (2 x 3 units x 2 micro-batches + 1) x 3.
      EXPECT_EQ(fsdp_engine(fsdp).gathers_started(), (2 * 3 * 2 + 1) * 3);
      // An evaluation pass gathers and releases everything it used.
      opt.force_param_sync();
      gpt.evaluate(tokens.data(), 2);
      EXPECT_FALSE(fsdp_engine(fsdp).anything_gathered());
      EXPECT_EQ(fsdp_engine(fsdp).gathers_started(), fsdp_engine(fsdp).releases_done());
    });
}

TEST(Fsdp, BadConfigsNameTheValue) {
  run_local(1, [](Communicator& comm) {
    MemoryTracker tracker;
    const GptConfig model{.num_layers = 1, .hidden_size = 32, .num_attention_heads = 2, .seq_length = 8};
    const auto specs = gpt_param_specs(model);
    auto init = gpt_init_params(model, 1);
    const std::vector<TensorView> views = param_views(init, specs);
    auto message = [&](const FsdpConfig& fc, const std::vector<std::vector<int>>& units) {
      try {
        FullyShardedDataParallel fsdp(comm, specs, units, fc, tracker, views);
      } catch (const Error& e) {
        return std::string(e.what());
      }
      return std::string("no error");
    };
    auto has = [](const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; };
    EXPECT_PRED2(has, message({.suggested_communication_unit_size = 0}, gpt_fsdp_units(model)),
                 "suggested_communication_unit_size 0");
    EXPECT_PRED2(has, message({.megatron_fsdp_main_params_dtype = DType::kBF16}, gpt_fsdp_units(model)),
                 "megatron_fsdp_main_params_dtype bf16");
    EXPECT_PRED2(has, message({}, {{2, 3}, {3}}), "in FSDP units 0 and 1");
    EXPECT_PRED2(has, message({}, {{99}}), "names param 99");
    // Initial values are read on the host, whole: a short one or one on a device is refused, naming it.
    auto with_initial = [&](size_t index, const TensorView& value) {
      std::vector<TensorView> bad = views;
      bad[index] = value;
      try {
        FullyShardedDataParallel fsdp(comm, specs, gpt_fsdp_units(model), FsdpConfig{}, tracker, bad);
      } catch (const Error& e) {
        return std::string(e.what());
      }
      return std::string("no error");
    };
    TensorView shorter = views[1];
    shorter.shape = Shape{shorter.numel() - 1};
    EXPECT_PRED2(has, with_initial(1, shorter), "initial value of '" + specs[1].name + "' has");
    TensorView elsewhere = views[2];
    elsewhere.device = Device::cuda(0);
    EXPECT_PRED2(has, with_initial(2, elsewhere), "initial value of '" + specs[2].name + "' is on cuda:0; expected cpu");
    EXPECT_EQ(tracker.usage().total_live_bytes, 0) << "a refused FSDP leaves nothing allocated";
  });
  EXPECT_THROW(parse_sharding_strategy("zero3"), Error);
  TrainConfig c = fsdp_config(ShardingStrategy::kOptim, false);
  c.ddp.bucket_size = 1000;
  EXPECT_THROW(c.validate(1), Error);
}

// ---- Checkpoints move between FSDP and DDP ------------------------------------------------------

// Saves after 3 of 6 iterations with `first` at dp_a, resumes with `second` at dp_b, and compares
// iterations 4..6 with an uninterrupted run of `second` (resharding is exact; the other dp sums in
// another order, hence 1e-5).
void expect_round_trip(const TrainConfig& first, int dp_a, const TrainConfig& second, int dp_b, const char* what) {
  const TempDir dir(std::string("mxddp_fsdp_ckpt_") + std::to_string(dp_a) + std::to_string(dp_b));
  TrainConfig a = first, b = second;
  a.global_batch_size = b.global_batch_size = 12;
  a.micro_batch_size = b.micro_batch_size = 1;
  a.train_iters = 3;
  a.save_dir = dir / "ckpt";
  b.train_iters = 6;
  const std::vector<double> full = losses(train_local(dp_b, b));
  train_local(dp_a, a);
  b.load_dir = a.save_dir;
  const TrainResult resumed = train_local(dp_b, b);
  ASSERT_EQ(resumed.start_iteration, 3);
  expect_close(losses(resumed), std::vector<double>(full.begin() + 3, full.end()), 1e-5, what);
}

TEST(Fsdp, CheckpointFromFsdpAtDp4LoadsIntoDdpAtDp2) {
  const TrainConfig fsdp = fsdp_config(ShardingStrategy::kOptimGradsParams, true);
  expect_round_trip(fsdp, 4, as_ddp(fsdp), 2, "fsdp dp4 -> ddp dp2");
}

TEST(Fsdp, CheckpointFromDdpAtDp2LoadsIntoFsdpAtDp3) {
  const TrainConfig fsdp = fsdp_config(ShardingStrategy::kOptimGradsParams, false);
  expect_round_trip(as_ddp(fsdp), 2, fsdp, 3, "ddp dp2 -> fsdp dp3");
}

TEST(Fsdp, NoShardCheckpointLoadsAtAnotherDp) {
  const TrainConfig no_shard = fsdp_config(ShardingStrategy::kNoShard, true);
  expect_round_trip(no_shard, 2, no_shard, 3, "no_shard dp2 -> dp3");
}

}  // namespace
}  // namespace mxddp::testing
