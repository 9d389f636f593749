// FsdpMemorySim: FullyShardedDataParallel's allocations and frees, without the data, for the memory
// plan (plan.h).
//
// What each bucket holds, and the bytes and category of each buffer, come from FsdpStoragePlan
// (src/fsdp/fsdp_storage_plan.h), from which FullyShardedDataParallel allocates; this class says
// only when each is charged and refunded.
// It is the state machine of src/fsdp/ (the gather state per group and slot, the releases, the
// bounded reduce-scatter queue that frees each bucket's transient unsharded grads, the MXFP8
// staging shards of a step and a forced sync), kept to the allocations: every buffer the real
// object would create or drop is a charge or a refund on the tracker here, in the same order. What
// the hooks decide (which pass, what to wait for, prefetch, release and reduce) is not copied:
// FsdpHookSchedule (fsdp.h) decides it for both. It runs one rank: every rank's state is the same.
// tests/train/memory_plan_test.cc compares plan and measurement over generated configurations;
// any change to the FSDP's allocation pattern must come here too, or that test fails.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include <mxddp/buffer.h>
#include <mxddp/fsdp.h>
#include <mxddp/memory.h>

#include "../fsdp/fsdp_hook_schedule.h"
#include "../fsdp/fsdp_storage_plan.h"

namespace mxddp {

class FsdpMemorySim final : private FsdpHookActions {
 public:
  // As FullyShardedDataParallel(comm of size dp, params, units, config, tracker, initial values,
  // a replica communicator of `replicas` ranks or none): charges what the constructor allocates.
  FsdpMemorySim(const std::vector<ParamSpec>& params, const std::vector<std::vector<int>>& units,
                const FsdpConfig& config, int dp, MemoryTracker& tracker, int replicas = 1);

  const ParamLayout& layout() const { return layout_; }
  int64_t optimizer_bucket_numel(int bucket) const;  // DistributedOptimizer's main param elements
  int64_t largest_unit_numel() const;

  // DataParallel's calls, as the trainer and the model make them.
  void main_grad(int param);
  void grad_ready(int param);
  void before_forward(const std::vector<int>& params);
  void after_forward(const std::vector<int>& params);
  void before_backward(const std::vector<int>& params);
  void after_backward(const std::vector<int>& params);
  void set_no_sync(bool on) { no_sync_ = on; }
  void start_iteration();
  void finish_grad_sync();
  void step_and_sync_params();
  void force_param_sync();
  void release_gathered_params();
  void zero_grad_buffer();  // FullyShardedDataParallel::zero_grad_buffer (start_iteration's first step)
  // Reductions issued since construction: the mpi backend's staging comes with the first.
  int64_t reductions_issued() const { return reductions_issued_; }

  const std::array<int64_t, kGatherSlots>& peak_gathered_bytes() const { return gathered_bytes_peak_; }

 private:
  struct Bucket {
    FsdpStoragePlan storage;  // what it holds, and the bytes of each buffer
    int64_t numel = 0;  // G (padded)
    int64_t shard = 0;  // G / dp
    bool mxfp8 = false;
    int64_t staging_bytes = 0;     // an MXFP8 bucket's params_shard while alive
    int64_t grads_full_bytes = 0;  // the sharded-grad strategies' transient [G] grads while alive
    std::array<int64_t, kGatherSlots> gathered_bytes{};
    bool reduction_in_flight = false;
  };
  using Slots = std::vector<GatherSlot>;

  bool shards_params() const { return fsdp_shards_params(config_.data_parallel_sharding_strategy); }
  bool shards_grads() const { return fsdp_shards_grads(config_.data_parallel_sharding_strategy); }
  int num_units() const { return static_cast<int>(unit_buckets_.size()); }
  int non_unit_group() const { return num_units(); }
  int unit_of_module(const std::vector<int>& params) const;
  const std::vector<int>& group_buckets(int group) const override;
  int64_t group_numel(int group) const override;
  Slots slots_for(int group, FsdpPhase pass) const override;
  uint8_t& state(int group, GatherSlot slot) { return gather_state_[static_cast<size_t>(group)][static_cast<size_t>(slot)]; }
  bool holds_slot(int group, GatherSlot slot) const override {
    return gather_state_[static_cast<size_t>(group)][static_cast<size_t>(slot)] != 0;
  }
  bool holds_any_slot(int group) const;
  int units_gathered() const override;
  void dispatch_gather(int group, GatherSlot slot) override;
  void wait_gather(int group, FsdpPhase pass) override;
  void release_slot(int group, GatherSlot slot) override;
  void release_group(int group) override;
  void issue_reduction(int bucket) override;
  void complete_oldest_reduction();
  void complete_reductions() override;
  void allocate_staging(int bucket);
  void free_staging(int bucket);
  // An MXFP8 bucket's whole scales, from its partial scales to its encoded shards (fsdp_mxfp8.cc).
  void start_quantize(int bucket);
  void finish_quantize(int bucket, bool keep_staging);
  void quantize_staged_shards(bool keep_staging);

  FsdpConfig config_;
  int dp_;
  MemoryTracker& tracker_;
  ParamLayout layout_;
  std::vector<int> unit_of_param_;
  std::vector<Bucket> buckets_;
  std::vector<std::vector<int>> unit_buckets_;
  std::vector<int> non_unit_buckets_;
  int64_t rs_queue_numel_ = 0;
  std::vector<std::array<uint8_t, kGatherSlots>> gather_state_;  // 0 empty, 1 in flight, 2 ready
  std::array<int64_t, kGatherSlots> gathered_bytes_{};
  std::array<int64_t, kGatherSlots> gathered_bytes_peak_{};
  std::vector<int> reductions_;  // buckets, oldest first
  int64_t reductions_numel_ = 0;
  int64_t reductions_issued_ = 0;
  std::vector<bool> reduced_;
  bool no_sync_ = false;
  FsdpHookSchedule schedule_;
};

}  // namespace mxddp
