// mxddp plan: every rank's memory, to the byte, before running.
//
// Owns: plan_train_memory (what `mxddp train` will hold, per category, at its steady state and
// overall peak: the same figures as its report), plan_param_memory (the same for a bare param
// list: buffers and optimizer, no model), plan_ddp_memory (a DDP and optional optimizer as the
// Python package builds them), plan_fsdp_memory (an FSDP over a torch module's params, driven as
// the Python package drives it), the closed-form estimates users know (Megatron's
// theoretical_memory_usage, DeepSpeed's estimate_zero2/3_model_states_mem_needs) and what the
// difference is made of.
//
// How it stays exact: the plan replays, against a MemoryTracker, the allocations the trainer's
// objects make, in their order, without allocating them. The layout is the buffer layer's own
// compute_param_layout (its shards left out: only their size matters); the model's requests come
// from trace_gpt_micro_batch, the GPT's own control flow with no arithmetic; DDP's, the
// optimizer's and the scratch pool's are sums over that layout. FSDP's gathers, releases and
// transient gradients come from a simulation of its state machine (src/plan/fsdp_memory_sim.h)
// that tests/train/memory_plan_test.cc holds to the real one, configuration by configuration.
//
// Every rank holds the same bytes: buckets split into equal shards, and nothing else depends on
// the rank. So a plan is one rank's figures, valid for each of the dp ranks. Cost: O(params +
// layers), so a 1T-parameter model at dp 4096 plans in milliseconds.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <mxddp/fsdp.h>
#include <mxddp/memory.h>
#include <mxddp/optim.h>
#include <mxddp/train.h>

