// FsdpStoragePlan: what one FSDP bucket holds, described once. FullyShardedDataParallel allocates
// its buffers from it, the memory plan's FsdpMemorySim charges them from it, and the per-element
// shares (memory_floor, `mxddp plan`'s padding cost, fsdp.h's table) come from the same
// per-strategy table, so none of them can say something else about a strategy's storage.
//
// Per bucket of G elements (padded to divide into dp shards), by strategy (fsdp.h's table):
//   buffer          bytes                      category  lifetime
//   params_full     G x param dtype            params    at rest (no_shard, optim, optim_grads)
//   params_shard    G/dp x param dtype         params    at rest (optim_grads_params); an MXFP8
//                                                        bucket's is the optimizer's staging
//   row_shard,      G/dp u8 each               mxfp8     at rest (MXFP8 buckets)
//   col_shard
//   row_scales,     S_row/dp, S_col/dp u8      mxfp8     at rest (MXFP8 buckets): this rank's shard
//   col_scales                                           of each orientation's E8M0 scale array (the
//                                                        bucket's MXFP8 params' mx_scale_shape in
//                                                        layout order, zero-padded to S, a multiple of dp)
//   gathered        per GatherSlot: G x param  gathered  from a gather of that slot to its release
//                   dtype (values) or G u8               (optim_grads_params)
//                   (row-, column-wise)
//   gathered_row_   S_row, S_col u8            gathered  with the row- / column-wise payload's slot
//   scales, ..col..
//   quantize_scales S_row + S_col u8           mxfp8     while a bucket's shards are quantized (the
//                                                        step, construction, a forced sync): the MAX
//                                                        all-reduce's buffer, both whole arrays
//   grads_full      G x grad dtype             grads     at rest (no_shard, optim); transient
//                                                        (optim_grads*): from the bucket's first
//                                                        gradient until its reduce-scatter lands
//   grads_shard     G/dp x grad dtype          grads     at rest (optim_grads*)
//
// Not distributed (as Megatron-FSDP at a data-parallel size of 1): in a shard group of one rank a
// shard is the whole bucket, so a gather's slot is the shard itself (no gathered buffers), and
// with no replicas either the gradients go straight into grads_shard (no transient grads_full).
#pragma once

#include <array>
#include <cstdint>
#include <string_view>
#include <vector>

#include <mxddp/fsdp.h>
#include <mxddp/memory.h>

namespace mxddp {

// What a strategy shards, the one table every figure about FSDP's storage derives from.
struct FsdpStrategyStorage {
  ShardingStrategy strategy;
  bool params_sharded;     // params rest as G/dp shards, gathered per unit; else G on every rank
  bool grads_sharded;      // grads rest as G/dp shards (plus the transient G per micro-batch)
  bool optimizer_sharded;  // main params and optimizer state: G/dp (else G)
};
const FsdpStrategyStorage& fsdp_strategy_storage(ShardingStrategy s);

// Bytes per bucket element one rank keeps at rest, by kind (no padding, no transients).
struct FsdpElementBytes {
  double params = 0;  // BF16/F32 values, or an MXFP8 element's payloads (and scales)
  double grads = 0;
  double main_params = 0;
  double optimizer_state = 0;  // every state together
  double total() const { return params + grads + main_params + optimizer_state; }
};
// optimizer_states: how many f32 states per element the optimizer keeps (Adam 2). mxfp8: the
// element is an MXFP8 param's (payloads 1 + 1 byte and scales 2/32 byte, a block of 32 having one
// per orientation, all sharded).
FsdpElementBytes fsdp_element_bytes(ShardingStrategy s, DType param_dtype, DType grad_dtype, int dp,
                                    int optimizer_states, bool mxfp8 = false);

// The grads' dtype under config: f32 with grad_reduce_in_fp32, else the param dtype.
DType fsdp_grad_dtype(const FsdpConfig& config);

enum class FsdpBuffer : uint8_t {
  kParamsFull, kParamsShard, kRowShard, kColShard, kRowScales, kColScales,
  kGatheredValues, kGatheredRowwise, kGatheredColwise, kGatheredRowScales, kGatheredColScales,
  kQuantizeScales, kGradsFull, kGradsShard,
};
inline constexpr int kFsdpBuffers = 14;
std::string_view fsdp_buffer_name(FsdpBuffer b);  // "params_full", ...

// When a buffer is alive.
enum class FsdpLifetime : uint8_t {
  kAtRest,          // from construction to destruction
  kGathered,        // from a gather of its slot to the slot's release
  kTransientGrads,  // from the bucket's first gradient of a micro-batch until its reduce-scatter lands
  kStaging,         // an MXFP8 bucket's bf16(main params): from construction to the first
                    // start_iteration, and in a step or forced sync until quantized
  kQuantizing,      // an MXFP8 bucket's whole scales: from its partial scales to its encoded shards
};
std::string_view fsdp_lifetime_name(FsdpLifetime l);  // "at rest", ...

struct FsdpBufferPlan {
  FsdpBuffer buffer;
  int64_t bytes = 0;
  MemoryCategory category;
  FsdpLifetime lifetime;
};

class FsdpStoragePlan {
 public:
  // Bucket `bucket` of layout (fsdp_param_layout of params) under config, on dp ranks.
  // replicas: HSDP's replica group size (1 without HSDP).
  static FsdpStoragePlan of_bucket(const FsdpConfig& config, int dp, const ParamLayout& layout, int bucket,
                                   const std::vector<ParamSpec>& params, int replicas = 1);
  FsdpStoragePlan() = default;
  // numel: the bucket's padded elements G (divisible by dp); mxfp8_shapes: its MXFP8 params' [M, N]
  // in layout order (none for a BF16/F32 bucket: FSDP gives a unit's MXFP8 params a bucket of their own).
  FsdpStoragePlan(ShardingStrategy strategy, DType param_dtype, DType grad_dtype, int dp, int64_t numel,
                  bool mxfp8, const std::vector<Shape>& mxfp8_shapes, int replicas = 1);

