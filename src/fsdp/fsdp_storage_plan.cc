// FsdpStoragePlan and the per-strategy table: see fsdp_storage_plan.h.
#include "fsdp_storage_plan.h"

#include <mxddp/optim.h>
#include <mxddp/quant.h>

namespace mxddp {

const FsdpStrategyStorage& fsdp_strategy_storage(ShardingStrategy s) {
  // What the hooks shard (fsdp_shards_params, fsdp_shards_grads) and what the optimizer shards.
  static const std::array<FsdpStrategyStorage, 4> table = [] {
    std::array<FsdpStrategyStorage, 4> t{};
    for (ShardingStrategy s : {ShardingStrategy::kNoShard, ShardingStrategy::kOptim, ShardingStrategy::kOptimGrads,
                               ShardingStrategy::kOptimGradsParams})
      t[static_cast<size_t>(s)] = {s, fsdp_shards_params(s), fsdp_shards_grads(s), s != ShardingStrategy::kNoShard};
    return t;
  }();
  const auto i = static_cast<size_t>(s);
  MXDDP_CHECK(i < table.size(), "unknown sharding strategy {}", static_cast<int>(s));
  return table[i];
}

FsdpElementBytes fsdp_element_bytes(ShardingStrategy s, DType param_dtype, DType grad_dtype, int dp,
                                    int optimizer_states, bool mxfp8) {
  MXDDP_CHECK(dp >= 1, "dp {} is not valid: at least 1", dp);
  const FsdpStrategyStorage& st = fsdp_strategy_storage(s);
  MXDDP_CHECK(!mxfp8 || st.params_sharded, "MXFP8 params under FSDP need optim_grads_params; got {}",
              sharding_strategy_name(s));
  const double n = dp;
  FsdpElementBytes e;
  if (mxfp8) e.params = (2.0 + 2.0 / kMxBlockSize) / n;  // payloads and scales, both orientations, sharded
  else e.params = static_cast<double>(dtype_size_bytes(param_dtype)) / (st.params_sharded ? n : 1.0);
  e.grads = static_cast<double>(dtype_size_bytes(grad_dtype)) / (st.grads_sharded ? n : 1.0);
  // An f32 param shard is its own main param (optim.h); MXFP8 and bf16 params get an f32 copy.
  e.main_params = !mxfp8 && main_params_alias_param_shard(param_dtype) ? 0.0 : 4.0 / (st.optimizer_sharded ? n : 1.0);
  e.optimizer_state = 4.0 * optimizer_states / (st.optimizer_sharded ? n : 1.0);
  return e;
}

DType fsdp_grad_dtype(const FsdpConfig& c) { return c.grad_reduce_in_fp32 ? DType::kF32 : c.param_dtype; }

std::string_view fsdp_buffer_name(FsdpBuffer b) {
  switch (b) {
    case FsdpBuffer::kParamsFull: return "params_full";
    case FsdpBuffer::kParamsShard: return "params_shard";
    case FsdpBuffer::kRowShard: return "row_shard";
    case FsdpBuffer::kColShard: return "col_shard";
    case FsdpBuffer::kRowScales: return "row_scales";
    case FsdpBuffer::kColScales: return "col_scales";
    case FsdpBuffer::kGatheredValues: return "gathered_values";
    case FsdpBuffer::kGatheredRowwise: return "gathered_rowwise";
    case FsdpBuffer::kGatheredColwise: return "gathered_colwise";
    case FsdpBuffer::kGatheredRowScales: return "gathered_row_scales";
    case FsdpBuffer::kGatheredColScales: return "gathered_col_scales";
    case FsdpBuffer::kQuantizeScales: return "quantize_scales";
    case FsdpBuffer::kGradsFull: return "grads_full";
    case FsdpBuffer::kGradsShard: return "grads_shard";
  }
  MXDDP_FAIL("unknown FSDP buffer {}", static_cast<int>(b));
}

std::string_view fsdp_lifetime_name(FsdpLifetime l) {
  switch (l) {
    case FsdpLifetime::kAtRest: return "at rest";
    case FsdpLifetime::kGathered: return "gathered per slot";
    case FsdpLifetime::kTransientGrads: return "transient grads";
    case FsdpLifetime::kStaging: return "staging";
    case FsdpLifetime::kQuantizing: return "quantizing";
  }
  MXDDP_FAIL("unknown FSDP buffer lifetime {}", static_cast<int>(l));
}

FsdpStoragePlan::FsdpStoragePlan(ShardingStrategy strategy, DType param_dtype, DType grad_dtype, int dp, int64_t numel,
                                 bool mxfp8, const std::vector<Shape>& mxfp8_shapes, int replicas)
    : numel_(numel), dp_(dp), mxfp8_(mxfp8) {
  MXDDP_CHECK(dp >= 1 && numel >= 0 && numel % dp == 0,
              "an FSDP bucket of {} elements cannot be split into {} equal shards: the layout pads it to a multiple of dp",
              numel, dp);
  MXDDP_CHECK(replicas >= 1, "an FSDP bucket's replica group of {} ranks; valid: at least 1", replicas);
  MXDDP_CHECK(mxfp8 == !mxfp8_shapes.empty(), "an FSDP bucket {} MXFP8 params was given {} MXFP8 shapes",
              mxfp8 ? "of" : "without", mxfp8_shapes.size());
  const FsdpStrategyStorage& st = fsdp_strategy_storage(strategy);
  MXDDP_CHECK(!mxfp8 || st.params_sharded, "MXFP8 buckets need optim_grads_params; got {}",
              sharding_strategy_name(strategy));
  shard_numel_ = numel / dp;
  const auto elem = static_cast<int64_t>(dtype_size_bytes(param_dtype));
  const auto grad_elem = static_cast<int64_t>(dtype_size_bytes(grad_dtype));
  if (st.params_sharded)
    add(FsdpBuffer::kParamsShard, shard_numel_ * elem, MemoryCategory::kParams,
        mxfp8 ? FsdpLifetime::kStaging : FsdpLifetime::kAtRest);
  else add(FsdpBuffer::kParamsFull, numel * elem, MemoryCategory::kParams, FsdpLifetime::kAtRest);
  if (st.grads_sharded) add(FsdpBuffer::kGradsShard, shard_numel_ * grad_elem, MemoryCategory::kGrads, FsdpLifetime::kAtRest);
  else add(FsdpBuffer::kGradsFull, numel * grad_elem, MemoryCategory::kGrads, FsdpLifetime::kAtRest);
  if (mxfp8) {
    for (const Shape& shape : mxfp8_shapes) {
      MXDDP_CHECK(shape.ndim() == 2, "MXFP8 params are 2-D [M, N]; got {}", shape.to_string());
      std::array<int64_t, 2>& at = scale_offsets_.emplace_back();
      for (QuantAxis axis : {QuantAxis::kRow, QuantAxis::kCol}) {
        at[static_cast<size_t>(axis)] = scales_numel_[static_cast<size_t>(axis)];
        scales_numel_[static_cast<size_t>(axis)] += mx_scale_shape(shape[0], shape[1], axis).numel();
      }
    }
    // Each orientation's array is split like the payloads: dp equal shards, the last zero-padded.
    for (int64_t& n : scales_numel_) n = (n + dp - 1) / dp * dp;
    add(FsdpBuffer::kRowScales, scales_shard_numel(QuantAxis::kRow), MemoryCategory::kMxfp8, FsdpLifetime::kAtRest);
    add(FsdpBuffer::kColScales, scales_shard_numel(QuantAxis::kCol), MemoryCategory::kMxfp8, FsdpLifetime::kAtRest);
    add(FsdpBuffer::kRowShard, shard_numel_, MemoryCategory::kMxfp8, FsdpLifetime::kAtRest);
    add(FsdpBuffer::kColShard, shard_numel_, MemoryCategory::kMxfp8, FsdpLifetime::kAtRest);
    add(FsdpBuffer::kQuantizeScales, scales_numel(QuantAxis::kRow) + scales_numel(QuantAxis::kCol),
        MemoryCategory::kMxfp8, FsdpLifetime::kQuantizing);
  }
  // What the strategy creates after construction; nothing not distributed (the header says why).
  gathers_are_shards_ = st.params_sharded && dp == 1;
  grads_in_shard_ = st.grads_sharded && dp == 1 && replicas == 1;
  if (st.params_sharded && !gathers_are_shards_) {
    if (mxfp8) {
      add(FsdpBuffer::kGatheredRowwise, numel, MemoryCategory::kGathered, FsdpLifetime::kGathered);
      add(FsdpBuffer::kGatheredRowScales, scales_numel(QuantAxis::kRow), MemoryCategory::kGathered, FsdpLifetime::kGathered);
      add(FsdpBuffer::kGatheredColwise, numel, MemoryCategory::kGathered, FsdpLifetime::kGathered);
      add(FsdpBuffer::kGatheredColScales, scales_numel(QuantAxis::kCol), MemoryCategory::kGathered, FsdpLifetime::kGathered);
    } else {
      add(FsdpBuffer::kGatheredValues, numel * elem, MemoryCategory::kGathered, FsdpLifetime::kGathered);
    }
  }
  if (st.grads_sharded && !grads_in_shard_)
    add(FsdpBuffer::kGradsFull, numel * grad_elem, MemoryCategory::kGrads, FsdpLifetime::kTransientGrads);
}

FsdpStoragePlan FsdpStoragePlan::of_bucket(const FsdpConfig& config, int dp, const ParamLayout& layout, int bucket,
                                           const std::vector<ParamSpec>& params, int replicas) {
  const BucketPlacement& placement = layout.buckets.at(static_cast<size_t>(bucket));
  const bool mxfp8 = params.at(static_cast<size_t>(placement.params.front())).mxfp8;
  std::vector<Shape> mxfp8_shapes;
  // Per slot axis (forward's, backward's): a param read column-wise in forward has its column-wise
  // scales in the row slot, as many as the row-wise scales of its transpose.
  if (mxfp8)
    for (int p : placement.params) {
      const ParamSpec& spec = params[static_cast<size_t>(p)];
      mxfp8_shapes.push_back(spec.mxfp8_colwise_forward && spec.shape.ndim() == 2 ? Shape{spec.shape[1], spec.shape[0]} : spec.shape);
    }
  return FsdpStoragePlan(config.data_parallel_sharding_strategy, config.param_dtype, fsdp_grad_dtype(config), dp,
                         placement.range.size(), mxfp8, mxfp8_shapes, replicas);
}

void FsdpStoragePlan::add(FsdpBuffer b, int64_t bytes, MemoryCategory category, FsdpLifetime lifetime) {
  buffers_.push_back({b, bytes, category, lifetime});
  index_[static_cast<size_t>(b)] = static_cast<int>(buffers_.size());
}

bool FsdpStoragePlan::holds(FsdpBuffer b) const { return index_[static_cast<size_t>(b)] != 0; }

const FsdpBufferPlan& FsdpStoragePlan::buffer(FsdpBuffer b) const {
  MXDDP_CHECK(holds(b), "this FSDP bucket holds no {} buffer", fsdp_buffer_name(b));
  return buffers_[static_cast<size_t>(index_[static_cast<size_t>(b)] - 1)];
}

bool FsdpStoragePlan::allocated_at_construction(FsdpBuffer b) const {
  if (!holds(b)) return false;
  const FsdpLifetime l = buffer(b).lifetime;
  return l == FsdpLifetime::kAtRest || l == FsdpLifetime::kStaging;
}

std::vector<FsdpBuffer> FsdpStoragePlan::gathered_buffers(GatherSlot slot) {
  switch (slot) {
    case GatherSlot::kValues: return {FsdpBuffer::kGatheredValues};
    case GatherSlot::kRowwise: return {FsdpBuffer::kGatheredRowwise, FsdpBuffer::kGatheredRowScales};
    case GatherSlot::kColwise: return {FsdpBuffer::kGatheredColwise, FsdpBuffer::kGatheredColScales};
  }
  MXDDP_FAIL("unknown gather slot {}", static_cast<int>(slot));
}

int64_t FsdpStoragePlan::gathered_bytes(GatherSlot slot) const {
  int64_t n = 0;
  for (FsdpBuffer b : gathered_buffers(slot)) n += bytes(b);
  return n;
}

}  // namespace mxddp
