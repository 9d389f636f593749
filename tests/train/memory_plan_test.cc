// mxddp plan is exact: for generated configurations of every mode the trainer has (DDP and its
// bucketing, padding, overlap and MXFP8 reuse; FSDP's four strategies, MXFP8, fine-grained gather,
// double buffer and unit sizes; recompute; Adam and SGD; 1..8 ranks, odd ones included), the plan
// equals what train() measures on every rank, per category, live and peak, steady state and
// overall, byte for byte. Also: a config the trainer refuses, the plan refuses; a 1T-parameter
// plan at dp 4096 is fast; the closed forms are Megatron's and DeepSpeed's; a 70B plan at dp 64
// keeps the MXFP8 payloads and scales sharded.
#include <chrono>
#include <cstdio>
#include <random>

#include <mxddp/plan.h>

#include "comm/recording_compute.h"
#include "model/train_util.h"
#include "plan/expect_same_usage.h"

namespace mxddp::testing {
namespace {

// A random configuration in the space the trainer accepts (mostly: the ones it refuses are kept
// too, and then the plan must refuse them as well).
TrainConfig generate_config(std::mt19937& rng, int& dp) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  auto coin = [&](double p = 0.5) { return std::bernoulli_distribution(p)(rng); };
  TrainConfig c;
  dp = pick(1, 8);
  const int heads = std::array{1, 2, 4}[static_cast<size_t>(pick(0, 2))];
  c.model = GptConfig{.num_layers = pick(1, 3), .hidden_size = heads * std::array{8, 16, 24}[static_cast<size_t>(pick(0, 2))],
                      .num_attention_heads = heads, .seq_length = std::array{8, 16, 24}[static_cast<size_t>(pick(0, 2))]};
  c.micro_batch_size = pick(1, 2);
  c.global_batch_size = c.micro_batch_size * dp * std::array{1, 2, 2, 6}[static_cast<size_t>(pick(0, 3))];  // accumulation
  c.train_iters = pick(1, 3);
  c.lr_warmup_iters = 1;
  c.corpus_bytes = 1 << 14;
  c.eval_iters = pick(0, 1);
  c.eval_interval = pick(0, 2);
  c.compute_threads = pick(1, 2);
  if (coin(0.15)) c.exit_interval = pick(1, 2);
  c.bf16 = coin(0.2);  // BF16 products stage their operands outside the tracker (docs/plan.md)
  c.optimizer.optimizer = coin(0.8) ? OptimizerType::kAdam : OptimizerType::kSgd;
  switch (pick(0, 3)) {
    case 0: break;
    case 1: c.recompute_granularity = RecomputeGranularity::kFull; break;
    default:
      c.recompute_granularity = RecomputeGranularity::kSelective;
      for (RecomputeModule m : {RecomputeModule::kCoreAttn, RecomputeModule::kMlp, RecomputeModule::kLayernorm})
        if (coin()) c.recompute_modules.insert(m);
      if (c.recompute_modules.empty()) c.recompute_modules.insert(RecomputeModule::kCoreAttn);
  }
  c.ddp.fp8_param_gather = coin(0.3);
  c.use_megatron_fsdp = coin(0.5);
  if (!c.use_megatron_fsdp) {
    c.ddp.overlap_grad_reduce = coin();
    if (c.ddp.overlap_grad_reduce && coin(0.7)) c.ddp.bucket_size = pick(200, 6000);
    c.ddp.pad_buckets_for_high_nccl_busbw = coin(0.2);
    c.ddp.buckets_per_group = pick(1, 2);
    c.ddp.overlap_param_gather = coin();
    c.ddp.reuse_grad_buf_for_mxfp8_param_ag = c.ddp.fp8_param_gather && coin();
    c.ddp.overlap_param_gather_with_optimizer_step =
        c.ddp.overlap_param_gather && !c.ddp.reuse_grad_buf_for_mxfp8_param_ag && coin(0.3);
    return c;
  }
  c.fsdp.data_parallel_sharding_strategy = c.ddp.fp8_param_gather || coin(0.4)
                                               ? ShardingStrategy::kOptimGradsParams
                                               : std::array{ShardingStrategy::kNoShard, ShardingStrategy::kOptim,
                                                            ShardingStrategy::kOptimGrads}[static_cast<size_t>(pick(0, 2))];
  c.fsdp.overlap_param_gather = c.ddp.overlap_param_gather = coin();
  c.fsdp.overlap_grad_reduce = c.ddp.overlap_grad_reduce = coin();
  c.fsdp.fsdp_double_buffer = coin(0.3);
  if (coin(0.4)) c.fsdp.suggested_communication_unit_size = pick(500, 20000);
  if (coin(0.5)) c.fsdp.megatron_fsdp_enable_fine_grained_param_gather = coin(0.7);
  return c;
}

std::string describe(const TrainConfig& c, int dp) {
  return fmt::format("dp {} model {} mb {} gb {} iters {} (exit {}) eval {}/{} threads {} opt {} recompute {} [{}] fp8 {} | "
                     "ddp overlap {} bucket {} pad {} bpg {} opg {} reuse {} opg-step {} | fsdp {} {} opg {} ogr {} "
                     "double {} unit {} fine {}",
                     dp, c.model.describe(), c.micro_batch_size, c.global_batch_size, c.train_iters, c.exit_interval,
                     c.eval_iters,
                     c.eval_interval, c.compute_threads, optimizer_name(c.optimizer.optimizer),
                     recompute_granularity_name(c.recompute_granularity), recompute_modules_names(c.recompute_modules),
                     c.ddp.fp8_param_gather, c.ddp.overlap_grad_reduce, c.ddp.bucket_size.value_or(-1),
                     c.ddp.pad_buckets_for_high_nccl_busbw, c.ddp.buckets_per_group, c.ddp.overlap_param_gather,
                     c.ddp.reuse_grad_buf_for_mxfp8_param_ag, c.ddp.overlap_param_gather_with_optimizer_step,
                     c.use_megatron_fsdp, sharding_strategy_name(c.fsdp.data_parallel_sharding_strategy),
                     c.fsdp.overlap_param_gather, c.fsdp.overlap_grad_reduce, c.fsdp.fsdp_double_buffer,
                     c.fsdp.suggested_communication_unit_size.value_or(-1),
                     c.fsdp.megatron_fsdp_enable_fine_grained_param_gather
                         ? (*c.fsdp.megatron_fsdp_enable_fine_grained_param_gather ? "on" : "off")
                         : "policy");
}

TEST(MemoryPlan, EqualsTheMeasuredMemoryOfEveryRankForGeneratedConfigs) {
  std::mt19937 rng(20261123);
  int compared = 0, refused = 0, fsdp = 0, mxfp8 = 0, recompute = 0, fine_grained = 0;
  std::set<int> dps;
  std::set<ShardingStrategy> strategies;
  while (compared < 120) {
    int dp = 1;
    const TrainConfig c = generate_config(rng, dp);
    const std::string what = describe(c, dp);
    MemoryPlan plan;
    try {
      plan = plan_train_memory(c, {.dp = dp});
    } catch (const Error& e) {
      // The plan refuses: then the trainer does too, with the same message.
      EXPECT_THROW(train_local_all(dp, c), Error) << what << ": the plan refused (" << e.what() << ")";
      ++refused;
      continue;
    }
    SCOPED_TRACE(what);
    const std::vector<TrainResult> all = train_local_all(dp, c);
    for (const TrainResult& r : all) {
      ASSERT_EQ(r.memory_by_rank.size(), static_cast<size_t>(dp));
      for (size_t rank = 0; rank < r.memory_by_rank.size(); ++rank) {
        const RankMemory& m = r.memory_by_rank[rank];
        expect_same_usage(plan.steady, m.steady, fmt::format("rank {} steady state", rank));
        expect_same_usage(plan.overall, m.overall, fmt::format("rank {} overall", rank));
        EXPECT_EQ(plan.peak_gathered_bytes_by_slot, m.peak_gathered_bytes_by_slot) << "rank " << rank;
      }
      break;  // every rank reports every rank's memory: one result is enough
    }
    if (::testing::Test::HasFailure()) {
      ADD_FAILURE() << "stopping at the first configuration that differs";
      return;
    }
    ++compared;
    dps.insert(dp);
    if (c.use_megatron_fsdp) {
      ++fsdp;
      strategies.insert(c.fsdp.data_parallel_sharding_strategy);
      fine_grained += c.fine_grained_param_gather().on ? 1 : 0;
    }
    mxfp8 += c.ddp.fp8_param_gather ? 1 : 0;
    recompute += c.recompute_granularity != RecomputeGranularity::kNone ? 1 : 0;
  }
  // The sweep covers what it claims to.
  EXPECT_EQ(dps.size(), 8u) << "dp 1..8";
  EXPECT_EQ(strategies.size(), 4u) << "every FSDP strategy";
  EXPECT_GE(fsdp, 30);
  EXPECT_GE(compared - fsdp, 30) << "DDP";
  EXPECT_GE(mxfp8, 15);
  EXPECT_GE(recompute, 30);
  EXPECT_GE(fine_grained, 5);
  RecordProperty("refused", refused);
}

// The plan traces at most four micro-batches of an iteration and one evaluation micro-batch: a
// long accumulation and many evaluation batches, with FSDP's reduce-scatter queue tight enough that
// reductions carry over from one micro-batch to the next, still equal the measurement.
TEST(MemoryPlan, LongAccumulationAndEvaluationEqualTheMeasurement) {
  for (ShardingStrategy s : {ShardingStrategy::kOptimGradsParams, ShardingStrategy::kOptimGrads, ShardingStrategy::kNoShard}) {
    TrainConfig c = small_train_config();
    c.global_batch_size = 2 * 2 * 9;  // 9 micro-batches per iteration at dp 2
    c.train_iters = 3;
    c.eval_iters = 3;
    c.compute_threads = 1;
    c.use_megatron_fsdp = true;
    c.fsdp.data_parallel_sharding_strategy = s;
    c.fsdp.overlap_grad_reduce = c.ddp.overlap_grad_reduce = true;
    c.fsdp.overlap_param_gather = c.ddp.overlap_param_gather = true;
    c.fsdp.suggested_communication_unit_size = 3000;
    SCOPED_TRACE(sharding_strategy_name(s));
    const MemoryPlan plan = plan_train_memory(c, {.dp = 2});
    const TrainResult r = train_local(2, c);
    for (const RankMemory& m : r.memory_by_rank) {
      expect_same_usage(plan.steady, m.steady, "steady state");
      expect_same_usage(plan.overall, m.overall, "overall");
    }
  }
}

TEST(MemoryPlan, RefusesWhatTheTrainerRefuses) {
  TrainConfig c = small_train_config();
  c.ddp.reuse_grad_buf_for_mxfp8_param_ag = true;  // without fp8_param_gather
  EXPECT_THROW(plan_train_memory(c, {.dp = 2}), Error);
  c = small_train_config();
  c.global_batch_size = 6;  // not a multiple of micro 2 x dp 2
  EXPECT_THROW(plan_train_memory(c, {.dp = 2}), Error);
  c = small_train_config();
  c.use_megatron_fsdp = true;
  c.ddp.fp8_param_gather = true;
  c.fsdp.data_parallel_sharding_strategy = ShardingStrategy::kOptim;  // MXFP8 needs optim_grads_params
  EXPECT_THROW(plan_train_memory(c, {.dp = 2}), Error);
}

// A 1T-parameter decoder (128 layers x 25600 hidden; the vocabulary is bytes) at dp 4096 plans in well
// under a second: the layout is computed, not materialized, and the model is traced, not run.
// plan_ddp_memory (the Python package's plan) equals what a DistributedDataParallel, with and
// without a DistributedOptimizer on it, allocates on every rank after a gradient sync and a step:
// the distributed optimizer on and off (off: a replicated optimizer, or none; the trainer's plan
// always has it on), F32 and BF16 params,
// F32 and BF16 grads, buckets, the bus-bandwidth padding. The local backend stages nothing; the
// mpi backend's staging is the Python tests' (tests/python/test_plan.py).
TEST(MemoryPlan, DdpPlanEqualsTheDdpAndOptimizerOnEveryRank) {
  const std::vector<ParamSpec> params = {{.name = "embed", .shape = Shape{300, 16}, .shared_embedding = true},
                                         {.name = "w1", .shape = Shape{16, 48}}, {.name = "b1", .shape = Shape{48}},
                                         {.name = "w2", .shape = Shape{48, 16}}, {.name = "b2", .shape = Shape{5}}};
  int cases = 0;
  for (int dp : {1, 3, 4})
    for (bool dist_opt : {false, true})
      for (DType dtype : {DType::kF32, DType::kBF16})
        for (bool f32_grads : {false, true})
          for (std::optional<int64_t> bucket : {std::optional<int64_t>{}, std::optional<int64_t>{900}}) {
            DdpConfig c{.grad_reduce_in_fp32 = f32_grads, .overlap_grad_reduce = bucket.has_value(),
                        .use_distributed_optimizer = dist_opt, .bucket_size = bucket,
                        .pad_buckets_for_high_nccl_busbw = dp == 3 && bucket.has_value(), .param_dtype = dtype};
            // Without the distributed optimizer, half the cases step a replicated optimizer (whole
            // buckets of state on every rank) and half plan the DDP alone.
            const bool with_opt = dist_opt || bucket.has_value();
            const std::optional<OptimizerType> opt =
                with_opt ? std::optional{dtype == DType::kF32 ? OptimizerType::kAdam : OptimizerType::kSgd} : std::nullopt;
            const MemoryPlan plan = plan_ddp_memory(params, c, opt, {.dp = dp});
            run_local(dp, [&](Communicator& comm) {
              MemoryTracker tracker;
              DistributedDataParallel ddp(comm, params, c, tracker);
              std::unique_ptr<DistributedOptimizer> optimizer;
              if (opt) optimizer = std::make_unique<DistributedOptimizer>(ddp, OptimizerConfig{.optimizer = *opt}, tracker);
              ddp.zero_grad_buffer();
              for (int p = 0; p < static_cast<int>(params.size()); ++p) ddp.grad_ready(p);
              ddp.finish_grad_sync();
              if (optimizer) optimizer->step();
              const MemoryUsage u = tracker.usage();
              EXPECT_EQ(u.live_bytes, plan.overall.live_bytes) << "dp " << dp << " dist_opt " << dist_opt;
              EXPECT_EQ(u.peak_bytes, plan.overall.peak_bytes) << "dp " << dp << " dist_opt " << dist_opt;
              EXPECT_EQ(u.total_peak_bytes, plan.overall.total_peak_bytes);
              EXPECT_EQ(ddp.buffer().layout().numel, plan.layout.buffer_numel);
            });
            ++cases;
          }
  EXPECT_EQ(cases, 48);
  EXPECT_THROW(plan_ddp_memory(params, DdpConfig{}, std::nullopt, {.dp = 0}), Error);
}

// On a device: a DDP and its optimizer whose ranks' computes claim cuda:5 (tests/comm/
// recording_compute.h) hold every byte on the device, bf16 params, MXFP8 params and MXFP8 params
// gathered through the grad buffer alike; plan_ddp_memory with data_parallel_place device plans
// them there, to the byte per place. train()'s plan refuses the device: its buffers are the host's.
TEST(MemoryPlan, DdpPlanOnADeviceEqualsTheRunsDeviceBytes) {
  const std::vector<ParamSpec> params = {{.name = "embed", .shape = Shape{300, 16}, .mxfp8 = true},
                                         {.name = "w1", .shape = Shape{16, 48}, .mxfp8 = true},
                                         {.name = "b1", .shape = Shape{48}}};
  for (int dp : {2, 4})
    for (int mxfp8 : {0, 1, 2}) {  // none, fp8_param_gather, and with reuse
      DdpConfig c{.overlap_grad_reduce = true, .use_distributed_optimizer = true, .bucket_size = 2000,
                  .param_dtype = DType::kBF16};
      c.fp8_param_gather = mxfp8 > 0;
      c.reuse_grad_buf_for_mxfp8_param_ag = mxfp8 == 2;
      std::vector<ParamSpec> specs = params;
      for (ParamSpec& p : specs) p.mxfp8 = p.mxfp8 && mxfp8 > 0;
      const std::string what = fmt::format("dp {} mxfp8 {}", dp, mxfp8);
      const MemoryPlan plan =
          plan_ddp_memory(specs, c, OptimizerType::kAdam, {.dp = dp, .data_parallel_place = MemoryPlace::kDevice});
      EXPECT_GT(plan.overall.at(MemoryPlace::kDevice).total_peak_bytes, 0) << what;
      EXPECT_EQ(plan.overall.at(MemoryPlace::kHost).total_peak_bytes, 0) << what;
      const ClaimedDevice claimed(dp);
      run_local(
          dp,
          [&](Communicator& comm) {
            MemoryTracker tracker;
            DistributedDataParallel ddp(comm, specs, c, tracker);
            DistributedOptimizer optimizer(ddp, OptimizerConfig{.optimizer = OptimizerType::kAdam}, tracker);
            optimizer.zero_grad();
            for (int p = static_cast<int>(specs.size()) - 1; p >= 0; --p) ddp.grad_ready(p);
            ddp.finish_grad_sync();
            optimizer.step();
            expect_same_usage(plan.overall, tracker.usage(), what + fmt::format(" rank {}", comm.rank()));
          },
          claimed.options);
    }
  TrainConfig t;
  t.model = GptConfig{.num_layers = 1, .hidden_size = 64, .num_attention_heads = 2, .seq_length = 16};
  EXPECT_THROW(
      {
        try {
          plan_train_memory(t, {.dp = 1, .data_parallel_place = MemoryPlace::kDevice});
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("data_parallel_place device is not valid for mxddp train's plan"),
                    std::string::npos)
              << e.what();
          throw;
        }
      },
      Error);
}

