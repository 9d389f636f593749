// MXFP8 params with the distributed optimizer (fp8_param_gather), with and without staging the
// param all-gather in the grad buffer (reuse_grad_buf_for_mxfp8_param_ag): construction errors,
// reuse changing nothing but where bytes live, the forced param sync with and without a gather in
// flight, the naive path it guards against, and the memory it saves.
#include <unistd.h>

#include <algorithm>
#include <filesystem>

#include <mxddp/checkpoint.h>

#include "optim/optim_checks.h"

namespace mxddp::testing {
namespace {

DdpConfig mxfp8_config(bool reuse, bool overlap_param_gather = false) {
  DdpConfig c = optim_ddp_config(overlap_param_gather);
  c.fp8_param_gather = true;
  c.reuse_grad_buf_for_mxfp8_param_ag = reuse;
  return c;
}

// Every rank's full main params (f32, layout order), all-gathered bucket by bucket.
std::vector<float> full_main_params(const DistributedOptimizer& opt) {
  const ParamAndGradBuffer& buf = ddp_of(opt).buffer();
  std::vector<float> full(static_cast<size_t>(buf.layout().numel));
  for (size_t b = 0; b < buf.layout().buckets.size(); ++b) {
    const Range r = buf.layout().buckets[b].range;
    ddp_of(opt).communicator().all_gather(opt.main_params(static_cast<int>(b)),
                                        TensorView{full.data() + r.start, DType::kF32, Shape{r.size()}});
  }
  return full;
}

// True if every MXFP8 param equals quantize(bf16(main)) in both orientations and every other
// param equals bf16(main).
bool model_params_match_main(const DistributedOptimizer& opt, std::string* why) {
  const DistributedDataParallel& ddp = ddp_of(opt);
  const std::vector<float> main = full_main_params(opt);
  MemoryTracker scratch;
  for (int p = 0; p < ddp.num_params(); ++p) {
    const ParamSpec& spec = ddp.buffer().params()[static_cast<size_t>(p)];
    const Range r = ddp.buffer().layout().params[static_cast<size_t>(p)].range;
    std::vector<bf16_bits> want(static_cast<size_t>(r.size()));
    convert_f32_to_bf16(main.data() + r.start, want.data(), want.size());
    if (!spec.mxfp8) {
      const TensorView got = ddp.param(p);
      if (!std::equal(want.begin(), want.end(), got.data_as<const bf16_bits>())) return *why = spec.name, false;
      continue;
    }
    Mxfp8Tensor expect(spec.shape[0], spec.shape[1], ddp.config().mxfp8_elem, ddp.config().mxfp8_scale_mode, scratch);
    expect.quantize_from(TensorView{want.data(), DType::kBF16, spec.shape});
    for (QuantAxis axis : {QuantAxis::kRow, QuantAxis::kCol})
      for (const Mxfp8View got = ddp.mxfp8_param(p, axis);
           const auto& [a, b] : {std::pair{got.data, expect.data(axis)}, std::pair{got.scales, expect.scales(axis)}})
        if (std::memcmp(a.data, b.data, a.nbytes()) != 0) return *why = spec.name + (axis == QuantAxis::kRow ? " (row)" : " (col)"), false;
  }
  return true;
}

TEST(Mxfp8Params, InvalidCombinationsAreErrorsAtConstruction) {
  run_local(1, [](Communicator& comm) {
    MemoryTracker tracker;
    auto expect_error = [&](DdpConfig cfg, std::vector<ParamSpec> params, std::string_view needle) {
      try {
        DistributedDataParallel ddp(comm, params, cfg, tracker);
        ADD_FAILURE() << "accepted; expected an error with '" << needle << "'";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      }
    };
    DdpConfig reuse_only = optim_ddp_config();
    reuse_only.reuse_grad_buf_for_mxfp8_param_ag = true;
    expect_error(reuse_only, mlp_params(true), "--reuse-grad-buf-for-mxfp8-param-ag) needs fp8_param_gather (--fp8-param-gather)");
    DdpConfig no_distopt = mxfp8_config(true);
    no_distopt.use_distributed_optimizer = false;
    expect_error(no_distopt, mlp_params(true), "fp8_param_gather needs use_distributed_optimizer");
    expect_error(optim_ddp_config(), mlp_params(true), "marked mxfp8 but fp8_param_gather is off");
    DdpConfig with_step = mxfp8_config(true, /*overlap_param_gather=*/true);
    with_step.overlap_param_gather_with_optimizer_step = true;
    expect_error(with_step, mlp_params(true), "cannot overlap the param gather with the optimizer step (--overlap-param-gather-with-optimizer-step)");
    auto bad = mlp_params(true);
    bad[1].mxfp8 = true;  // a bias
    expect_error(mxfp8_config(false), bad, "MXFP8 params are 2-D");
    // The optimizer takes its main params from the shared buffer: only before it is zeroed.
    auto init = mlp_init();
    DistributedDataParallel ddp(comm, mlp_params(true), mxfp8_config(true), tracker, views_of(init));
    ddp.zero_grad_buffer();
    EXPECT_THROW(DistributedOptimizer(ddp, {}, tracker), Error);
  });
}

// Losses and final MXFP8 weights of a run, per rank.
struct RunResult {
  std::vector<double> losses;
  std::vector<uint8_t> weights;  // every MXFP8 param's row-wise data, concatenated
};

RunResult train_mxfp8(Communicator& comm, bool reuse, bool overlap, int steps) {
  MemoryTracker tracker;
  auto init = mlp_init();
  DistributedDataParallel ddp(comm, mlp_params(true), mxfp8_config(reuse, overlap), tracker, views_of(init));
  DistributedOptimizer opt(ddp, {.lr = 1e-2f}, tracker);
  RunResult r;
  for (int s = 0; s < steps; ++s) r.losses.push_back(ddp_train_step(opt, s, kGlobalBatch));
  opt.force_param_sync();
  std::string why;
  EXPECT_TRUE(model_params_match_main(opt, &why)) << "after force_param_sync: " << why;
  for (int p = 0; p < ddp.num_params(); ++p)
    if (ddp.buffer().params()[static_cast<size_t>(p)].mxfp8) {
      const TensorView d = ddp.mxfp8_param(p, QuantAxis::kRow).data;
      r.weights.insert(r.weights.end(), d.data_as<uint8_t>(), d.data_as<uint8_t>() + d.numel());
    }
  return r;
}

TEST(Mxfp8Params, ReuseAndOverlapChangeNothingButWhereBytesLive) {
  for (int dp : {1, 2, 4}) {
    std::vector<RunResult> base(static_cast<size_t>(dp));
    run_local(dp, [&](Communicator& comm) { base[static_cast<size_t>(comm.rank())] = train_mxfp8(comm, false, false, 5); });
    for (auto [reuse, overlap] : {std::pair{true, false}, std::pair{false, true}, std::pair{true, true}}) {
      std::vector<RunResult> other(static_cast<size_t>(dp));
      run_local(dp, [&](Communicator& comm) { other[static_cast<size_t>(comm.rank())] = train_mxfp8(comm, reuse, overlap, 5); });
      for (int r = 0; r < dp; ++r) {
        EXPECT_EQ(other[static_cast<size_t>(r)].losses, base[static_cast<size_t>(r)].losses) << "dp " << dp << " reuse " << reuse << " overlap " << overlap;
        EXPECT_EQ(other[static_cast<size_t>(r)].weights, base[static_cast<size_t>(r)].weights);
      }
    }
  }
}

TEST(Mxfp8Params, Dp1AndDp4AgreeAndTheLossFalls) {
  std::vector<double> dp1, dp4;
  run_local(1, [&](Communicator& comm) { dp1 = train_mxfp8(comm, true, true, 8).losses; });
  run_local(4, [&](Communicator& comm) {
    auto l = train_mxfp8(comm, true, true, 8).losses;
    if (comm.rank() == 0) dp4 = l;
  });
  for (size_t s = 0; s < dp1.size(); ++s) EXPECT_NEAR(dp4[s], dp1[s], 1e-5 * std::fabs(dp1[s])) << "step " << s;
  EXPECT_LT(dp1.back(), dp1.front());
}

class ForcedSyncWithReuse : public ::testing::TestWithParam<bool> {};

TEST_P(ForcedSyncWithReuse, RestagesAndGathersWithOrWithoutAGatherInFlight) {
  const bool overlap = GetParam();
  run_local(2, [overlap](Communicator& comm) {
    MemoryTracker tracker;
    auto init = mlp_init();
    DistributedDataParallel ddp(comm, mlp_params(true), mxfp8_config(true, overlap), tracker, views_of(init));
    DistributedOptimizer opt(ddp, {.lr = 1e-2f}, tracker);
    ddp_train_step(opt, 0, kGlobalBatch);
    ddp_train_step(opt, 1, kGlobalBatch);  // the step updated main params; the model's are stale
    std::string why;
    EXPECT_FALSE(model_params_match_main(opt, &why)) << "the test needs stale weights to start from";
    if (overlap) {
      opt.zero_grad();  // stages and dispatches the first group's gather
      EXPECT_TRUE(ddp.param_sync_pending()) << "a gather should be in flight";
    }
    opt.force_param_sync();
    EXPECT_TRUE(model_params_match_main(opt, &why)) << why;
    EXPECT_FALSE(ddp.param_sync_pending());
  });
}

INSTANTIATE_TEST_SUITE_P(OverlapParamGather, ForcedSyncWithReuse, ::testing::Bool());

// The path force_param_sync guards against: gathering whatever the shared buffer holds.
TEST(Mxfp8Params, NaivePathGathersGradientsOrZerosIntoTheModel) {
  run_local(2, [](Communicator& comm) {
    MemoryTracker tracker;
    auto init = mlp_init();
    DistributedDataParallel ddp(comm, mlp_params(true), mxfp8_config(true), tracker, views_of(init));
    DistributedOptimizer opt(ddp, {.lr = 1e-2f}, tracker);
    ddp_train_step(opt, 0, kGlobalBatch);
    // Gradients live in the buffer: a gather there would gather them as params. Refused.
    try {
      ddp.start_param_sync(/*force_sync=*/true);
      ADD_FAILURE() << "a param gather ran over live gradients";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("while gradients live in the grad buffer"), std::string::npos) << e.what();
    }
    // Zeroing without re-staging: the gather is allowed, and gathers zeros into the model.
    ddp.zero_grad_buffer();
    ddp.start_param_sync(/*force_sync=*/true);
    std::string why;
    EXPECT_FALSE(model_params_match_main(opt, &why)) << "the naive gather should have produced wrong weights";
    const TensorView w = ddp.mxfp8_param(0, QuantAxis::kRow).data;
    EXPECT_TRUE(std::all_of(w.data_as<uint8_t>(), w.data_as<uint8_t>() + w.numel(), [](uint8_t c) { return c == 0; }))
        << "it gathered the zeroed staging area";
    // The guarded path gets them right.
    opt.force_param_sync();
    EXPECT_TRUE(model_params_match_main(opt, &why)) << why;
  });
}

TEST(Mxfp8Params, SaveAndResumeInTheMiddleReproducesTheRun) {
  const std::string dir = (std::filesystem::temp_directory_path() / fmt::format("mxddp_mxfp8_{}", ::getpid())).string();
  std::filesystem::remove_all(dir);
  auto segment = [&](int first, int last, bool load, bool save) {
    std::vector<double> losses;
    run_local(2, [&](Communicator& comm) {
      MemoryTracker tracker;
      auto init = mlp_init();
      DistributedDataParallel ddp(comm, mlp_params(true), mxfp8_config(true, true), tracker, views_of(init));
      DistributedOptimizer opt(ddp, {.lr = 1e-2f}, tracker);
      if (load) load_checkpoint(dir, opt);
      std::vector<double> mine;
      for (int s = first; s < last; ++s) mine.push_back(ddp_train_step(opt, s, kGlobalBatch));
      if (save) save_checkpoint(dir, opt, {.overwrite = true});
      if (comm.rank() == 0) losses = mine;
    });
    return losses;
  };
  const std::vector<double> uninterrupted = segment(0, 6, false, false);
  segment(0, 3, false, true);
  const std::vector<double> resumed = segment(3, 6, true, false);
  for (size_t s = 0; s < resumed.size(); ++s) EXPECT_EQ(resumed[s], uninterrupted[s + 3]) << "step " << s + 3;
  std::filesystem::remove_all(dir);
}

TEST(Mxfp8Params, ReuseSavesExactlyTheBf16ParamBuffer) {
  for (int dp : {1, 2, 4}) {
    std::vector<MemoryUsage> with(static_cast<size_t>(dp)), without(static_cast<size_t>(dp));
    int64_t numel = 0;
    for (bool reuse : {false, true})
      run_local(dp, [&](Communicator& comm) {
        MemoryTracker tracker;
        auto init = mlp_init();
        DistributedDataParallel ddp(comm, mlp_params(true), mxfp8_config(reuse), tracker, views_of(init));
        DistributedOptimizer opt(ddp, {}, tracker);
        (reuse ? with : without)[static_cast<size_t>(comm.rank())] = tracker.usage();
        if (comm.rank() == 0) numel = ddp.buffer().layout().numel;  // the same on every rank
      });
    for (int r = 0; r < dp; ++r) {
      const MemoryUsage& a = without[static_cast<size_t>(r)];
      const MemoryUsage& b = with[static_cast<size_t>(r)];
      EXPECT_EQ(a.total_live_bytes - b.total_live_bytes, 2 * numel) << "dp " << dp;
      EXPECT_EQ(a.live(MemoryCategory::kParams) - b.live(MemoryCategory::kParams), 2 * numel);
      EXPECT_EQ(a.live(MemoryCategory::kGrads), b.live(MemoryCategory::kGrads));
      EXPECT_EQ(a.live(MemoryCategory::kMxfp8), b.live(MemoryCategory::kMxfp8));
      EXPECT_GT(b.live(MemoryCategory::kMxfp8), 0);
    }
  }
}

}  // namespace
}  // namespace mxddp::testing
