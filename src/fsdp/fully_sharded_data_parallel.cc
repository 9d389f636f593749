// FsdpEngine (fsdp_engine.h), the implementation of FullyShardedDataParallel: storage per strategy, the hooks, the per-unit gradient reductions and
// the optimizer's side (see fsdp.h). The gather state machine is in fsdp_gather.cc, the MXFP8
// shards' quantization in fsdp_mxfp8.cc.
#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <numeric>

#include <mxddp/fsdp.h>

#include "../comm/progress_queue.h"
#include "fsdp_bucket.h"
#include "fsdp_engine.h"

namespace mxddp {

std::string_view sharding_strategy_name(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::kNoShard: return "no_shard";
    case ShardingStrategy::kOptim: return "optim";
    case ShardingStrategy::kOptimGrads: return "optim_grads";
    case ShardingStrategy::kOptimGradsParams: return "optim_grads_params";
  }
  MXDDP_FAIL("unknown sharding strategy {}", static_cast<int>(s));
}

ShardingStrategy parse_sharding_strategy(std::string_view name) {
  for (ShardingStrategy s : {ShardingStrategy::kNoShard, ShardingStrategy::kOptim, ShardingStrategy::kOptimGrads,
                             ShardingStrategy::kOptimGradsParams})
    if (sharding_strategy_name(s) == name) return s;
  MXDDP_FAIL("data_parallel_sharding_strategy '{}' is not valid: no_shard, optim, optim_grads or optim_grads_params",
             name);
}

std::string_view fine_grained_param_gather_policy_name(FineGrainedParamGatherPolicy p) {
  switch (p) {
    case FineGrainedParamGatherPolicy::kMegatron: return "megatron";
    case FineGrainedParamGatherPolicy::kRecomputeAware: return "recompute-aware";
  }
  MXDDP_FAIL("unknown fine-grained param gather policy {}", static_cast<int>(p));
}

FineGrainedParamGatherPolicy parse_fine_grained_param_gather_policy(std::string_view name) {
  for (FineGrainedParamGatherPolicy p : {FineGrainedParamGatherPolicy::kMegatron, FineGrainedParamGatherPolicy::kRecomputeAware})
    if (fine_grained_param_gather_policy_name(p) == name) return p;
  MXDDP_FAIL("--fine-grained-param-gather-policy '{}' is not valid: megatron or recompute-aware", name);
}

namespace {


// Copies `count` elements of src (f32 or dst_dtype) into dst (dst_dtype), rounding to bf16 if needed.
void copy_converted(const TensorView& src, void* dst, DType dst_dtype, size_t count) {
  if (src.dtype == dst_dtype) std::memcpy(dst, src.data, count * dtype_size_bytes(dst_dtype));
  else if (src.dtype == DType::kF32 && dst_dtype == DType::kBF16)
    convert_f32_to_bf16(src.data_as<const float>(), static_cast<bf16_bits*>(dst), count);
  else MXDDP_FAIL("initial value of dtype {} cannot initialize a {} param", dtype_name(src.dtype), dtype_name(dst_dtype));
}


// The walk order for the layout: reverse registration order (the rule's), except that within each
// run of one unit's params the MXFP8 ones come after the others, so that the key (unit, mxfp8)
// changes once per unit and each unit gets one bucket per kind. Without MXFP8 params: empty (the
// rule's own order).
std::vector<int> layout_order(const std::vector<ParamSpec>& params, const std::vector<int>& unit_of_param) {
  if (std::none_of(params.begin(), params.end(), [](const ParamSpec& p) { return p.mxfp8; })) return {};
  std::vector<int> order;
  for (int i = static_cast<int>(params.size()) - 1; i >= 0;) {
    int j = i;
    while (j >= 0 && unit_of_param[static_cast<size_t>(j)] == unit_of_param[static_cast<size_t>(i)]) --j;
    for (bool mxfp8 : {false, true})
      for (int k = i; k > j; --k)
        if (params[static_cast<size_t>(k)].mxfp8 == mxfp8) order.push_back(k);
    i = j;
  }
  return order;
}

// HSDP: the chain that issues replica all-reduces on `replica`, shared by every engine on it (one
// queue keeps their issue order, which is the program's, the same on every rank). It lives while
// an engine holds it.
std::shared_ptr<ProgressQueue> replica_chain_for(Communicator& replica) {
  static std::mutex mutex;
  static std::map<const Communicator*, std::weak_ptr<ProgressQueue>> chains;
  std::lock_guard lock(mutex);
  std::weak_ptr<ProgressQueue>& slot = chains[&replica];
  if (std::shared_ptr<ProgressQueue> chain = slot.lock()) return chain;
  auto chain = std::make_shared<ProgressQueue>();
  slot = chain;
  return chain;
}

}  // namespace