namespace mxddp {

struct MemoryPlanOptions {
  int dp = 1;
  // Where the ranks run: how many share this machine's cores (0: all dp, as the local backend
  // runs them). Sets the threads each rank computes with when TrainConfig::compute_threads is 0,
  // which sizes attention's scratch (two [64, T] tiles per thread).
  int ranks_on_this_machine = 0;
  // The iteration the run starts at: 0, or a --load checkpoint's. Only the count of iterations
  // left matters (none, one, or more: iterations after the second repeat it).
  int64_t start_iteration = 0;
  // The ranks run on the mpi backend: its f32 staging of gradient reductions (mpi_staging_bytes,
  // the largest bucket's) is charged as comm from the first iteration's gradient sync on, as train()
  // has the communicator charge it (Communicator::set_memory_tracker). The local backend has none.
  bool mpi_backend = false;
  // plan_fsdp_memory: the micro-batches of each iteration (the first micro_batches - 1 under
  // no_sync). The trainer's plans take theirs from the config.
  int micro_batches = 1;
  // plan_fsdp_memory: [param] whether its modules' backward adds its weight gradient into
  // main_grad itself (mxddp.torch's gradient accumulation fusion); empty: none is.
  std::vector<bool> fused_grads;
  // plan_fsdp_memory: HSDP (fsdp.h), Megatron's --num-distributed-optimizer-instances: the dp
  // ranks form this many replica groups of dp / it ranks each (the shard group), and a rank holds
  // FSDP's bytes at dp / it (the replica all-reduce works in place; on the mpi backend an f32 one
  // needs no staging, and bf16 grads are refused there: that staging is not planned). 1: plain FSDP.
  int num_distributed_optimizer_instances = 1;
  // Where the data-parallel object's and the optimizer's buffers live: the communicator's compute
  // (Communicator::compute(); a local group whose ranks each have a device's puts them there). The
  // params, grads, main params, optimizer state, MXFP8 copies and FSDP's gathers are then planned as
  // device bytes (MemoryPlan's usage .at(MemoryPlace::kDevice)); the model's scratch and the mpi
  // backend's staging stay host bytes. Not planned: the page-locked copies an mpi communicator on a
  // device keeps of its messages (MpiOptions::compute; staged_host_bytes). plan_ddp_memory,
  // plan_fsdp_memory and plan_param_memory; plan_train_memory refuses kDevice (train() keeps every buffer on the host).
  MemoryPlace data_parallel_place = MemoryPlace::kHost;
};

// What the bytes are made of, for the comparison with the closed forms.
struct MemoryPlanLayout {
  int64_t params_numel = 0;         // the model's params (no padding)
  int64_t buffer_numel = 0;         // the padded buffer: params + alignment + bucket-end padding
  int64_t num_buckets = 0;
  int64_t param_start_padding_numel = 0;  // params' starts rounded up to 64 elements
  int64_t bucket_end_padding_numel = 0;   // buckets' ends rounded up to lcm(dp, 128[, 65536])
  int64_t largest_unit_numel = 0;         // FSDP: the largest gather unit (padded); DDP: 0
  // [num buckets] in buffer order: each bucket's padded elements and the padding at its end.
  std::vector<std::pair<int64_t, int64_t>> bucket_numel_and_end_padding;
  int compute_threads = 0;                // the threads the plan assumed per rank
};

struct MemoryPlan {
  int dp = 1;
  // HSDP's replica groups (MemoryPlanOptions); the shard group is dp / it ranks. 1: not HSDP.
  int num_distributed_optimizer_instances = 1;
  // As RankMemory in the train report: peaks from the first iteration on (overall) and after it
  // (steady state), per category, and the peak of their sum.
  MemoryUsage overall;
  MemoryUsage steady;
  // FSDP (optim_grads_params): the peak of the gathered bytes per GatherSlot over the run.
  std::array<int64_t, kGatherSlots> peak_gathered_bytes_by_slot{};
  MemoryPlanLayout layout;
  // Tracked bytes live once the DataParallel is built: train() still holds the f32 initial values
  // then (and FSDP one bucket's staging of them), which no tracker counts.
  int64_t build_live_bytes = 0;
  int64_t build_untracked_bytes = 0;  // those initial values and that staging
};

// HSDP's shard group size for opts (dp / num_distributed_optimizer_instances) under this FSDP
// config; throws Error naming the value where the instances do not divide dp, or where the plan
// would need the replica all-reduce's mpi staging (bf16 grads on the mpi backend), not modelled.
int fsdp_shard_group_size(const MemoryPlanOptions& opts, const FsdpConfig& config);

// The memory `train(comm, config)` will hold on each of opts.dp ranks, equal to what its report
// measures (TrainResult::memory_by_rank) byte for byte. Throws Error naming a config the trainer
// would refuse (config.validate(dp)). Allocates only O(params + layers).
MemoryPlan plan_train_memory(const TrainConfig& config, const MemoryPlanOptions& opts);

// The same for a bare param list (--shapes, or a safetensors header): the param, grad, MXFP8, main
// param and optimizer state bytes of config's DDP or FSDP over these params, no model (activations
// and scratch 0). Under FSDP a unit is the params whose names share a layer index
// ("...layers.<i>." or "...h.<i>."); the others are non-unit params.
MemoryPlan plan_param_memory(const std::vector<ParamSpec>& params, const TrainConfig& config,
                             const MemoryPlanOptions& opts);

// What one rank holds for a DistributedDataParallel over `params` built with `config` as given
// (use_distributed_optimizer included, unlike the trainer's) and, when `optimizer` is set, a
// DistributedOptimizer on it, once a gradient sync and a step have run: the objects the Python
// package builds (mxddp.torch.plan). No model: activations and scratch 0. With opts.mpi_backend
// the backend's staging of the gradient reductions is charged at the sync, as comm. An optimizer
// without use_distributed_optimizer is an Error, as DistributedOptimizer refuses it.
MemoryPlan plan_ddp_memory(const std::vector<ParamSpec>& params, const DdpConfig& config,
                           std::optional<OptimizerType> optimizer, const MemoryPlanOptions& opts);

// A module whose forward runs FSDP's hooks (mxddp.torch's fsdp_units): the params its hooks name
// (registration indices), its unit, -1 for a non-unit module, and its recompute region, -1 for
// none: the modules a torch.utils.checkpoint around one module (a layer) re-runs in backward share
// a region (fine-grained units: a layer's submodules; a unit per layer: a region of one).
struct FsdpHookedModule {
  std::vector<int> params;
  int unit = -1;
  int recompute_region = -1;
};

// What one rank holds for a FullyShardedDataParallel over `params` with `units` (as its
// constructor takes them) and `config`, and, when `optimizer` is set, a DistributedOptimizer on
// it, through iterations driven as the Python package's FullyShardedDataParallel drives them (the
// objects mxddp.torch.plan plans). `hooked`: the modules with hooks in forward order; each unit is
// one of them, with exactly its unit's params, in the order the forward calls them (which need not
// be the units' own: the schedule learns it from the first pass, as the real one does). Per micro-batch:
//   forward: before_forward(every non-unit param, in registration order) once, as the wrapper's
//     forward starts (where there are any); then for each unit's module in order,
//     before_forward(params) and after_forward(params); a non-unit module has no hooks;
//   backward: walking the hooked modules in reverse: at a unit's module, before_backward(unit
//     params), main_grad(p) + grad_ready(p) for each of its params in decreasing registration
//     index, after_backward(unit params); at a non-unit module, main_grad(p) + grad_ready(p) for
//     each of its params, in reverse order of its list, whose first use in forward is this module
//     (a param read by several modules reports once, at its first reader: torch accumulates it);
//     with sharded grads (optim_grads, optim_grads_params) the non-unit params' reports are held
//     back until the last of them arrives, then main_grad of each and grad_ready of each, in
//     arrival order; a fused non-unit param (opts.fused_grads) is not held back: main_grad(p) where
//     backward first reaches a module naming it (its last reader in forward: the Function adds
//     dW there), grad_ready(p) at its first reader's;
//   recompute: as backward reaches a region's last module, after its before_backward (a unit's),
//     the region's units' forwards run again, before_forward(params) and after_forward(params)
//     each in order (the checkpoint's re-run), then that module's reports. A region's modules are
//     consecutive in `hooked`; a non-unit module in one re-runs without hooks. torch calls the
//     layer's last pre-backward first where the layer's output reaches its last unit through ops
//     that saved no tensor (a transformer layer's residual add); where one did (an activation after
//     the last Linear) the re-run comes first. The gathered bytes are the same either way, except
//     with MXFP8 weights: re-run first, the last unit's row-wise copy is released before its
//     column-wise one is gathered, so the run gathers less than planned
//     (tests/plan/fsdp_memory_plan_test.cc drives both orders).
// An iteration: optimizer->zero_grad() (start_iteration), opts.micro_batches micro-batches (all
// but the last under no_sync), finish_grad_sync, optimizer->step() (step_and_sync_params); with
// no optimizer, zero_grad_buffer, the micro-batches and finish_grad_sync. overall: from
// construction through any number of iterations; steady: an iteration after the first; live: at
// the end of an iteration. With opts.mpi_backend the backend's staging of the gradient
// reductions (the largest bucket's) is charged as comm from the first reduction on. No model:
// activations and scratch 0. Throws Error naming what FullyShardedDataParallel refuses, or a
// hooked module that breaks the rules above.
MemoryPlan plan_fsdp_memory(const std::vector<ParamSpec>& params, const std::vector<std::vector<int>>& units,
                            const std::vector<FsdpHookedModule>& hooked, const FsdpConfig& config,
                            std::optional<OptimizerType> optimizer, const MemoryPlanOptions& opts);

// Bytes per buffer element each rank keeps at rest of params, grads, main params and optimizer
// state: what one element of padding costs. FSDP's come from its per-strategy storage table
// (src/fsdp/fsdp_storage_plan.h), DDP's from the distributed optimizer's sharding.
double model_state_bytes_per_element(const TrainConfig& config, int dp);

// The closed-form figures of model states per rank (bytes), for the same params and dp.
struct ClosedFormMemory {
  // Megatron's theoretical_memory_usage, weights and optimizer: (6 + 12/dp) bytes per param with
  // the distributed optimizer (bf16 param, f32 grad, then f32 main param and two Adam moments
  // sharded), 18 without.
  double megatron_bytes = 0;
  // DeepSpeed's estimate_zero2_model_states_mem_needs (no offload): 4 N + 16 N / dp.
  double deepspeed_zero2_bytes = 0;
  // DeepSpeed's estimate_zero3_model_states_mem_needs (no offload): 4 x largest layer + 18 N / dp.
  double deepspeed_zero3_bytes = 0;
};
ClosedFormMemory closed_form_memory(int64_t params_numel, int64_t largest_layer_numel, int dp);

}  // namespace mxddp
