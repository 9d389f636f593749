// FsdpEngine: FullyShardedDataParallel's implementation (internal to src/fsdp; the public class in
// include/mxddp/fsdp.h forwards to it): the buckets' storage per strategy, the gather state per unit
// and slot, the reductions, the optimizer's side, and the observability the tests and benchmarks
// read through fsdp_engine(fsdp). The behaviour is documented in fsdp.h.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <mxddp/fsdp.h>

#include "fsdp_hook_schedule.h"
#include "fsdp_storage_plan.h"

namespace mxddp {

class ProgressQueue;  // src/comm/progress_queue.h

// Observability: one record per collective issued, in issue order.
struct FsdpCollective {
  // kReplicaAllReduce: HSDP's all-reduce of a bucket's reduction across the replica group.
  enum class Kind : uint8_t { kAllGather, kReduceScatter, kAllReduce, kReplicaAllReduce } kind;
  int bucket = 0;
  bool operator==(const FsdpCollective&) const = default;
};

// Observability: one record per gather or release of one slot of a group (a unit, or the non-unit
// params, group == num_units()), in order, with the phase of the hook (or prefetch) that did it.
struct FsdpGatherEvent {
  enum class Kind : uint8_t { kGather, kRelease } kind;
  int group = 0;
  FsdpPhase phase = FsdpPhase::kForward;
  GatherSlot slot = GatherSlot::kValues;
  bool operator==(const FsdpGatherEvent&) const = default;
};

class FsdpEngine final : private FsdpHookActions {
 public:
  // units: the params of each unit (registration indices), in forward order; a param in none is a
  // non-unit param. initial_values: one view per param (f32 or param_dtype); every rank keeps
  // only what its strategy keeps of them. comm and tracker must outlive this object.
  FsdpEngine(Communicator& comm, const std::vector<ParamSpec>& params,
             const std::vector<std::vector<int>>& units, const FsdpConfig& config,
             MemoryTracker& tracker, const std::vector<TensorView>& initial_values, Communicator* replica = nullptr);
  ~FsdpEngine();  // waits for collectives still in flight
  FsdpEngine(const FsdpEngine&) = delete;
  FsdpEngine& operator=(const FsdpEngine&) = delete;

  const FsdpConfig& config() const { return config_; }
  Communicator& communicator() const { return comm_; }
  Communicator* replica_communicator() const { return replica_; }
  Compute& compute() const { return compute_; }  // where the shards and gathers live: the communicator's
  const std::vector<ParamSpec>& params() const { return specs_; }
  int num_params() const { return static_cast<int>(specs_.size()); }
  DType param_dtype() const { return config_.param_dtype; }
  DType grad_dtype() const;
  std::string describe() const;

  TensorView param(int index) const;
  bool is_mxfp8(int index) const;
  Mxfp8View mxfp8_param(int index, QuantAxis axis) const;
  TensorView main_grad(int index);
  void grad_ready(int index);
  void before_forward(const std::vector<int>& module_params);
  void after_forward(const std::vector<int>& module_params);
  void before_backward(const std::vector<int>& module_params);
  void after_backward(const std::vector<int>& module_params);
  void release_gathered_params();

  void finish_grad_sync();
  void zero_grad_buffer();

  const ParamLayout& layout() const { return layout_; }
  OptimizerBucket optimizer_bucket(int bucket) const;
  OptimizerBucketIo optimizer_io(int bucket) const;
  TensorView initial_params(int bucket) const;
  void step_and_sync_params(const std::function<void(int bucket)>& update);
  void start_iteration(const std::function<void()>& stage);
  void force_param_sync(const std::function<void()>& stage);

  // ---- Observability for tests and benchmarks.
  int num_units() const { return static_cast<int>(unit_buckets_.size()); }
  int64_t prefetch_budget_numel() const { return prefetch_budget_numel_; }
  int64_t reduce_scatter_queue_numel() const { return rs_queue_numel_; }
  const std::vector<int>& unit_buckets(int unit) const { return unit_buckets_.at(static_cast<size_t>(unit)); }
  const std::vector<int>& non_unit_buckets() const { return non_unit_buckets_; }
  int64_t gathers_started() const { return gathers_; }   // unit or non-unit gathers (optim_grads_params)
  int64_t releases_done() const { return releases_; }
  bool anything_gathered() const;
  FsdpPhase phase() const { return schedule_.phase(); }  // the pass the last hook was in
  int units_gathered() const override;  // units gathered or in flight (the non-unit params not counted)
  // The most bytes gathered (or in flight) at once in each slot since construction or the last
  // reset; the sum over slots at any moment is the tracker's kGathered.
  int64_t peak_gathered_bytes(GatherSlot slot) const { return gathered_bytes_peak_[static_cast<size_t>(slot)]; }
  void reset_peak_gathered_bytes() { gathered_bytes_peak_ = gathered_bytes_; }
  // Every gather and release since construction (cleared by clear_gather_events).
  const std::vector<FsdpGatherEvent>& gather_events() const { return events_; }
  void clear_gather_events() { events_.clear(); }
  // Every collective since construction, in issue order (cleared by clear_collective_log).
  const std::vector<FsdpCollective>& collective_log() const { return log_; }
  void clear_collective_log() { log_.clear(); }
  // What bucket `bucket` holds, and (MXFP8 buckets) this rank's shard of its `axis` scale array:
  // u8 [storage_plan(bucket).scales_shard_numel(axis)].
  const FsdpStoragePlan& storage_plan(int bucket) const;
  TensorView mxfp8_scales_shard(int bucket, QuantAxis axis) const;

 void enter_no_sync() { ++no_sync_depth_; }
  void exit_no_sync() { --no_sync_depth_; }

