// HSDP (FSDP sharded within a shard group, replicated across groups) on the local backend: a
// shard x replica grid of in-process ranks gives the params of FSDP and of DDP over all its ranks,
// every replica holds bitwise the same params, the replica all-reduce follows each reduction in
// the collective log, and the memory tracker charges exactly what FSDP at the shard group's size
// charges.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>

#include <mxddp/ddp.h>
#include <mxddp/fsdp.h>
#include <mxddp/optim.h>

#include "fsdp/fsdp_engine.h"
#include "fsdp/fsdp_util.h"
#include "fsdp/hsdp_grid.h"

namespace mxddp::testing {
namespace {

const GptConfig kModel{.num_layers = 3, .hidden_size = 32, .num_attention_heads = 2, .seq_length = 16};
constexpr int kIters = 3, kMicro = 2;

// One rank's result: its f32 main params scattered into the full params (what it owns, NaN
// elsewhere), its losses, and its tracker's usage at the end.
struct RankResult {
  std::vector<std::vector<float>> params;
  std::vector<double> losses;
  MemoryUsage usage;
  std::vector<FsdpCollective> log;
};

// kIters iterations of kMicro micro-batches of 2 sequences on `rank` (of all ranks of the run,
// whatever its grouping), through dp and opt.
void train_hand_driven(DataParallel& dp, DistributedOptimizer& opt, GptModel& gpt, int rank, RankResult& out) {
  const TokenDataset data(builtin_corpus(1 << 14), 0.1, kModel.seq_length);
  std::vector<int32_t> tokens(static_cast<size_t>(2 * (kModel.seq_length + 1)));
  for (int it = 0; it < kIters; ++it) {
    opt.zero_grad();
    for (int m = 0; m < kMicro; ++m) {
      data.fill_batch(false, 1, it, rank * 2 * kMicro + m * 2, 2, tokens.data());
      if (m + 1 < kMicro) {
        auto scope = dp.no_sync();
        out.losses.push_back(gpt.forward_backward(tokens.data(), 2, 1.0f / kMicro));
      } else {
        out.losses.push_back(gpt.forward_backward(tokens.data(), 2, 1.0f / kMicro));
      }
    }
    dp.finish_grad_sync();
    opt.step();
  }
  const std::vector<ParamSpec>& specs = dp.params();
  for (const ParamSpec& p : specs) out.params.emplace_back(static_cast<size_t>(p.shape.numel()), std::nanf(""));
  for (int b = 0; b < opt.num_buckets(); ++b) {
    const float* main = opt.main_params(b).data_as<const float>();
    for (const ShardParamRange& r : opt.bucket(b).owned)
      std::memcpy(out.params[static_cast<size_t>(r.param)].data() + r.in_param.start, main + r.in_shard.start,
                  static_cast<size_t>(r.in_param.size()) * sizeof(float));
  }
}

FsdpConfig hsdp_fsdp_config(ShardingStrategy s, bool overlap) {
  FsdpConfig fc;
  fc.data_parallel_sharding_strategy = s;
  fc.overlap_grad_reduce = fc.overlap_param_gather = overlap;
  return fc;
}

// FSDP over shard x replicas ranks; replicas > 1 or force_hsdp: HSDP (a replica communicator, of
// size 1 when replicas is 1), otherwise plain FSDP over a shard group of all the ranks.
// mxfp8: the linear weights MXFP8 (optim_grads_params). clip_grad: the optimizer's (0: none).
std::vector<RankResult> run_fsdp(int shard, int replicas, ShardingStrategy s, bool overlap, bool hsdp,
                                 bool mxfp8 = false, float clip_grad = OptimizerConfig{}.clip_grad) {
  set_compute_threads(1);
  std::vector<RankResult> results(static_cast<size_t>(shard * replicas));
  auto body = [&](Communicator& comm, Communicator* replica, int rank) {
    RankResult& out = results[static_cast<size_t>(rank)];
    MemoryTracker tracker;
    GlobalMemoryBuffer pool(tracker);
    const std::vector<ParamSpec> specs = gpt_param_specs(kModel, mxfp8);
    std::vector<std::vector<float>> init = gpt_init_params(kModel, 7);
    FullyShardedDataParallel fsdp(comm, specs, gpt_fsdp_units(kModel), hsdp_fsdp_config(s, overlap), tracker,
                                  param_views(init, specs), replica);
    DistributedOptimizer opt(fsdp, OptimizerConfig{.clip_grad = clip_grad}, tracker);
    GptModel gpt(fsdp, pool, kModel);
    train_hand_driven(fsdp, opt, gpt, rank, out);
    out.log = fsdp_engine(fsdp).collective_log();
    out.usage = tracker.usage();
  };
  if (hsdp) run_grid(shard, replicas, [&](Communicator& c, Communicator& r, int rank) { body(c, &r, rank); });
  else run_local(shard * replicas, [&](Communicator& c) { body(c, nullptr, c.rank()); });
  return results;
}

std::vector<RankResult> run_ddp(int dp) {
  set_compute_threads(1);
  std::vector<RankResult> results(static_cast<size_t>(dp));
  run_local(dp, [&](Communicator& comm) {
    RankResult& out = results[static_cast<size_t>(comm.rank())];
    MemoryTracker tracker;
    GlobalMemoryBuffer pool(tracker);
    const std::vector<ParamSpec> specs = gpt_param_specs(kModel);
    std::vector<std::vector<float>> init = gpt_init_params(kModel, 7);
    DistributedDataParallel ddp(comm, specs, DdpConfig{.use_distributed_optimizer = true}, tracker,
                                param_views(init, specs));
    DistributedOptimizer opt(ddp, {}, tracker);
    GptModel gpt(ddp, pool, kModel);
    train_hand_driven(ddp, opt, gpt, comm.rank(), out);
  });
  return results;
}

// The full params of a run: each element from the rank that owns it (ranks first..first+count-1
// are one full set, e.g. one shard group). Every element must be owned by exactly one of them.
std::vector<std::vector<float>> assemble(const std::vector<RankResult>& ranks, int first, int count) {
  std::vector<std::vector<float>> full = ranks[static_cast<size_t>(first)].params;
  for (int r = first + 1; r < first + count; ++r)
    for (size_t p = 0; p < full.size(); ++p)
      for (size_t i = 0; i < full[p].size(); ++i) {
        const float v = ranks[static_cast<size_t>(r)].params[p][i];
        if (std::isnan(v)) continue;
        EXPECT_TRUE(std::isnan(full[p][i])) << "param " << p << " element " << i << " owned twice";
        full[p][i] = v;
      }
  for (const auto& p : full)
    for (float v : p) EXPECT_FALSE(std::isnan(v)) << "an element no rank owns";
  return full;
}

// The largest |a - b| over every element, relative to the largest |b|.
double max_relative_difference(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  double diff = 0, scale = 0;
  for (size_t p = 0; p < a.size(); ++p)
    for (size_t i = 0; i < a[p].size(); ++i) {
      diff = std::max(diff, static_cast<double>(std::abs(a[p][i] - b[p][i])));
      scale = std::max(scale, static_cast<double>(std::abs(b[p][i])));
    }
  return diff / scale;
}

bool bitwise_equal(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  for (size_t p = 0; p < a.size(); ++p)
    if (std::memcmp(a[p].data(), b[p].data(), a[p].size() * sizeof(float)) != 0) return false;
  return true;
}

class HsdpParity : public ::testing::TestWithParam<std::tuple<ShardingStrategy, bool, std::pair<int, int>>> {};

// HSDP's params after kIters steps against FSDP and DDP over all its ranks. The gradient of
// every element is the same prescaled sum, grouped ((g0 + g1) + (g2 + g3)) instead of in rank
// order; with a single replica the grouping is the rank order and the params are bitwise FSDP's,
// and so they are with a single group when nothing clips (below). Measured at 2 x 2 (max
// |difference| over the largest |param|, after three Adam steps): 5.9e-8 from FSDP and DDP for
// no_shard and optim, 1.5e-7 from FSDP and 1.2e-7 from DDP for optim_grads* (FSDP at 4 is itself
// 1.2e-7 from DDP there); bounded at 1e-6.
TEST_P(HsdpParity, ParamsMatchFsdpAndDdpOverAllRanks) {
  const auto [strategy, overlap, grid] = GetParam();
  const auto [shard, replicas] = grid;
  const int world = shard * replicas;
  const std::vector<RankResult> hsdp = run_fsdp(shard, replicas, strategy, overlap, /*hsdp=*/true);
  const std::vector<RankResult> fsdp = run_fsdp(world, 1, strategy, overlap, /*hsdp=*/false);
  const std::vector<RankResult> ddp = run_ddp(world);
  const auto hsdp_params = assemble(hsdp, 0, shard);
  // Every replica holds bitwise the params of the first shard group.
  for (int r = 1; r < replicas; ++r) EXPECT_TRUE(bitwise_equal(assemble(hsdp, r * shard, shard), hsdp_params)) << "replica " << r;
  const auto fsdp_params = assemble(fsdp, 0, world), ddp_params = assemble(ddp, 0, world);
  const double vs_fsdp = max_relative_difference(hsdp_params, fsdp_params);
  const double vs_ddp = max_relative_difference(hsdp_params, ddp_params);
  std::printf("hsdp %dx%d %s: max |hsdp - fsdp| %.3g, |hsdp - ddp| %.3g, |fsdp - ddp| %.3g (of the largest param)\n",
              shard, replicas, std::string(sharding_strategy_name(strategy)).c_str(), vs_fsdp, vs_ddp,
              max_relative_difference(fsdp_params, ddp_params));
  if (replicas == 1) {
    EXPECT_TRUE(bitwise_equal(hsdp_params, fsdp_params));
  }
  if (shard == 1) {
    // A shard group of one owns every element, FSDP's ranks half each: the clipping's grad norm is
    // summed over another partition (one f64 sum against two f32-pair halves), and the clip
    // coefficient it gives may differ in its last bit (seen on an AVX2 machine, not on AVX-512
    // ones, whose GEMMs give other grads). Without clipping the update is element for element the
    // same.
    const std::vector<RankResult> hsdp_unclipped = run_fsdp(shard, replicas, strategy, overlap, true, false, 0.0f);
    const std::vector<RankResult> fsdp_unclipped = run_fsdp(world, 1, strategy, overlap, false, false, 0.0f);
    EXPECT_TRUE(bitwise_equal(assemble(hsdp_unclipped, 0, shard), assemble(fsdp_unclipped, 0, world)));
  }
  EXPECT_LE(vs_fsdp, 1e-6);
  EXPECT_LE(vs_ddp, 1e-6);
  for (int rank = 0; rank < world; ++rank)
    expect_close(hsdp[static_cast<size_t>(rank)].losses, ddp[static_cast<size_t>(rank)].losses, 1e-6, "losses vs ddp");
}

std::string grid_name(const ::testing::TestParamInfo<std::tuple<ShardingStrategy, bool, std::pair<int, int>>>& info) {
  const auto [strategy, overlap, grid] = info.param;
  return fmt::format("{}_{}_shard{}_x_{}", sharding_strategy_name(strategy), overlap ? "overlap" : "serial", grid.first,
                     grid.second);
}

INSTANTIATE_TEST_SUITE_P(StrategyOverlapGrid, HsdpParity,
                         ::testing::Combine(::testing::ValuesIn(kStrategies), ::testing::Bool(),
                                            ::testing::Values(std::pair{2, 2}, std::pair{2, 1}, std::pair{1, 2})),
                         grid_name);

// MXFP8 weights: each shard group quantizes its updated shards with scales MAX all-reduced over
// the group only, which are the whole tensor's on every replica (the replicas' main params are
// bitwise the same), so the replicas stay bitwise equal and HSDP stays within FSDP-over-4's
// rounding. Measured at 2 x 2: 9.3e-9 of the largest param apart; bounded at 1e-6.
TEST(Hsdp, Mxfp8ParamsMatchFsdpOverAllRanks) {
  for (bool overlap : {false, true}) {
    const std::vector<RankResult> hsdp = run_fsdp(2, 2, ShardingStrategy::kOptimGradsParams, overlap, true, true);
    const std::vector<RankResult> fsdp = run_fsdp(4, 1, ShardingStrategy::kOptimGradsParams, overlap, false, true);
    const auto hsdp_params = assemble(hsdp, 0, 2);
    EXPECT_TRUE(bitwise_equal(assemble(hsdp, 2, 2), hsdp_params)) << "overlap " << overlap;
    const double diff = max_relative_difference(hsdp_params, assemble(fsdp, 0, 4));
    std::printf("hsdp 2x2 mxfp8, overlap %d: max |hsdp - fsdp| %.3g of the largest param\n", overlap, diff);
    EXPECT_LE(diff, 1e-6) << "overlap " << overlap;
    for (int rank = 0; rank < 4; ++rank)
      expect_close(hsdp[static_cast<size_t>(rank)].losses, fsdp[static_cast<size_t>(rank)].losses, 1e-5, "mxfp8 losses");
  }
}

// Each reduction is followed by its replica all-reduce in the log, and without a replica
// communicator there is none (plain FSDP's log is unchanged).
TEST(Hsdp, EveryReductionIsAllReducedAcrossReplicasOnce) {
  for (ShardingStrategy s : kStrategies) {
    const std::vector<RankResult> hsdp = run_fsdp(2, 2, s, true, true);
    const std::vector<RankResult> fsdp = run_fsdp(2, 1, s, true, false);
    for (const RankResult& r : hsdp) {
      std::vector<FsdpCollective> without_replica;
      for (size_t i = 0; i < r.log.size(); ++i) {
        if (r.log[i].kind == FsdpCollective::Kind::kReplicaAllReduce) continue;
        without_replica.push_back(r.log[i]);
        const bool reduction = r.log[i].kind == FsdpCollective::Kind::kReduceScatter ||
                               (s == ShardingStrategy::kNoShard && r.log[i].kind == FsdpCollective::Kind::kAllReduce);
        if (!reduction) continue;
        ASSERT_LT(i + 1, r.log.size());
        EXPECT_EQ(r.log[i + 1], (FsdpCollective{FsdpCollective::Kind::kReplicaAllReduce, r.log[i].bucket}))
            << sharding_strategy_name(s) << ": collective " << i;
      }
      EXPECT_EQ(without_replica, fsdp.front().log) << sharding_strategy_name(s);
    }
    for (const FsdpCollective& c : fsdp.front().log) EXPECT_NE(c.kind, FsdpCollective::Kind::kReplicaAllReduce);
  }
}

// HSDP's bytes per rank, live and peak in every category, are FSDP's at the shard group's size:
// the replica all-reduce works in place on what the reduction left.
TEST(Hsdp, TrackerChargesAreFsdpsAtTheShardGroupSize) {
  for (ShardingStrategy s : kStrategies)
    for (bool overlap : {false, true}) {
      const std::vector<RankResult> hsdp = run_fsdp(2, 2, s, overlap, true);
      const std::vector<RankResult> fsdp = run_fsdp(2, 1, s, overlap, false);
      for (size_t rank = 0; rank < hsdp.size(); ++rank) {
        const MemoryUsage& h = hsdp[rank].usage;
        const MemoryUsage& f = fsdp[rank % 2].usage;
        EXPECT_EQ(h.live_bytes, f.live_bytes) << sharding_strategy_name(s) << " rank " << rank;
        EXPECT_EQ(h.peak_bytes, f.peak_bytes) << sharding_strategy_name(s) << " rank " << rank;
        EXPECT_EQ(h.total_peak_bytes, f.total_peak_bytes) << sharding_strategy_name(s) << " rank " << rank;
      }
    }
}

// Two HSDP models on the same shard and replica communicators, their micro-batches interleaved,
// with every collective of either group delayed at random (so each rank's reduce-scatters land in
// another order): their replica all-reduces go through one queue per communicator in issue order,
// so each model trains as it does alone. With a queue per model the ranks could pair one model's
// all-reduce with the other's (a count mismatch, or the wrong data).
TEST(Hsdp, TwoModelsSharingTheCommunicatorsEachTrainAsAlone) {
  const GptConfig big = kModel;
  const GptConfig small{.num_layers = 2, .hidden_size = 16, .num_attention_heads = 2, .seq_length = 16};
  LocalOptions delayed;
  delayed.injected_delay = {.min_us = 0, .max_us = 300, .seed = 5, .all_reduce = true};
  set_compute_threads(1);
  auto train = [&](bool together, std::vector<std::vector<float>>& big_out, std::vector<std::vector<float>>& small_out) {
    std::vector<RankResult> results_big(4), results_small(4);
    run_grid(2, 2, [&](Communicator& comm, Communicator& replica, int rank) {
      struct Model {
        MemoryTracker tracker;
        GlobalMemoryBuffer pool{tracker};
        std::vector<ParamSpec> specs;
        std::vector<std::vector<float>> init;
        FullyShardedDataParallel fsdp;
        DistributedOptimizer opt;
        GptModel gpt;
        Model(Communicator& c, Communicator& r, const GptConfig& m)
            : specs(gpt_param_specs(m)), init(gpt_init_params(m, 7)),
              fsdp(c, specs, gpt_fsdp_units(m), hsdp_fsdp_config(ShardingStrategy::kOptimGradsParams, true), tracker,
                   param_views(init, specs), &r),
              opt(fsdp, {}, tracker), gpt(fsdp, pool, m) {}
      };
      const TokenDataset data(builtin_corpus(1 << 14), 0.1, kModel.seq_length);
      std::vector<int32_t> tokens(static_cast<size_t>(2 * (kModel.seq_length + 1)));
      Model a(comm, replica, big);
      std::optional<Model> b;
      if (together) b.emplace(comm, replica, small);
      for (int it = 0; it < kIters; ++it) {
        a.opt.zero_grad();
        if (b) b->opt.zero_grad();
        for (int m = 0; m < kMicro; ++m) {
          data.fill_batch(false, 1, it, rank * 2 * kMicro + m * 2, 2, tokens.data());
          const bool last = m + 1 == kMicro;
          for (Model* x : {&a, b ? &*b : nullptr}) {
            if (!x) continue;
            if (last) {
              x->gpt.forward_backward(tokens.data(), 2, 1.0f / kMicro);
            } else {
              auto scope = x->fsdp.no_sync();
              x->gpt.forward_backward(tokens.data(), 2, 1.0f / kMicro);
            }
          }
        }
        a.fsdp.finish_grad_sync();
        if (b) b->fsdp.finish_grad_sync();
        a.opt.step();
        if (b) b->opt.step();
      }
      auto keep = [&](Model& x, RankResult& out) {
        for (const ParamSpec& p : x.specs) out.params.emplace_back(static_cast<size_t>(p.shape.numel()), std::nanf(""));
        for (int bk = 0; bk < x.opt.num_buckets(); ++bk)
          for (const ShardParamRange& r : x.opt.bucket(bk).owned)
            std::memcpy(out.params[static_cast<size_t>(r.param)].data() + r.in_param.start,
                        x.opt.main_params(bk).data_as<const float>() + r.in_shard.start,
                        static_cast<size_t>(r.in_param.size()) * sizeof(float));
      };
      keep(a, results_big[static_cast<size_t>(rank)]);
      if (b) keep(*b, results_small[static_cast<size_t>(rank)]);
    }, delayed);
    big_out = assemble(results_big, 0, 2);
    if (together) small_out = assemble(results_small, 0, 2);
  };
  std::vector<std::vector<float>> big_alone, big_together, small_together, unused;
  train(false, big_alone, unused);
  train(true, big_together, small_together);
  EXPECT_TRUE(bitwise_equal(big_together, big_alone)) << "the big model trained beside the small one";
  EXPECT_FALSE(small_together.empty());
}

TEST(Hsdp, TheShardGroupCannotBeItsOwnReplicaGroup) {
  run_local(2, [](Communicator& comm) {
    MemoryTracker tracker;
    const std::vector<ParamSpec> specs = gpt_param_specs(kModel);
    std::vector<std::vector<float>> init = gpt_init_params(kModel, 7);
    try {
      FullyShardedDataParallel fsdp(comm, specs, gpt_fsdp_units(kModel), FsdpConfig{}, tracker, param_views(init, specs),
                                    &comm);
      ADD_FAILURE() << "accepted the shard group as its own replica group";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("replica communicator is the shard group's own"), std::string::npos) << e.what();
    }
  });
}

}  // namespace
}  // namespace mxddp::testing
