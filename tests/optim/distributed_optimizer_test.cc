// The distributed optimizer on the local backend: equivalence with plain AdamW/SGD at several dp,
// overlapped param gather, force_param_sync, clipping, skipped steps, memory, config errors.
#include <mxddp/model.h>

#include "optim/optim_checks.h"

namespace mxddp::testing {
namespace {

class OptimDp : public ::testing::TestWithParam<int> {};

TEST_P(OptimDp, AdamWMatchesPlainAdamWOverTheGlobalBatch) {
  run_local(GetParam(), [](Communicator& comm) {
    check_matches_plain_optimizer(comm, {.lr = 1e-2f, .weight_decay = 0.1f, .clip_grad = 0}, 6);
  });
}

TEST_P(OptimDp, SgdMatchesPlainSgd) {
  run_local(GetParam(), [](Communicator& comm) {
    check_matches_plain_optimizer(comm, {.optimizer = OptimizerType::kSgd, .lr = 5e-2f, .weight_decay = 0.1f, .clip_grad = 0}, 6);
  });
}

TEST_P(OptimDp, ClippingMatchesSerialReference) {
  run_local(GetParam(), [](Communicator& comm) {
    MemoryTracker tracker;
    auto init = mlp_init();
    const OptimizerConfig cfg{.lr = 1e-2f, .clip_grad = 0.05f};
    DistributedDataParallel ddp(comm, mlp_params(), optim_ddp_config(), tracker, views_of(init));
    DistributedOptimizer opt(ddp, cfg, tracker);
    PlainTrainer ref(cfg);
    for (int s = 0; s < 4; ++s) {
      ddp.zero_grad_buffer();
      const int local = kGlobalBatch / comm.size();
      forward_backward(ddp_hooks(ddp), s, comm.rank() * local, local);
      ddp.finish_grad_sync();
      const StepResult r = opt.step();
      ref.train_step(s, kGlobalBatch, comm.size());
      EXPECT_NEAR(r.grad_norm, ref.last_norm, 1e-6 * ref.last_norm);
      EXPECT_LT(r.clip_coeff, 1.0) << "the test must exercise clipping";
      EXPECT_NEAR(r.clip_coeff, ref.last_coeff, 1e-6 * ref.last_coeff);
    }
    EXPECT_LE(max_rel_diff_to_reference(opt, ref), 1e-6);
  });
}

// Megatron's rule for f32 params: the param buffer's shard is the main param. Nothing is charged
// as main params, the view is the shard itself, and the update written in place (no staging
// pass) still matches plain AdamW and SGD.
TEST_P(OptimDp, F32ParamShardIsItsOwnMainParam) {
  run_local(GetParam(), [](Communicator& comm) {
    MemoryTracker tracker;
    DdpConfig cfg = optim_ddp_config();
    cfg.param_dtype = DType::kF32;
    DistributedDataParallel ddp(comm, mlp_params(), cfg, tracker);
    DistributedOptimizer opt(ddp, {}, tracker);
    EXPECT_EQ(tracker.usage().live(MemoryCategory::kMainParams), 0);
    EXPECT_GT(tracker.usage().live(MemoryCategory::kOptimizerState), 0);
    for (int b = 0; b < opt.num_buckets(); ++b) EXPECT_EQ(opt.main_params(b).data, ddp.optimizer_io(b).params.data);
  });
  run_local(GetParam(), [](Communicator& comm) {
    check_matches_plain_optimizer(comm, {.lr = 1e-2f, .weight_decay = 0.1f, .clip_grad = 0}, 6, 1e-6, DType::kF32);
    check_matches_plain_optimizer(comm, {.optimizer = OptimizerType::kSgd, .lr = 5e-2f, .weight_decay = 0.1f}, 6,
                                  1e-6, DType::kF32);
  });
}

// After a step's sync every rank writes the same values into each param's whole grad: +0 or -0 at
// a fixed pattern, 1 elsewhere. The count is the pattern's: each element once (not once per rank),
// and not the buckets' padding, which is zero too.
TEST_P(OptimDp, CountZeroGradsCountsEachElementOnceWithoutPadding) {
  for (const bool fp32_grads : {false, true})
    run_local(GetParam(), [fp32_grads](Communicator& comm) {
      MemoryTracker tracker;
      auto init = mlp_init();
      DdpConfig config = optim_ddp_config();
      config.grad_reduce_in_fp32 = fp32_grads;
      DistributedDataParallel ddp(comm, mlp_params(), config, tracker, views_of(init));
      DistributedOptimizer opt(ddp, {.lr = 1e-2f}, tracker);
      ddp_train_step(opt, 0, kGlobalBatch);
      const ParamLayout& layout = ddp.buffer().layout();
      if (comm.size() > 1) {
        ASSERT_GT(layout.numel, layout.params_numel()) << "no padding to leave out";
      }
      int64_t zeros = 0;
      for (int p = 0; p < ddp.num_params(); ++p) {
        const TensorView g = ddp.main_grad(p).flat();
        ASSERT_EQ(g.dtype, fp32_grads ? DType::kF32 : DType::kBF16);
        for (int64_t i = 0; i < g.numel(); ++i) {
          const bool zero = (i + p) % 5 == 0;
          const float v = !zero ? 1.0f : (i % 2 == 0 ? 0.0f : -0.0f);
          zeros += zero;
          if (fp32_grads) g.data_as<float>()[i] = v;
          else g.data_as<bf16_bits>()[i] = f32_to_bf16(v);
        }
      }
      ASSERT_GT(zeros, 0);
      EXPECT_EQ(opt.count_zero_grads(), zeros) << "rank " << comm.rank();
    });
}

INSTANTIATE_TEST_SUITE_P(Dp, OptimDp, ::testing::Values(1, 2, 4));

// Runs `steps` steps and returns this rank's full param buffer bytes and the losses.
std::pair<std::vector<char>, std::vector<double>> train_bytes(Communicator& comm, bool overlap, int steps,
                                                              bool overlap_with_step = false) {
  MemoryTracker tracker;
  auto init = mlp_init();
  DdpConfig cfg = optim_ddp_config(overlap);
  cfg.overlap_param_gather_with_optimizer_step = overlap_with_step;
  DistributedDataParallel ddp(comm, mlp_params(), cfg, tracker, views_of(init));
  DistributedOptimizer opt(ddp, {.lr = 1e-2f}, tracker);
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) losses.push_back(ddp_train_step(opt, s, kGlobalBatch));
  opt.force_param_sync();
  const TensorView all = ddp.buffer().param_buffer();
  return {std::vector<char>(static_cast<char*>(all.data), static_cast<char*>(all.data) + all.nbytes()), losses};
}

TEST(DistributedOptimizer, OverlapParamGatherIsBitwiseIdentical) {
  for (int dp : {2, 4}) {
    std::vector<std::pair<std::vector<char>, std::vector<double>>> on(static_cast<size_t>(dp)), off(static_cast<size_t>(dp));
    run_local(dp, [&](Communicator& comm) { on[static_cast<size_t>(comm.rank())] = train_bytes(comm, true, 5); });
    run_local(dp, [&](Communicator& comm) { off[static_cast<size_t>(comm.rank())] = train_bytes(comm, false, 5); });
    for (int r = 0; r < dp; ++r) {
      EXPECT_EQ(on[static_cast<size_t>(r)].first, off[static_cast<size_t>(r)].first) << "dp " << dp << " rank " << r;
      EXPECT_EQ(on[static_cast<size_t>(r)].second, off[static_cast<size_t>(r)].second);
    }
  }
}

// A group's gather must be dispatched only after its update: dispatched before, it reads the
// shards while the update writes them. That misordering rarely changes the bytes (the local
// gather usually runs after the update anyway), but the tsan preset reports it as a data race
// on every run, so that build is what guards the order.
TEST(DistributedOptimizer, GatherOverlappedWithTheStepIsBitwiseIdentical) {
  for (int dp : {2, 4}) {
    std::vector<std::pair<std::vector<char>, std::vector<double>>> with(static_cast<size_t>(dp)), off(static_cast<size_t>(dp));
    run_local(dp, [&](Communicator& comm) { with[static_cast<size_t>(comm.rank())] = train_bytes(comm, true, 5, true); });
    run_local(dp, [&](Communicator& comm) { off[static_cast<size_t>(comm.rank())] = train_bytes(comm, false, 5); });
    for (int r = 0; r < dp; ++r) {
      EXPECT_EQ(with[static_cast<size_t>(r)].first, off[static_cast<size_t>(r)].first) << "dp " << dp << " rank " << r;
      EXPECT_EQ(with[static_cast<size_t>(r)].second, off[static_cast<size_t>(r)].second);
    }
  }
}

TEST(DistributedOptimizer, StepDispatchesEveryGroupsGatherAsItsUpdateFinishes) {
  run_local(2, [](Communicator& comm) {
    MemoryTracker tracker;
    auto init = mlp_init();
    DdpConfig cfg = optim_ddp_config(true);
    cfg.overlap_param_gather_with_optimizer_step = true;
    DistributedDataParallel ddp(comm, mlp_params(), cfg, tracker, views_of(init));
    DistributedOptimizer opt(ddp, {.lr = 1e-2f}, tracker);
    ASSERT_GE(ddp.num_bucket_groups(), 3);
    ddp_train_step(opt, 0, kGlobalBatch);
    EXPECT_TRUE(ddp.param_sync_pending()) << "the forward hooks still wait for the gathers";
    EXPECT_EQ(ddp.next_param_gather_group(), -1) << "every group's gather was dispatched during the step";
    ddp.before_forward({4, 5});
    EXPECT_FALSE(ddp.param_sync_pending());
  });
}

TEST(DistributedOptimizer, OverlapWithStepNeedsOverlapParamGather) {
  run_local(1, [](Communicator& comm) {
    MemoryTracker tracker;
    DdpConfig cfg = optim_ddp_config(false);
    cfg.overlap_param_gather_with_optimizer_step = true;
    EXPECT_THROW(DistributedDataParallel(comm, mlp_params(), cfg, tracker), Error);
  });
}

TEST(DistributedOptimizer, OverlappedGatherIsDispatchedGroupByGroupInForward) {
  run_local(2, [](Communicator& comm) {
    MemoryTracker tracker;
    auto init = mlp_init();
    DistributedDataParallel ddp(comm, mlp_params(), optim_ddp_config(true), tracker, views_of(init));
    DistributedOptimizer opt(ddp, {.lr = 1e-2f}, tracker);
    ASSERT_GE(ddp.num_bucket_groups(), 3);
    ddp_train_step(opt, 0, kGlobalBatch);  // its forward consumed no pending gather (none yet)
    EXPECT_TRUE(ddp.param_sync_pending()) << "with overlap the step leaves the gathers to the forward hooks";
    // The first layer's params live in the last group: it is the one dispatched first.
    const int first_layer_group = ddp.group_of_param(0);
    EXPECT_EQ(first_layer_group, ddp.num_bucket_groups() - 1);
    ddp.before_forward({0, 1});
    EXPECT_TRUE(ddp.param_sync_pending()) << "later groups are still to come";
    ddp.before_forward({4, 5});  // the last layer: it and every group before it are gathered
    EXPECT_FALSE(ddp.param_sync_pending());
  });
}

// A forward that skips a module leaves its group's gather pending after the step; the next step
// must finish it before the update writes the shards it reads (else a data race, and the gather
// may send half-updated values).
TEST(DistributedOptimizer, StepFinishesAGatherTheForwardLeftPending) {
  run_local(2, [](Communicator& comm) {
    MemoryTracker tracker;
    auto init = mlp_init();
    DistributedDataParallel ddp(comm, mlp_params(), optim_ddp_config(true), tracker, views_of(init));
    DistributedOptimizer opt(ddp, {.lr = 1e-2f}, tracker);
    ddp_train_step(opt, 0, kGlobalBatch);
    ASSERT_TRUE(ddp.param_sync_pending());
    ddp.before_forward({0, 1});  // only the first layer ran: later groups stay pending
    ASSERT_TRUE(ddp.param_sync_pending());
    std::vector<bool> pending_during_update;
    ddp.step_and_sync_params([&](int) { pending_during_update.push_back(ddp.param_sync_pending()); });
    EXPECT_EQ(pending_during_update, std::vector<bool>(ddp.buffer().layout().buckets.size(), false))
        << "a bucket was updated while a gather of the last step was still pending";
    EXPECT_TRUE(ddp.param_sync_pending()) << "the step then starts its own gather";
    ddp.before_forward({4, 5});
    EXPECT_FALSE(ddp.param_sync_pending());
  });
}

// After force_param_sync, every rank's whole param buffer equals BF16(main params) of the ranks
// that own each shard: own shard checked against own main params, and all ranks' buffers equal.
void expect_params_equal_staged_main(Communicator& comm, DistributedOptimizer& opt) {
  const ParamAndGradBuffer& buf = ddp_of(opt).buffer();
  for (size_t b = 0; b < buf.layout().buckets.size(); ++b) {
    const TensorView shard = buf.param_shard(static_cast<int>(b), comm.rank());
    const float* main = opt.main_params(static_cast<int>(b)).data_as<const float>();
    for (int64_t i = 0; i < shard.numel(); ++i) ASSERT_EQ(shard.data_as<bf16_bits>()[i], f32_to_bf16(main[i]));
  }
  const TensorView all = buf.param_buffer();
  std::vector<bf16_bits> mine(all.data_as<bf16_bits>(), all.data_as<bf16_bits>() + all.numel());
  std::vector<bf16_bits> root = mine;
  comm.broadcast(TensorView{root.data(), DType::kBF16, Shape{all.numel()}, Device::cpu()}, {.root = 0});
  EXPECT_EQ(mine, root) << "rank " << comm.rank() << " holds params that differ from rank 0's";
}

class ForceParamSync : public ::testing::TestWithParam<bool> {};

TEST_P(ForceParamSync, BringsParamsToStagedMainWithOrWithoutAGatherInFlight) {
  const bool overlap = GetParam();
  run_local(3, [overlap](Communicator& comm) {
    MemoryTracker tracker;
    auto init = mlp_init();
    DistributedDataParallel ddp(comm, mlp_params(), optim_ddp_config(overlap), tracker, views_of(init));
    DistributedOptimizer opt(ddp, {.lr = 1e-2f}, tracker);
    ddp_train_step(opt, 0, kGlobalBatch);
    ddp_train_step(opt, 1, kGlobalBatch);
    EXPECT_EQ(ddp.param_sync_pending(), overlap) << (overlap ? "a gather should be in flight" : "nothing in flight");
    // Scribble over the whole param buffer: force_param_sync must restage and regather, never
    // trust what happens to be in the buffer.
    const TensorView all = ddp.buffer().param_buffer();
    if (!overlap) std::fill_n(all.data_as<bf16_bits>(), all.numel(), f32_to_bf16(123.0f));
    opt.force_param_sync();
    EXPECT_FALSE(ddp.param_sync_pending());
    expect_params_equal_staged_main(comm, opt);
  });
}

INSTANTIATE_TEST_SUITE_P(OverlapParamGather, ForceParamSync, ::testing::Bool());

// Clipping on, the norm below the limit: nothing is clipped, so the run is bitwise the unclipped
// one; a clip applied when it should not be (coefficient clip / norm > 1) would scale every update.
TEST(DistributedOptimizer, ClipAboveTheNormChangesNothing) {
  auto run = [](float clip_grad) {
    std::vector<double> losses;
    std::vector<float> main;
    run_local(2, [&](Communicator& comm) {
      MemoryTracker tracker;
      auto init = mlp_init();
      DistributedDataParallel ddp(comm, mlp_params(), optim_ddp_config(), tracker, views_of(init));
      DistributedOptimizer opt(ddp, {.lr = 1e-2f, .clip_grad = clip_grad}, tracker);
      std::vector<double> mine;
      double norm_max = 0;
      const int local = kGlobalBatch / comm.size();
      for (int s = 0; s < 4; ++s) {
        opt.zero_grad();
        mine.push_back(forward_backward(ddp_hooks(ddp), s, comm.rank() * local, local));
        ddp.finish_grad_sync();
        const StepResult r = opt.step();
        EXPECT_EQ(r.clip_coeff, 1.0) << "nothing to clip below the limit";
        norm_max = std::max(norm_max, r.grad_norm);
      }
      if (clip_grad > 0) {
        EXPECT_LT(norm_max, clip_grad) << "the limit must sit above every norm";
      }
      if (comm.rank() == 0) {
        losses = mine;
        main.assign(opt.main_params(0).data_as<float>(), opt.main_params(0).data_as<float>() + opt.main_params(0).numel());
      }
    });
    return std::make_pair(losses, main);
  };
  const auto unclipped = run(0.0f);
  const auto clipped = run(100.0f);
  EXPECT_EQ(clipped.first, unclipped.first);
  EXPECT_EQ(clipped.second, unclipped.second);
}

TEST(DistributedOptimizer, NonFiniteGradNormSkipsTheStepAndChangesNothing) {
  run_local(2, [](Communicator& comm) {
    MemoryTracker tracker;
    auto init = mlp_init();
    DistributedDataParallel ddp(comm, mlp_params(), optim_ddp_config(), tracker, views_of(init));
    DistributedOptimizer opt(ddp, {.lr = 1e-2f}, tracker);
    ddp_train_step(opt, 0, kGlobalBatch);
    auto snapshot = [&] {
      std::vector<float> s;
      for (size_t b = 0; b < ddp.buffer().layout().buckets.size(); ++b)
        for (const TensorView& v : {opt.main_params(static_cast<int>(b)), opt.state(0, static_cast<int>(b)), opt.state(1, static_cast<int>(b))})
          s.insert(s.end(), v.data_as<float>(), v.data_as<float>() + v.numel());
      return s;
    };
    const auto before = snapshot();
    ddp.zero_grad_buffer();
    // One rank, one element, before backward reports the gradient final (with overlap its bucket's
    // reduce-scatter may start at once): backward accumulates onto it, inf + g = inf.
    if (comm.rank() == 1) ddp.main_grad(2).data_as<float>()[5] = INFINITY;
    forward_backward(ddp_hooks(ddp), 1, comm.rank() * 6, 6);
    ddp.finish_grad_sync();
    const StepResult r = opt.step();
    EXPECT_TRUE(r.skipped) << "rank " << comm.rank();
    EXPECT_EQ(r.grad_norm, INFINITY) << "an Inf gradient's norm is Inf (torch's, Megatron's), not NaN";
    EXPECT_EQ(opt.step_count(), 1);
    EXPECT_EQ(snapshot(), before);
    // Every rank names the one param whose gradient holds the Inf, not its whole bucket.
    EXPECT_EQ(opt.nonfinite_grad_params(), std::vector<int>{2}) << "rank " << comm.rank();
  });
}

TEST(DistributedOptimizer, MainParamsAndStateAreShardSizedAndTracked) {
  run_local(4, [](Communicator& comm) {
    MemoryTracker tracker;
    DistributedDataParallel ddp(comm, mlp_params(), optim_ddp_config(), tracker);
    const int64_t numel = ddp.buffer().layout().numel;
    DistributedOptimizer opt(ddp, {}, tracker);
    EXPECT_EQ(tracker.usage().live(MemoryCategory::kMainParams), numel / 4 * 4);
    EXPECT_EQ(tracker.usage().live(MemoryCategory::kOptimizerState), numel / 4 * 8);
    EXPECT_EQ(opt.state_name(1), "exp_avg_sq");
  });
}

TEST(DistributedOptimizer, RejectsBadConfig) {
  run_local(1, [](Communicator& comm) {
    MemoryTracker tracker;
    DistributedDataParallel ddp(comm, mlp_params(), optim_ddp_config(), tracker);
    try {
      parse_optimizer("adamw");
      ADD_FAILURE() << "optimizer 'adamw' accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("'adamw' is not supported; valid: adam, sgd"), std::string::npos);
    }
    EXPECT_THROW(DistributedOptimizer(ddp, {.optimizer = static_cast<OptimizerType>(7)}, tracker), Error);
    EXPECT_EQ(parse_optimizer("sgd"), OptimizerType::kSgd);
    EXPECT_EQ(optimizer_name(OptimizerType::kAdam), "adam");
    EXPECT_THROW(DistributedOptimizer(ddp, {.adam_beta2 = 1.0f}, tracker), Error);
    EXPECT_THROW(DistributedOptimizer(ddp, {.clip_grad = -1.0f}, tracker), Error);
  });
}


// The update, the grad norm and the zeroing run on the rank's threads; each element is computed on
// its own and the norm is summed in fixed chunks, so one and two threads give the same bits. A
// param of 3 x 2^20 + 5 elements makes the norm cut its run into chunks and both threads take a
// share of every pass; clipping is active, so the norm's bits reach the update.
TEST(OptimThreads, StepsGiveTheSameBitsAtOneAndTwoThreads) {
  struct Result {
    std::vector<double> norms;
    std::vector<float> main, exp_avg, exp_avg_sq;
    std::vector<uint16_t> params;
  };
  auto run = [](int threads) {
    Result out;
    run_local(1, [&](Communicator& comm) {
      set_compute_threads(threads);
      MemoryTracker tracker;
      const int64_t big = 3 * (int64_t{1} << 20) + 5;
      DistributedDataParallel ddp(comm, {{"w", Shape{big / 5, 5}}, {"b", Shape{5}}},
                                  {.use_distributed_optimizer = true}, tracker);
      DistributedOptimizer opt(ddp, {.lr = 1e-3f, .weight_decay = 0.1f, .clip_grad = 1.0f}, tracker);
      for (int step = 0; step < 3; ++step) {
        ddp.zero_grad_buffer();
        for (int p = 0; p < 2; ++p) {
          const TensorView g = ddp.main_grad(p);
          float* data = g.data_as<float>();
          for (int64_t i = 0; i < g.numel(); ++i) data[i] = 1e-3f * static_cast<float>((i * 7919 + step * 31 + p) % 2001 - 1000);
        }
        ddp.finish_grad_sync();
        const StepResult r = opt.step();
        EXPECT_LT(r.clip_coeff, 1.0) << "the test must exercise clipping";
        out.norms.push_back(r.grad_norm);
      }
      for (int b = 0; b < opt.num_buckets(); ++b) {
        auto append = [](std::vector<float>& to, const TensorView& v) {
          to.insert(to.end(), v.data_as<const float>(), v.data_as<const float>() + v.numel());
        };
        append(out.main, opt.main_params(b));
        append(out.exp_avg, opt.state(0, b));
        append(out.exp_avg_sq, opt.state(1, b));
        const TensorView staged = ddp.optimizer_io(b).params;
        out.params.insert(out.params.end(), staged.data_as<const uint16_t>(), staged.data_as<const uint16_t>() + staged.numel());
      }
    });
    return out;
  };
  const Result one = run(1), two = run(2);
  EXPECT_EQ(one.norms, two.norms);
  EXPECT_TRUE(one.main == two.main) << "main params";
  EXPECT_TRUE(one.exp_avg == two.exp_avg && one.exp_avg_sq == two.exp_avg_sq) << "Adam moments";
  EXPECT_TRUE(one.params == two.params) << "the staged BF16 params";
  EXPECT_GT(one.main.size(), size_t{3} << 20);
}

}  // namespace
}  // namespace mxddp::testing
