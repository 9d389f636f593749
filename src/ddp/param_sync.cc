// ParamSync: see param_sync.h.
#include "param_sync.h"

#include <algorithm>

namespace mxddp {

ParamSync::ParamSync(Communicator& comm, ParamAndGradBuffer& buffer, ModelParamStore* store,
                     const ParamSyncOptions& options, std::function<bool()> grads_live)
    : comm_(comm), buffer_(buffer), store_(store), options_(options), grads_live_(std::move(grads_live)) {
  const auto& groups = buffer_.bucket_groups();
  std::vector<int> group_of_bucket(buffer_.layout().buckets.size());
  for (size_t g = 0; g < groups.size(); ++g)
    for (int b : groups[g]) group_of_bucket[static_cast<size_t>(b)] = static_cast<int>(g);
  for (const ParamPlacement& p : buffer_.layout().params) group_of_param_.push_back(group_of_bucket[static_cast<size_t>(p.bucket)]);
  works_.resize(groups.size());
  waited_.assign(groups.size(), false);
}

ParamSync::~ParamSync() {
  for (auto& group : works_)
    for (Work& w : group) {
      try {
        w.wait();
      } catch (...) {  // a destructor cannot report it; the sync that waited would have
      }
    }
}

void ParamSync::check_no_live_grads_under_staging() const {
  // With reuse the gather stages in the grad buffer: gradients there would be gathered as params.
  MXDDP_CHECK(!(options_.reuse_grad_buf_for_mxfp8_param_ag && grads_live_()),
              "param all-gather while gradients live in the grad buffer it stages in "
              "(reuse_grad_buf_for_mxfp8_param_ag): zero the grad buffer and re-stage the main params first "
              "(DistributedOptimizer::zero_grad or force_param_sync)");
}

void ParamSync::on_gathered(int group) {
  if (!store_) return;
  for (int b : buffer_.bucket_groups()[static_cast<size_t>(group)]) {
    for (int p : buffer_.layout().buckets[static_cast<size_t>(b)].params) store_->store_from(p, buffer_.param_data(p));
    // The staging view overlaps other buckets' gradients: leave it zero for them.
    if (options_.reuse_grad_buf_for_mxfp8_param_ag) {
      const TensorView staging = buffer_.bucket_params(b);
      buffer_.compute().zero(staging.data, staging.nbytes());
    }
  }
}

void ParamSync::dispatch(int position) {
  check_no_live_grads_under_staging();
  const int group = num_groups() - 1 - position;
  auto& works = works_[static_cast<size_t>(group)];
  for (int b : buffer_.bucket_groups()[static_cast<size_t>(group)])
    works.push_back(comm_.all_gather(buffer_.param_shard(b, comm_.rank()), buffer_.bucket_params(b), {.async_op = true}));
}

void ParamSync::begin() {
  MXDDP_CHECK(buffer_.layout().options.use_distributed_optimizer,
              "start_param_sync: params are sharded (and gathered) only with use_distributed_optimizer");
  check_no_live_grads_under_staging();  // before any state changes: a refused sync leaves none behind
  if (pending_) complete();             // the previous sync still owns the buffer
  pending_ = true;
  next_position_ = 0;
  for (auto& w : works_) w.clear();
  waited_.assign(waited_.size(), false);
}

void ParamSync::dispatch_next() {
  MXDDP_CHECK(pending_, "dispatch_next_param_gather outside a param sync (call begin_param_sync first)");
  if (next_position_ < num_groups()) dispatch(next_position_++);
}

int ParamSync::next_group() const {
  return pending_ && next_position_ < num_groups() ? num_groups() - 1 - next_position_ : -1;
}

void ParamSync::start(bool force_sync) {
  begin();
  if (force_sync || !options_.overlap_param_gather) complete();
  else dispatch_next();
}

void ParamSync::finish(int group) {
  MXDDP_CHECK(group >= 0 && group < num_groups(), "bucket group {} out of range; valid: 0..{}", group, num_groups() - 1);
  if (!pending_ || waited_[static_cast<size_t>(group)]) return;
  // Waits for this group and every group gathered before it, so a module never sees a group whose
  // gather is still running even if an earlier module's hook was skipped.
  const int position = num_groups() - 1 - group;
  while (next_position_ <= position) dispatch(next_position_++);
  for (int p = 0; p <= position; ++p) wait(num_groups() - 1 - p);
  // Prefetch: the next group's gather overlaps the compute that follows.
  if (next_position_ < num_groups()) dispatch(next_position_++);
  if (std::all_of(waited_.begin(), waited_.end(), [](bool w) { return w; })) pending_ = false;
}

void ParamSync::before_forward(const std::vector<int>& params) {
  if (!pending_) return;
  // Finish the groups these params need in gather order (highest group index first).
  std::vector<int> groups;
  for (int p : params) {
    MXDDP_CHECK(p >= 0 && p < buffer_.num_params(), "before_forward: param index {} out of range; valid: 0..{}", p,
                buffer_.num_params() - 1);
    groups.push_back(group_of_param_[static_cast<size_t>(p)]);
  }
  std::sort(groups.rbegin(), groups.rend());
  for (int g : groups) finish(g);
}

void ParamSync::wait(int group) {
  if (waited_[static_cast<size_t>(group)]) return;
  for (Work& w : works_[static_cast<size_t>(group)]) w.wait();
  waited_[static_cast<size_t>(group)] = true;
  on_gathered(group);
}

void ParamSync::wait_in_flight() {
  for (int position = 0; position < next_position_; ++position) wait(num_groups() - 1 - position);
}

void ParamSync::complete() {
  if (!pending_) return;
  while (next_position_ < num_groups()) dispatch(next_position_++);
  wait_in_flight();
  pending_ = false;
}

void ParamSync::before_zero_grad_buffer() {
  if (!options_.reuse_grad_buf_for_mxfp8_param_ag) return;
  complete();
  param_buffer_holds_params_ = false;
}

void ParamSync::force(const std::function<void()>& stage, const std::function<void()>& zero_grads) {
  if (options_.reuse_grad_buf_for_mxfp8_param_ag) {
    // The staging area is the grad buffer: it may hold gradients or zeros, never trust it.
    zero_grads();  // finishes a pending sync first, from its still-valid staging
    stage();
    start(/*force_sync=*/true);
    return;
  }
  // A gather in flight reads the shards: let it finish before they are re-staged.
  wait_in_flight();
  stage();
  if (pending_) complete();  // gathers only what is left
  else start(/*force_sync=*/true);
}

}  // namespace mxddp
