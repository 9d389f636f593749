// plan_ddp_memory (plan.h) and the DDP and optimizer charges the whole planner shares
// (ddp_memory_sim.h): what DistributedDataParallel and DistributedOptimizer allocate, replayed
// against a MemoryTracker without allocating it.
#include <algorithm>
#include <limits>

#include <mxddp/comm.h>
#include <mxddp/quant.h>

#include "ddp_memory_sim.h"

namespace mxddp {

ParamLayout charge_ddp_construction(const std::vector<ParamSpec>& specs, const DdpConfig& c, int dp,
                                   MemoryTracker& tracker) {
  check_ddp_config(c, specs);
  LayoutOptions lo = c.layout_options(dp);
  lo.compute_shards = false;
  ParamLayout layout = compute_param_layout(specs, lo);
  const auto param_elem = static_cast<int64_t>(dtype_size_bytes(c.param_dtype));
  const int64_t grad_elem = c.grad_reduce_in_fp32 ? 4 : param_elem;
  tracker.on_allocate(MemoryCategory::kGrads, layout.numel * grad_elem);
  if (!c.reuse_grad_buf_for_mxfp8_param_ag) tracker.on_allocate(MemoryCategory::kParams, layout.numel * param_elem);
  if (c.fp8_param_gather)
    for (const ParamSpec& s : specs) {
      if (!s.mxfp8) {
        tracker.on_allocate(MemoryCategory::kParams, s.shape.numel() * 2);
        continue;
      }
      tracker.on_allocate(MemoryCategory::kMxfp8, s.shape.numel());
      tracker.on_allocate(MemoryCategory::kMxfp8, s.shape.numel());
      tracker.on_allocate(MemoryCategory::kMxfp8, mx_scale_shape(s.shape[0], s.shape[1], QuantAxis::kRow).numel());
      tracker.on_allocate(MemoryCategory::kMxfp8, mx_scale_shape(s.shape[0], s.shape[1], QuantAxis::kCol).numel());
    }
  return layout;
}

int64_t gradient_sync_staging_bytes(const ParamLayout& layout, bool reduce_scatter, DType grad_dtype, int dp) {
  int64_t bytes = 0;
  for (const BucketPlacement& b : layout.buckets) {
    const int64_t count = reduce_scatter ? b.range.size() / dp : b.range.size();
    bytes = std::max(bytes, mpi_staging_bytes(reduce_scatter, grad_dtype, count, dp));
  }
  return bytes;
}

void charge_optimizer_construction(const std::vector<int64_t>& shard_numel, OptimizerType optimizer,
                                   DType param_dtype, MemoryTracker& tracker) {
  const auto states = static_cast<int64_t>(optimizer_state_names(optimizer).size());
  for (int64_t n : shard_numel) {
    if (!main_params_alias_param_shard(param_dtype)) tracker.on_allocate(MemoryCategory::kMainParams, n * 4);
    for (int64_t s = 0; s < states; ++s) tracker.on_allocate(MemoryCategory::kOptimizerState, n * 4);
  }
}

void place_data_parallel_state(MemoryTracker& tracker, MemoryPlace place) {
  for (MemoryCategory c : {MemoryCategory::kParams, MemoryCategory::kGrads, MemoryCategory::kMainParams,
                           MemoryCategory::kOptimizerState, MemoryCategory::kMxfp8, MemoryCategory::kGathered})
    tracker.set_default_place(c, place);
}

void describe_layout(const ParamLayout& layout, MemoryPlanLayout& d) {
  d.params_numel = layout.params_numel();
  d.buffer_numel = layout.numel;
  d.num_buckets = static_cast<int64_t>(layout.buckets.size());
  for (const BucketPlacement& b : layout.buckets) {
    const int64_t last_end = layout.params[static_cast<size_t>(b.params.back())].range.end;
    d.bucket_end_padding_numel += b.range.end - last_end;
    d.bucket_numel_and_end_padding.emplace_back(b.range.size(), b.range.end - last_end);
  }
  d.param_start_padding_numel = d.buffer_numel - d.params_numel - d.bucket_end_padding_numel;
}

MemoryPlan plan_ddp_memory(const std::vector<ParamSpec>& params, const DdpConfig& config,
                           std::optional<OptimizerType> optimizer, const MemoryPlanOptions& opts) {
  const int dp = opts.dp;
  MXDDP_CHECK(dp >= 1, "dp {} is not valid: at least 1", dp);
  MXDDP_CHECK(!params.empty(), "the param list is empty: a DistributedDataParallel needs at least one param");
  int64_t n = 0;
  for (const ParamSpec& p : params) n = checked_add(n, p.shape.numel(), "the param list's elements");
  // Every category together holds at most a few dozen bytes per element (plan.cc's bound).
  constexpr int64_t kBytesPerElementMax = 64;
  MXDDP_CHECK(n <= std::numeric_limits<int64_t>::max() / kBytesPerElementMax,
              "the param list's {} elements are more than mxddp plans: their bytes would not fit in a 64-bit count", n);
  MemoryTracker tracker;
  place_data_parallel_state(tracker, opts.data_parallel_place);
  const ParamLayout layout = charge_ddp_construction(params, config, dp, tracker);
  if (optimizer) {
    std::vector<int64_t> shard_numel;
    // Without use_distributed_optimizer the optimizer is replicated: every rank keeps main params
    // and state for whole buckets.
    for (const BucketPlacement& b : layout.buckets)
      shard_numel.push_back(config.use_distributed_optimizer ? b.range.size() / dp : b.range.size());
    charge_optimizer_construction(shard_numel, *optimizer, config.param_dtype, tracker);
  }
  const MemoryUsage built = tracker.usage();
  tracker.reset_peaks();
  // A backward's gradient sync: the mpi backend allocates its staging at the first reduction and
  // keeps it. The optimizer's step (norm, update, param all-gather) allocates nothing.
  if (opts.mpi_backend) {
    const DType grad_dtype = config.grad_reduce_in_fp32 ? DType::kF32 : config.param_dtype;
    const int64_t staging =
        gradient_sync_staging_bytes(layout, config.use_distributed_optimizer && !config.force_all_reduce, grad_dtype, dp);
    if (staging > 0) tracker.on_allocate(MemoryCategory::kComm, staging);
  }
  MemoryPlan plan;
  plan.dp = dp;
  plan.steady = tracker.usage();
  plan.overall = max_peaks(built, plan.steady);
  describe_layout(layout, plan.layout);
  return plan;
}

}  // namespace mxddp
