// FullyShardedDataParallel: storage per strategy, the unit gather / release state machine with
// its prefetch budget, and the per-unit gradient reductions (see fsdp.h).
#include <algorithm>
#include <cstring>
#include <numeric>

#include <mxddp/fsdp.h>

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

// One bucket's storage; which members are allocated depends on the strategy.
struct FullyShardedDataParallel::Bucket {
  Range range;          // in the layout
  int64_t numel = 0;    // padded: G
  int64_t shard = 0;    // G / dp
  HostBuffer params_full;   // [G] param dtype, kParams: no_shard, optim, optim_grads
  HostBuffer params_shard;  // [G/dp] param dtype, kParams: optim_grads_params
  HostBuffer gathered;      // [G] param dtype, kGathered: optim_grads_params while its group is gathered
  HostBuffer grads_full;    // [G] grad dtype, kGrads: no_shard, optim (kept); optim_grads* (transient)
  HostBuffer grads_shard;   // [G/dp] grad dtype, kGrads: optim_grads*
  bool reduction_in_flight = false;
};

namespace {

void validate(const FsdpConfig& c, const std::vector<ParamSpec>& params, const std::vector<std::vector<int>>& units) {
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
  for (const ParamSpec& p : params)
    MXDDP_CHECK(!p.mxfp8, "param '{}' is marked mxfp8: MXFP8 params are not supported under FSDP; use DDP with "
                "--fp8-param-gather", p.name);
}

// The elements [offset, offset + shape.numel()) of a flat view, shaped.
TensorView sub(const TensorView& flat, int64_t offset, const Shape& shape) {
  MXDDP_ASSERT(offset >= 0 && offset + shape.numel() <= flat.numel());
  return TensorView{static_cast<char*>(flat.data) + static_cast<size_t>(offset) * dtype_size_bytes(flat.dtype), flat.dtype,
                    shape, flat.device};
}

// Copies `count` elements of src (f32 or dst_dtype) into dst (dst_dtype), rounding to bf16 if needed.
void copy_converted(const TensorView& src, void* dst, DType dst_dtype, size_t count) {
  if (src.dtype == dst_dtype) std::memcpy(dst, src.data, count * dtype_size_bytes(dst_dtype));
  else if (src.dtype == DType::kF32 && dst_dtype == DType::kBF16)
    convert_f32_to_bf16(src.data_as<const float>(), static_cast<bf16_bits*>(dst), count);
  else MXDDP_FAIL("initial value of dtype {} cannot initialize a {} param", dtype_name(src.dtype), dtype_name(dst_dtype));
}

// dst [n] += src [n], f32 or bf16 (summed in f32, rounded once).
void accumulate(void* dst, const void* src, DType dtype, int64_t n) {
  if (dtype == DType::kF32) {
    float* d = static_cast<float*>(dst);
    const float* s = static_cast<const float*>(src);
    for (int64_t i = 0; i < n; ++i) d[i] += s[i];
    return;
  }
  bf16_bits* d = static_cast<bf16_bits*>(dst);
  const bf16_bits* s = static_cast<const bf16_bits*>(src);
  for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(bf16_to_f32(d[i]) + bf16_to_f32(s[i]));
}

}  // namespace

