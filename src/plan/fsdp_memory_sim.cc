// FsdpMemorySim: see fsdp_memory_sim.h. Each function names the FullyShardedDataParallel function
// it follows (src/fsdp/fully_sharded_data_parallel.cc, fsdp_gather.cc, fsdp_mxfp8.cc); only what
// allocates, frees, or decides when either happens is kept.
#include "fsdp_memory_sim.h"

#include <algorithm>


namespace mxddp {

namespace {

bool slot_applies(GatherSlot slot, bool mxfp8_bucket) { return (slot == GatherSlot::kValues) != mxfp8_bucket; }

}  // namespace

FsdpMemorySim::FsdpMemorySim(const std::vector<ParamSpec>& params, const std::vector<std::vector<int>>& units,
                             const FsdpConfig& config, int dp, MemoryTracker& tracker, int replicas)
    : config_((check_fsdp_config(config, params, units), config)), dp_(dp), tracker_(tracker) {
  unit_of_param_ = fsdp_unit_of_param(params.size(), units);
  layout_ = fsdp_param_layout(params, unit_of_param_, dp, /*compute_shards=*/false);
  unit_buckets_.resize(units.size());
  // The constructor, bucket by bucket: what its storage plan allocates at construction (params,
  // grads, and for an MXFP8 bucket its scales and its row- and column-wise shards).
  for (size_t b = 0; b < layout_.buckets.size(); ++b) {
    const BucketPlacement& placement = layout_.buckets[b];
    const int unit = unit_of_param_[static_cast<size_t>(placement.params.front())];
    (unit < 0 ? non_unit_buckets_ : unit_buckets_[static_cast<size_t>(unit)]).push_back(static_cast<int>(b));
    Bucket bucket;
    bucket.storage = FsdpStoragePlan::of_bucket(config_, dp, layout_, static_cast<int>(b), params, replicas);
    bucket.numel = bucket.storage.numel();
    bucket.shard = bucket.storage.shard_numel();
    bucket.mxfp8 = bucket.storage.mxfp8();
    for (const FsdpBufferPlan& buffer : bucket.storage.buffers())
      if (bucket.storage.allocated_at_construction(buffer.buffer)) tracker_.on_allocate(buffer.category, buffer.bytes);
    if (bucket.storage.holds(FsdpBuffer::kParamsShard) &&
        bucket.storage.buffer(FsdpBuffer::kParamsShard).lifetime == FsdpLifetime::kStaging)
      bucket.staging_bytes = bucket.storage.bytes(FsdpBuffer::kParamsShard);  // the initial staging
    buckets_.push_back(std::move(bucket));
  }
  // The MXFP8 shards of the initial values (quantize_staged_shards, keeping the staging).
  quantize_staged_shards(/*keep_staging=*/true);
  // Budgets (elements): Megatron's default unit size is twice the average unit.
  int64_t unit_numel_sum = 0;
  for (int u = 0; u < num_units(); ++u) unit_numel_sum += group_numel(u);
  const int64_t unit_size = config_.suggested_communication_unit_size.value_or(2 * unit_numel_sum / num_units());
  rs_queue_numel_ = unit_size;
  schedule_ = FsdpHookSchedule(*this, config_, layout_, unit_of_param_, num_units(),
                               /*prefetch_budget_numel=*/unit_size / 2);
  gather_state_.assign(static_cast<size_t>(num_units() + 1), {0, 0, 0});
  reduced_.assign(buckets_.size(), false);
}

int64_t FsdpMemorySim::optimizer_bucket_numel(int bucket) const {
  const Bucket& b = buckets_.at(static_cast<size_t>(bucket));
  return config_.data_parallel_sharding_strategy == ShardingStrategy::kNoShard ? b.numel : b.shard;
}

int64_t FsdpMemorySim::largest_unit_numel() const {
  int64_t largest = 0;
  for (int u = 0; u < num_units(); ++u) largest = std::max(largest, group_numel(u));
  return largest;
}

int FsdpMemorySim::unit_of_module(const std::vector<int>& params) const {
  return unit_of_param_.at(static_cast<size_t>(params.at(0)));
}

const std::vector<int>& FsdpMemorySim::group_buckets(int group) const {
  return group == non_unit_group() ? non_unit_buckets_ : unit_buckets_[static_cast<size_t>(group)];
}

int64_t FsdpMemorySim::group_numel(int group) const {
  int64_t n = 0;
  for (int b : group_buckets(group)) n += buckets_[static_cast<size_t>(b)].numel;
  return n;
}

// ---- Gathers (fsdp_gather.cc) ----

FsdpMemorySim::Slots FsdpMemorySim::slots_for(int group, FsdpPhase pass) const {
  bool values = false, mxfp8 = false;
  for (int b : group_buckets(group)) (buckets_[static_cast<size_t>(b)].mxfp8 ? mxfp8 : values) = true;
  Slots slots;
  if (values) slots.push_back(GatherSlot::kValues);
  if (mxfp8) slots.push_back(pass == FsdpPhase::kBackward ? GatherSlot::kColwise : GatherSlot::kRowwise);
  return slots;
}

bool FsdpMemorySim::holds_any_slot(int group) const {
  const auto& slots = gather_state_[static_cast<size_t>(group)];
  return std::any_of(slots.begin(), slots.end(), [](uint8_t s) { return s != 0; });
}

int FsdpMemorySim::units_gathered() const {
  int n = 0;
  for (int u = 0; u < num_units(); ++u) n += holds_any_slot(u) ? 1 : 0;
  return n;
}

void FsdpMemorySim::dispatch_gather(int group, GatherSlot slot) {
  const auto s = static_cast<size_t>(slot);
  for (int bi : group_buckets(group)) {
    Bucket& b = buckets_[static_cast<size_t>(bi)];
    if (!slot_applies(slot, b.mxfp8)) continue;
    b.gathered_bytes[s] = b.storage.gathered_bytes(slot);  // 0 where the slot views the shard
    if (b.gathered_bytes[s] > 0) tracker_.on_allocate(MemoryCategory::kGathered, b.gathered_bytes[s]);
    gathered_bytes_[s] += b.gathered_bytes[s];
  }
  gathered_bytes_peak_[s] = std::max(gathered_bytes_peak_[s], gathered_bytes_[s]);
  state(group, slot) = 1;
}

void FsdpMemorySim::wait_gather(int group, FsdpPhase pass) {
  for (GatherSlot slot : slots_for(group, pass)) {
    if (state(group, slot) == 0) dispatch_gather(group, slot);
    state(group, slot) = 2;
  }
}

void FsdpMemorySim::release_slot(int group, GatherSlot slot) {
  if (state(group, slot) == 0) return;
  const auto s = static_cast<size_t>(slot);
  for (int bi : group_buckets(group)) {
    Bucket& b = buckets_[static_cast<size_t>(bi)];
    if (b.gathered_bytes[s] > 0) tracker_.on_free(MemoryCategory::kGathered, b.gathered_bytes[s]);
    gathered_bytes_[s] -= b.gathered_bytes[s];
    b.gathered_bytes[s] = 0;
  }
  state(group, slot) = 0;
}

void FsdpMemorySim::release_group(int group) {
  for (GatherSlot slot : {GatherSlot::kValues, GatherSlot::kRowwise, GatherSlot::kColwise}) release_slot(group, slot);
}

// ---- Hooks (fully_sharded_data_parallel.cc): the decisions are FsdpHookSchedule's ----

void FsdpMemorySim::before_forward(const std::vector<int>& params) {
  const int unit = unit_of_module(params);
  if (shards_params()) schedule_.before_forward(unit);
}

void FsdpMemorySim::after_forward(const std::vector<int>& params) { schedule_.after_forward(unit_of_module(params)); }

void FsdpMemorySim::before_backward(const std::vector<int>& params) {
  schedule_.before_backward(unit_of_module(params));
}

void FsdpMemorySim::after_backward(const std::vector<int>& params) {
  schedule_.after_backward(unit_of_module(params), !no_sync_);
}

void FsdpMemorySim::release_gathered_params() { schedule_.release_gathered_params(); }

// ---- Gradients and their reductions ----

void FsdpMemorySim::main_grad(int param) {
  Bucket& b = buckets_[static_cast<size_t>(layout_.params.at(static_cast<size_t>(param)).bucket)];
  while (b.reduction_in_flight) complete_oldest_reduction();
  if (shards_grads() && !b.storage.grads_in_shard() && b.grads_full_bytes == 0) {
    b.grads_full_bytes = b.storage.bytes(FsdpBuffer::kGradsFull);
    tracker_.on_allocate(b.storage.buffer(FsdpBuffer::kGradsFull).category, b.grads_full_bytes);
  }
}

void FsdpMemorySim::grad_ready(int param) { schedule_.grad_ready(param, !no_sync_); }

void FsdpMemorySim::issue_reduction(int bucket) {
  Bucket& b = buckets_[static_cast<size_t>(bucket)];
  if (b.storage.grads_in_shard()) {
    reduced_[static_cast<size_t>(bucket)] = true;
    return;
  }
  if (shards_grads())
    while (!reductions_.empty() && reductions_numel_ + b.numel > rs_queue_numel_) complete_oldest_reduction();
  b.reduction_in_flight = true;
  ++reductions_issued_;
  reduced_[static_cast<size_t>(bucket)] = true;
  reductions_.push_back(bucket);
  reductions_numel_ += b.numel;
}

void FsdpMemorySim::complete_oldest_reduction() {
  const int bucket = reductions_.front();
  reductions_.erase(reductions_.begin());
  Bucket& b = buckets_[static_cast<size_t>(bucket)];
  reductions_numel_ -= b.numel;
  b.reduction_in_flight = false;
  if (!shards_grads()) return;
  tracker_.on_free(b.storage.buffer(FsdpBuffer::kGradsFull).category, b.grads_full_bytes);
  b.grads_full_bytes = 0;
}

void FsdpMemorySim::complete_reductions() {
  while (!reductions_.empty()) complete_oldest_reduction();
}

void FsdpMemorySim::finish_grad_sync() {
  if (!shards_grads())
    for (size_t b = 0; b < buckets_.size(); ++b)
      if (!reduced_[b]) issue_reduction(static_cast<int>(b));
  complete_reductions();
  release_gathered_params();
  reduced_.assign(reduced_.size(), false);
  schedule_.clear_ready();
}

void FsdpMemorySim::zero_grad_buffer() {
  complete_reductions();
  reduced_.assign(reduced_.size(), false);
  schedule_.clear_ready();
}

// ---- The optimizer's side, and the MXFP8 staging (fsdp_mxfp8.cc) ----

void FsdpMemorySim::allocate_staging(int bucket) {
  Bucket& b = buckets_[static_cast<size_t>(bucket)];
  if (b.staging_bytes > 0) return;
  b.staging_bytes = b.storage.bytes(FsdpBuffer::kParamsShard);
  tracker_.on_allocate(b.storage.buffer(FsdpBuffer::kParamsShard).category, b.staging_bytes);
}

void FsdpMemorySim::free_staging(int bucket) {
  Bucket& b = buckets_[static_cast<size_t>(bucket)];
  if (b.staging_bytes > 0) tracker_.on_free(b.storage.buffer(FsdpBuffer::kParamsShard).category, b.staging_bytes);
  b.staging_bytes = 0;
}

void FsdpMemorySim::start_iteration() {
  zero_grad_buffer();
  schedule_.start_iteration();
  for (size_t b = 0; b < buckets_.size(); ++b)
    if (buckets_[b].mxfp8) free_staging(static_cast<int>(b));
  if (shards_params() && config_.overlap_param_gather) {
    const int first = schedule_.first_forward_unit();
    for (int group : {non_unit_group(), first})
      for (GatherSlot slot : slots_for(group, FsdpPhase::kForward))
        if (state(group, slot) == 0) dispatch_gather(group, slot);
    schedule_.prefetch_from(first, FsdpPhase::kForward);
  }
}

void FsdpMemorySim::start_quantize(int bucket) {
  const FsdpBufferPlan& scales = buckets_[static_cast<size_t>(bucket)].storage.buffer(FsdpBuffer::kQuantizeScales);
  tracker_.on_allocate(scales.category, scales.bytes);
}

void FsdpMemorySim::finish_quantize(int bucket, bool keep_staging) {
  const FsdpBufferPlan& scales = buckets_[static_cast<size_t>(bucket)].storage.buffer(FsdpBuffer::kQuantizeScales);
  tracker_.on_free(scales.category, scales.bytes);
  if (!keep_staging) free_staging(bucket);
}

void FsdpMemorySim::quantize_staged_shards(bool keep_staging) {
  // At most two buckets' whole scales alive: a bucket's are freed once the next one's are taken.
  int quantizing = -1;
  for (int b = 0; b < static_cast<int>(buckets_.size()); ++b) {
    if (!buckets_[static_cast<size_t>(b)].mxfp8) continue;
    start_quantize(b);
    if (quantizing >= 0) finish_quantize(quantizing, keep_staging);
    quantizing = b;
  }
  if (quantizing >= 0) finish_quantize(quantizing, keep_staging);
}

void FsdpMemorySim::step_and_sync_params() {
  // At most two staging shards (and whole scales) alive: a bucket's are freed once the next one
  // has been updated and its partial scales taken.
  int quantizing = -1;
  for (int b = 0; b < static_cast<int>(buckets_.size()); ++b) {
    if (!buckets_[static_cast<size_t>(b)].mxfp8) continue;
    allocate_staging(b);
    start_quantize(b);
    if (quantizing >= 0) finish_quantize(quantizing, /*keep_staging=*/false);
    quantizing = b;
  }
  if (quantizing >= 0) finish_quantize(quantizing, /*keep_staging=*/false);
}

void FsdpMemorySim::force_param_sync() {
  release_gathered_params();
  for (int b = 0; b < static_cast<int>(buckets_.size()); ++b)
    if (buckets_[static_cast<size_t>(b)].mxfp8) allocate_staging(b);
  quantize_staged_shards(/*keep_staging=*/false);
}

}  // namespace mxddp