void check_fsdp_config(const FsdpConfig& c, const std::vector<ParamSpec>& params, const std::vector<std::vector<int>>& units) {
  MXDDP_CHECK(c.megatron_fsdp_main_params_dtype == DType::kF32,
              "megatron_fsdp_main_params_dtype {} is not supported: f32 only",
              dtype_name(c.megatron_fsdp_main_params_dtype));
  MXDDP_CHECK(c.param_dtype == DType::kBF16 || c.param_dtype == DType::kF32,
              "FSDP param dtype {} is not valid: bf16 or f32", dtype_name(c.param_dtype));
  MXDDP_CHECK(!c.suggested_communication_unit_size || *c.suggested_communication_unit_size >= 1,
              "suggested_communication_unit_size {} is not valid: at least 1 element",
              c.suggested_communication_unit_size.value_or(0));
  MXDDP_CHECK(!units.empty(), "FSDP needs at least one unit (e.g. a decoder layer); got none");
  std::vector<int> seen(params.size(), -1);
  for (size_t u = 0; u < units.size(); ++u) {
    MXDDP_CHECK(!units[u].empty(), "FSDP unit {} has no params", u);
    for (int p : units[u]) {
      MXDDP_CHECK(p >= 0 && p < static_cast<int>(params.size()), "FSDP unit {} names param {}; valid: 0..{}", u, p,
                  params.size() - 1);
      MXDDP_CHECK(seen[static_cast<size_t>(p)] < 0, "param '{}' is in FSDP units {} and {}; a param belongs to one unit",
                  params[static_cast<size_t>(p)].name, seen[static_cast<size_t>(p)], u);
      seen[static_cast<size_t>(p)] = static_cast<int>(u);
    }
  }
  for (const ParamSpec& p : params) {
    MXDDP_CHECK(p.mxfp8 || !p.mxfp8_colwise_forward,
                "param '{}' is marked mxfp8_colwise_forward but not mxfp8; the mark says which MXFP8 copy its forward reads",
                p.name);
    if (!p.mxfp8) continue;
    MXDDP_CHECK(c.data_parallel_sharding_strategy == ShardingStrategy::kOptimGradsParams,
                "param '{}' is marked mxfp8, and MXFP8 params under FSDP need data_parallel_sharding_strategy "
                "optim_grads_params (their row- and column-wise shards are what a gather moves); got {}",
                p.name, sharding_strategy_name(c.data_parallel_sharding_strategy));
    MXDDP_CHECK(p.shape.ndim() == 2, "param '{}' is marked mxfp8 but has shape {}; MXFP8 params are 2-D [M, N]",
                p.name, p.shape.to_string());
  }
}

std::vector<int> fsdp_unit_of_param(size_t num_params, const std::vector<std::vector<int>>& units) {
  std::vector<int> unit_of_param(num_params, -1);
  for (size_t u = 0; u < units.size(); ++u)
    for (int p : units[u]) unit_of_param.at(static_cast<size_t>(p)) = static_cast<int>(u);
  return unit_of_param;
}

ParamLayout fsdp_param_layout(const std::vector<ParamSpec>& params, const std::vector<int>& unit_of_param, int dp,
                              bool compute_shards) {
  // The distributed optimizer's layout rule (padding, shards), a bucket per unit. Buckets are
  // keyed by (unit, MXFP8 or not), as Megatron-FSDP keys them by unit and dtype.
  std::vector<int> bucket_key(params.size());
  for (size_t p = 0; p < params.size(); ++p)
    bucket_key[p] = unit_of_param[p] < 0 ? -1 : 2 * unit_of_param[p] + (params[p].mxfp8 ? 1 : 0);
  return compute_param_layout(params, LayoutOptions{.dp = dp, .bucket_size = std::nullopt,
                                                    .use_distributed_optimizer = true,
                                                    .param_unit = bucket_key,
                                                    .param_order = layout_order(params, unit_of_param),
                                                    .compute_shards = compute_shards});
}

