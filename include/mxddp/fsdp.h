// mxddp fsdp: fully sharded data parallel (Megatron-FSDP, ZeRO-3) beside DDP.
//
// Owns: FsdpConfig (Megatron's names), FullyShardedDataParallel.
//
// Units: the model names its units (a decoder layer each, or with the fine-grained param gather
// each of a layer's weighted submodules: see docs/fsdp.md); the params of no unit (embeddings,
// the final norm) are gathered at their first use in an iteration and kept until
// finish_grad_sync. Buckets follow the layout rule with a bucket per (unit, dtype): every bucket
// is padded to divide into dp equal shards, and a rank keeps only its shards of what the strategy
// shards. Bytes per param per rank at rest (bf16 params, f32 grads and main params, Adam, dp N):
//
//   strategy            params   grads   main + Adam    total
//   no_shard            2        4       12             18
//   optim               2        4       12/N           6 + 12/N
//   optim_grads         2        4/N     12/N           2 + 16/N
//   optim_grads_params  2/N      4/N     12/N           18/N
//     MXFP8 params      (2 + 1/16)/N     12/N           (18 + 1/16)/N
//
// plus the padding (src/fsdp/fsdp_storage_plan.h derives every such figure from one per-strategy
// table, and lists each buffer a bucket holds). With f32 params each param shard is its own main
// param (optim.h): main + Adam is 8 (8/N), and optim_grads_params keeps 16/N.
// MXFP8 params (ParamSpec::mxfp8, optim_grads_params only; Megatron's fp8_param_gather under FSDP)
// rest as shards of their row-wise and column-wise E4M3/E5M2 payloads, 1 + 1 bytes per element / N,
// and of both orientations' E8M0 scale arrays (1/32 + 1/32 byte per element / N, each array zero-
// padded to divide by N), each orientation's scales gathered with its payload; each unit's MXFP8
// params form a bucket of their own beside its BF16 one.
// Transient: optim_grads_params's gathered units (the current one plus the
// prefetch, or at most two with fsdp_double_buffer) and non-unit params, in the tracker category
// "gathered"; the sharded-grad strategies' unsharded grad buckets, from a bucket's first gradient
// until its reduce-scatter has landed in the shard, counted as "grads".
// On one rank nothing is distributed, as in Megatron-FSDP at a data-parallel size of 1: a shard is
// the whole bucket, a unit's gather views it in place (no gathered bytes, no all-gather), and with
// no HSDP replicas the grads go straight into the grad shard and accumulate over micro-batches
// there (no transient grads, no reduce-scatter).
//
// One iteration (every collective on the communicator's queue, in program order, so the same on
// every rank):
//   start_iteration (the optimizer's zero_grad): zero the grads; with overlap_param_gather, gather
//     the non-unit params and the first unit and prefetch within the budget;
//   pre-forward(unit): wait for it, prefetch the next units within the budget;
//   post-forward(unit): release it;
//   pre-backward(unit): re-gather, prefetch the previous units within the budget;
//   pre-forward(unit) during backward (a recompute re-running the unit's forward; recognised as a
//     pre-forward after a pre-backward, or of a unit at or before the last forward unit): gather
//     it without prefetch; its post-forward releases only the MXFP8 row-wise payloads (backward
//     reads column-wise) and keeps BF16 values for the unit's backward;
//   post-backward(unit): release whatever of it is still gathered (every gather is released once)
//     and start its gradients' reduce-scatter (all-reduce for no_shard): every micro-batch for
//     optim_grads*, the last one only for no_shard and optim;
//   finish_grad_sync: wait, fold the reduced grads into the shards, release the non-unit params;
//   the optimizer step on the shards, then (optim, optim_grads) the all-gather of the updated
//     param shards into the full params, or (MXFP8 buckets) the quantization of the updated shards:
//     each rank's partial block scales, a u8 MAX all-reduce (of the bucket's whole scale arrays,
//     transient, two buckets at a time), then its shards of both orientations' payloads and scales
//     (bitwise what quantizing the whole gathered tensor gives; quant.h's mx_shard_scales).
// With MXFP8 params a gather is per slot (GatherSlot): forward gathers values and row-wise,
// backward values and column-wise, a recompute values and row-wise (an MXFP8 slot: the payload
// and that orientation's scales).
// Hybrid sharding (HSDP; Megatron-FSDP's num_distributed_optimizer_instances, FSDP2's 2-D mesh
// ("replicate", "shard")): with a replica communicator, `comm` is the shard group (the ranks that
// split each bucket between them, e.g. a host's) and `replica` joins this rank to the ranks of the
// other shard groups that hold the same shard index. Everything above happens inside the shard
// group (buckets padded to divide by its size, gathers, the reduce-scatter); each reduction's
// result (the reduced shard, or the whole bucket for no_shard) is then all-reduced across the
// replica group, issued as soon as the shard group's reduction lands, from a thread of the
// engine's own (the main thread keeps computing), in issue order, so in the same order on every
// rank. The 1/(shard x replicas) prescale rides in the first reduction: the gradient is the mean
// over every rank, as DDP over them all gives. Each replica then updates its identical shard;
// communicator() is the shard group, so the optimizer's grad norm counts each element once.
// Bytes per rank are FSDP's at dp = the shard group's size; the replica all-reduce is in place
// (the mpi backend stages a bf16 one in f32, charged as comm by that communicator). One exception:
// a shard group of one keeps each micro-batch's whole grads for the replica all-reduce, which FSDP
// on one rank in all does without.
// The all-gather prefetch budget is suggested_communication_unit_size / 2 elements and the
// reduce-scatter queue holds at most suggested_communication_unit_size elements in flight; both are
// caps (Megatron turns them into floors of 5e8 and 1e9 elements with max(1e9, ...)).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <mxddp/data_parallel.h>
#include <mxddp/data_parallel_fields.h>
#include <mxddp/quant.h>

