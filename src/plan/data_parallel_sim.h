// The planner's DataParallel (DDP or FSDP) as far as memory goes, shared by plan_train_memory
// (memory_plan.cc, which drives it with the GPT's trace) and plan_fsdp_memory (fsdp_memory_plan.cc,
// which drives it with a torch module's hooked modules): what construction charges, and the calls
// of an iteration, an evaluation and a forced sync. It needs the model's GptCallTrace interface
// only, not the model, so the Python extension links it without the model's kernels.
#pragma once

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <mxddp/model.h>
#include <mxddp/plan.h>

#include "ddp_memory_sim.h"
#include "fsdp_memory_sim.h"

namespace mxddp {

// GlobalMemoryBuffer's growth, as charges: a request above a name's capacity frees the old block
// and takes max(request, 2 x capacity).
class ScratchSim {
 public:
  explicit ScratchSim(MemoryTracker& tracker) : tracker_(tracker) {}
  void request(const std::string& name, int64_t numel) {
    int64_t& capacity = capacity_numel_[name];
    if (numel <= capacity) return;
    if (capacity > 0) tracker_.on_free(MemoryCategory::kScratch, capacity * 4);
    capacity = std::max(numel, 2 * capacity);
    tracker_.on_allocate(MemoryCategory::kScratch, capacity * 4);
  }

 private:
  MemoryTracker& tracker_;
  std::map<std::string, int64_t> capacity_numel_;  // f32 elements, as the model asks for them
};

// One rank's DataParallel (DDP or FSDP) as far as memory goes: construction charges, and the
// calls of an iteration, an evaluation and a forced sync. DDP allocates nothing after construction.
class DataParallelSim : public GptCallTrace {
 public:
  DataParallelSim(MemoryTracker& tracker, ScratchSim* scratch) : tracker_(tracker), scratch_(scratch) {}

  // The mpi backend's staging for this DataParallel's gradient reductions: one per bucket, each
  // in place (this rank's block of the bucket receives its shard), all-reduced (count = the
  // bucket) or reduce-scattered (count = the shard). The backend keeps the largest.
  void stage_reductions_for_mpi(bool reduce_scatter, DType grad_dtype, int dp) {
    mpi_staging_bytes_ = gradient_sync_staging_bytes(layout_, reduce_scatter, grad_dtype, dp);
  }

  // train()'s DDP: the distributed optimizer always on (trainer.cc).
  void build_ddp(const std::vector<ParamSpec>& specs, DdpConfig c, int dp, bool mpi) {
    c.use_distributed_optimizer = true;
    layout_ = charge_ddp_construction(specs, c, dp, tracker_);
    for (const BucketPlacement& b : layout_.buckets) optimizer_numel_.push_back(b.range.size() / dp);
    param_dtype_ = c.param_dtype;
    if (mpi) stage_reductions_for_mpi(!c.force_all_reduce, c.grad_reduce_in_fp32 ? DType::kF32 : c.param_dtype, dp);
  }

  // dp: the shard group's size; replicas: HSDP's replica group's (1 without HSDP).
  void build_fsdp(const std::vector<ParamSpec>& specs, const std::vector<std::vector<int>>& units,
                  const FsdpConfig& c, int dp, bool mpi, int replicas = 1) {
    fsdp_ = std::make_unique<FsdpMemorySim>(specs, units, c, dp, tracker_, replicas);
    layout_ = fsdp_->layout();
    for (size_t b = 0; b < layout_.buckets.size(); ++b)
      optimizer_numel_.push_back(fsdp_->optimizer_bucket_numel(static_cast<int>(b)));
    param_dtype_ = c.param_dtype;
    // Sharded grads on one rank in all are never reduced (FsdpStoragePlan::grads_in_shard): no staging.
    const bool reduces = !fsdp_shards_grads(c.data_parallel_sharding_strategy) || dp * replicas > 1;
    if (mpi && reduces)
      stage_reductions_for_mpi(c.data_parallel_sharding_strategy != ShardingStrategy::kNoShard,
                               c.grad_reduce_in_fp32 ? DType::kF32 : c.param_dtype, dp);
    for (const std::vector<int>& u : units) unit_params_.insert(u.begin(), u.end());
    fsdp_reduces_every_micro_batch_ = c.data_parallel_sharding_strategy == ShardingStrategy::kOptimGrads ||
                                      c.data_parallel_sharding_strategy == ShardingStrategy::kOptimGradsParams;
    fsdp_overlap_grad_reduce_ = c.overlap_grad_reduce;
  }

  // DistributedOptimizer's constructor.
  void build_optimizer(OptimizerType optimizer) { charge_optimizer_construction(optimizer_numel_, optimizer, param_dtype_, tracker_); }