FsdpEngine::FsdpEngine(Communicator& comm, const std::vector<ParamSpec>& params,
                                                   const std::vector<std::vector<int>>& units, const FsdpConfig& config,
                                                   MemoryTracker& tracker, const std::vector<TensorView>& initial_values,
                                                   Communicator* replica)
    : comm_(comm), compute_(comm.compute()), replica_(replica), config_((check_fsdp_config(config, params, units), config)), specs_(params),
      tracker_(tracker) {
  const int dp = comm.size(), rank = comm.rank();
  // The shards, gathers and grads live in the communicator's compute (host memory, or the rank's
  // device), so HSDP's replica all-reduce must reach the same memory.
  MXDDP_CHECK(replica == nullptr || replica->device() == comm.device(),
              "HSDP: the replica communicator's collectives run on {} but the shard group's on {}; both must "
              "reach the same memory", to_string(replica->device()), to_string(comm.device()));
  // Two stream-ordered communicators (nccl) would each order their collectives with their own
  // compute stream, not with each other, and the replica chain's thread would interleave the two
  // communicators' calls differently on each rank, which NCCL may deadlock on.
  MXDDP_CHECK(replica == nullptr || (!comm.stream_ordered() && !replica->stream_ordered()),
              "HSDP over a stream-ordered ({}) communicator is not supported yet: its replica all-reduces would "
              "not be ordered with the shard group's collectives; use FSDP over one communicator",
              comm.stream_ordered() ? comm.backend_name() : replica->backend_name());
  MXDDP_CHECK(replica != &comm,
              "HSDP's replica communicator is the shard group's own communicator; the replica group must be another "
              "one (the ranks holding this rank's shard index in the other shard groups)");
  if (replica_) replica_chain_ = replica_chain_for(*replica_);
  MXDDP_CHECK(initial_values.size() == params.size(), "FSDP needs one initial value per param: got {} for {} params",
              initial_values.size(), params.size());
  unit_of_param_ = fsdp_unit_of_param(params.size(), units);
  layout_ = fsdp_param_layout(params, unit_of_param_, dp);
  scale_offset_.assign(params.size(), {-1, -1});
  unit_buckets_.resize(units.size());
  const size_t elem = dtype_size_bytes(config_.param_dtype);
  for (size_t b = 0; b < layout_.buckets.size(); ++b) {
    const BucketPlacement& placement = layout_.buckets[b];
    const int unit = unit_of_param_[static_cast<size_t>(placement.params.front())];
    bucket_unit_.push_back(unit);
    (unit < 0 ? non_unit_buckets_ : unit_buckets_[static_cast<size_t>(unit)]).push_back(static_cast<int>(b));

    auto bucket = std::make_unique<Bucket>();
    bucket->storage = FsdpStoragePlan::of_bucket(config_, dp, layout_, static_cast<int>(b), params,
                                                 replica_ ? replica_->size() : 1);
    bucket->range = placement.range;
    bucket->numel = bucket->storage.numel();
    bucket->shard = bucket->storage.shard_numel();
    bucket->mxfp8 = bucket->storage.mxfp8();
    // What the storage plan keeps from construction (an MXFP8 bucket's params_shard is the
    // optimizer's initial staging, quantized below).
    for (const FsdpBufferPlan& buffer : bucket->storage.buffers())
      if (bucket->storage.allocated_at_construction(buffer.buffer)) bucket->allocate(buffer.buffer, compute_, tracker);
    const auto g = static_cast<size_t>(bucket->numel), s = static_cast<size_t>(bucket->shard);
    // The bucket's initial values, padding zero, assembled in host memory; every rank copies in
    // what its strategy keeps. Its grads start zeroed (allocate).
    std::vector<char> full(g * elem, 0);
    for (int p : placement.params) {
      const TensorView& value = initial_values[static_cast<size_t>(p)];
      const ParamSpec& spec = params[static_cast<size_t>(p)];
      MXDDP_CHECK(value.numel() == spec.shape.numel(), "initial value of '{}' has {} elements ({}); the param has {} ({})",
                  spec.name, value.numel(), value.shape.to_string(), spec.shape.numel(), spec.shape.to_string());
      MXDDP_CHECK(value.device.is_cpu(), "initial value of '{}' is on {}; expected cpu", spec.name,
                  to_string(value.device));
      const int64_t at = layout_.params[static_cast<size_t>(p)].range.start - placement.range.start;
      copy_converted(initial_values[static_cast<size_t>(p)], full.data() + static_cast<size_t>(at) * elem,
                     config_.param_dtype, static_cast<size_t>(params[static_cast<size_t>(p)].shape.numel()));
    }
    if (bucket->params_shard.data())
      compute_.copy_from_host(bucket->params_shard.data(), full.data() + static_cast<size_t>(rank) * s * elem, s * elem);
    else compute_.copy_from_host(bucket->params_full.data(), full.data(), g * elem);
    if (bucket->mxfp8)
      for (size_t k = 0; k < placement.params.size(); ++k)
        for (QuantAxis axis : {QuantAxis::kRow, QuantAxis::kCol})
          scale_offset_[static_cast<size_t>(placement.params[k])][static_cast<size_t>(axis)] =
              bucket->storage.scale_offset(k, axis);
    buckets_.push_back(std::move(bucket));
  }
  // The MXFP8 shards of the initial values (collective: every rank constructs). The staging stays
  // for the optimizer's initial main params until the first start_iteration.
  quantize_staged_shards(/*keep_staging=*/true);
  // Budgets (elements): Megatron's default unit size is twice the average unit.
  int64_t unit_numel_sum = 0;
  for (int u = 0; u < num_units(); ++u) unit_numel_sum += group_numel(u);
  const int64_t unit_size = config_.suggested_communication_unit_size.value_or(2 * unit_numel_sum / num_units());
  prefetch_budget_numel_ = unit_size / 2;
  rs_queue_numel_ = unit_size;
  schedule_ = FsdpHookSchedule(*this, config_, layout_, unit_of_param_, num_units(), prefetch_budget_numel_);

  gather_works_.resize(static_cast<size_t>(num_units() + 1));
  gather_state_.assign(static_cast<size_t>(num_units() + 1), {0, 0, 0});
  reduced_.assign(buckets_.size(), false);
  full_param_gathers_.resize(buckets_.size());
  full_param_waited_.assign(buckets_.size(), true);
}

