// The memory of a DistributedDataParallel and its DistributedOptimizer as charges on a
// MemoryTracker, with nothing allocated: the DDP half of the planner (plan.h). It is kept apart
// from the model's trace (memory_plan.cc) so that plan_ddp_memory, which the Python package's
// mxddp.torch.plan calls, links without the model and its kernels.
#pragma once

#include <cstdint>
#include <vector>

#include <mxddp/buffer.h>
#include <mxddp/ddp.h>
#include <mxddp/memory.h>
#include <mxddp/optim.h>
#include <mxddp/plan.h>

namespace mxddp {

// DistributedDataParallel's constructor, as ParamAndGradBuffer and ModelParamStore allocate: the
// grad buffer, the param buffer (none with MXFP8 reuse) and, with fp8_param_gather, each param's
// BF16 copy or its MXFP8 row and column payloads and scales. Returns the layout (shards left out:
// only their size, a bucket / dp, matters). Throws what check_ddp_config throws.
ParamLayout charge_ddp_construction(const std::vector<ParamSpec>& specs, const DdpConfig& config, int dp,
                                   MemoryTracker& tracker);

// The mpi backend's staging for one gradient sync over the layout's buckets (mpi_staging_bytes of
// the largest: each bucket reduced in place, all-reduced or reduce-scattered), in bytes.
int64_t gradient_sync_staging_bytes(const ParamLayout& layout, bool reduce_scatter, DType grad_dtype, int dp);

// DistributedOptimizer's constructor: per bucket, its main params (none where param_dtype's shard
// is its own main param, main_params_alias_param_shard) and then each state, f32, over that
// bucket's shard_numel[bucket] elements.
void charge_optimizer_construction(const std::vector<int64_t>& shard_numel, OptimizerType optimizer,
                                   DType param_dtype, MemoryTracker& tracker);

// Sets tracker's default place of every category a data-parallel object and its optimizer charge
// (params, grads, main params, optimizer state, MXFP8, gathered) to place: MemoryPlanOptions::
// data_parallel_place. Scratch and comm keep the host.
void place_data_parallel_state(MemoryTracker& tracker, MemoryPlace place);

// The plan's layout figures (params, padding, buckets) for a layout.
void describe_layout(const ParamLayout& layout, MemoryPlanLayout& out);

}  // namespace mxddp