TEST(MemoryPlan, PlansOneTrillionParamsAtDp4096Quickly) {
  TrainConfig c;
  c.model = GptConfig{.num_layers = 128, .hidden_size = 25600, .num_attention_heads = 200,
                      .seq_length = 2048};
  c.micro_batch_size = 1;
  c.global_batch_size = 4096;
  c.compute_threads = 8;
  for (bool fsdp : {false, true}) {
    c.use_megatron_fsdp = fsdp;
    const auto t0 = std::chrono::steady_clock::now();
    const MemoryPlan plan = plan_train_memory(c, {.dp = 4096});
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_GT(plan.layout.params_numel, 1'000'000'000'000) << "a 1T-parameter model";
    EXPECT_GT(plan.steady.total_peak_bytes, 0);
    // Not a timed assertion of speed but of complexity: a layout materialized per rank, or a run
    // of the model, takes minutes here, not seconds.
    EXPECT_LT(s, 5.0) << (fsdp ? "fsdp" : "ddp") << " plan took " << s << " s";
  }
}

// Issue 30 point 2: docs/plan.md's 70B decoder at dp 64 under FSDP optim_grads_params with MXFP8
// weights (fine-grained, as a full recompute requires). Each rank keeps 1/dp of both orientations'
// payloads and scales: the MXFP8 bytes at rest are at most the whole tensors' / dp plus the padding
// (the layout's, at 2 bytes per element over dp, and under one byte per bucket and orientation for
// the scale arrays'). With the scales replicated they were 6.12 GiB, 4.1 GiB of it scales.
TEST(MemoryPlan, SeventyBAtDp64KeepsMxfp8PayloadsAndScalesSharded) {
  TrainConfig c;
  c.model = GptConfig{.num_layers = 87, .hidden_size = 8192, .num_attention_heads = 64, .seq_length = 4096};
  c.micro_batch_size = 1;
  c.global_batch_size = 1024;
  c.recompute_granularity = RecomputeGranularity::kFull;
  c.compute_threads = 8;
  c.use_megatron_fsdp = true;
  c.ddp.fp8_param_gather = true;
  c.ddp.overlap_grad_reduce = c.ddp.overlap_param_gather = true;
  c.fsdp.overlap_grad_reduce = c.fsdp.overlap_param_gather = true;
  const int dp = 64;
  const MemoryPlan plan = plan_train_memory(c, {.dp = dp});
  double payload = 0, scales = 0;
  for (const ParamSpec& s : gpt_param_specs(c.model, true)) {
    if (!s.mxfp8) continue;
    payload += 2.0 * static_cast<double>(s.shape.numel());
    for (QuantAxis axis : {QuantAxis::kRow, QuantAxis::kCol})
      scales += static_cast<double>(mx_scale_shape(s.shape[0], s.shape[1], axis).numel());
  }
  const double padding = 2.0 * static_cast<double>(plan.layout.buffer_numel - plan.layout.params_numel) / dp +
                         2.0 * static_cast<double>(plan.layout.num_buckets);
  const auto mxfp8 = static_cast<double>(plan.steady.live(MemoryCategory::kMxfp8));
  std::printf("70B at dp 64, MXFP8 bytes per rank at rest: %.0f (%s); (payload + scales) / dp = %.0f\n", mxfp8,
              format_bytes(mxfp8).c_str(), (payload + scales) / dp);
  EXPECT_GT(mxfp8, (payload + scales) / dp * 0.99);
  EXPECT_LE(mxfp8, (payload + scales) / dp + padding);
  EXPECT_LT(mxfp8, scales) << "the scales would be replicated";
  // The step's whole scales (two buckets at a time) are transient: the peak stays near the rest.
  EXPECT_LT(static_cast<double>(plan.overall.peak(MemoryCategory::kMxfp8)), 1.25 * mxfp8);
}