FsdpEngine::~FsdpEngine() {
  auto quiet_wait = [](const Work& w) {
    try {
      w.wait();
    } catch (...) {  // a destructor cannot report it; the call that waited would have
    }
  };
  for (auto& group : gather_works_)
    for (auto& slot : group)
      for (Work& w : slot) quiet_wait(w);
  for (auto& [bucket, w] : reductions_) quiet_wait(w);
  for (Work& w : full_param_gathers_) quiet_wait(w);
}

DType FsdpEngine::grad_dtype() const { return fsdp_grad_dtype(config_); }

std::string FsdpEngine::describe() const {
  if (!replica_) return fmt::format("fsdp:{}", sharding_strategy_name(config_.data_parallel_sharding_strategy));
  return fmt::format("fsdp:{} (hsdp: shard group {} x {} replicas)",
                     sharding_strategy_name(config_.data_parallel_sharding_strategy), comm_.size(), replica_->size());
}

// ---- The model's side ----

TensorView FsdpEngine::param(int index) const {
  MXDDP_CHECK(index >= 0 && index < num_params(), "param index {} out of range; valid: 0..{}", index, num_params() - 1);
  const ParamPlacement& p = layout_.params[static_cast<size_t>(index)];
  const Bucket& b = *buckets_[static_cast<size_t>(p.bucket)];
  const int64_t at = p.range.start - b.range.start;
  const ParamSpec& spec = specs_[static_cast<size_t>(index)];
  if (!shards_params()) {
    MXDDP_CHECK(full_param_waited_[static_cast<size_t>(p.bucket)],
                "param '{}' read before its module's pre-forward hook waited for its all-gather", spec.name);
    return fsdp_sub(b.params_full.view(config_.param_dtype, Shape{b.numel}), at, spec.shape);
  }
  MXDDP_CHECK(!spec.mxfp8, "param '{}' is kept as MXFP8: read it with mxfp8_param({}, axis)", spec.name, index);
  const int unit = unit_of_param_[static_cast<size_t>(index)];
  const int group = unit < 0 ? non_unit_group() : unit;
  MXDDP_CHECK(slot_state(group, GatherSlot::kValues) == 2,
              "param '{}' read while its {} is not gathered: call the module's pre-forward or pre-backward hook first",
              spec.name, unit < 0 ? std::string("non-unit params") : fmt::format("unit {}", unit));
  return fsdp_sub(b.gathered[static_cast<size_t>(GatherSlot::kValues)].view(config_.param_dtype, Shape{b.numel}), at,
                  spec.shape);
}

bool FsdpEngine::is_mxfp8(int index) const {
  MXDDP_CHECK(index >= 0 && index < num_params(), "param index {} out of range; valid: 0..{}", index, num_params() - 1);
  return specs_[static_cast<size_t>(index)].mxfp8;
}

