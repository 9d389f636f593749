// Shared by the FSDP tests: the four strategies, a small FSDP training config and its DDP twin.
#pragma once

#include <string>
#include <tuple>

#include <mxddp/fsdp.h>

#include "model/train_util.h"

namespace mxddp::testing {

inline constexpr ShardingStrategy kStrategies[] = {ShardingStrategy::kNoShard, ShardingStrategy::kOptim,
                                                   ShardingStrategy::kOptimGrads, ShardingStrategy::kOptimGradsParams};

inline TrainConfig fsdp_config(ShardingStrategy s, bool overlap) {
  TrainConfig c = small_train_config();
  c.model = GptConfig{.num_layers = 3, .hidden_size = 32, .num_attention_heads = 2, .seq_length = 16};
  c.train_iters = 3;
  c.eval_iters = 0;
  c.use_megatron_fsdp = true;
  c.fsdp.data_parallel_sharding_strategy = s;
  c.fsdp.overlap_grad_reduce = c.fsdp.overlap_param_gather = overlap;
  c.ddp.overlap_grad_reduce = c.ddp.overlap_param_gather = overlap;  // the DDP baseline's
  return c;
}

// The name of a (strategy, overlap, dp, micro-batches) case, e.g. "optim_overlap_dp2_mb3".
inline std::string strategy_overlap_dp_micro_name(
    const ::testing::TestParamInfo<std::tuple<ShardingStrategy, bool, int, int>>& info) {
  const auto [strategy, overlap, dp, accum] = info.param;
  return fmt::format("{}_{}_dp{}_mb{}", sharding_strategy_name(strategy), overlap ? "overlap" : "serial", dp, accum);
}

// f32 views of init (gpt_init_params's values), one per spec, as FSDP's initial values.
inline std::vector<TensorView> param_views(std::vector<std::vector<float>>& init, const std::vector<ParamSpec>& specs) {
  std::vector<TensorView> views;
  for (size_t i = 0; i < specs.size(); ++i) views.push_back({init[i].data(), DType::kF32, specs[i].shape});
  return views;
}

// Micro-batch m of iteration it (2 sequences per rank) through gpt; the first of an iteration's
// micro-batches under no_sync, as a gradient-accumulation loop runs it.
inline void forward_backward_micro_batch(DataParallel& dp, GptModel& gpt, const TokenDataset& data, int it, int m,
                                         std::vector<int32_t>& tokens) {
  data.fill_batch(false, 1, it, dp.communicator().rank() * 4 + m * 2, 2, tokens.data());
  if (m == 0) {
    auto scope = dp.no_sync();
    gpt.forward_backward(tokens.data(), 2, 0.5f);
  } else {
    gpt.forward_backward(tokens.data(), 2, 0.5f);
  }
}

// A recompute setting with a name for test cases.
struct Recompute {
  const char* name;
  RecomputeGranularity granularity;
  RecomputeModules modules;
};

// An FSDP (optim_grads_params unless fc says otherwise) over a GPT's params (seed 7; the linear
// weights MXFP8 with `mxfp8`), its optimizer, the GPT and a dataset, built on one rank's
// communicator, for the tests that drive iterations and inspect FSDP's state by hand. The units
// follow options.fine_grained_param_gather.
struct HandDrivenFsdpGpt {
  MemoryTracker tracker;
  GlobalMemoryBuffer pool{tracker};
  std::vector<ParamSpec> specs;
  std::vector<std::vector<float>> init;
  FullyShardedDataParallel fsdp;
  DistributedOptimizer opt;
  GptModel gpt;
  TokenDataset data;
  std::vector<int32_t> tokens;  // one micro-batch of 2 sequences

  HandDrivenFsdpGpt(Communicator& comm, const GptConfig& model, const FsdpConfig& fc, const GptModelOptions& options = {},
                    bool mxfp8 = false)
      : specs(gpt_param_specs(model, mxfp8)),
        init(gpt_init_params(model, 7)),
        fsdp(comm, specs, gpt_fsdp_units(model, options.fine_grained_param_gather), fc, tracker, param_views(init, specs)),
        opt(fsdp, {}, tracker),
        gpt(fsdp, pool, model, options),
        data(builtin_corpus(1 << 14), 0.1, model.seq_length),
        tokens(static_cast<size_t>(2 * (model.seq_length + 1))) {}

  // Micro-batch m of iteration it, as forward_backward_micro_batch runs it.
  void micro_batch(int it, int m) { forward_backward_micro_batch(fsdp, gpt, data, it, m, tokens); }
};

inline TrainConfig as_ddp(TrainConfig c) {
  c.use_megatron_fsdp = false;
  return c;
}

}  // namespace mxddp::testing