namespace mxddp {

enum class ShardingStrategy : uint8_t { kNoShard, kOptim, kOptimGrads, kOptimGradsParams };
std::string_view sharding_strategy_name(ShardingStrategy s);  // "no_shard", "optim", ...
// Throws Error naming the value and the valid names.
ShardingStrategy parse_sharding_strategy(std::string_view name);

// When FSDP gathers each decoder layer's submodules as units of their own (the fine-grained param
// gather, Megatron's --megatron-fsdp-enable-fine-grained-param-gather); the rules and the decision
// are in fsdp_fine_grained.h.
//   kMegatron: Megatron's merged rule: on for MXFP8 params with fp8_param_gather, or with the flag.
//   kRecomputeAware: the rule discussed in review of Megatron-LM PR #4181: on where it is required
//     (MXFP8 params with fp8_param_gather and a selective recompute that re-runs weighted modules),
//     otherwise as the flag says.
enum class FineGrainedParamGatherPolicy : uint8_t { kMegatron, kRecomputeAware };
std::string_view fine_grained_param_gather_policy_name(FineGrainedParamGatherPolicy p);  // "megatron", ...
// Throws Error naming the value and the valid names.
FineGrainedParamGatherPolicy parse_fine_grained_param_gather_policy(std::string_view name);

struct FsdpConfig {
  ShardingStrategy data_parallel_sharding_strategy = ShardingStrategy::kOptimGradsParams;
  // Gathers run asynchronously and are prefetched within the budget; off: each unit is gathered
  // (and, for optim / optim_grads, the whole model after the step) synchronously when needed.
  bool overlap_param_gather = false;
  // Reductions start at each unit's post-backward and run while backward goes on; off, no_shard
  // and optim reduce everything in finish_grad_sync, and the sharded-grad strategies wait for
  // each unit's reduce-scatter at its post-backward.
  bool overlap_grad_reduce = false;
  // Elements; nullopt: twice the average unit's elements (Megatron's default).
  std::optional<int64_t> suggested_communication_unit_size;
  // At most two units gathered (or in flight) at once, whatever the budget allows.
  bool fsdp_double_buffer = false;
  bool grad_reduce_in_fp32 = true;  // false keeps grads in param_dtype
  DType megatron_fsdp_main_params_dtype = DType::kF32;  // f32 only
  DType param_dtype = DType::kBF16;                     // bf16 or f32
  // The format of the params marked mxfp8 (DistributedDataParallelConfig's fields of the same names).
  Fp8Format mxfp8_elem = Fp8Format::kE4M3;
  ScaleMode mxfp8_scale_mode = ScaleMode::kRceil;
  // Tri-state, so that "off" can be said explicitly: nullopt (neither flag given) lets the policy
  // decide; true is --megatron-fsdp-enable-fine-grained-param-gather; false is
  // --no-megatron-fsdp-enable-fine-grained-param-gather, which is an error where the policy requires
  // fine-grained. The trainer resolves it (decide_fine_grained_param_gather) into the units it
  // gives FullyShardedDataParallel, which itself only sees units.
  std::optional<bool> megatron_fsdp_enable_fine_grained_param_gather;
  FineGrainedParamGatherPolicy fine_grained_param_gather_policy = FineGrainedParamGatherPolicy::kRecomputeAware;
};

template <>
struct FieldEnum<ShardingStrategy> {
  static std::string_view name(ShardingStrategy s) { return sharding_strategy_name(s); }
  static ShardingStrategy parse(std::string_view s) { return parse_sharding_strategy(s); }
  static std::vector<std::string> names() { return {"no_shard", "optim", "optim_grads", "optim_grads_params"}; }
};
template <>
struct FieldEnum<FineGrainedParamGatherPolicy> {
  static std::string_view name(FineGrainedParamGatherPolicy p) { return fine_grained_param_gather_policy_name(p); }
  static FineGrainedParamGatherPolicy parse(std::string_view s) { return parse_fine_grained_param_gather_policy(s); }
  static std::vector<std::string> names() { return {"megatron", "recompute-aware"}; }
};

// Every FsdpConfig field, once (config_fields.h): `mxddp train`'s flags, its report's "fsdp" section
// and a checkpoint manifest's "fsdp" section come from here. The fields DdpConfig has too come
// first, from their shared description (data_parallel_fields.h): `mxddp train` registers their
// flags once, with DdpConfig's, and copies the values here. The tri-state fine-grained flag is
// spelled twice, on and (CLI11's "!") explicitly off; neither leaves it unset. A field without a
// flag is set by the command (megatron_fsdp_main_params_dtype is f32 only).
constexpr auto describe_fields(std::type_identity<FsdpConfig>) {
  using C = FsdpConfig;
  return std::tuple_cat(
      describe_shared_data_parallel_fields<C>(),
      std::tuple{
          ConfigField<C, ShardingStrategy>{"data_parallel_sharding_strategy", "--data-parallel-sharding-strategy",
                                           "What FSDP shards: no_shard, optim, optim_grads or optim_grads_params",
                                           &C::data_parallel_sharding_strategy},
          ConfigField<C, std::optional<int64_t>>{
              "suggested_communication_unit_size", "--suggested-communication-unit-size",
              "Elements; the gather prefetch budget is half, the reduce-scatter queue all (default: 2 x a unit)",
              &C::suggested_communication_unit_size, kPositive},
          ConfigField<C, bool>{"fsdp_double_buffer", "--fsdp-double-buffer", "At most two units gathered at once",
                               &C::fsdp_double_buffer},
          ConfigField<C, DType>{"megatron_fsdp_main_params_dtype", "", "The main params' dtype (f32 only)",
                                &C::megatron_fsdp_main_params_dtype},
          ConfigField<C, std::optional<bool>>{
              "megatron_fsdp_enable_fine_grained_param_gather",
              "--megatron-fsdp-enable-fine-grained-param-gather,!--no-megatron-fsdp-enable-fine-grained-param-gather",
              "Each weighted submodule (norm, qkv, proj, fc1, fc2) is its own unit: gathered just before it runs and "
              "released after, lowering the peak gathered bytes; the --no- form: explicitly off (an error where the "
              "policy requires it); neither: the policy decides",
              &C::megatron_fsdp_enable_fine_grained_param_gather},
          ConfigField<C, FineGrainedParamGatherPolicy>{
              "fine_grained_param_gather_policy", "--fine-grained-param-gather-policy",
              "When fine-grained is on: megatron (MXFP8 + fp8 param gather, or the flag) or recompute-aware "
              "(required only for MXFP8 + selective recompute of mlp or layernorm, otherwise the flag)",
              &C::fine_grained_param_gather_policy},
      });
}

// What one gather of a group brings in: the values of its BF16 (or F32) params, or one orientation
// of its MXFP8 params' payloads. Forward and a recompute read row-wise, backward's data gradient
// column-wise; a BF16 bucket serves every pass from its one gather.
enum class GatherSlot : uint8_t { kValues, kRowwise, kColwise };
inline constexpr int kGatherSlots = 3;
std::string_view gather_slot_name(GatherSlot s);  // "values", "rowwise", "colwise"

// What a strategy shards besides the optimizer state: params (optim_grads_params), grads
// (optim_grads and optim_grads_params).
bool fsdp_shards_params(ShardingStrategy s);
bool fsdp_shards_grads(ShardingStrategy s);

// Throws Error naming what FullyShardedDataParallel refuses in this config, params and units.
void check_fsdp_config(const FsdpConfig& config, const std::vector<ParamSpec>& params,
                       const std::vector<std::vector<int>>& units);

// [num params]: each param's unit (its index in units), -1 for the non-unit params.
std::vector<int> fsdp_unit_of_param(size_t num_params, const std::vector<std::vector<int>>& units);

// The layout FullyShardedDataParallel gives these params: the distributed optimizer's rule with no
// bucket size, a bucket per (unit, MXFP8 or not), a unit's MXFP8 params after its others.
// compute_shards false: LayoutOptions::compute_shards (for a memory plan).
ParamLayout fsdp_param_layout(const std::vector<ParamSpec>& params, const std::vector<int>& unit_of_param, int dp,
                              bool compute_shards = true);

class FsdpEngine;  // the implementation (src/fsdp/fsdp_engine.h)

class FullyShardedDataParallel final : public DataParallel {
 public:
  // units: the params of each unit (registration indices), in forward order; a param in none is a
  // non-unit param. initial_values: one view per param (f32 or param_dtype); every rank keeps
  // only what its strategy keeps of them. comm and tracker must outlive this object.
  // replica: null for plain FSDP; otherwise HSDP (above): comm is the shard group and replica the
  // replica group (every rank passes one, of the same size; it too must outlive this object). Other
  // HSDP objects may share it (their replica all-reduces go through one queue per communicator, in
  // issue order); nothing else may issue collectives on it while they live.
  FullyShardedDataParallel(Communicator& comm, const std::vector<ParamSpec>& params,
                           const std::vector<std::vector<int>>& units, const FsdpConfig& config,
                           MemoryTracker& tracker, const std::vector<TensorView>& initial_values,
                           Communicator* replica = nullptr);
  ~FullyShardedDataParallel() override;  // waits for collectives still in flight
  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  const FsdpConfig& config() const;
  Communicator& communicator() const override;  // the shard group
  Compute& compute() const override;  // the shards and gathers': the communicator's
  Communicator* replica_communicator() const;    // HSDP's replica group; null without HSDP
  const std::vector<ParamSpec>& params() const override;
  DType param_dtype() const override;
  DType grad_dtype() const override;
  std::string describe() const override;