Mxfp8View FsdpEngine::mxfp8_param(int index, QuantAxis axis) const {
  MXDDP_CHECK(is_mxfp8(index), "param '{}' is not an MXFP8 param: read it with param({})",
              specs_[static_cast<size_t>(index)].name, index);
  const ParamSpec& spec = specs_[static_cast<size_t>(index)];
  const ParamPlacement& p = layout_.params[static_cast<size_t>(index)];
  const Bucket& b = *buckets_[static_cast<size_t>(p.bucket)];
  const QuantAxis slot_axis = encoding_axis(index, axis);  // where the pass that reads `axis` gathers it
  const GatherSlot slot = slot_axis == QuantAxis::kRow ? GatherSlot::kRowwise : GatherSlot::kColwise;
  const int unit = unit_of_param_[static_cast<size_t>(index)];
  // Forward and a recompute gather the forward's copy, backward the data gradient's: reading the
  // other is a model bug.
  MXDDP_CHECK(unit >= 0 && slot_state(unit, slot) == 2,
              "MXFP8 param '{}' read {}-wise while unit {} holds no {}-wise copy: forward and recompute read {}-wise, "
              "backward's data gradient {}-wise, each between the unit's pre- and post-hook",
              spec.name, quant_axis_name(axis), unit, quant_axis_name(axis),
              quant_axis_name(encoding_axis(index, QuantAxis::kRow)), quant_axis_name(encoding_axis(index, QuantAxis::kCol)));
  return Mxfp8View{
      .data = fsdp_sub(b.gathered[static_cast<size_t>(slot)].view(DType::kU8, Shape{b.numel}), p.range.start - b.range.start,
                       spec.shape),
      .scales = param_scales(index, slot_axis, b.gathered_scales[static_cast<size_t>(slot)].view(
                                                   DType::kU8, Shape{b.storage.scales_numel(slot_axis)})),
      .options = {config_.mxfp8_elem, config_.mxfp8_scale_mode, axis}};
}

TensorView FsdpEngine::main_grad(int index) {
  MXDDP_CHECK(index >= 0 && index < num_params(), "param index {} out of range; valid: 0..{}", index, num_params() - 1);
  const ParamPlacement& p = layout_.params[static_cast<size_t>(index)];
  Bucket& b = *buckets_[static_cast<size_t>(p.bucket)];
  // The previous micro-batch's reduction of this bucket may still be in flight (sharded grads
  // reduce every micro-batch): it must land before new gradients go in.
  while (b.reduction_in_flight) complete_oldest_reduction();
  if (b.storage.grads_in_shard()) {  // one rank in all: the shard is the bucket's grads
    b.grads_unreduced = true;
    return fsdp_sub(b.grads_shard.view(grad_dtype(), Shape{b.numel}), p.range.start - b.range.start,
                    specs_[static_cast<size_t>(index)].shape);
  }
  if (shards_grads() && !b.grads_full.data()) {
    // The bucket's unsharded grads live from its first gradient of the micro-batch until its
    // reduce-scatter lands in the shard.
    b.allocate(FsdpBuffer::kGradsFull, compute_, tracker_);  // zeroed
  }
  return fsdp_sub(b.grads_full.view(grad_dtype(), Shape{b.numel}), p.range.start - b.range.start,
                                                               specs_[static_cast<size_t>(index)].shape);
}

int FsdpEngine::unit_of_module(const std::vector<int>& module_params, std::string_view hook) const {
  MXDDP_CHECK(!module_params.empty(), "{}: a module with no params", hook);
  int unit = -2;
  for (int p : module_params) {
    MXDDP_CHECK(p >= 0 && p < num_params(), "{}: param index {} out of range; valid: 0..{}", hook, p, num_params() - 1);
    const int u = unit_of_param_[static_cast<size_t>(p)];
    MXDDP_CHECK(unit == -2 || u == unit, "{}: the module's params span FSDP units {} and {} (param '{}'); a module is "
                "one unit or only non-unit params", hook, unit, u, specs_[static_cast<size_t>(p)].name);
    unit = u;
  }
  return unit;
}

void FsdpEngine::check_all_ready(const std::vector<int>& params, std::string_view hook) const {
  for (int p : params)
    MXDDP_CHECK(schedule_.is_ready(p), "{}: param '{}' has not reported grad_ready in this micro-batch", hook,
                specs_[static_cast<size_t>(p)].name);
}

void FsdpEngine::grad_ready(int index) {
  MXDDP_CHECK(index >= 0 && index < num_params(), "grad_ready: param index {} out of range; valid: 0..{}", index,
              num_params() - 1);
  MXDDP_CHECK(!schedule_.is_ready(index), "grad_ready called twice for param '{}' (index {}) in one micro-batch",
              specs_[static_cast<size_t>(index)].name, index);
  schedule_.grad_ready(index, no_sync_depth_ == 0);
}