FullyShardedDataParallel::FullyShardedDataParallel(Communicator& comm, const std::vector<ParamSpec>& params,
                                                   const std::vector<std::vector<int>>& units, const FsdpConfig& config,
                                                   MemoryTracker& tracker, const std::vector<TensorView>& initial_values)
    : comm_(comm), config_((validate(config, params, units), config)), specs_(params), tracker_(tracker) {
  const int dp = comm.size(), rank = comm.rank();
  MXDDP_CHECK(initial_values.size() == params.size(), "FSDP needs one initial value per param: got {} for {} params",
              initial_values.size(), params.size());
  unit_of_param_.assign(params.size(), -1);
  for (size_t u = 0; u < units.size(); ++u)
    for (int p : units[u]) unit_of_param_[static_cast<size_t>(p)] = static_cast<int>(u);
  // The distributed optimizer's layout rule (padding, shards), a bucket per unit.
  layout_ = compute_param_layout(params, LayoutOptions{.dp = dp, .bucket_size = std::nullopt,
                                                       .use_distributed_optimizer = true,
                                                       .param_unit = unit_of_param_});
  unit_buckets_.resize(units.size());
  const size_t elem = dtype_size_bytes(config_.param_dtype), grad_elem = dtype_size_bytes(grad_dtype());
  for (size_t b = 0; b < layout_.buckets.size(); ++b) {
    const BucketPlacement& placement = layout_.buckets[b];
    const int unit = unit_of_param_[static_cast<size_t>(placement.params.front())];
    bucket_unit_.push_back(unit);
    (unit < 0 ? non_unit_buckets_ : unit_buckets_[static_cast<size_t>(unit)]).push_back(static_cast<int>(b));

    auto bucket = std::make_unique<Bucket>();
    bucket->range = placement.range;
    bucket->numel = placement.range.size();
    bucket->shard = bucket->numel / dp;
    const auto g = static_cast<size_t>(bucket->numel), s = static_cast<size_t>(bucket->shard);
    // The bucket's initial values, padding zero; every rank keeps what its strategy keeps.
    std::vector<char> full(g * elem, 0);
    for (int p : placement.params) {
      const int64_t at = layout_.params[static_cast<size_t>(p)].range.start - placement.range.start;
      copy_converted(initial_values[static_cast<size_t>(p)], full.data() + static_cast<size_t>(at) * elem,
                     config_.param_dtype, static_cast<size_t>(params[static_cast<size_t>(p)].shape.numel()));
    }
    if (shards_params()) {
      bucket->params_shard = HostBuffer(s * elem, MemoryCategory::kParams, tracker);
      std::memcpy(bucket->params_shard.data(), full.data() + static_cast<size_t>(rank) * s * elem, s * elem);
    } else {
      bucket->params_full = HostBuffer(g * elem, MemoryCategory::kParams, tracker);
      std::memcpy(bucket->params_full.data(), full.data(), g * elem);
    }
    if (shards_grads()) {
      bucket->grads_shard = HostBuffer(s * grad_elem, MemoryCategory::kGrads, tracker);
      std::memset(bucket->grads_shard.data(), 0, s * grad_elem);
    } else {
      bucket->grads_full = HostBuffer(g * grad_elem, MemoryCategory::kGrads, tracker);
      std::memset(bucket->grads_full.data(), 0, g * grad_elem);
    }
    buckets_.push_back(std::move(bucket));
  }
  // Budgets (elements): Megatron's default unit size is twice the average unit.
  int64_t unit_numel_sum = 0;
  for (int u = 0; u < num_units(); ++u) unit_numel_sum += group_numel(u);
  const int64_t unit_size = config_.suggested_communication_unit_size.value_or(2 * unit_numel_sum / num_units());
  prefetch_budget_numel_ = unit_size / 2;
  rs_queue_numel_ = unit_size;

  gather_works_.resize(static_cast<size_t>(num_units() + 1));
  gather_state_.assign(static_cast<size_t>(num_units() + 1), 0);
  reduced_.assign(buckets_.size(), false);
  full_param_gathers_.resize(buckets_.size());
  full_param_waited_.assign(buckets_.size(), true);
  ready_.assign(params.size(), false);
}

FullyShardedDataParallel::~FullyShardedDataParallel() {
  auto quiet_wait = [](const Work& w) {
    try {
      w.wait();
    } catch (...) {  // a destructor cannot report it; the call that waited would have
    }
  };
  for (auto& group : gather_works_)
    for (Work& w : group) quiet_wait(w);
  for (auto& [bucket, w] : reductions_) quiet_wait(w);
  for (Work& w : full_param_gathers_) quiet_wait(w);
}

