// FSDP's hook schedule (internal to src/fsdp and the memory plan): which pass a module hook is in
// and what it waits for, prefetches, releases and reduces, decided once for FsdpEngine (real
// buffers and collectives) and the planner's FsdpMemorySim (a tracker).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include <mxddp/fsdp.h>

namespace mxddp {

// The pass a hook runs in: a forward pass, a backward pass, or a recompute in backward (from its
// pre-forward to its post-forward).
enum class FsdpPhase : uint8_t { kForward, kBackward, kRecompute };
std::string_view fsdp_phase_name(FsdpPhase p);  // "forward", "backward", "recompute"

// The prefetch rule, shared by FsdpEngine and the memory plan's simulation of it:
// walking from `unit` in the pass's order (forward: the units' forward order, backward: its
// reverse; `unit` -1 starts before the first), each unit ahead that lacks
// some of the pass's slots gets them dispatched while what is gathered or in flight ahead fits
// budget_numel (the current unit is always fetched and not counted) and, with double_buffer, while
// fewer than two units are held. Returns the (unit, slots) to dispatch, in order.
struct FsdpPrefetchState {
  int num_units = 0;
  int64_t budget_numel = 0;
  bool double_buffer = false;
  int units_held = 0;                                       // units holding any slot now
  std::function<int64_t(int unit)> numel;                   // a unit's gathered elements
  std::function<std::vector<GatherSlot>(int unit)> slots;   // the pass's slots of a unit
  std::function<bool(int unit, GatherSlot slot)> held;      // whether it holds (or is fetching) one
  std::span<const int> order;  // the units in forward order (a permutation); empty: 0..num_units-1
};
std::vector<std::pair<int, std::vector<GatherSlot>>> fsdp_prefetch(int unit, FsdpPhase pass, const FsdpPrefetchState& state);

// What FSDP's module hooks do, decided once for FsdpEngine (real buffers and
// collectives) and the memory plan's FsdpMemorySim (a tracker), so the two cannot decide
// differently: which pass a hook is in (a pre-forward of a unit that already ran in this forward
// pass is a recompute), what is waited for, prefetched, released and reduced. Each owner carries out the
// actions on what it holds. Groups: 0..U-1 the units, U the non-unit params.
class FsdpHookActions {
 public:
  virtual void wait_gather(int group, FsdpPhase pass) = 0;
  virtual void dispatch_gather(int group, GatherSlot slot) = 0;
  virtual void release_slot(int group, GatherSlot slot) = 0;
  virtual void release_group(int group) = 0;
  virtual void issue_reduction(int bucket) = 0;
  virtual void complete_reductions() = 0;  // every reduction in flight
  virtual const std::vector<int>& group_buckets(int group) const = 0;
  virtual int64_t group_numel(int group) const = 0;
  virtual std::vector<GatherSlot> slots_for(int group, FsdpPhase pass) const = 0;
  virtual bool holds_slot(int group, GatherSlot slot) const = 0;  // gathered or in flight
  virtual int units_gathered() const = 0;                          // units holding any slot

 protected:
  ~FsdpHookActions() = default;
};

class FsdpHookSchedule {
 public:
  FsdpHookSchedule() = default;
  // actions and layout must outlive this; the config's strategy, overlap flags and double buffer
  // apply. unit_of_param as fsdp_unit_of_param.
  FsdpHookSchedule(FsdpHookActions& actions, const FsdpConfig& config, const ParamLayout& layout,
                   std::vector<int> unit_of_param, int num_units, int64_t prefetch_budget_numel);

  FsdpPhase phase() const;
  // A new iteration: no pass is under way.
  void start_iteration() { in_backward_ = recomputing_ = false; }
  // The hooks, with the module's unit (-1: a non-unit module). before_forward only when params
  // are sharded (the owner handles the others' full-param gathers). grads_sync: not in no_sync.
  void before_forward(int unit);
  void after_forward(int unit);
  void before_backward(int unit);
  void after_backward(int unit, bool grads_sync);
  // Param `param`'s grad is final for this micro-batch: a non-unit bucket is reduced when its last
  // grad is in (a unit's at its post-backward). The micro-batch's backward is over, and a new one
  // starts, once every param is in and every unit's post-backward has run, whichever comes last: a
  // unit may report the last grad and still check its reports at its post-backward after that.
  void grad_ready(int param, bool grads_sync);
  bool is_ready(int param) const { return ready_[static_cast<size_t>(param)]; }
  void clear_ready();  // the grads were zeroed or synced: none is in, no unit's backward has run
  // Ends the phase: every group released.
  void release_gathered_params();
  // fsdp_prefetch from unit in this pass, and each slot it returns dispatched.
  void prefetch_from(int unit, FsdpPhase pass);
  // The unit a forward pass runs first: as the last whole forward pass ran them (unit 0 before one
  // has run), which is what the prefetch follows.
  int first_forward_unit() const { return forward_order_.empty() ? 0 : forward_order_.front(); }

 private:
  bool shards_params() const { return fsdp_shards_params(config_.data_parallel_sharding_strategy); }
  bool shards_grads() const { return fsdp_shards_grads(config_.data_parallel_sharding_strategy); }
  // Whether grads are reduced as they come: always when sharded, else with overlap outside no_sync.
  bool reduce_now(bool grads_sync) const { return shards_grads() || (grads_sync && config_.overlap_grad_reduce); }
  void wait_without_overlap();
  void end_micro_batch_if_done();  // clear_ready once every param is in and every unit is done

  FsdpHookActions* actions_ = nullptr;
  FsdpConfig config_;
  const ParamLayout* layout_ = nullptr;
  std::vector<int> unit_of_param_;  // [param], -1 for non-unit
  std::vector<bool> ready_;         // [param], this micro-batch
  int ready_count_ = 0;
  std::vector<bool> unit_done_;     // [unit] its post-backward ran in this micro-batch
  int units_done_ = 0;
  int num_units_ = 0;
  int64_t prefetch_budget_numel_ = 0;
  // The units whose pre-forward ran in this forward pass, and whether any did. A pass calls its
  // units in the model's code order, which need not be theirs (fine-grained units are in
  // module-tree order: Llama registers its norms after the attention and MLP they precede).
  std::vector<bool> forwarded_;  // [unit]
  bool any_forwarded_ = false;
  std::vector<int> pass_order_;     // the units this forward pass ran, in order
  std::vector<int> forward_order_;  // the last pass that ran every unit once; empty: unit order
  void start_forward_pass();        // none forwarded; a pass that ran every unit sets the order
  bool recomputing_ = false;  // from a recompute's pre-forward to its post-forward
  // In a backward pass: from a pre-backward, or a recompute's pre-forward, until the next forward
  // starts (a non-unit module's pre-forward: the embeddings) or the next iteration.
  bool in_backward_ = false;
};

}  // namespace mxddp
