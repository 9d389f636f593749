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

inline TrainConfig as_ddp(TrainConfig c) {
  c.use_megatron_fsdp = false;
  return c;
}

}  // namespace mxddp::testing