  TensorView param(int index) const override;
  bool is_mxfp8(int index) const override;
  Mxfp8View mxfp8_param(int index, QuantAxis axis) const override;
  TensorView main_grad(int index) override;
  void grad_ready(int index) override;
  void before_forward(const std::vector<int>& module_params) override;
  void after_forward(const std::vector<int>& module_params) override;
  void before_backward(const std::vector<int>& module_params) override;
  void after_backward(const std::vector<int>& module_params) override;
  void release_gathered_params() override;

  void finish_grad_sync() override;
  void zero_grad_buffer() override;

  const ParamLayout& layout() const override;
  OptimizerBucket optimizer_bucket(int bucket) const override;
  OptimizerBucketIo optimizer_io(int bucket) const override;
  TensorView initial_params(int bucket) const override;
  void step_and_sync_params(const std::function<void(int bucket)>& update) override;
  void start_iteration(const std::function<void()>& stage) override;
  void force_param_sync(const std::function<void()>& stage) override;

  int num_units() const;
  // The most bytes gathered (or in flight) at once in each slot since construction or the last
  // reset (the report's peak gathered bytes); the sum over slots at any moment is the tracker's
  // kGathered.
  int64_t peak_gathered_bytes(GatherSlot slot) const;
  void reset_peak_gathered_bytes();

 protected:
  void enter_no_sync() override;
  void exit_no_sync() override;

 private:
  friend FsdpEngine& fsdp_engine(FullyShardedDataParallel& fsdp);
  std::unique_ptr<FsdpEngine> engine_;
};

}  // namespace mxddp
