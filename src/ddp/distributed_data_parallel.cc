// DistributedDataParallel: readiness bookkeeping and bucket dispatch (see ddp.h).
#include <algorithm>
#include <cmath>
#include <cstring>

#include <mxddp/ddp.h>

#include "model_params.h"
#include "param_sync.h"

namespace mxddp {

LayoutOptions DdpConfig::layout_options(int dp) const {
  LayoutOptions o;
  o.dp = dp;
  o.bucket_size = overlap_grad_reduce ? (bucket_size ? bucket_size : default_bucket_size(dp, true)) : std::nullopt;
  o.use_distributed_optimizer = use_distributed_optimizer;
  // A replicated optimizer owns its rank's shard of the unpadded buckets (ddp.h).
  o.shard_unpadded_buckets = !use_distributed_optimizer;
  o.pad_buckets_for_high_nccl_busbw = pad_buckets_for_high_nccl_busbw;
  return o;
}

namespace {
// The buffers (and the MXFP8 and BF16 copies of fp8_param_gather) live where the communicator's
// collectives run (its rank's compute): host memory, or a local group's device.
BufferOptions buffer_options(const DdpConfig& c, Communicator& comm) {
  return BufferOptions{.param_dtype = c.param_dtype, .grad_reduce_in_fp32 = c.grad_reduce_in_fp32,
                       .buckets_per_group = c.buckets_per_group,
                       .params_in_grad_buffer = c.reuse_grad_buf_for_mxfp8_param_ag, .compute = &comm.compute()};
}

}  // namespace

void check_ddp_config(const DdpConfig& c, const std::vector<ParamSpec>& params) {
  MXDDP_CHECK(!c.overlap_param_gather_with_optimizer_step || (c.overlap_param_gather && c.use_distributed_optimizer),
              "overlap_param_gather_with_optimizer_step (--overlap-param-gather-with-optimizer-step) needs overlap_param_gather "
              "(--overlap-param-gather) and use_distributed_optimizer");
  MXDDP_CHECK(!(c.reuse_grad_buf_for_mxfp8_param_ag && c.overlap_param_gather_with_optimizer_step),
              "reuse_grad_buf_for_mxfp8_param_ag (--reuse-grad-buf-for-mxfp8-param-ag) cannot overlap the param gather with "
              "the optimizer step (--overlap-param-gather-with-optimizer-step): the "
              "gathers stage in the grad buffer, which holds gradients until the step is done");
  MXDDP_CHECK(!c.reuse_grad_buf_for_mxfp8_param_ag || c.fp8_param_gather,
              "reuse_grad_buf_for_mxfp8_param_ag (--reuse-grad-buf-for-mxfp8-param-ag) needs fp8_param_gather "
              "(--fp8-param-gather): there is nothing to stage without it");
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

DistributedDataParallel::DistributedDataParallel(Communicator& comm, const std::vector<ParamSpec>& params,
                                                 const DdpConfig& config, MemoryTracker& tracker,
                                                 const std::vector<TensorView>& initial_values)
    : comm_(comm),
      config_((check_ddp_config(config, params), config)),
      buffer_(params, config.layout_options(comm.size()), buffer_options(config, comm), tracker, initial_values) {
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
  reset_iteration();
  // Every rank holds the full initial params in the param buffer: the store takes its copies like
  // a gather would, and the buffer stays as it is (the optimizer takes its main params from it).
  if (config_.fp8_param_gather)
    store_ = std::make_unique<ModelParamStore>(buffer_, config_.mxfp8_elem, config_.mxfp8_scale_mode, tracker);
  param_sync_ = std::make_unique<ParamSync>(
      comm_, buffer_, store_.get(),
      ParamSyncOptions{.overlap_param_gather = config_.overlap_param_gather,
                       .reuse_grad_buf_for_mxfp8_param_ag = config_.reuse_grad_buf_for_mxfp8_param_ag},
      [this] { return grads_live_; });
}

TensorView DistributedDataParallel::param(int index) const {
  if (!store_) return buffer_.param_data(index);
  MXDDP_CHECK(index >= 0 && index < num_params(), "param index {} out of range; valid: 0..{}", index, num_params() - 1);
  return store_->bf16(index);
}

bool DistributedDataParallel::is_mxfp8(int index) const {
  MXDDP_CHECK(index >= 0 && index < num_params(), "param index {} out of range; valid: 0..{}", index, num_params() - 1);
  return store_ && store_->is_mxfp8(index);
}

Mxfp8View DistributedDataParallel::mxfp8_param(int index, QuantAxis axis) const {
  MXDDP_CHECK(index >= 0 && index < num_params(), "param index {} out of range; valid: 0..{}", index, num_params() - 1);
  MXDDP_CHECK(store_, "param '{}' is not an MXFP8 param (mark it mxfp8 and turn on fp8_param_gather)",
              buffer_.params()[static_cast<size_t>(index)].name);
  return store_->mxfp8(index, axis);
}

DistributedDataParallel::~DistributedDataParallel() {
  param_sync_.reset();  // waits for its gathers
  for (auto& group : works_)
    for (Work& w : group) {
      try {
        w.wait();
      } catch (...) {  // a destructor cannot report it; finish_grad_sync would have
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
  if (buffer_.compute().all_finite(buffer_.bucket_grads(bucket))) return;
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
  param_sync_->before_zero_grad_buffer();  // with reuse, a pending sync stages in this buffer
  const TensorView grads = buffer_.grad_buffer();
  buffer_.compute().zero(grads.data, grads.nbytes());  // the rank's threads, or its stream
  grads_live_ = false;
  reset_iteration();
}

void DistributedDataParallel::broadcast_params() { comm_.broadcast(buffer_.param_buffer(), {.root = 0}); }

void DistributedDataParallel::before_forward(const std::vector<int>& module_params) {
  param_sync_->before_forward(module_params);
}

void DistributedDataParallel::start_param_sync(bool force_sync) { param_sync_->start(force_sync); }
bool DistributedDataParallel::param_sync_pending() const { return param_sync_->pending(); }
bool DistributedDataParallel::param_gather_pending(int index) const {
  return param_sync_->gather_pending(group_of_param(index));
}
int DistributedDataParallel::next_param_gather_group() const { return param_sync_->next_group(); }

OptimizerBucket DistributedDataParallel::optimizer_bucket(int bucket) const {
  const ParamLayout& layout = buffer_.layout();
  MXDDP_CHECK(bucket >= 0 && bucket < static_cast<int>(layout.buckets.size()), "bucket {} out of range; valid: 0..{}",
              bucket, layout.buckets.size() - 1);
  const BucketShard& shard = layout.shards.at(static_cast<size_t>(comm_.rank())).at(static_cast<size_t>(bucket));
  if (!replicated_optimizer())
    return OptimizerBucket{.numel = shard.range.size(), .update = shard.params, .owned = shard.params};
  // Replicated: the optimizer's views are the whole bucket, so offsets count from its start.
  const BucketPlacement& b = layout.buckets[static_cast<size_t>(bucket)];
  OptimizerBucket ob{.numel = b.range.size(), .update = {}, .owned = shard.params};
  for (int p : b.params) {  // in buffer order
    const Range r = layout.params[static_cast<size_t>(p)].range;
    ob.update.push_back({p, r, {0, r.size()}, {r.start - b.range.start, r.end - b.range.start}});
  }
  const int64_t shard_at = shard.range.start - b.range.start;
  for (ShardParamRange& r : ob.owned) r.in_shard = {r.in_shard.start + shard_at, r.in_shard.end + shard_at};
  return ob;
}

OptimizerBucketIo DistributedDataParallel::optimizer_io(int bucket) const {
  if (replicated_optimizer())
    return OptimizerBucketIo{.grads = buffer_.bucket_grads(bucket), .params = buffer_.bucket_params(bucket)};
  // Under reuse the param shard is grad memory until the step is over: staging waits for
  // start_iteration.
  return OptimizerBucketIo{.grads = buffer_.grad_shard(bucket, comm_.rank()),
                           .params = buffer_.param_shard(bucket, comm_.rank()),
                           .stage_in_step = !config_.reuse_grad_buf_for_mxfp8_param_ag};
}

TensorView DistributedDataParallel::initial_params(int bucket) const {
  if (replicated_optimizer()) return buffer_.bucket_params(bucket);
  MXDDP_CHECK(param_sync_->param_buffer_holds_params(),
              "construct the DistributedOptimizer before the first zero_grad_buffer: with "
              "reuse_grad_buf_for_mxfp8_param_ag the initial params live in the grad buffer until then");
  return buffer_.param_shard(bucket, comm_.rank());
}

void DistributedDataParallel::step_and_sync_params(const std::function<void(int bucket)>& update) {
  if (replicated_optimizer()) {
    // Every rank updates (and stages) all of its params from the same all-reduced grads: there is
    // nothing to gather.
    for (int b = 0; b < static_cast<int>(buffer_.layout().buckets.size()); ++b) update(b);
    return;
  }
  // A forward that skipped a module (its pre-hook never ran) leaves that group's gather pending or
  // in flight; it reads the shards the update is about to write, so finish it first.
  if (param_sync_->pending()) param_sync_->complete();
  if (config_.overlap_param_gather_with_optimizer_step) {
    // Update group by group in gather order; each group's gather runs while later groups update.
    ParamSync& sync = *param_sync_;
    sync.begin();
    for (int g = sync.next_group(); g >= 0; g = sync.next_group()) {
      for (int b : buffer_.bucket_groups()[static_cast<size_t>(g)]) update(b);
      sync.dispatch_next();
    }
    return;
  }
  for (int b = 0; b < static_cast<int>(buffer_.layout().buckets.size()); ++b) update(b);
  // Under reuse nothing is staged yet: the gathers wait for start_iteration.
  if (!config_.reuse_grad_buf_for_mxfp8_param_ag) param_sync_->start();
}

void DistributedDataParallel::start_iteration(const std::function<void()>& stage) {
  zero_grad_buffer();
  if (!config_.reuse_grad_buf_for_mxfp8_param_ag) return;
  stage();
  param_sync_->start();
}

void DistributedDataParallel::force_param_sync(const std::function<void()>& stage) {
  // Replicated: every rank re-stages all of its params itself; nothing is gathered.
  if (replicated_optimizer()) stage();
  else param_sync_->force(stage, [this] { zero_grad_buffer(); });
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

void DistributedDataParallel::exit_no_sync() {
  if (--no_sync_depth_ == 0) {
    // A micro-batch that ended with some params unreported leaves nothing behind.
    ready_.assign(ready_.size(), false);
    ready_count_ = 0;
  }
}

}  // namespace mxddp