  const ParamLayout& layout() const { return layout_; }
  const FsdpMemorySim* fsdp() const { return fsdp_.get(); }

  void start_iteration() { if (fsdp_) fsdp_->start_iteration(); }
  // DataParallel::zero_grad_buffer, where no optimizer starts the iteration.
  void zero_grad_buffer() { if (fsdp_) fsdp_->zero_grad_buffer(); }
  void set_no_sync(bool on) {
    no_sync_ = on;
    if (fsdp_) fsdp_->set_no_sync(on);
  }
  void finish_grad_sync() {
    charge_mpi_staging();  // DDP's, and FSDP's when nothing reduced during backward
    if (fsdp_) fsdp_->finish_grad_sync();
  }
  void step() { if (fsdp_) fsdp_->step_and_sync_params(); }
  void force_param_sync() { if (fsdp_) fsdp_->force_param_sync(); }
  void release_gathered_params() { if (fsdp_) fsdp_->release_gathered_params(); }

  // GptCallTrace: the model's calls.
  void scratch(const std::string& name, int64_t numel) override { scratch_->request(name, numel); }
  void main_grad(int p) override { if (fsdp_) fsdp_->main_grad(p); }
  void grad_ready(int p) override {
    if (!fsdp_) return;
    fsdp_->grad_ready(p);
    // A non-unit bucket is reduced at its last grad_ready (a torch module's head, reporting
    // before any unit's post-backward): the staging comes with that first reduction.
    if (fsdp_->reductions_issued() > 0) charge_mpi_staging();
  }
  void before_forward(const std::vector<int>& p) override { if (fsdp_) fsdp_->before_forward(p); }
  void after_forward(const std::vector<int>& p) override { if (fsdp_) fsdp_->after_forward(p); }
  void before_backward(const std::vector<int>& p) override { if (fsdp_) fsdp_->before_backward(p); }
  void after_backward(const std::vector<int>& p) override {
    if (!fsdp_) return;
    fsdp_->after_backward(p);
    // FSDP reduces a unit's grads at its post-backward (FsdpHookSchedule::reduce_now): in every
    // micro-batch when it shards grads, in the synced one with overlap_grad_reduce. The progress
    // thread allocates the staging as that first reduction runs, while backward goes on. (DDP
    // allocates nothing else after construction, so when its staging comes changes no peak.)
    const bool unit = !p.empty() && unit_params_.count(p.front()) > 0;
    if (unit && (fsdp_reduces_every_micro_batch_ || (!no_sync_ && fsdp_overlap_grad_reduce_))) charge_mpi_staging();
  }

 private:
  MemoryTracker& tracker_;
  ScratchSim* scratch_;
  ParamLayout layout_;
  std::unique_ptr<FsdpMemorySim> fsdp_;
  std::vector<int64_t> optimizer_numel_;  // [bucket] the optimizer's main param elements
  DType param_dtype_ = DType::kF32;       // the param shards' dtype: f32 ones are their own main params
  int64_t mpi_staging_bytes_ = 0;  // the mpi backend's staging for the reductions (0: none or local)
  bool mpi_staging_charged_ = false;
  bool no_sync_ = false;
  std::set<int> unit_params_;  // FSDP: the params of a unit (the others are reduced after them)
  bool fsdp_reduces_every_micro_batch_ = false;  // optim_grads, optim_grads_params
  bool fsdp_overlap_grad_reduce_ = false;

  // The staging, once: the backend keeps it (grown to the largest reduction) for the rest of the run.
  void charge_mpi_staging() {
    if (mpi_staging_bytes_ > 0 && !mpi_staging_charged_) tracker_.on_allocate(MemoryCategory::kComm, mpi_staging_bytes_);
    mpi_staging_charged_ = true;
  }
};

// The plan of a replayed DataParallel: its steady-state usage, the overall peaks (those of
// `before`, what ran before the steady state, included), the layout figures, and FSDP's unit size
// and gather peaks.
inline MemoryPlan data_parallel_plan(const DataParallelSim& dpsim, int dp, const MemoryUsage& steady,
                                     const MemoryUsage& before) {
  MemoryPlan plan;
  plan.dp = dp;
  plan.steady = steady;
  plan.overall = max_peaks(before, steady);
  describe_layout(dpsim.layout(), plan.layout);
  if (const FsdpMemorySim* fsdp = dpsim.fsdp()) {
    plan.layout.largest_unit_numel = fsdp->largest_unit_numel();
    plan.peak_gathered_bytes_by_slot = fsdp->peak_gathered_bytes();
  }
  return plan;
}

}  // namespace mxddp
