// DistributedDataParallel: readiness bookkeeping and bucket dispatch (see ddp.h).
#include <algorithm>
#include <cmath>
#include <cstring>

#include <mxddp/ddp.h>

namespace mxddp {

LayoutOptions DdpConfig::layout_options(int dp) const {
  LayoutOptions o;
  o.dp = dp;
  o.bucket_size = overlap_grad_reduce ? (bucket_size ? bucket_size : default_bucket_size(dp, true)) : std::nullopt;
  o.use_distributed_optimizer = use_distributed_optimizer;
  o.pad_buckets_for_high_nccl_busbw = pad_buckets_for_high_nccl_busbw;
  return o;
}

namespace {
BufferOptions buffer_options(const DdpConfig& c) {
  return BufferOptions{.param_dtype = c.param_dtype, .grad_reduce_in_fp32 = c.grad_reduce_in_fp32,
                       .buckets_per_group = c.buckets_per_group,
                       .params_in_grad_buffer = c.reuse_grad_buf_for_mxfp8_param_ag};
}

void validate(const DdpConfig& c, const std::vector<ParamSpec>& params) {
  MXDDP_CHECK(!c.overlap_param_gather_with_optimizer_step || (c.overlap_param_gather && c.use_distributed_optimizer),
              "overlap_param_gather_with_optimizer_step needs overlap_param_gather and use_distributed_optimizer");
  MXDDP_CHECK(!(c.reuse_grad_buf_for_mxfp8_param_ag && c.overlap_param_gather_with_optimizer_step),
              "reuse_grad_buf_for_mxfp8_param_ag cannot overlap the param gather with the optimizer step: the "
              "gathers stage in the grad buffer, which holds gradients until the step is done");
  MXDDP_CHECK(!c.reuse_grad_buf_for_mxfp8_param_ag || c.fp8_param_gather,
              "reuse_grad_buf_for_mxfp8_param_ag needs fp8_param_gather (there is nothing to stage without it)");
  MXDDP_CHECK(!c.fp8_param_gather || c.use_distributed_optimizer,
              "fp8_param_gather needs use_distributed_optimizer (MXFP8 params are gathered from the optimizer's shards)");
  MXDDP_CHECK(!c.fp8_param_gather || c.param_dtype == DType::kBF16, "fp8_param_gather stages bf16 params; got param_dtype {}",
              dtype_name(c.param_dtype));
  for (const ParamSpec& p : params) {
    MXDDP_CHECK(!p.mxfp8 || c.fp8_param_gather, "param '{}' is marked mxfp8 but fp8_param_gather is off", p.name);
    MXDDP_CHECK(!p.mxfp8 || p.shape.ndim() == 2, "param '{}' is marked mxfp8 but has shape {}; MXFP8 params are 2-D",
                p.name, p.shape.to_string());
  }
}
}  // namespace

DistributedDataParallel::DistributedDataParallel(Communicator& comm, const std::vector<ParamSpec>& params,
                                                 const DdpConfig& config, MemoryTracker& tracker,
                                                 const std::vector<TensorView>& initial_values)
    : comm_(comm),
      config_((validate(config, params), config)),
      buffer_(params, config.layout_options(comm.size()), buffer_options(config), tracker, initial_values) {
  const auto& groups = buffer_.bucket_groups();
  std::vector<int> group_of_bucket(buffer_.layout().buckets.size());
  for (size_t g = 0; g < groups.size(); ++g)
    for (int b : groups[g]) group_of_bucket[static_cast<size_t>(b)] = static_cast<int>(g);
  group_param_count_.assign(groups.size(), 0);
  for (const ParamPlacement& p : buffer_.layout().params) {
    const int g = group_of_bucket[static_cast<size_t>(p.bucket)];
    group_of_param_.push_back(g);
    ++group_param_count_[static_cast<size_t>(g)];
  }
  works_.resize(groups.size());
  gather_works_.resize(groups.size());
  gather_waited_.assign(groups.size(), false);
  reset_iteration();
  if (config_.fp8_param_gather) {
    // Every rank holds the full initial params in the param buffer: move them out like a gather
    // would, but leave the buffer as it is (the optimizer takes its main params from it).
    mxfp8_.resize(params.size());
    own_bf16_.resize(params.size());
    for (size_t p = 0; p < params.size(); ++p) {
      const TensorView staged = buffer_.param_data(static_cast<int>(p));
      if (params[p].mxfp8) {
        mxfp8_[p] = std::make_unique<Mxfp8Tensor>(params[p].shape[0], params[p].shape[1], config_.mxfp8_elem,
                                                  config_.mxfp8_scale_mode, tracker);
        mxfp8_[p]->quantize_from(staged);
      } else {
        own_bf16_[p] = HostBuffer(staged.nbytes(), MemoryCategory::kParams, tracker);
        std::memcpy(own_bf16_[p].data(), staged.data, staged.nbytes());
      }
    }
  }
}

TensorView DistributedDataParallel::param(int index) const {
  if (!config_.fp8_param_gather) return buffer_.param_data(index);
  MXDDP_CHECK(index >= 0 && index < num_params(), "param index {} out of range; valid: 0..{}", index, num_params() - 1);
  const ParamSpec& spec = buffer_.params()[static_cast<size_t>(index)];
  MXDDP_CHECK(!mxfp8_[static_cast<size_t>(index)], "param '{}' is kept as MXFP8: read it with mxfp8_param({})", spec.name,
              index);
  return own_bf16_[static_cast<size_t>(index)].view(DType::kBF16, spec.shape);
}

const Mxfp8Tensor& DistributedDataParallel::mxfp8_param(int index) const {
  MXDDP_CHECK(index >= 0 && index < num_params(), "param index {} out of range; valid: 0..{}", index, num_params() - 1);
  MXDDP_CHECK(config_.fp8_param_gather && mxfp8_[static_cast<size_t>(index)],
              "param '{}' is not an MXFP8 param (mark it mxfp8 and turn on fp8_param_gather)",
              buffer_.params()[static_cast<size_t>(index)].name);
  return *mxfp8_[static_cast<size_t>(index)];
}

void DistributedDataParallel::on_group_gathered(int group) {
  if (!config_.fp8_param_gather) return;
  for (int b : buffer_.bucket_groups()[static_cast<size_t>(group)]) {
    for (int p : buffer_.layout().buckets[static_cast<size_t>(b)].params) {
      const TensorView gathered = buffer_.param_data(p);
      if (mxfp8_[static_cast<size_t>(p)]) mxfp8_[static_cast<size_t>(p)]->quantize_from(gathered);
      else std::memcpy(own_bf16_[static_cast<size_t>(p)].data(), gathered.data, gathered.nbytes());
    }
    // The staging view overlaps other buckets' gradients: leave it zero for them.
    if (config_.reuse_grad_buf_for_mxfp8_param_ag) {
      const TensorView staging = buffer_.bucket_params(b);
      std::memset(staging.data, 0, staging.nbytes());
    }
  }
}

DistributedDataParallel::~DistributedDataParallel() {
  for (auto* all : {&works_, &gather_works_})
    for (auto& group : *all)
      for (Work& w : group) {
        try {
          w.wait();
        } catch (...) {  // a destructor cannot report it; finish_grad_sync / the param sync would have
        }
      }
}

void DistributedDataParallel::reset_iteration() {
  ready_.assign(static_cast<size_t>(num_params()), false);
  ready_count_ = 0;
  group_remaining_ = group_param_count_;
  next_group_ = 0;
  for (auto& group : works_) group.clear();
}

void DistributedDataParallel::grad_ready(int index) {
  MXDDP_CHECK(index >= 0 && index < num_params(), "grad_ready: param index {} out of range; valid: 0..{}", index,
              num_params() - 1);
  const auto i = static_cast<size_t>(index);
  MXDDP_CHECK(!ready_[i], "grad_ready called twice for param '{}' (index {}) in one micro-batch",
              buffer_.params()[i].name, index);
  ready_[i] = true;
  ++ready_count_;
  grads_live_ = true;
  if (no_sync_depth_ > 0) {
    // Accumulating: a micro-batch ends when every param has reported.
    if (ready_count_ == num_params()) {
      ready_.assign(ready_.size(), false);
      ready_count_ = 0;
    }
    return;
  }
  --group_remaining_[static_cast<size_t>(group_of_param_[i])];
  if (config_.overlap_grad_reduce) issue_ready_groups_in_order();
}

void DistributedDataParallel::issue_ready_groups_in_order() {
  while (next_group_ < num_bucket_groups() && group_remaining_[static_cast<size_t>(next_group_)] == 0)
    issue_group(next_group_++);
}

void DistributedDataParallel::check_finite(int bucket) const {
  const TensorView grads = buffer_.bucket_grads(bucket);
  const auto n = static_cast<size_t>(grads.numel());
  bool finite = true;
  if (grads.dtype == DType::kF32) {
    const float* g = grads.data_as<const float>();
    for (size_t i = 0; i < n && finite; ++i) finite = std::isfinite(g[i]);
  } else {
    const bf16_bits* g = grads.data_as<const bf16_bits>();
    for (size_t i = 0; i < n && finite; ++i) finite = (g[i] & 0x7f80u) != 0x7f80u;
  }
  if (finite) return;
  std::string names;
  for (int p : buffer_.layout().buckets[static_cast<size_t>(bucket)].params)
    names += fmt::format("{}{}", names.empty() ? "" : ", ", buffer_.params()[static_cast<size_t>(p)].name);
  MXDDP_FAIL("rank {}: NaN or Inf in the gradients of bucket {} (params: {}) before its collective", comm_.rank(),
             bucket, names);
}

void DistributedDataParallel::issue_group(int group) {
  const int dp = comm_.size();
  const bool reduce_scatter = config_.use_distributed_optimizer && !config_.force_all_reduce;
  const ReduceOp op = config_.average_in_collective ? ReduceOp::kAvg : ReduceOp::kSum;
  // Scaling by 1/dp rides inside the reduction (prescale) instead of a pass over the bucket.
  const float prescale = config_.average_in_collective ? 1.0f : 1.0f / static_cast<float>(dp);
  auto& works = works_[static_cast<size_t>(group)];
  for (int b : buffer_.bucket_groups()[static_cast<size_t>(group)]) {
    if (config_.check_for_nan_in_grad) check_finite(b);
    const TensorView grads = buffer_.bucket_grads(b);
    if (reduce_scatter)
      works.push_back(comm_.reduce_scatter(grads, buffer_.grad_shard(b, comm_.rank()),
                                           {.op = op, .async_op = true, .prescale = prescale}));
    else
      works.push_back(comm_.all_reduce(grads, {.op = op, .async_op = true, .prescale = prescale}));
  }
}

void DistributedDataParallel::wait_all_issued() {
  for (int g = 0; g < next_group_; ++g)
    for (Work& w : works_[static_cast<size_t>(g)]) w.wait();
}

void DistributedDataParallel::finish_grad_sync() {
  MXDDP_CHECK(no_sync_depth_ == 0, "finish_grad_sync called inside a no_sync scope; call it after the last micro-batch");
  if (config_.overlap_grad_reduce && next_group_ < num_bucket_groups()) {
    std::string missing;
    int count = 0;
    for (int i = 0; i < num_params(); ++i)
      if (!ready_[static_cast<size_t>(i)] && count++ < 8)
        missing += fmt::format("{}'{}'", missing.empty() ? "" : ", ", buffer_.params()[static_cast<size_t>(i)].name);
    MXDDP_FAIL("finish_grad_sync: overlap_grad_reduce is on but {} param(s) never reported grad_ready: {}{}", count,
               missing, count > 8 ? ", ..." : "");
  }
  while (next_group_ < num_bucket_groups()) issue_group(next_group_++);
  wait_all_issued();
  reset_iteration();
}

void DistributedDataParallel::zero_grad_buffer() {
  wait_all_issued();  // a collective may still be reading the buffer
  // With reuse, a pending param sync stages in this buffer: finish it (from the still-valid
  // staging) before the zeros would be gathered as params.
  if (config_.reuse_grad_buf_for_mxfp8_param_ag) {
    complete_param_sync();
    param_buffer_holds_params_ = false;
  }
  const TensorView grads = buffer_.grad_buffer();
  std::memset(grads.data, 0, grads.nbytes());
  grads_live_ = false;
  reset_iteration();
}

void DistributedDataParallel::broadcast_params() { comm_.broadcast(buffer_.param_buffer(), {.root = 0}); }

void DistributedDataParallel::check_no_live_grads_under_staging() const {
  // With reuse the gather stages in the grad buffer: gradients there would be gathered as params.
  MXDDP_CHECK(!(config_.reuse_grad_buf_for_mxfp8_param_ag && grads_live_),
              "param all-gather while gradients live in the grad buffer it stages in "
              "(reuse_grad_buf_for_mxfp8_param_ag): zero the grad buffer and re-stage the main params first "
              "(DistributedOptimizer::zero_grad or force_param_sync)");
}

void DistributedDataParallel::dispatch_gather(int position) {
  check_no_live_grads_under_staging();
  const int group = num_bucket_groups() - 1 - position;
  auto& works = gather_works_[static_cast<size_t>(group)];
  for (int b : buffer_.bucket_groups()[static_cast<size_t>(group)])
    works.push_back(comm_.all_gather(buffer_.param_shard(b, comm_.rank()), buffer_.bucket_params(b), {.async_op = true}));
}

void DistributedDataParallel::begin_param_sync() {
  MXDDP_CHECK(config_.use_distributed_optimizer,
              "start_param_sync: params are sharded (and gathered) only with use_distributed_optimizer");
  check_no_live_grads_under_staging();  // before any state changes: a refused sync leaves none behind
  if (gather_pending_) complete_param_sync();  // the previous sync still owns the buffer
  gather_pending_ = true;
  gather_next_position_ = 0;
  for (auto& w : gather_works_) w.clear();
  gather_waited_.assign(gather_waited_.size(), false);
}

void DistributedDataParallel::dispatch_next_param_gather() {
  MXDDP_CHECK(gather_pending_, "dispatch_next_param_gather outside a param sync (call begin_param_sync first)");
  if (gather_next_position_ < num_bucket_groups()) dispatch_gather(gather_next_position_++);
}

int DistributedDataParallel::next_param_gather_group() const {
  return gather_pending_ && gather_next_position_ < num_bucket_groups() ? num_bucket_groups() - 1 - gather_next_position_ : -1;
}

void DistributedDataParallel::start_param_sync(bool force_sync) {
  begin_param_sync();
  if (force_sync || !config_.overlap_param_gather) complete_param_sync();
  else dispatch_next_param_gather();
}

void DistributedDataParallel::finish_param_sync(int group) {
  MXDDP_CHECK(group >= 0 && group < num_bucket_groups(), "bucket group {} out of range; valid: 0..{}", group,
              num_bucket_groups() - 1);
  if (!gather_pending_ || gather_waited_[static_cast<size_t>(group)]) return;
  // Waits for this group and every group gathered before it, so a module never sees a group whose
  // gather is still running even if an earlier module's hook was skipped.
  const int position = num_bucket_groups() - 1 - group;
  while (gather_next_position_ <= position) dispatch_gather(gather_next_position_++);
  for (int p = 0; p <= position; ++p) wait_gather(num_bucket_groups() - 1 - p);
  // Prefetch: the next group's gather overlaps the compute that follows.
  if (gather_next_position_ < num_bucket_groups()) dispatch_gather(gather_next_position_++);
  if (std::all_of(gather_waited_.begin(), gather_waited_.end(), [](bool w) { return w; })) gather_pending_ = false;
}

void DistributedDataParallel::before_forward(const std::vector<int>& params) {
  if (!gather_pending_) return;
  // Finish the groups these params need in gather order (highest group index first).
  std::vector<int> groups;
  for (int p : params) {
    MXDDP_CHECK(p >= 0 && p < num_params(), "before_forward: param index {} out of range; valid: 0..{}", p,
                num_params() - 1);
    groups.push_back(group_of_param_[static_cast<size_t>(p)]);
  }
  std::sort(groups.rbegin(), groups.rend());
  for (int g : groups) finish_param_sync(g);
}

void DistributedDataParallel::wait_gather(int group) {
  if (gather_waited_[static_cast<size_t>(group)]) return;
  for (Work& w : gather_works_[static_cast<size_t>(group)]) w.wait();
  gather_waited_[static_cast<size_t>(group)] = true;
  on_group_gathered(group);
}

void DistributedDataParallel::wait_param_gathers_in_flight() {
  for (int position = 0; position < gather_next_position_; ++position) wait_gather(num_bucket_groups() - 1 - position);
}

void DistributedDataParallel::complete_param_sync() {
  if (!gather_pending_) return;
  while (gather_next_position_ < num_bucket_groups()) dispatch_gather(gather_next_position_++);
  wait_param_gathers_in_flight();
  gather_pending_ = false;
}

bool DistributedDataParallel::bucket_group_issued(int group) const {
  MXDDP_CHECK(group >= 0 && group < num_bucket_groups(), "bucket group {} out of range; valid: 0..{}", group,
              num_bucket_groups() - 1);
  return group < next_group_;
}

bool DistributedDataParallel::bucket_group_completed(int group) const {
  if (!bucket_group_issued(group)) return false;
  for (const Work& w : works_[static_cast<size_t>(group)])
    if (!w.is_completed()) return false;
  return true;
}

DistributedDataParallel::NoSyncScope::NoSyncScope(DistributedDataParallel& ddp) : ddp_(ddp) { ++ddp_.no_sync_depth_; }

DistributedDataParallel::NoSyncScope::~NoSyncScope() {
  if (--ddp_.no_sync_depth_ == 0) {
    // A micro-batch that ended with some params unreported leaves nothing behind.
    ddp_.ready_.assign(ddp_.ready_.size(), false);
    ddp_.ready_count_ = 0;
  }
}

}  // namespace mxddp