void FsdpEngine::before_forward(const std::vector<int>& module_params) {
  const int unit = unit_of_module(module_params, "before_forward");
  if (!shards_params()) {
    if (!full_param_gather_pending_) return;
    for (int p : module_params) {
      const auto b = static_cast<size_t>(layout_.params[static_cast<size_t>(p)].bucket);
      if (!full_param_waited_[b]) {
        full_param_gathers_[b].wait();
        full_param_waited_[b] = true;
      }
    }
    return;
  }
  schedule_.before_forward(unit);
}

void FsdpEngine::after_forward(const std::vector<int>& module_params) {
  schedule_.after_forward(unit_of_module(module_params, "after_forward"));
}

void FsdpEngine::before_backward(const std::vector<int>& module_params) {
  schedule_.before_backward(unit_of_module(module_params, "before_backward"));
}

void FsdpEngine::after_backward(const std::vector<int>& module_params) {
  const int unit = unit_of_module(module_params, "after_backward");
  if (unit >= 0) check_all_ready(module_params, "after_backward");
  schedule_.after_backward(unit, no_sync_depth_ == 0);
}

void FsdpEngine::release_gathered_params() { schedule_.release_gathered_params(); }

// ---- Reductions ----

void FsdpEngine::issue_reduction(int bucket) {
  Bucket& b = *buckets_[static_cast<size_t>(bucket)];
  if (b.storage.grads_in_shard()) {  // nothing to reduce: the grads are already in the shard
    b.grads_unreduced = false;
    reduced_[static_cast<size_t>(bucket)] = true;
    return;
  }
  MXDDP_ASSERT(!b.reduction_in_flight && b.grads_full.data());
  if (shards_grads())  // the queue bounds the unsharded grads alive at once
    while (!reductions_.empty() && reductions_numel_ + b.numel > rs_queue_numel_) complete_oldest_reduction();
  // Every rank this gradient is averaged over: the shard group, times the replicas under HSDP.
  const int dp = comm_.size() * (replica_ ? replica_->size() : 1);
  const TensorView grads = b.grads_full.view(grad_dtype(), Shape{b.numel});
  const float prescale = 1.0f / static_cast<float>(dp);  // 1/dp rides inside the reduction, as in DDP
  Work work;
  TensorView reduced = grads;  // what this rank's reduction leaves reduced
  if (config_.data_parallel_sharding_strategy == ShardingStrategy::kNoShard) {
    work = comm_.all_reduce(grads, {.op = ReduceOp::kSum, .async_op = true, .prescale = prescale});
    log_.push_back({FsdpCollective::Kind::kAllReduce, bucket});
  } else {
    // In place: this rank's block of the bucket receives its reduced shard.
    reduced = fsdp_sub(grads, comm_.rank() * b.shard, Shape{b.shard});
    work = comm_.reduce_scatter(grads, reduced, {.op = ReduceOp::kSum, .async_op = true, .prescale = prescale});
    log_.push_back({FsdpCollective::Kind::kReduceScatter, bucket});
  }
  if (replica_) {
    // HSDP: the shard group's result, summed across the replicas (the prescale above already
    // divided by every rank). The chain's thread waits for the shard group's reduction and then
    // runs the all-reduce on the replica communicator, while this thread goes on; the chain is
    // FIFO and reductions are issued in the same order on every rank, so the replica all-reduces
    // are too. The returned Work completes after both, carrying either one's error.
    work = replica_chain_->submit([first = std::move(work), replica = replica_, reduced] {
      first.wait();
      replica->all_reduce(reduced);
    });
    log_.push_back({FsdpCollective::Kind::kReplicaAllReduce, bucket});
  }
  b.reduction_in_flight = true;
  reduced_[static_cast<size_t>(bucket)] = true;
  reductions_.emplace_back(bucket, std::move(work));
  reductions_numel_ += b.numel;
}

void FsdpEngine::complete_oldest_reduction() {
  MXDDP_ASSERT(!reductions_.empty());
  auto [bucket, work] = std::move(reductions_.front());
  reductions_.erase(reductions_.begin());
  Bucket& b = *buckets_[static_cast<size_t>(bucket)];
  reductions_numel_ -= b.numel;
  b.reduction_in_flight = false;
  work.wait();
  if (!shards_grads()) return;
  // Fold this micro-batch's reduced shard into the kept one (summed in f32, rounded once) and free
  // the unsharded grads.
  const size_t elem = dtype_size_bytes(grad_dtype());
  const void* const inputs[2] = {b.grads_shard.data(), static_cast<const char*>(b.grads_full.data()) +
                                                           static_cast<size_t>(comm_.rank() * b.shard) * elem};
  void* const outputs[1] = {b.grads_shard.data()};
  compute_.reduce({.dtype = grad_dtype(), .op = ReduceOp::kSum, .count = b.shard, .inputs = inputs, .outputs = outputs});
  b.grads_full = ComputeBuffer();
}