DType FullyShardedDataParallel::grad_dtype() const {
  return config_.grad_reduce_in_fp32 ? DType::kF32 : config_.param_dtype;
}

std::string FullyShardedDataParallel::describe() const {
  return fmt::format("fsdp:{}", sharding_strategy_name(config_.data_parallel_sharding_strategy));
}

bool FullyShardedDataParallel::shards_params() const {
  return config_.data_parallel_sharding_strategy == ShardingStrategy::kOptimGradsParams;
}

bool FullyShardedDataParallel::shards_grads() const {
  return config_.data_parallel_sharding_strategy == ShardingStrategy::kOptimGrads || shards_params();
}

// ---- The model's side ----

TensorView FullyShardedDataParallel::param(int index) const {
  MXDDP_CHECK(index >= 0 && index < num_params(), "param index {} out of range; valid: 0..{}", index, num_params() - 1);
  const ParamPlacement& p = layout_.params[static_cast<size_t>(index)];
  const Bucket& b = *buckets_[static_cast<size_t>(p.bucket)];
  const int64_t at = p.range.start - b.range.start;
  const ParamSpec& spec = specs_[static_cast<size_t>(index)];
  if (!shards_params()) {
    MXDDP_CHECK(full_param_waited_[static_cast<size_t>(p.bucket)],
                "param '{}' read before its module's pre-forward hook waited for its all-gather", spec.name);
    return sub(b.params_full.view(config_.param_dtype, Shape{b.numel}), at, spec.shape);
  }
  const int unit = unit_of_param_[static_cast<size_t>(index)];
  const int group = unit < 0 ? non_unit_group() : unit;
  MXDDP_CHECK(gather_state_[static_cast<size_t>(group)] == 2,
              "param '{}' read while its {} is not gathered: call the module's pre-forward or pre-backward hook first",
              spec.name, unit < 0 ? std::string("non-unit params") : fmt::format("unit {}", unit));
  return sub(b.gathered.view(config_.param_dtype, Shape{b.numel}), at, spec.shape);
}

const Mxfp8Tensor& FullyShardedDataParallel::mxfp8_param(int index) const {
  MXDDP_FAIL("param {} is not an MXFP8 param: FSDP keeps no MXFP8 params", index);
}

TensorView FullyShardedDataParallel::main_grad(int index) {
  MXDDP_CHECK(index >= 0 && index < num_params(), "param index {} out of range; valid: 0..{}", index, num_params() - 1);
  const ParamPlacement& p = layout_.params[static_cast<size_t>(index)];
  Bucket& b = *buckets_[static_cast<size_t>(p.bucket)];
  // The previous micro-batch's reduction of this bucket may still be in flight (sharded grads
  // reduce every micro-batch): it must land before new gradients go in.
  while (b.reduction_in_flight) complete_oldest_reduction();
  if (shards_grads() && !b.grads_full.data()) {
    // The bucket's unsharded grads live from its first gradient of the micro-batch until its
    // reduce-scatter lands in the shard.
    const size_t bytes = static_cast<size_t>(b.numel) * dtype_size_bytes(grad_dtype());
    b.grads_full = HostBuffer(bytes, MemoryCategory::kGrads, tracker_);
    std::memset(b.grads_full.data(), 0, bytes);
  }
  return sub(b.grads_full.view(grad_dtype(), Shape{b.numel}), p.range.start - b.range.start,
                                                               specs_[static_cast<size_t>(index)].shape);
}

