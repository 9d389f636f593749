// mxddp data_parallel: the one interface a model, a training loop and the optimizer see, whether
// DistributedDataParallel (ddp.h) or FullyShardedDataParallel (fsdp.h) runs underneath.
//
// Owns: DataParallel, OptimizerBucket and the no_sync scope.
//
// The model's protocol, per micro-batch (a "module" is the param list a hook names: a decoder
// layer, the embeddings, the final norm):
//   before_forward(m) ... read param(i) / mxfp8_param(i, axis) of m ... after_forward(m)
//   backward, modules in reverse order:
//     before_backward(m) ... read params, accumulate into main_grad(i), grad_ready(i) ... after_backward(m)
//   a forward-only pass (evaluation) ends with release_gathered_params().
// DDP keeps every param resident, so its after_forward / before_backward / after_backward have
// nothing to do; FSDP gathers a unit's params in the pre-hooks and frees them in the post-hooks.
// A param may be read only between its module's pre- and post-hook.
//
// The training loop's protocol, per iteration: zero_grad (through the optimizer), micro-batches
// 1..k-1 under no_sync(), micro-batch k, finish_grad_sync(), the optimizer step.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <mxddp/buffer.h>
#include <mxddp/comm.h>
#include <mxddp/compute.h>
#include <mxddp/quant.h>

namespace mxddp {

// One bucket as the optimizer sees it on this rank: its f32 main params and state hold `numel`
// elements; `update` are the param elements it steps on, `owned` the ones this rank answers for
// in the global grad norm and in checkpoints (every element of the model is owned by exactly one
// rank). Sharded strategies update what they own; a replicated optimizer (FSDP no_shard, DDP
// without use_distributed_optimizer) updates the whole bucket and owns its layout shard.
// ShardParamRange::in_shard is the offset in the optimizer's [numel] buffers and in grads() / params().
struct OptimizerBucket {
  int64_t numel = 0;
  std::vector<ShardParamRange> update;
  std::vector<ShardParamRange> owned;
};

// Where the optimizer's update of one bucket reads its reduced grads and where the updated params
// are staged (cast to the param dtype), both [OptimizerBucket::numel]. stage_in_step: the update
// stages as it goes; false while `params` is grad memory until the step is over (MXFP8 reuse),
// when staging waits for start_iteration. params is empty (null) where the strategy keeps no values
// between steps (FSDP's MXFP8 buckets): the optimizer may read grads at any time, params only while
// step_and_sync_params, start_iteration or force_param_sync has it stage.
struct OptimizerBucketIo {
  TensorView grads;
  TensorView params;
  bool stage_in_step = true;
};

class DataParallel {
 public:
  virtual ~DataParallel() = default;

  virtual Communicator& communicator() const = 0;
  // Where this rank's buffers live and the element work on them runs (the optimizer's step): for
  // DDP and FSDP alike their communicator's (Communicator::compute(): host memory, or a local
  // group's device).
  virtual Compute& compute() const = 0;
  virtual const std::vector<ParamSpec>& params() const = 0;
  int num_params() const { return static_cast<int>(params().size()); }
  virtual DType param_dtype() const = 0;
  virtual DType grad_dtype() const = 0;
  // "ddp" or "fsdp:<strategy>", for reports and checkpoint manifests.
  virtual std::string describe() const = 0;

  // ---- The model's side ----
  // The param's values (param_dtype), valid between its module's pre- and post-hook. A param
  // kept as MXFP8 (is_mxfp8) has none: read mxfp8_param, row-wise for forward products and
  // column-wise for backward's data gradient (FSDP holds each only while a pass needs it).
  virtual TensorView param(int index) const = 0;
  virtual bool is_mxfp8(int index) const = 0;
  virtual Mxfp8View mxfp8_param(int index, QuantAxis axis) const = 0;
  // Where the param's gradient accumulates (+=) in this micro-batch; valid until grad_ready.
  virtual TensorView main_grad(int index) = 0;
  // The gradient in main_grad is final for this micro-batch. Throws if reported twice.
  virtual void grad_ready(int index) = 0;
  virtual void before_forward(const std::vector<int>& module_params) = 0;
  virtual void after_forward(const std::vector<int>& module_params) = 0;
  virtual void before_backward(const std::vector<int>& module_params) = 0;
  virtual void after_backward(const std::vector<int>& module_params) = 0;
  // A forward-only pass is over: nothing gathered for it is needed any more.
  virtual void release_gathered_params() = 0;

  // ---- The training loop's side ----
  virtual void finish_grad_sync() = 0;
  virtual void zero_grad_buffer() = 0;

  // While a scope is alive, gradients accumulate locally where the strategy allows it: nothing is
  // reduced (DDP, FSDP no_shard and optim). FSDP optim_grads* still reduce-scatter every
  // micro-batch, since they keep only a shard of the gradients.
  class NoSyncScope {
   public:
    explicit NoSyncScope(DataParallel& dp) : dp_(dp) { dp_.enter_no_sync(); }
    ~NoSyncScope() { dp_.exit_no_sync(); }
    NoSyncScope(const NoSyncScope&) = delete;
    NoSyncScope& operator=(const NoSyncScope&) = delete;

   private:
    DataParallel& dp_;
  };
  [[nodiscard]] NoSyncScope no_sync() { return NoSyncScope(*this); }

  // ---- The optimizer's side ----
  // The layout: buckets, and layout().shards[rank], the part of each bucket that rank owns.
  virtual const ParamLayout& layout() const = 0;
  virtual OptimizerBucket optimizer_bucket(int bucket) const = 0;
  virtual OptimizerBucketIo optimizer_io(int bucket) const = 0;
  // The params the optimizer takes its initial main params from, one view per bucket laid out as
  // its [numel] (param_dtype or f32). Throws if they are no longer there (MXFP8 reuse after the
  // first zero_grad_buffer).
  virtual TensorView initial_params(int bucket) const = 0;
  // The optimizer's step: calls update(bucket) for every bucket, in the order the param sync
  // wants them, and starts the param sync of what was staged (at once, or overlapped with the
  // rest of the update or with the next forward, as configured).
  virtual void step_and_sync_params(const std::function<void(int bucket)>& update) = 0;
  // The start of an iteration: zeroes the gradients; `stage` casts the main params into
  // optimizer_io(b).params for every bucket, for a strategy that stages only now (MXFP8 reuse).
  virtual void start_iteration(const std::function<void()>& stage) = 0;
  // Brings every rank's model params up to date with the main params between iterations
  // (checkpoint save, evaluation, end of training), whatever state the param sync is in: `stage`
  // re-stages them. Collective.
  virtual void force_param_sync(const std::function<void()>& stage) = 0;

 protected:
  virtual void enter_no_sync() = 0;
  virtual void exit_no_sync() = 0;
};

}  // namespace mxddp
