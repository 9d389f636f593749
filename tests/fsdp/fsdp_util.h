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

inline TrainConfig as_ddp(TrainConfig c) {
  c.use_megatron_fsdp = false;
  return c;
}

}  // namespace mxddp::testing