void FsdpEngine::complete_reductions() {
  while (!reductions_.empty()) complete_oldest_reduction();
}

void FsdpEngine::finish_grad_sync() {
  MXDDP_CHECK(no_sync_depth_ == 0, "finish_grad_sync called inside a no_sync scope; call it after the last micro-batch");
  if (shards_grads()) {
    // Every bucket was reduced at its post-backward (or last grad_ready); one that was not has
    // unreported grads and would be lost.
    for (size_t b = 0; b < buckets_.size(); ++b)
      if ((buckets_[b]->grads_full.data() && !buckets_[b]->reduction_in_flight) || buckets_[b]->grads_unreduced) {
        const int p = layout_.buckets[b].params.front();
        MXDDP_FAIL("finish_grad_sync: bucket {} (param '{}', ...) holds gradients that were never reduced: every param "
                   "must report grad_ready and every unit must run its post-backward hook", b,
                   specs_[static_cast<size_t>(p)].name);
      }
  } else {
    for (size_t b = 0; b < buckets_.size(); ++b)
      if (!reduced_[b]) issue_reduction(static_cast<int>(b));
  }
  complete_reductions();
  release_gathered_params();  // the non-unit params, kept through backward
  MXDDP_ASSERT(!anything_gathered());
  reduced_.assign(reduced_.size(), false);
  schedule_.clear_ready();
}

void FsdpEngine::zero_grad_buffer() {
  complete_reductions();  // a collective may still be reading the grads
  for (auto& b : buckets_) {
    ComputeBuffer& kept = shards_grads() ? b->grads_shard : b->grads_full;
    compute_.zero(kept.data(), kept.size_bytes());  // the rank's threads, or its stream
  }
  reduced_.assign(reduced_.size(), false);
  schedule_.clear_ready();
}

// ---- The optimizer's side ----

OptimizerBucket FsdpEngine::optimizer_bucket(int bucket) const {
  const int rank = comm_.rank();
  const BucketShard& shard = layout_.shards.at(static_cast<size_t>(rank)).at(static_cast<size_t>(bucket));
  if (config_.data_parallel_sharding_strategy != ShardingStrategy::kNoShard)
    return OptimizerBucket{.numel = shard.range.size(), .update = shard.params, .owned = shard.params};
  // no_shard: the optimizer is replicated; it updates the whole bucket and owns its layout shard.
  const Bucket& b = *buckets_[static_cast<size_t>(bucket)];
  OptimizerBucket ob{.numel = b.numel, .update = {}, .owned = shard.params};
  for (int p : layout_.buckets[static_cast<size_t>(bucket)].params) {
    const Range r = layout_.params[static_cast<size_t>(p)].range;
    ob.update.push_back({p, r, {0, r.size()}, {r.start - b.range.start, r.end - b.range.start}});
  }
  std::sort(ob.update.begin(), ob.update.end(),
            [](const ShardParamRange& x, const ShardParamRange& y) { return x.in_shard.start < y.in_shard.start; });
  for (ShardParamRange& r : ob.owned) r.in_shard = {r.in_shard.start + rank * b.shard, r.in_shard.end + rank * b.shard};
  return ob;
}

OptimizerBucketIo FsdpEngine::optimizer_io(int bucket) const {
  const Bucket& b = *buckets_.at(static_cast<size_t>(bucket));
  const int64_t at = comm_.rank() * b.shard;
  switch (config_.data_parallel_sharding_strategy) {
    case ShardingStrategy::kNoShard:
      return {.grads = b.grads_full.view(grad_dtype(), Shape{b.numel}),
              .params = b.params_full.view(config_.param_dtype, Shape{b.numel})};
    case ShardingStrategy::kOptim:
      return {.grads = fsdp_sub(b.grads_full.view(grad_dtype(), Shape{b.numel}), at, Shape{b.shard}),
              .params = fsdp_sub(b.params_full.view(config_.param_dtype, Shape{b.numel}), at, Shape{b.shard})};
    case ShardingStrategy::kOptimGrads:
      return {.grads = b.grads_shard.view(grad_dtype(), Shape{b.shard}),
              .params = fsdp_sub(b.params_full.view(config_.param_dtype, Shape{b.numel}), at, Shape{b.shard})};
    case ShardingStrategy::kOptimGradsParams:
      // An MXFP8 bucket's bf16 values exist only while the optimizer stages them (its construction
      // before the first iteration, a step, a forced param sync); otherwise params is empty.
      return {.grads = b.grads_shard.view(grad_dtype(), Shape{b.shard}),
              .params = b.params_shard.data() ? b.params_shard.view(config_.param_dtype, Shape{b.shard}) : TensorView{}};
  }
  MXDDP_FAIL("unknown sharding strategy");
}

