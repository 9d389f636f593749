// FullyShardedDataParallel's gathers (optim_grads_params): per group (a unit, or the non-unit
// params) and slot (GatherSlot: BF16 values, MXFP8 row-wise, MXFP8 column-wise), the state
// empty -> in flight -> ready -> empty, the prefetch within the budget, and the bytes per slot.
#include <algorithm>

#include <mxddp/fsdp.h>

#include "fsdp_bucket.h"
#include "fsdp_engine.h"

namespace mxddp {

std::string_view gather_slot_name(GatherSlot s) {
  switch (s) {
    case GatherSlot::kValues: return "values";
    case GatherSlot::kRowwise: return "rowwise";
    case GatherSlot::kColwise: return "colwise";
  }
  MXDDP_FAIL("unknown gather slot {}", static_cast<int>(s));
}

std::string_view fsdp_phase_name(FsdpPhase p) {
  switch (p) {
    case FsdpPhase::kForward: return "forward";
    case FsdpPhase::kBackward: return "backward";
    case FsdpPhase::kRecompute: return "recompute";
  }
  MXDDP_FAIL("unknown FSDP phase {}", static_cast<int>(p));
}

namespace {

bool slot_applies(GatherSlot slot, bool mxfp8_bucket) { return (slot == GatherSlot::kValues) != mxfp8_bucket; }

}  // namespace

const std::vector<int>& FsdpEngine::group_buckets(int group) const {
  return group == non_unit_group() ? non_unit_buckets_ : unit_buckets_[static_cast<size_t>(group)];
}

int64_t FsdpEngine::group_numel(int group) const {
  int64_t n = 0;
  for (int b : group_buckets(group)) n += buckets_[static_cast<size_t>(b)]->numel;
  return n;
}

FsdpEngine::Slots FsdpEngine::slots_for(int group, FsdpPhase pass) const {
  bool values = false, mxfp8 = false;
  for (int b : group_buckets(group)) (buckets_[static_cast<size_t>(b)]->mxfp8 ? mxfp8 : values) = true;
  Slots slots;
  if (values) slots.push_back(GatherSlot::kValues);
  if (mxfp8) slots.push_back(pass == FsdpPhase::kBackward ? GatherSlot::kColwise : GatherSlot::kRowwise);
  return slots;
}

uint8_t& FsdpEngine::slot_state(int group, GatherSlot slot) {
  return gather_state_[static_cast<size_t>(group)][static_cast<size_t>(slot)];
}

uint8_t FsdpEngine::slot_state(int group, GatherSlot slot) const {
  return gather_state_[static_cast<size_t>(group)][static_cast<size_t>(slot)];
}

void FsdpEngine::dispatch_gather(int group, GatherSlot slot) {
  MXDDP_ASSERT(slot_state(group, slot) == 0);
  const auto s = static_cast<size_t>(slot);
  // Values move in the param dtype, MXFP8 payloads as their bytes, each with its orientation's
  // scales (every rank's shard of the array: the whole array again).
  const DType dtype = slot == GatherSlot::kValues ? config_.param_dtype : DType::kU8;
  for (int bi : group_buckets(group)) {
    Bucket& b = *buckets_[static_cast<size_t>(bi)];
    if (!slot_applies(slot, b.mxfp8)) continue;
    const ComputeBuffer& shard = slot == GatherSlot::kValues ? b.params_shard
                              : slot == GatherSlot::kRowwise ? b.row_shard : b.col_shard;
    if (b.storage.gathers_are_shards()) {
      // A shard group of one rank: the slot views the shard (and its scales) in place.
      const auto view_of = [](const ComputeBuffer& at) { return ComputeBuffer(nullptr, at.data(), at.size_bytes(), at.device()); };
      b.gathered[s] = view_of(shard);
      if (slot != GatherSlot::kValues)
        b.gathered_scales[s] = view_of(b.scales_shard[static_cast<size_t>(slot == GatherSlot::kRowwise ? QuantAxis::kRow : QuantAxis::kCol)]);
      continue;
    }
    for (FsdpBuffer buffer : FsdpStoragePlan::gathered_buffers(slot)) {
      b.allocate(buffer, compute_, tracker_);
      gathered_bytes_[s] += static_cast<int64_t>(b.held(buffer).size_bytes());
    }
    auto& works = gather_works_[static_cast<size_t>(group)][s];
    works.push_back(comm_.all_gather(shard.view(dtype, Shape{b.shard}), b.gathered[s].view(dtype, Shape{b.numel}),
                                     {.async_op = true}));
    log_.push_back({FsdpCollective::Kind::kAllGather, bi});
    if (slot == GatherSlot::kValues) continue;
    const QuantAxis axis = slot == GatherSlot::kRowwise ? QuantAxis::kRow : QuantAxis::kCol;
    works.push_back(comm_.all_gather(mxfp8_scales_shard(bi, axis),
                                     b.gathered_scales[s].view(DType::kU8, Shape{b.storage.scales_numel(axis)}),
                                     {.async_op = true}));
    log_.push_back({FsdpCollective::Kind::kAllGather, bi});
  }
  gathered_bytes_peak_[s] = std::max(gathered_bytes_peak_[s], gathered_bytes_[s]);
  slot_state(group, slot) = 1;
  ++gathers_;
  events_.push_back({FsdpGatherEvent::Kind::kGather, group, schedule_.phase(), slot});
}

void FsdpEngine::wait_gather(int group, FsdpPhase pass) {
  for (GatherSlot slot : slots_for(group, pass)) {
    uint8_t& state = slot_state(group, slot);
    if (state == 0) dispatch_gather(group, slot);
    if (state == 1) {
      auto& works = gather_works_[static_cast<size_t>(group)][static_cast<size_t>(slot)];
      for (Work& w : works) w.wait();
      works.clear();
      state = 2;
    }
  }
}

void FsdpEngine::release_slot(int group, GatherSlot slot) {
  uint8_t& state = slot_state(group, slot);
  if (state == 0) return;
  const auto s = static_cast<size_t>(slot);
  // A gather still in flight writes into the storage: let it land before freeing it.
  auto& works = gather_works_[static_cast<size_t>(group)][s];
  for (Work& w : works) w.wait();
  works.clear();
  for (int bi : group_buckets(group)) {
    Bucket& b = *buckets_[static_cast<size_t>(bi)];
    if (!b.storage.gathers_are_shards())  // a slot that views its shard brought no bytes in
      gathered_bytes_[s] -= static_cast<int64_t>(b.gathered[s].size_bytes() + b.gathered_scales[s].size_bytes());
    b.gathered[s] = ComputeBuffer();
    b.gathered_scales[s] = ComputeBuffer();
  }
  state = 0;
  ++releases_;
  events_.push_back({FsdpGatherEvent::Kind::kRelease, group, schedule_.phase(), slot});
}

void FsdpEngine::release_group(int group) {
  for (GatherSlot slot : {GatherSlot::kValues, GatherSlot::kRowwise, GatherSlot::kColwise}) release_slot(group, slot);
}

bool FsdpEngine::holds_any_slot(int group) const {
  const auto& slots = gather_state_[static_cast<size_t>(group)];
  return std::any_of(slots.begin(), slots.end(), [](uint8_t s) { return s != 0; });
}

bool FsdpEngine::anything_gathered() const {
  for (int g = 0; g <= num_units(); ++g)
    if (holds_any_slot(g)) return true;
  return false;
}

int FsdpEngine::units_gathered() const {
  int n = 0;
  for (int u = 0; u < num_units(); ++u) n += holds_any_slot(u) ? 1 : 0;
  return n;
}

std::vector<std::pair<int, std::vector<GatherSlot>>> fsdp_prefetch(int unit, FsdpPhase pass, const FsdpPrefetchState& st) {
  std::vector<std::pair<int, std::vector<GatherSlot>>> dispatch;
  MXDDP_ASSERT(st.order.empty() || static_cast<int>(st.order.size()) == st.num_units);
  auto unit_at = [&st](int position) { return st.order.empty() ? position : st.order[static_cast<size_t>(position)]; };
  int from = -1;  // unit's position in forward order
  if (unit >= 0)
    from = st.order.empty() ? unit
                            : static_cast<int>(std::find(st.order.begin(), st.order.end(), unit) - st.order.begin());
  const int step = pass == FsdpPhase::kForward ? 1 : -1;
  int64_t ahead = 0;
  int held = st.units_held;
  for (int at = from + step; at >= 0 && at < st.num_units; at += step) {
    const int u = unit_at(at);
    const int64_t n = st.numel(u);
    std::vector<GatherSlot> missing;
    for (GatherSlot slot : st.slots(u))
      if (!st.held(u, slot)) missing.push_back(slot);
    bool holds_any = false;
    for (GatherSlot slot : {GatherSlot::kValues, GatherSlot::kRowwise, GatherSlot::kColwise}) holds_any |= st.held(u, slot);
    if (missing.empty()) {
      ahead += n;
      continue;
    }
    if (ahead + n > st.budget_numel) break;
    if (st.double_buffer && !holds_any && held >= 2) break;
    dispatch.emplace_back(u, std::move(missing));
    ahead += n;
    held += holds_any ? 0 : 1;
  }
  return dispatch;
}

}  // namespace mxddp