int FullyShardedDataParallel::unit_of_module(const std::vector<int>& module_params, std::string_view hook) const {
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

void FullyShardedDataParallel::check_all_ready(const std::vector<int>& params, std::string_view hook) const {
  for (int p : params)
    MXDDP_CHECK(ready_[static_cast<size_t>(p)], "{}: param '{}' has not reported grad_ready in this micro-batch", hook,
                specs_[static_cast<size_t>(p)].name);
}

void FullyShardedDataParallel::grad_ready(int index) {
  MXDDP_CHECK(index >= 0 && index < num_params(), "grad_ready: param index {} out of range; valid: 0..{}", index,
              num_params() - 1);
  const auto i = static_cast<size_t>(index);
  MXDDP_CHECK(!ready_[i], "grad_ready called twice for param '{}' (index {}) in one micro-batch", specs_[i].name, index);
  ready_[i] = true;
  ++ready_count_;
  // A unit's grads are reduced at its post-backward; a non-unit bucket's when its last grad is in.
  const int bucket = layout_.params[i].bucket;
  if (unit_of_param_[i] < 0) {
    const auto& members = layout_.buckets[static_cast<size_t>(bucket)].params;
    if (std::all_of(members.begin(), members.end(), [&](int p) { return ready_[static_cast<size_t>(p)]; })) {
      const bool now = shards_grads() || (no_sync_depth_ == 0 && config_.overlap_grad_reduce);
      if (now) issue_reduction(bucket);
      if (shards_grads() && !config_.overlap_grad_reduce) complete_reductions();
    }
  }
  if (ready_count_ == num_params()) {  // the micro-batch's backward is over
    ready_.assign(ready_.size(), false);
    ready_count_ = 0;
  }
}

void FullyShardedDataParallel::before_forward(const std::vector<int>& module_params) {
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
  if (unit < 0) {
    in_backward_ = false;  // the embeddings open a forward pass (the final norm runs inside one)
    wait_gather(non_unit_group());
    // Only the non-unit modules before the first unit (the embeddings) start the units' prefetch;
    // the final norm comes after the last unit, with nothing left to prefetch in this pass.
    if (config_.overlap_param_gather && forward_unit_ < 0) prefetch_from(-1, Pass::kForward);
    return;
  }
  // A forward pass meets its units in order, so a pre-forward of a unit at or before the last one
  // is a re-run: a recompute in backward, which may come before the layer's first pre-backward.
  if (in_backward_ || (forward_unit_ >= 0 && unit <= forward_unit_)) {
    // The recompute's gather: no prefetch (this pass runs in backward order, and a forward-order
    // prefetch would fetch what backward has finished with), kept until the unit's post-backward.
    in_backward_ = true;
    forward_unit_ = -1;
    wait_gather(unit);
    return;
  }
  forward_unit_ = unit;
  wait_gather(unit);
  if (config_.overlap_param_gather) prefetch_from(unit, Pass::kForward);
}

void FullyShardedDataParallel::after_forward(const std::vector<int>& module_params) {
  const int unit = unit_of_module(module_params, "after_forward");
  // After a recompute the unit's backward comes next and reads it again: its post-backward releases
  // it, so that each gather is released once (Megatron frees it at the unit's post-backward too).
  if (shards_params() && unit >= 0 && !in_backward_) release_group(unit);
}

void FullyShardedDataParallel::before_backward(const std::vector<int>& module_params) {
  const int unit = unit_of_module(module_params, "before_backward");
  forward_unit_ = -1;  // the next forward starts again at the first unit
  in_backward_ = true;
  if (!shards_params() || unit < 0) return;
  wait_gather(unit);
  if (config_.overlap_param_gather) prefetch_from(unit, Pass::kBackward);
}

void FullyShardedDataParallel::after_backward(const std::vector<int>& module_params) {
  const int unit = unit_of_module(module_params, "after_backward");
  if (unit < 0) return;
  check_all_ready(module_params, "after_backward");
  if (shards_params()) release_group(unit);
  const bool now = shards_grads() || (no_sync_depth_ == 0 && config_.overlap_grad_reduce);
  if (!now) return;
  for (int b : unit_buckets_[static_cast<size_t>(unit)]) issue_reduction(b);
  // Without overlap the sharded-grad strategies wait here, so the unit's unsharded grads go now.
  if (shards_grads() && !config_.overlap_grad_reduce) complete_reductions();
}

void FullyShardedDataParallel::release_gathered_params() {
  forward_unit_ = -1;
  in_backward_ = false;
  for (int g = 0; g <= num_units(); ++g) release_group(g);
}

// ---- Gathers (optim_grads_params) ----

const std::vector<int>& FullyShardedDataParallel::group_buckets(int group) const {
  return group == non_unit_group() ? non_unit_buckets_ : unit_buckets_[static_cast<size_t>(group)];
}

int64_t FullyShardedDataParallel::group_numel(int group) const {
  int64_t n = 0;
  for (int b : group_buckets(group)) n += buckets_[static_cast<size_t>(b)]->numel;
  return n;
}

void FullyShardedDataParallel::dispatch_gather(int group) {
  MXDDP_ASSERT(gather_state_[static_cast<size_t>(group)] == 0);
  const size_t elem = dtype_size_bytes(config_.param_dtype);
  for (int bi : group_buckets(group)) {
    Bucket& b = *buckets_[static_cast<size_t>(bi)];
    b.gathered = HostBuffer(static_cast<size_t>(b.numel) * elem, MemoryCategory::kGathered, tracker_);
    gather_works_[static_cast<size_t>(group)].push_back(
        comm_.all_gather(b.params_shard.view(config_.param_dtype, Shape{b.shard}),
                         b.gathered.view(config_.param_dtype, Shape{b.numel}), {.async_op = true}));
    log_.push_back({FsdpCollective::Kind::kAllGather, bi});
  }
  gather_state_[static_cast<size_t>(group)] = 1;
  ++gathers_;
  events_.push_back({FsdpGatherEvent::Kind::kGather, group, in_backward_});
}

void FullyShardedDataParallel::wait_gather(int group) {
  auto& state = gather_state_[static_cast<size_t>(group)];
  if (state == 0) dispatch_gather(group);
  if (state == 1) {
    for (Work& w : gather_works_[static_cast<size_t>(group)]) w.wait();
    gather_works_[static_cast<size_t>(group)].clear();
    state = 2;
  }
}

void FullyShardedDataParallel::release_group(int group) {
  auto& state = gather_state_[static_cast<size_t>(group)];
  if (state == 0) return;
  // A gather still in flight writes into the storage: let it land before freeing it.
  for (Work& w : gather_works_[static_cast<size_t>(group)]) w.wait();
  gather_works_[static_cast<size_t>(group)].clear();
  for (int b : group_buckets(group)) buckets_[static_cast<size_t>(b)]->gathered = HostBuffer();
  state = 0;
  ++releases_;
  events_.push_back({FsdpGatherEvent::Kind::kRelease, group, in_backward_});
}

bool FullyShardedDataParallel::anything_gathered() const {
  return std::any_of(gather_state_.begin(), gather_state_.end(), [](uint8_t s) { return s != 0; });
}

int FullyShardedDataParallel::units_gathered() const {
  return static_cast<int>(std::count_if(gather_state_.begin(), gather_state_.begin() + num_units(),
                                        [](uint8_t s) { return s != 0; }));
}

void FullyShardedDataParallel::prefetch_from(int unit, Pass pass) {
  // Units ahead of `unit` in this pass's order, dispatched while what is gathered or in flight
  // ahead of it fits the budget (the current unit is always fetched and not counted), and with
  // fsdp_double_buffer while fewer than two units are held.
  const int step = pass == Pass::kForward ? 1 : -1;
  int64_t ahead = 0;
  int held = 0;
  for (int u = 0; u < num_units(); ++u) held += gather_state_[static_cast<size_t>(u)] != 0;
  for (int u = unit + step; u >= 0 && u < num_units(); u += step) {
    const int64_t n = group_numel(u);
    if (gather_state_[static_cast<size_t>(u)] != 0) {
      ahead += n;
      continue;
    }
    if (ahead + n > prefetch_budget_numel_) break;
    if (config_.fsdp_double_buffer && held >= 2) break;
    dispatch_gather(u);
    ahead += n;
    ++held;
  }
}

// ---- Reductions ----

void FullyShardedDataParallel::issue_reduction(int bucket) {
  Bucket& b = *buckets_[static_cast<size_t>(bucket)];
  MXDDP_ASSERT(!b.reduction_in_flight && b.grads_full.data());
  if (shards_grads())  // the queue bounds the unsharded grads alive at once
    while (!reductions_.empty() && reductions_numel_ + b.numel > rs_queue_numel_) complete_oldest_reduction();
  const int dp = comm_.size();
  const TensorView grads = b.grads_full.view(grad_dtype(), Shape{b.numel});
  const float prescale = 1.0f / static_cast<float>(dp);  // 1/dp rides inside the reduction, as in DDP
  Work work;
  if (config_.data_parallel_sharding_strategy == ShardingStrategy::kNoShard) {
    work = comm_.all_reduce(grads, {.op = ReduceOp::kSum, .async_op = true, .prescale = prescale});
    log_.push_back({FsdpCollective::Kind::kAllReduce, bucket});
  } else {
    // In place: this rank's block of the bucket receives its reduced shard.
    work = comm_.reduce_scatter(grads, sub(grads, comm_.rank() * b.shard, Shape{b.shard}),
                                {.op = ReduceOp::kSum, .async_op = true, .prescale = prescale});
    log_.push_back({FsdpCollective::Kind::kReduceScatter, bucket});
  }
  b.reduction_in_flight = true;
  reduced_[static_cast<size_t>(bucket)] = true;
  reductions_.emplace_back(bucket, std::move(work));
  reductions_numel_ += b.numel;
}

void FullyShardedDataParallel::complete_oldest_reduction() {
  MXDDP_ASSERT(!reductions_.empty());
  auto [bucket, work] = std::move(reductions_.front());
  reductions_.erase(reductions_.begin());
  Bucket& b = *buckets_[static_cast<size_t>(bucket)];
  reductions_numel_ -= b.numel;
  b.reduction_in_flight = false;
  work.wait();
  if (!shards_grads()) return;
  // Fold this micro-batch's reduced shard into the kept one and free the unsharded grads.
  const size_t elem = dtype_size_bytes(grad_dtype());
  accumulate(b.grads_shard.data(),
             static_cast<const char*>(b.grads_full.data()) + static_cast<size_t>(comm_.rank() * b.shard) * elem,
             grad_dtype(), b.shard);
  b.grads_full = HostBuffer();
}

void FullyShardedDataParallel::complete_reductions() {
  while (!reductions_.empty()) complete_oldest_reduction();
}

void FullyShardedDataParallel::finish_grad_sync() {
  MXDDP_CHECK(no_sync_depth_ == 0, "finish_grad_sync called inside a no_sync scope; call it after the last micro-batch");
  if (shards_grads()) {
    // Every bucket was reduced at its post-backward (or last grad_ready); one that was not has
    // unreported grads and would be lost.
    for (size_t b = 0; b < buckets_.size(); ++b)
      if (buckets_[b]->grads_full.data() && !buckets_[b]->reduction_in_flight) {
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
  ready_.assign(ready_.size(), false);
  ready_count_ = 0;
}

void FullyShardedDataParallel::zero_grad_buffer() {
  complete_reductions();  // a collective may still be reading the grads
  for (auto& b : buckets_) {
    HostBuffer& kept = shards_grads() ? b->grads_shard : b->grads_full;
    std::memset(kept.data(), 0, kept.size_bytes());
  }
  reduced_.assign(reduced_.size(), false);
  ready_.assign(ready_.size(), false);
  ready_count_ = 0;
}

// ---- The optimizer's side ----

OptimizerBucket FullyShardedDataParallel::optimizer_bucket(int bucket) const {
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

OptimizerBucketIo FullyShardedDataParallel::optimizer_io(int bucket) const {
  const Bucket& b = *buckets_.at(static_cast<size_t>(bucket));
  const int64_t at = comm_.rank() * b.shard;
  switch (config_.data_parallel_sharding_strategy) {
    case ShardingStrategy::kNoShard:
      return {.grads = b.grads_full.view(grad_dtype(), Shape{b.numel}),
              .params = b.params_full.view(config_.param_dtype, Shape{b.numel})};
    case ShardingStrategy::kOptim:
      return {.grads = sub(b.grads_full.view(grad_dtype(), Shape{b.numel}), at, Shape{b.shard}),
              .params = sub(b.params_full.view(config_.param_dtype, Shape{b.numel}), at, Shape{b.shard})};
    case ShardingStrategy::kOptimGrads:
      return {.grads = b.grads_shard.view(grad_dtype(), Shape{b.shard}),
              .params = sub(b.params_full.view(config_.param_dtype, Shape{b.numel}), at, Shape{b.shard})};
    case ShardingStrategy::kOptimGradsParams:
      return {.grads = b.grads_shard.view(grad_dtype(), Shape{b.shard}),
              .params = b.params_shard.view(config_.param_dtype, Shape{b.shard})};
  }
  MXDDP_FAIL("unknown sharding strategy");
}

TensorView FullyShardedDataParallel::initial_params(int bucket) const { return optimizer_io(bucket).params; }

void FullyShardedDataParallel::issue_full_param_gathers() {
  // optim / optim_grads: every rank keeps full params; gather the updated shards in forward order
  // (the last bucket holds the first params).
  for (int b = static_cast<int>(buckets_.size()) - 1; b >= 0; --b) {
    const Bucket& bucket = *buckets_[static_cast<size_t>(b)];
    const TensorView full = bucket.params_full.view(config_.param_dtype, Shape{bucket.numel});
    full_param_gathers_[static_cast<size_t>(b)] =
        comm_.all_gather(sub(full, comm_.rank() * bucket.shard, Shape{bucket.shard}), full, {.async_op = true});
    full_param_waited_[static_cast<size_t>(b)] = false;
    log_.push_back({FsdpCollective::Kind::kAllGather, b});
  }
  full_param_gather_pending_ = true;
}

void FullyShardedDataParallel::wait_full_param_gathers() {
  if (!full_param_gather_pending_) return;
  for (size_t b = 0; b < buckets_.size(); ++b)
    if (!full_param_waited_[b]) {
      full_param_gathers_[b].wait();
      full_param_waited_[b] = true;
    }
  full_param_gather_pending_ = false;
}

void FullyShardedDataParallel::step_and_sync_params(const std::function<void(int bucket)>& update) {
  wait_full_param_gathers();  // (done by the forward already; the update rewrites the shards)
  for (int b = 0; b < static_cast<int>(buckets_.size()); ++b) update(b);
  const ShardingStrategy s = config_.data_parallel_sharding_strategy;
  if (s == ShardingStrategy::kOptim || s == ShardingStrategy::kOptimGrads) {
    issue_full_param_gathers();
    if (!config_.overlap_param_gather) wait_full_param_gathers();
  }
  // no_shard updated the full params in place; optim_grads_params gathers unit by unit in forward.
}

void FullyShardedDataParallel::start_iteration(const std::function<void()>&) {
  zero_grad_buffer();
  in_backward_ = false;
  // The design's start_param_sync: the non-unit params and the first unit, plus the prefetch.
  if (shards_params() && config_.overlap_param_gather) {
    if (gather_state_[static_cast<size_t>(non_unit_group())] == 0) dispatch_gather(non_unit_group());
    if (gather_state_[0] == 0) dispatch_gather(0);
    prefetch_from(0, Pass::kForward);
  }
}

void FullyShardedDataParallel::force_param_sync(const std::function<void()>& stage) {
  // Whatever was gathered or is in flight came from the shards as they were: drop it all.
  wait_full_param_gathers();
  release_gathered_params();
  stage();
  const ShardingStrategy s = config_.data_parallel_sharding_strategy;
  if (s == ShardingStrategy::kOptim || s == ShardingStrategy::kOptimGrads) {
    issue_full_param_gathers();
    wait_full_param_gathers();
  }
}

}  // namespace mxddp