TEST(MemoryPlan, ClosedFormsAreMegatronsAndDeepSpeeds) {
  const ClosedFormMemory f = closed_form_memory(1'000'000, 10'000, 4);
  EXPECT_DOUBLE_EQ(f.megatron_bytes, 1e6 * (6 + 12.0 / 4));
  EXPECT_DOUBLE_EQ(f.deepspeed_zero2_bytes, 4e6 + 16e6 / 4);
  EXPECT_DOUBLE_EQ(f.deepspeed_zero3_bytes, 4e4 + 18e6 / 4);
}

// The padding the plan itemizes is the layout's: per bucket, its end rounded to lcm(dp, 128), and
// in all, the params' starts rounded to 64 elements besides.
TEST(MemoryPlan, PaddingIsTheLayoutsPerBucket) {
  const std::vector<ParamSpec> params = {{"a", Shape{95, 95}}, {"b", Shape{95}}, {"c", Shape{1}}};
  TrainConfig c;
  c.ddp.overlap_grad_reduce = true;
  c.ddp.bucket_size = 100;
  const MemoryPlan plan = plan_param_memory(params, c, {.dp = 3});
  LayoutOptions lo = c.ddp.layout_options(3);
  lo.use_distributed_optimizer = true;
  const ParamLayout layout = compute_param_layout(params, lo);
  ASSERT_EQ(plan.layout.bucket_numel_and_end_padding.size(), layout.buckets.size());
  int64_t end_padding = 0;
  for (size_t b = 0; b < layout.buckets.size(); ++b) {
    const BucketPlacement& bucket = layout.buckets[b];
    const int64_t last_end = layout.params[static_cast<size_t>(bucket.params.back())].range.end;
    EXPECT_EQ(plan.layout.bucket_numel_and_end_padding[b], std::make_pair(bucket.range.size(), bucket.range.end - last_end));
    EXPECT_EQ(bucket.range.end % 384, 0) << "lcm(3, 128)";
    end_padding += bucket.range.end - last_end;
  }
  EXPECT_EQ(plan.layout.bucket_end_padding_numel, end_padding);
  EXPECT_EQ(plan.layout.params_numel, 95 * 95 + 95 + 1);
  EXPECT_EQ(plan.layout.buffer_numel, layout.numel);
  EXPECT_EQ(plan.layout.param_start_padding_numel, layout.numel - plan.layout.params_numel - end_padding);
  EXPECT_GT(plan.layout.param_start_padding_numel, 0) << "b and c start on multiples of 64";
  // Every category holding the buffer pays for the padding: grads (f32) hold all of it.
  EXPECT_EQ(plan.steady.live(MemoryCategory::kGrads), 4 * layout.numel);
}

TEST(MemoryPlan, ParamListPlanMatchesTheGptPlanOnItsBuffers) {
  // The same params given as a list plan to the same buffer and optimizer bytes as the GPT's.
  TrainConfig c = small_train_config();
  c.eval_iters = 0;
  const MemoryPlan gpt = plan_train_memory(c, {.dp = 2});
  const MemoryPlan list = plan_param_memory(gpt_param_specs(c.model), c, {.dp = 2});
  for (MemoryCategory k : {MemoryCategory::kParams, MemoryCategory::kGrads, MemoryCategory::kMainParams,
                           MemoryCategory::kOptimizerState})
    EXPECT_EQ(list.steady.live(k), gpt.steady.live(k)) << memory_category_name(k);
  EXPECT_EQ(list.steady.live(MemoryCategory::kScratch), 0);
  EXPECT_EQ(list.layout.buffer_numel, gpt.layout.buffer_numel);
}

}  // namespace
}  // namespace mxddp::testing
