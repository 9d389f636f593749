// The replicated optimizer over DDP (torch DDP's default: use_distributed_optimizer off) on the
// local backend: a step equals the distributed optimizer's step and a single-rank trainer's over
// the full batch, every rank ends with identical params and state, a step issues all-reduces only
// (no param all-gather), memory is charged for the whole model on each rank, and checkpoints save
// and load across this mode, the distributed optimizer and other data-parallel sizes.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <unistd.h>

#include <mxddp/checkpoint.h>

#include "ddp/replicated_counting_comm.h"
#include "optim/optim_checks.h"

namespace mxddp::testing {
namespace {

// Several buckets (bucket_size 128 elements) of uneven sizes, so shards are cut unevenly at dp 3.
DdpConfig replicated_config(DType param_dtype = DType::kBF16) {
  return DdpConfig{.overlap_grad_reduce = true, .use_distributed_optimizer = false, .bucket_size = 128,
                   .param_dtype = param_dtype};
}

// Clipping on (0.05 is below the MLP's grad norm), so the owned-only norm decides the update.
const OptimizerConfig kAdam{.lr = 1e-2f, .weight_decay = 0.1f, .clip_grad = 0.05f};

struct StepOut {
  StepResult result;
  double loss = 0;  // this rank's micro-batch mean loss
};

StepOut step_once(DistributedOptimizer& opt, int step) {
  DistributedDataParallel& ddp = ddp_of(opt);
  const int dp = ddp.communicator().size(), local = kGlobalBatch / dp;
  opt.zero_grad();
  StepOut out;
  out.loss = forward_backward(ddp_hooks(ddp), step, ddp.communicator().rank() * local, local);
  ddp.finish_grad_sync();
  out.result = opt.step();
  return out;
}

// The elements of `what` (main params, or state s) this rank's optimizer holds, by param:
// [param][element], NaN where this rank holds nothing (a distributed optimizer's other shards).
std::vector<std::vector<float>> held_values(const DistributedOptimizer& opt, int state = -1) {
  const auto specs = mlp_params();
  std::vector<std::vector<float>> v;
  for (const ParamSpec& s : specs) v.emplace_back(static_cast<size_t>(s.shape.numel()), std::nanf(""));
  for (int b = 0; b < opt.num_buckets(); ++b) {
    const float* src = (state < 0 ? opt.main_params(b) : opt.state(state, b)).data_as<const float>();
    for (const ShardParamRange& r : opt.bucket(b).update)
      for (int64_t k = 0; k < r.in_param.size(); ++k)
        v[static_cast<size_t>(r.param)][static_cast<size_t>(r.in_param.start + k)] = src[r.in_shard.start + k];
  }
  return v;
}

int64_t count_held(const std::vector<std::vector<float>>& v) {
  int64_t n = 0;
  for (const auto& p : v)
    for (float x : p) n += std::isnan(x) ? 0 : 1;
  return n;
}

// Bytes of `view` on every rank equal rank 0's.
void expect_same_on_every_rank(Communicator& comm, const TensorView& view, const std::string& what) {
  const int64_t n = static_cast<int64_t>(view.nbytes());
  std::vector<char> all(static_cast<size_t>(n * comm.size()));
  comm.all_gather(TensorView{view.data, DType::kU8, Shape{n}, Device::cpu()},
                  TensorView{all.data(), DType::kU8, Shape{n * comm.size()}, Device::cpu()});
  for (int r = 1; r < comm.size(); ++r)
    EXPECT_EQ(std::memcmp(all.data(), all.data() + r * n, static_cast<size_t>(n)), 0)
        << what << " differs between rank 0 and rank " << r;
}

class Replicated : public ::testing::TestWithParam<int> {};

// Adam divides by sqrt(exp_avg_sq), which magnifies an ulp of difference in a near-zero reduced grad
// (two engines' sums, or a reference's) into a few ulps of the update: the tolerance where the sums
// are not the same.
constexpr double kRelTol = 1e-5;

// Largest relative difference over the elements both optimizers hold (the sharded one holds only
// its shard, which at dp 3 may be padding alone: the ranks together compare every element), for
// the main params and each state; the replicated one must hold every element.
double max_rel_diff(const DistributedOptimizer& sharded, const DistributedOptimizer& replicated) {
  double worst = 0;
  for (int st = -1; st < replicated.state_count(); ++st) {
    const auto want = held_values(sharded, st), got = held_values(replicated, st);
    EXPECT_EQ(count_held(got), ddp_of(replicated).buffer().layout().params_numel()) << "replicated holds every element";
    for (size_t p = 0; p < want.size(); ++p)
      for (size_t k = 0; k < want[p].size(); ++k) {
        if (std::isnan(want[p][k])) continue;
        const double w = want[p][k], g = got[p][k];
        worst = std::max(worst, w == g ? 0.0 : std::fabs(g - w) / std::max(std::fabs(w), 1e-3));
      }
  }
  return worst;
}

// Steps the distributed optimizer (sharded_cfg) and the replicated one side by side from the same
// init; the losses and every element each holds must agree within rel_tol (0: the same bits).
void check_equals_distributed_optimizer(Communicator& comm, const DdpConfig& sharded_cfg, const OptimizerConfig& cfg,
                                        double rel_tol) {
  MemoryTracker tracker;
  auto init = mlp_init();
  DistributedDataParallel sharded_ddp(comm, mlp_params(), sharded_cfg, tracker, views_of(init));
  DistributedOptimizer sharded(sharded_ddp, cfg, tracker);
  DistributedDataParallel replicated_ddp(comm, mlp_params(), replicated_config(), tracker, views_of(init));
  DistributedOptimizer replicated(replicated_ddp, cfg, tracker);
  bool clipped = false;
  for (int s = 0; s < 5; ++s) {
    const StepOut a = step_once(sharded, s);
    const StepOut b = step_once(replicated, s);
    EXPECT_NEAR(a.loss, b.loss, rel_tol * std::fabs(a.loss)) << "step " << s;
    // The same elements, owned in other runs (the layouts differ in padding): the ranks' partial
    // sums differ, and their all-reduce travels as an f32 (hi, lo) pair, so the norms agree to
    // about f32's precision, not to the bit.
    EXPECT_NEAR(a.result.grad_norm, b.result.grad_norm, std::max(rel_tol, 1e-6) * a.result.grad_norm) << "step " << s;
    EXPECT_FALSE(b.result.skipped);
    clipped = clipped || b.result.clip_coeff < 1.0;
  }
  EXPECT_EQ(clipped, cfg.clip_grad > 0) << "the test must exercise clipping where it asks for it";
  EXPECT_LE(max_rel_diff(sharded, replicated), rel_tol) << "rank " << comm.rank() << "/" << comm.size();
  // The model params every rank reads: the replicated DDP's equal the gathered ones.
  double worst = 0;
  for (int p = 0; p < replicated_ddp.num_params(); ++p) {
    const auto want = ddp_param_f32(sharded_ddp, p, QuantAxis::kRow);
    const auto got = ddp_param_f32(replicated_ddp, p, QuantAxis::kRow);
    for (size_t k = 0; k < want.size(); ++k) {
      const double w = want[k], g = got[k];
      worst = std::max(worst, w == g ? 0.0 : std::fabs(g - w) / std::max(std::fabs(w), 1e-3));
    }
  }
  EXPECT_LE(worst, rel_tol == 0 ? 0.0 : 1e-2) << "model params (bf16: one ulp is 2^-8)";
}

// The reduced grads are the same bits (the local engine reduces each element alike whatever the
// collective), so without clipping (the only use of the norm, which differs in its last bits) the
// steps are the same bits too, against the distributed optimizer's reduce-scatter and all-reduce.
TEST_P(Replicated, StepEqualsTheDistributedOptimizersStepBitForBit) {
  run_local(GetParam(), [](Communicator& comm) {
    const OptimizerConfig no_clip{.lr = 1e-2f, .weight_decay = 0.1f, .clip_grad = 0};
    check_equals_distributed_optimizer(comm, optim_ddp_config(), no_clip, 0);
    DdpConfig all_reduce = optim_ddp_config();
    all_reduce.force_all_reduce = true;
    check_equals_distributed_optimizer(comm, all_reduce, no_clip, 0);
  });
}

// With clipping: the clip coefficient carries the norm's last-bit difference into the update.
TEST_P(Replicated, ClippedStepEqualsTheDistributedOptimizersStep) {
  run_local(GetParam(), [](Communicator& comm) {
    check_equals_distributed_optimizer(comm, optim_ddp_config(), kAdam, kRelTol);
  });
}

TEST_P(Replicated, StepEqualsASingleRankTrainerOverTheFullBatch) {
  for (DType param_dtype : {DType::kBF16, DType::kF32})
    for (const OptimizerConfig& cfg :
         {kAdam, OptimizerConfig{.optimizer = OptimizerType::kSgd, .lr = 5e-2f, .weight_decay = 0.1f}})
      run_local(GetParam(), [&](Communicator& comm) {
        MemoryTracker tracker;
        auto init = mlp_init();
        DistributedDataParallel ddp(comm, mlp_params(), replicated_config(param_dtype), tracker, views_of(init));
        DistributedOptimizer opt(ddp, cfg, tracker);
        PlainTrainer ref(cfg, param_dtype);
        for (int s = 0; s < 5; ++s) {
          const StepOut out = step_once(opt, s);
          ref.train_step(s, kGlobalBatch, comm.size());
          EXPECT_NEAR(out.result.grad_norm, ref.last_norm, 1e-6 * ref.last_norm) << "step " << s;
        }
        // Every element, on every rank (each holds the whole model).
        const auto got = held_values(opt);
        double worst = 0;
        for (size_t p = 0; p < got.size(); ++p)
          for (size_t k = 0; k < got[p].size(); ++k) {
            const double g = got[p][k], w = ref.main[p][k];
            worst = std::max(worst, std::fabs(g - w) / std::max(std::fabs(w), 1e-3));
          }
        EXPECT_LE(worst, kRelTol) << "rank " << comm.rank() << "/" << comm.size() << " " << dtype_name(param_dtype)
                                  << " " << optimizer_name(cfg.optimizer);
        EXPECT_EQ(count_held(got), ddp.buffer().layout().params_numel());
      });
}

TEST_P(Replicated, ParamsAndStateAreIdenticalAcrossRanks) {
  run_local(GetParam(), [](Communicator& comm) {
    MemoryTracker tracker;
    auto init = mlp_init();
    DistributedDataParallel ddp(comm, mlp_params(), replicated_config(), tracker, views_of(init));
    DistributedOptimizer opt(ddp, kAdam, tracker);
    for (int s = 0; s < 3; ++s) step_once(opt, s);
    expect_same_on_every_rank(comm, ddp.buffer().param_buffer(), "the param buffer");
    for (int b = 0; b < opt.num_buckets(); ++b) {
      expect_same_on_every_rank(comm, opt.main_params(b), fmt::format("bucket {}'s main params", b));
      for (int st = 0; st < opt.state_count(); ++st)
        expect_same_on_every_rank(comm, opt.state(st, b), fmt::format("bucket {}'s {}", b, opt.state_name(st)));
    }
    // And the ranks did train on different data: their grads differed before the all-reduce.
    opt.zero_grad();
    const int local = kGlobalBatch / comm.size();
    forward_backward(ddp_hooks(ddp), 3, comm.rank() * local, local);
    if (comm.size() > 1) {
      std::vector<float> mine(ddp.main_grad(0).data_as<const float>(), ddp.main_grad(0).data_as<const float>() + 4);
      std::vector<float> all(mine.size() * static_cast<size_t>(comm.size()));
      comm.all_gather(TensorView{mine.data(), DType::kF32, Shape{4}, Device::cpu()},
                      TensorView{all.data(), DType::kF32, Shape{4 * comm.size()}, Device::cpu()});
      EXPECT_NE(std::vector<float>(all.begin(), all.begin() + 4), std::vector<float>(all.begin() + 4, all.begin() + 8));
    }
    ddp.finish_grad_sync();
  });
}

TEST_P(Replicated, AStepIssuesAllReducesAndNoGather) {
  run_local(GetParam(), [](Communicator& local) {
    CountingCommunicator counting(local);
    Communicator& comm = counting.comm();
    MemoryTracker tracker;
    auto init = mlp_init();
    DistributedDataParallel ddp(comm, mlp_params(), replicated_config(), tracker, views_of(init));
    DistributedOptimizer opt(ddp, kAdam, tracker);
    const int buckets = opt.num_buckets();
    ASSERT_GT(buckets, 1);
    for (int s = 0; s < 3; ++s) {
      const int reduces = counting.count(CollectiveKind::kAllReduce);
      step_once(opt, s);
      // One all-reduce per bucket (a group each) and the grad norm's; nothing else.
      EXPECT_EQ(counting.count(CollectiveKind::kAllReduce) - reduces, buckets + 1) << "step " << s;
      opt.force_param_sync();  // a forced sync (checkpoint, evaluation) gathers nothing either
    }
    EXPECT_EQ(counting.count(CollectiveKind::kAllGather), 0);
    EXPECT_EQ(counting.count(CollectiveKind::kReduceScatter), 0);
    EXPECT_EQ(counting.count(CollectiveKind::kBroadcast), 0);
    EXPECT_FALSE(ddp.param_sync_pending());
    // The counter does see gathers where they happen: the distributed optimizer's step issues them.
    DistributedDataParallel sharded_ddp(comm, mlp_params(), optim_ddp_config(), tracker, views_of(init));
    DistributedOptimizer sharded(sharded_ddp, kAdam, tracker);
    step_once(sharded, 0);
    EXPECT_EQ(counting.count(CollectiveKind::kAllGather), sharded_ddp.num_bucket_groups());
  });
}

TEST_P(Replicated, MemoryIsTheWholeModelOnEachRank) {
  run_local(GetParam(), [](Communicator& comm) {
    {
      MemoryTracker tracker;
      DistributedDataParallel ddp(comm, mlp_params(), replicated_config(), tracker);
      const int64_t numel = ddp.buffer().layout().numel;
      EXPECT_EQ(numel, ddp.buffer().layout().params_numel()) << "nothing is padded without the distributed optimizer";
      DistributedOptimizer opt(ddp, kAdam, tracker);
      // BF16 params: a full f32 main copy and both AdamW states, on every rank.
      EXPECT_EQ(tracker.usage().live(MemoryCategory::kMainParams), numel * 4);
      EXPECT_EQ(tracker.usage().live(MemoryCategory::kOptimizerState), numel * 8);
    }
    MemoryTracker tracker;
    DistributedDataParallel ddp(comm, mlp_params(), replicated_config(DType::kF32), tracker);
    DistributedOptimizer opt(ddp, {.optimizer = OptimizerType::kSgd}, tracker);
    // F32 params: the param buffer is the main param itself (Megatron's rule), one state.
    EXPECT_EQ(tracker.usage().live(MemoryCategory::kMainParams), 0);
    EXPECT_EQ(tracker.usage().live(MemoryCategory::kOptimizerState), ddp.buffer().layout().numel * 4);
    for (int b = 0; b < opt.num_buckets(); ++b) EXPECT_EQ(opt.main_params(b).data, ddp.buffer().bucket_params(b).data);
  });
}

TEST_P(Replicated, OwnedElementsAreEachOnExactlyOneRank) {
  const int dp = GetParam();
  std::mutex mu;
  std::map<std::pair<int, int64_t>, int> owners;  // (param, element) -> ranks owning it
  run_local(dp, [&](Communicator& comm) {
    MemoryTracker tracker;
    DistributedDataParallel ddp(comm, mlp_params(), replicated_config(), tracker);
    for (int b = 0; b < static_cast<int>(ddp.layout().buckets.size()); ++b) {
      const OptimizerBucket ob = ddp.optimizer_bucket(b);
      EXPECT_EQ(ob.numel, ddp.layout().buckets[static_cast<size_t>(b)].range.size());
      const std::lock_guard lock(mu);
      for (const ShardParamRange& r : ob.owned) {
        // in_shard counts from the bucket's start (the optimizer's views are the whole bucket).
        EXPECT_EQ(r.in_shard.start, r.in_buffer.start - ddp.layout().buckets[static_cast<size_t>(b)].range.start);
        for (int64_t e = r.in_param.start; e < r.in_param.end; ++e) ++owners[{r.param, e}];
      }
    }
  });
  int64_t total = 0;
  for (const ParamSpec& s : mlp_params()) total += s.shape.numel();
  EXPECT_EQ(static_cast<int64_t>(owners.size()), total);
  for (const auto& [where, n] : owners) EXPECT_EQ(n, 1) << "param " << where.first << " element " << where.second;
}

TEST_P(Replicated, StartParamSyncIsRefusedByName) {
  run_local(GetParam(), [](Communicator& comm) {
    MemoryTracker tracker;
    DistributedDataParallel ddp(comm, mlp_params(), replicated_config(), tracker);
    try {
      ddp.start_param_sync();
      ADD_FAILURE() << "start_param_sync accepted without use_distributed_optimizer";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("use_distributed_optimizer"), std::string::npos) << e.what();
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Dp, Replicated, ::testing::Values(1, 2, 3, 4));

// The layout rule the replicated optimizer's ownership rests on: an unpadded bucket of G elements
// is cut at floor(r * G / dp), and only when asked (the Megatron layout itself shards nothing).
TEST(ReplicatedLayout, UnpaddedBucketsAreCutAtFloorOfRTimesGOverDp) {
  const std::vector<ParamSpec> params = {{"a", Shape{7}}, {"b", Shape{5}}, {"c", Shape{3}}};
  LayoutOptions o{.dp = 4};
  EXPECT_TRUE(compute_param_layout(params, o).shards.empty());
  o.shard_unpadded_buckets = true;
  const ParamLayout l = compute_param_layout(params, o);
  ASSERT_EQ(l.numel, 15);
  ASSERT_EQ(l.shards.size(), 4u);
  const int64_t cuts[5] = {0, 3, 7, 11, 15};  // floor(15 r / 4)
  std::vector<int> covered(15, 0);
  for (int r = 0; r < 4; ++r) {
    const BucketShard& s = l.shards[static_cast<size_t>(r)][0];
    EXPECT_EQ(s.range, (Range{cuts[r], cuts[r + 1]})) << "rank " << r;
    for (const ShardParamRange& p : s.params) {
      EXPECT_EQ(p.in_buffer.size(), p.in_param.size());
      EXPECT_EQ(p.in_shard.start, p.in_buffer.start - s.range.start);
      for (int64_t e = p.in_buffer.start; e < p.in_buffer.end; ++e) ++covered[static_cast<size_t>(e)];
    }
  }
  EXPECT_EQ(covered, std::vector<int>(15, 1));
  o.compute_shards = false;  // a memory plan's layout stays without them
  EXPECT_TRUE(compute_param_layout(params, o).shards.empty());
}

// A checkpoint of the replicated optimizer holds each element once (each rank its owned shard), so
// it loads at another dp, into the distributed optimizer, and back.
TEST(ReplicatedCheckpoint, SavesAndLoadsAcrossModesAndDataParallelSizes) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / fmt::format("mxddp_replicated_ckpt_{}", getpid())).string();
  std::filesystem::remove_all(dir);
  std::vector<std::vector<float>> saved_main, saved_m;  // [param][element], from rank 0
  std::vector<std::vector<float>> saved_model;          // ddp.param(i) widened
  run_local(2, [&](Communicator& comm) {
    MemoryTracker tracker;
    auto init = mlp_init();
    DistributedDataParallel ddp(comm, mlp_params(), replicated_config(), tracker, views_of(init));
    DistributedOptimizer opt(ddp, kAdam, tracker);
    for (int s = 0; s < 3; ++s) step_once(opt, s);
    save_checkpoint(dir, opt, {.metadata = {{"iteration", "3"}}});
    if (comm.rank() == 0) {
      saved_main = held_values(opt);
      saved_m = held_values(opt, 0);
      for (int p = 0; p < ddp.num_params(); ++p) saved_model.push_back(ddp_param_f32(ddp, p, QuantAxis::kRow));
    }
  });
  struct Target {
    int dp;
    bool distributed_optimizer;
  };
  for (const Target t : {Target{4, true}, Target{1, false}, Target{3, false}})
    run_local(t.dp, [&](Communicator& comm) {
      MemoryTracker tracker;
      const DdpConfig cfg = t.distributed_optimizer ? optim_ddp_config() : replicated_config();
      DistributedDataParallel ddp(comm, mlp_params(), cfg, tracker);  // zeros until the load
      DistributedOptimizer opt(ddp, kAdam, tracker);
      const auto metadata = load_checkpoint(dir, opt, {.count_metadata = {"iteration"}});
      EXPECT_EQ(metadata.at("iteration"), "3");
      EXPECT_EQ(opt.step_count(), 3);
      const auto main = held_values(opt), m = held_values(opt, 0);
      int64_t differing = 0;
      for (size_t p = 0; p < main.size(); ++p)
        for (size_t k = 0; k < main[p].size(); ++k)
          if (!std::isnan(main[p][k]) && (main[p][k] != saved_main[p][k] || m[p][k] != saved_m[p][k])) ++differing;
      EXPECT_EQ(differing, 0) << "dp " << t.dp << (t.distributed_optimizer ? " distributed" : " replicated");
      // The load re-stages (and, sharded, gathers) the model params on every rank.
      for (int p = 0; p < ddp.num_params(); ++p)
        EXPECT_EQ(ddp_param_f32(ddp, p, QuantAxis::kRow), saved_model[static_cast<size_t>(p)]) << "param " << p;
      // And training goes on from there: a step changes the params.
      step_once(opt, 3);
      EXPECT_NE(ddp_param_f32(ddp, 0, QuantAxis::kRow), saved_model[0]);
    });
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace mxddp::testing