 private:
  struct Bucket;  // storage and state of one bucket (src/fsdp/fsdp_bucket.h)
  using Slots = std::vector<GatherSlot>;

  bool shards_params() const { return fsdp_shards_params(config_.data_parallel_sharding_strategy); }
  bool shards_grads() const { return fsdp_shards_grads(config_.data_parallel_sharding_strategy); }
  int unit_of_module(const std::vector<int>& module_params, std::string_view hook) const;
  // Gather groups: 0..U-1 the units, U the non-unit params.
  int non_unit_group() const { return num_units(); }
  const std::vector<int>& group_buckets(int group) const override;
  // The slots a pass reads that the group has (forward and recompute: values and row-wise;
  // backward: values and column-wise).
  Slots slots_for(int group, FsdpPhase pass) const override;
  uint8_t& slot_state(int group, GatherSlot slot);  // 0 empty, 1 in flight, 2 ready
  uint8_t slot_state(int group, GatherSlot slot) const;
  bool holds_slot(int group, GatherSlot slot) const override { return slot_state(group, slot) != 0; }
  bool holds_any_slot(int group) const;  // some slot gathered or in flight
  void dispatch_gather(int group, GatherSlot slot) override;
  void wait_gather(int group, FsdpPhase pass) override;
  void release_slot(int group, GatherSlot slot) override;
  void release_group(int group) override;
  int64_t group_numel(int group) const override;
  // MXFP8 buckets: the optimizer writes bf16(main params) into a staging shard, from which each
  // rank quantizes its shards of both orientations (src/fsdp/fsdp_mxfp8.cc).
  void allocate_staging(int bucket);
  // The orientation an MXFP8 param's copy in a slot axis is encoded in. The row- and column-wise
  // slots (payload shards, scale arrays, gathers) are per pass: kRow what forward and recompute
  // read, kCol what backward reads. That is the orientation itself for an nn.Linear weight and the
  // other one for a weight read column-wise in forward (ParamSpec::mxfp8_colwise_forward). Its own
  // inverse: the slot axis holding an orientation.
  QuantAxis encoding_axis(int param, QuantAxis slot_axis) const;
  // An MXFP8 param's scales in a slot axis: u8 mx_scale_shape(M, N, encoding_axis), in `array`,
  // the slot axis's whole scale array of its bucket (gathered, or the quantization's).
  TensorView param_scales(int param, QuantAxis slot_axis, const TensorView& array) const;
  // The slot axis's array in the bucket's quantize_scales.
  TensorView quantize_scales(int bucket, QuantAxis slot_axis) const;
  Work start_shard_scales(int bucket);  // this rank's partial scales, MAX all-reduced (async)
  // Waits for the scales, encodes the shards and (unless keep_staging) frees the staging.
  void finish_shard_quantize(int bucket, const Work& scales, bool keep_staging = false);
  // Every MXFP8 bucket's staging quantized (construction, a forced sync).
  void quantize_staged_shards(bool keep_staging);
  void issue_reduction(int bucket) override;
  void complete_oldest_reduction();
  void complete_reductions() override;
  void issue_full_param_gathers();
  void wait_full_param_gathers();
  void check_all_ready(const std::vector<int>& params, std::string_view hook) const;

  Communicator& comm_;
  Compute& compute_;                 // comm_'s: every bucket's memory and the work on it
  Communicator* replica_ = nullptr;  // HSDP's replica group, or null
  // HSDP: the thread that issues each replica all-reduce once its shard group's reduction has
  // landed, in issue order, so the main thread never blocks on the chain. One per replica
  // communicator, shared by every engine on it, so that their replica all-reduces keep the
  // program's issue order on every rank.
  std::shared_ptr<ProgressQueue> replica_chain_;
  FsdpConfig config_;
  std::vector<ParamSpec> specs_;
  ParamLayout layout_;
  MemoryTracker& tracker_;
  std::vector<std::unique_ptr<Bucket>> buckets_;  // [num buckets]
  std::vector<std::vector<int>> unit_buckets_;     // [unit] buckets, in buffer order
  std::vector<int> non_unit_buckets_;
  std::vector<int> unit_of_param_;                 // [param], -1 for non-unit
  std::vector<int> bucket_unit_;                   // [bucket], -1 for non-unit
  std::vector<std::array<int64_t, 2>> scale_offset_;  // [param][axis] in its bucket's axis scale array (MXFP8)
  int64_t prefetch_budget_numel_ = 0;
  int64_t rs_queue_numel_ = 0;
  // Gather state per group and slot: [U + 1][kGatherSlots].
  std::vector<std::array<std::vector<Work>, kGatherSlots>> gather_works_;
  std::vector<std::array<uint8_t, kGatherSlots>> gather_state_;
  std::array<int64_t, kGatherSlots> gathered_bytes_{}, gathered_bytes_peak_{};
  FsdpHookSchedule schedule_;          // which pass a hook is in, and what it gathers and reduces
  // Reductions in flight, oldest first: (bucket, its work).
  std::vector<std::pair<int, Work>> reductions_;
  int64_t reductions_numel_ = 0;
  std::vector<bool> reduced_;          // [bucket] its reduction was issued this micro-batch
  std::vector<Work> full_param_gathers_;  // optim / optim_grads after the step, [bucket]
  std::vector<bool> full_param_waited_;
  bool full_param_gather_pending_ = false;
  int no_sync_depth_ = 0;
  int64_t gathers_ = 0, releases_ = 0;
  std::vector<FsdpCollective> log_;
  std::vector<FsdpGatherEvent> events_;
};

// The engine behind a FullyShardedDataParallel: its observability for tests and benchmarks.
FsdpEngine& fsdp_engine(FullyShardedDataParallel& fsdp);
const FsdpEngine& fsdp_engine(const FullyShardedDataParallel& fsdp);

}  // namespace mxddp
