// step_profile.h: thread-local records and a stack of open scopes.
#include "step_profile.h"

namespace mxddp::model::profile {

namespace {

struct ThreadProfile {
  bool enabled = false;
  std::vector<MicroBatch> records;
  Scope* open = nullptr;  // the innermost open scope
};

ThreadProfile& state() {
  thread_local ThreadProfile profile;
  return profile;
}

// A product, cast or softmax inside attention counts as attention's.
Part inside_attention(Part part) {
  switch (part) {
    case Part::kProducts: return Part::kAttentionProducts;
    case Part::kCasts: return Part::kAttentionCasts;
    default: return part;
  }
}

bool is_attention(Part part) {
  return part == Part::kAttentionProducts || part == Part::kAttentionCasts || part == Part::kAttentionSoftmax ||
         part == Part::kAttentionOther;
}

thread_local Part t_open_part = Part::kCount;  // the innermost open scope's part (kCount: none)

}  // namespace

const char* part_name(Part part) {
  switch (part) {
    case Part::kProducts: return "products";
    case Part::kCasts: return "casts";
    case Part::kLayerNorm: return "layernorm";
    case Part::kGelu: return "gelu";
    case Part::kCrossEntropy: return "cross-entropy";
    case Part::kElementwise: return "bias, residual, embedding";
    case Part::kAttentionProducts: return "attention products";
    case Part::kAttentionCasts: return "attention casts";
    case Part::kAttentionSoftmax: return "attention softmax";
    case Part::kAttentionOther: return "attention other";
    case Part::kWeights: return "weight staging";
    case Part::kCount: break;
  }
  return "?";
}

void set_enabled(bool on) {
  ThreadProfile& p = state();
  p.enabled = on;
  p.records.clear();
}

bool enabled() { return state().enabled; }

void begin_micro_batch() {
  ThreadProfile& p = state();
  if (p.enabled) p.records.push_back(MicroBatch{});
}

const std::vector<MicroBatch>& records() { return state().records; }

Scope::Scope(Part part) : part_(part) {
  ThreadProfile& p = state();
  if (!p.enabled || p.records.empty()) return;
  if (t_open_part != Part::kCount && is_attention(t_open_part)) part_ = inside_attention(part);
  active_ = true;
  parent_ = p.open;
  p.open = this;
  t_open_part = part_;
  t0_ = std::chrono::steady_clock::now();
}

Scope::~Scope() {
  if (!active_) return;
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0_).count();
  ThreadProfile& p = state();
  p.records.back()[static_cast<size_t>(part_)] += ms - nested_ms_;
  if (parent_ != nullptr) parent_->nested_ms_ += ms;
  p.open = parent_;
  t_open_part = parent_ != nullptr ? parent_->part_ : Part::kCount;
}

}  // namespace mxddp::model::profile