  // A gather's slot is the shard itself (a shard group of one rank; optim_grads_params): no
  // collective, no gathered bytes.
  bool gathers_are_shards() const { return gathers_are_shards_; }
  // The gradients go straight into grads_shard, accumulating over micro-batches, with no
  // reduction (one rank in all; optim_grads*).
  bool grads_in_shard() const { return grads_in_shard_; }

  // Every buffer this bucket ever holds, in allocation order at construction.
  const std::vector<FsdpBufferPlan>& buffers() const { return buffers_; }
  bool holds(FsdpBuffer b) const;
  const FsdpBufferPlan& buffer(FsdpBuffer b) const;  // Error if the bucket holds none
  int64_t bytes(FsdpBuffer b) const { return holds(b) ? buffer(b).bytes : 0; }
  // Allocated by the constructor: at rest, and an MXFP8 bucket's initial staging.
  bool allocated_at_construction(FsdpBuffer b) const;
  // What a gather of `slot` fills: the values, or a payload and its scales.
  static std::vector<FsdpBuffer> gathered_buffers(GatherSlot slot);
  // The bytes a gather of `slot` brings in (0 when the bucket has nothing in that slot).
  int64_t gathered_bytes(GatherSlot slot) const;

  int64_t numel() const { return numel_; }
  int64_t shard_numel() const { return shard_numel_; }
  bool mxfp8() const { return mxfp8_; }
  // The k-th MXFP8 param's scales in `axis`: its offset in that orientation's scale array.
  int64_t scale_offset(size_t k, QuantAxis axis) const { return scale_offsets_.at(k)[static_cast<size_t>(axis)]; }
  // An orientation's scale array: S, padded to divide into dp shards, and a rank's shard of it.
  int64_t scales_numel(QuantAxis axis) const { return scales_numel_[static_cast<size_t>(axis)]; }
  int64_t scales_shard_numel(QuantAxis axis) const { return scales_numel(axis) / dp_; }
  // Where an orientation's array starts in quantize_scales (row-wise first).
  int64_t quantize_scales_offset(QuantAxis axis) const { return axis == QuantAxis::kRow ? 0 : scales_numel(QuantAxis::kRow); }

 private:
  void add(FsdpBuffer b, int64_t bytes, MemoryCategory category, FsdpLifetime lifetime);

  int64_t numel_ = 0, shard_numel_ = 0;
  int dp_ = 1;
  bool mxfp8_ = false;
  bool gathers_are_shards_ = false, grads_in_shard_ = false;
  std::vector<FsdpBufferPlan> buffers_;
  std::array<int, kFsdpBuffers> index_{};  // [buffer] its index in buffers_ + 1; 0: not held
  std::vector<std::array<int64_t, 2>> scale_offsets_;  // [k][axis]
  std::array<int64_t, 2> scales_numel_{};               // [axis] padded to a multiple of dp
};

}  // namespace mxddp
