// FsdpHookSchedule (fsdp_hook_schedule.h): the decisions of FSDP's module hooks, for
// FullyShardedDataParallel and the memory plan's FsdpMemorySim alike.
#include "fsdp_hook_schedule.h"

#include <algorithm>
#include <utility>

namespace mxddp {

bool fsdp_shards_params(ShardingStrategy s) { return s == ShardingStrategy::kOptimGradsParams; }

bool fsdp_shards_grads(ShardingStrategy s) {
  return s == ShardingStrategy::kOptimGrads || s == ShardingStrategy::kOptimGradsParams;
}

FsdpHookSchedule::FsdpHookSchedule(FsdpHookActions& actions, const FsdpConfig& config, const ParamLayout& layout,
                                   std::vector<int> unit_of_param, int num_units, int64_t prefetch_budget_numel)
    : actions_(&actions),
      config_(config),
      layout_(&layout),
      unit_of_param_(std::move(unit_of_param)),
      ready_(unit_of_param_.size(), false),
      unit_done_(static_cast<size_t>(num_units), false),
      num_units_(num_units),
      prefetch_budget_numel_(prefetch_budget_numel),
      forwarded_(static_cast<size_t>(num_units), false) {}

void FsdpHookSchedule::start_forward_pass() {
  // The prefetch follows the order the model's code calls the units in, which module-tree order
  // (theirs) need not be; learned from a pass that ran each unit once, so the next passes prefetch
  // what comes next.
  if (static_cast<int>(pass_order_.size()) == num_units_) forward_order_ = pass_order_;
  pass_order_.clear();
  forwarded_.assign(forwarded_.size(), false);
  any_forwarded_ = false;
}

FsdpPhase FsdpHookSchedule::phase() const {
  if (recomputing_) return FsdpPhase::kRecompute;
  return in_backward_ ? FsdpPhase::kBackward : FsdpPhase::kForward;
}

void FsdpHookSchedule::before_forward(int unit) {
  if (unit < 0) {
    in_backward_ = false;  // the embeddings open a forward pass (the final norm runs inside one)
    recomputing_ = false;
    actions_->wait_gather(num_units_, FsdpPhase::kForward);
    // Only the non-unit modules before the first unit (the embeddings) start the units' prefetch;
    // the final norm comes after the last unit, with nothing left to prefetch in this pass.
    if (config_.overlap_param_gather && !any_forwarded_) prefetch_from(-1, FsdpPhase::kForward);
    return;
  }
  // A forward pass runs each unit once, in whatever order the model's code calls them, so a
  // pre-forward of a unit this pass has already run is a re-run: a recompute in backward, which
  // may come before the layer's first pre-backward. (Comparing unit indices instead took every
  // unit after an out-of-order one for a recompute, and kept them all gathered.)
  if (in_backward_ || forwarded_[static_cast<size_t>(unit)]) {
    // The recompute's gather: no prefetch (this pass runs in backward order, and a forward-order
    // prefetch would fetch what backward has finished with).
    in_backward_ = true;
    recomputing_ = true;
    start_forward_pass();
    actions_->wait_gather(unit, FsdpPhase::kRecompute);
    return;
  }
  forwarded_[static_cast<size_t>(unit)] = true;
  any_forwarded_ = true;
  pass_order_.push_back(unit);
  actions_->wait_gather(unit, FsdpPhase::kForward);
  if (config_.overlap_param_gather) prefetch_from(unit, FsdpPhase::kForward);
}

void FsdpHookSchedule::after_forward(int unit) {
  if (!shards_params() || unit < 0) return;
  if (!in_backward_) {
    actions_->release_group(unit);
    return;
  }
  // After a recompute the unit's backward comes next: it reads the BF16 values again (kept, and
  // released by its post-backward, so each gather is released once) but MXFP8 weights only
  // column-wise, so the row-wise copy has had its last use (Megatron keeps it to post-backward).
  actions_->release_slot(unit, GatherSlot::kRowwise);
  recomputing_ = false;
}

void FsdpHookSchedule::before_backward(int unit) {
  start_forward_pass();  // the next forward runs every unit again
  in_backward_ = true;
  recomputing_ = false;
  if (!shards_params() || unit < 0) return;
  actions_->wait_gather(unit, FsdpPhase::kBackward);
  if (config_.overlap_param_gather) prefetch_from(unit, FsdpPhase::kBackward);
}

void FsdpHookSchedule::after_backward(int unit, bool grads_sync) {
  if (unit < 0) return;
  if (shards_params()) actions_->release_group(unit);
  if (reduce_now(grads_sync))
    for (int b : actions_->group_buckets(unit)) actions_->issue_reduction(b);
  wait_without_overlap();
  if (!unit_done_[static_cast<size_t>(unit)]) {
    unit_done_[static_cast<size_t>(unit)] = true;
    ++units_done_;
  }
  end_micro_batch_if_done();  // this unit may have reported the micro-batch's last grad
}

void FsdpHookSchedule::grad_ready(int param, bool grads_sync) {
  const auto i = static_cast<size_t>(param);
  ready_[i] = true;
  ++ready_count_;
  // A unit's grads are reduced at its post-backward; a non-unit bucket's when its last grad is in.
  const int bucket = layout_->params[i].bucket;
  if (unit_of_param_[i] < 0) {
    const auto& members = layout_->buckets[static_cast<size_t>(bucket)].params;
    if (std::all_of(members.begin(), members.end(), [&](int p) { return ready_[static_cast<size_t>(p)]; })) {
      if (reduce_now(grads_sync)) actions_->issue_reduction(bucket);
      wait_without_overlap();
    }
  }
  end_micro_batch_if_done();
}

void FsdpHookSchedule::end_micro_batch_if_done() {
  // Clearing at the last grad_ready alone would forget a unit's reports before its post-backward
  // checks them, wherever a unit reports last (every param in units, or the non-unit params all
  // after the first unit).
  if (ready_count_ != static_cast<int>(ready_.size()) || units_done_ != num_units_) return;
  clear_ready();
  // The backward pass is over, so the next pre-forward opens a forward pass. Without this, a model
  // with no non-unit module before its first unit (whose pre-forward resets the phase) would take
  // the next micro-batch's first units for recomputes: gathered without prefetch, and kept.
  in_backward_ = false;
  recomputing_ = false;
  start_forward_pass();
}

void FsdpHookSchedule::clear_ready() {
  ready_.assign(ready_.size(), false);
  ready_count_ = 0;
  unit_done_.assign(unit_done_.size(), false);
  units_done_ = 0;
}

void FsdpHookSchedule::wait_without_overlap() {
  // Without overlap the sharded-grad strategies wait here, so the unsharded grads go now.
  if (shards_grads() && !config_.overlap_grad_reduce) actions_->complete_reductions();
}

void FsdpHookSchedule::release_gathered_params() {
  start_forward_pass();
  recomputing_ = false;
  for (int g = 0; g <= num_units_; ++g) actions_->release_group(g);  // in the phase that ends
  in_backward_ = false;
}

void FsdpHookSchedule::prefetch_from(int unit, FsdpPhase pass) {
  // Dispatching only touches the units ahead, which the rule has already walked past.
  const FsdpHookActions& a = *actions_;
  const FsdpPrefetchState state{.num_units = num_units_,
                                .budget_numel = prefetch_budget_numel_,
                                .double_buffer = config_.fsdp_double_buffer,
                                .units_held = a.units_gathered(),
                                .numel = [&a](int u) { return a.group_numel(u); },
                                .slots = [&a, pass](int u) { return a.slots_for(u, pass); },
                                .held = [&a](int u, GatherSlot slot) { return a.holds_slot(u, slot); },
                                .order = forward_order_};
  for (const auto& [u, slots] : fsdp_prefetch(unit, pass, state))
    for (GatherSlot slot : slots) actions_->dispatch_gather(u, slot);
}

}  // namespace mxddp