TensorView FsdpEngine::initial_params(int bucket) const { return optimizer_io(bucket).params; }

void FsdpEngine::issue_full_param_gathers() {
  // optim / optim_grads: every rank keeps full params; gather the updated shards in forward order
  // (the last bucket holds the first params).
  for (int b = static_cast<int>(buckets_.size()) - 1; b >= 0; --b) {
    const Bucket& bucket = *buckets_[static_cast<size_t>(b)];
    const TensorView full = bucket.params_full.view(config_.param_dtype, Shape{bucket.numel});
    full_param_gathers_[static_cast<size_t>(b)] =
        comm_.all_gather(fsdp_sub(full, comm_.rank() * bucket.shard, Shape{bucket.shard}), full, {.async_op = true});
    full_param_waited_[static_cast<size_t>(b)] = false;
    log_.push_back({FsdpCollective::Kind::kAllGather, b});
  }
  full_param_gather_pending_ = true;
}

void FsdpEngine::wait_full_param_gathers() {
  if (!full_param_gather_pending_) return;
  for (size_t b = 0; b < buckets_.size(); ++b)
    if (!full_param_waited_[b]) {
      full_param_gathers_[b].wait();
      full_param_waited_[b] = true;
    }
  full_param_gather_pending_ = false;
}

void FsdpEngine::step_and_sync_params(const std::function<void(int bucket)>& update) {
  wait_full_param_gathers();  // (done by the forward already; the update rewrites the shards)
  // An MXFP8 bucket's scales all-reduce runs while the next bucket updates; so at most two staging
  // shards are alive at once.
  std::optional<std::pair<int, Work>> quantizing;
  for (int b = 0; b < static_cast<int>(buckets_.size()); ++b) {
    const bool mxfp8 = buckets_[static_cast<size_t>(b)]->mxfp8;
    if (mxfp8) allocate_staging(b);
    update(b);
    if (!mxfp8) continue;
    Work scales = start_shard_scales(b);
    if (quantizing) finish_shard_quantize(quantizing->first, quantizing->second);
    quantizing.emplace(b, std::move(scales));
  }
  if (quantizing) finish_shard_quantize(quantizing->first, quantizing->second);
  const ShardingStrategy s = config_.data_parallel_sharding_strategy;
  if (s == ShardingStrategy::kOptim || s == ShardingStrategy::kOptimGrads) {
    issue_full_param_gathers();
    if (!config_.overlap_param_gather) wait_full_param_gathers();
  }
  // no_shard updated the full params in place; optim_grads_params gathers unit by unit in forward.
}

void FsdpEngine::start_iteration(const std::function<void()>&) {
  zero_grad_buffer();
  schedule_.start_iteration();
  // The MXFP8 buckets' initial staging has served the optimizer's construction.
  for (auto& b : buckets_)
    if (b->mxfp8) b->params_shard = ComputeBuffer();
  // The design's start_param_sync: the non-unit params and the first unit, plus the prefetch.
  if (shards_params() && config_.overlap_param_gather) {
    const int first = schedule_.first_forward_unit();
    for (int group : {non_unit_group(), first})
      for (GatherSlot slot : slots_for(group, FsdpPhase::kForward))
        if (slot_state(group, slot) == 0) dispatch_gather(group, slot);
    schedule_.prefetch_from(first, FsdpPhase::kForward);
  }
}

void FsdpEngine::force_param_sync(const std::function<void()>& stage) {
  // Whatever was gathered or is in flight came from the shards as they were: drop it all.
  wait_full_param_gathers();
  release_gathered_params();
  for (int b = 0; b < static_cast<int>(buckets_.size()); ++b)
    if (buckets_[static_cast<size_t>(b)]->mxfp8) allocate_staging(b);
  stage();
  quantize_staged_shards(/*keep_staging=*/false);
  const ShardingStrategy s = config_.data_parallel_sharding_strategy;
  if (s == ShardingStrategy::kOptim || s == ShardingStrategy::kOptimGrads) {
    issue_full_param_gathers();
    wait_full_param_gathers();
  }
}

}  // namespace mxddp
