// mxddp ddp: data-parallel gradient synchronization over a ParamAndGradBuffer.
//
// Owns: DistributedDataParallel, which turns the model's "this gradient is final" notifications
// into bucket collectives: an in-place reduce-scatter into this rank's shard with the distributed
// optimizer, an all-reduce without it. With overlap_grad_reduce a bucket group's collective starts
// the moment its last gradient is reported, while backward goes on.
//
// The param all-gather of the distributed optimizer and the MXFP8 param copies live in
// src/ddp/param_sync.h and src/ddp/model_params.h; DDP owns one of each.
//
// The optimizer's side has two modes, as torch DDP and Megatron offer them:
//   - use_distributed_optimizer (ZeRO-1): the optimizer updates this rank's shard of each bucket
//     and the param all-gather brings every rank's params up to date;
//   - without it, a replicated optimizer (torch DDP's default): the grads are all-reduced, every
//     rank updates every param of every bucket (F32 main params and state for the whole model on
//     each rank; an F32 param buffer is its own main param), and nothing is gathered. Each rank owns
//     its layout shard (LayoutOptions::shard_unpadded_buckets) for the global grad norm and for
//     checkpoints, so every element is counted and saved once, as under the distributed optimizer.
//
// Protocol, per iteration (a global batch of one or more micro-batches):
//   zero_grad_buffer();
//   for each micro-batch but the last:  { auto scope = ddp.no_sync(); forward; backward; }
//   last micro-batch: forward; backward (accumulate into main_grad(i), then grad_ready(i));
//   finish_grad_sync();
// The model accumulates each weight gradient into main_grad(i) (it is never overwritten by the
// library between zero_grad_buffer calls) and calls grad_ready(i) once per micro-batch, when that
// gradient is final for the micro-batch.
//
// Ordering: bucket groups are issued strictly in index order (bucket 0 holds the last registered
// params, the first whose gradients backward produces), so every rank issues the same collectives
// in the same order whatever order its gradients become ready in.
#pragma once

#include <optional>
#include <vector>

#include <memory>

#include <mxddp/buffer.h>
#include <mxddp/comm.h>
#include <mxddp/config_fields.h>
#include <mxddp/data_parallel.h>
#include <mxddp/data_parallel_fields.h>
#include <mxddp/quant.h>

namespace mxddp {

struct DdpConfig {
  bool grad_reduce_in_fp32 = true;
  bool overlap_grad_reduce = false;
  bool use_distributed_optimizer = false;
  // Elements. Without overlap_grad_reduce there is one bucket, whatever this says; with it,
  // nullopt means Megatron's default, max(40,000,000, 1,000,000 x dp).
  std::optional<int64_t> bucket_size;
  bool pad_buckets_for_high_nccl_busbw = false;
  // Average in the collective (sum, then divide by dp) instead of scaling each rank's grads by 1/dp
  // as they enter the sum (the collective's prescale).
  bool average_in_collective = false;
  // Before each collective, a NaN or Inf in the bucket is an Error naming it, its params and rank.
  bool check_for_nan_in_grad = false;
  // All-reduce even with the distributed optimizer (every rank then holds every reduced grad).
  bool force_all_reduce = false;
  int buckets_per_group = 1;
  DType param_dtype = DType::kBF16;
  // Distributed optimizer: gather updated params group by group in the forward pre-hooks
  // (before_forward) instead of all at once at the end of the optimizer step.
  bool overlap_param_gather = false;
  // With overlap_param_gather: the optimizer step updates the bucket groups in gather order and
  // dispatches each group's all-gather as soon as its shards are updated, so the gathers overlap
  // the rest of the update.
  bool overlap_param_gather_with_optimizer_step = false;
  // MXFP8 params (ParamSpec::mxfp8): every param gets storage outside the buffers (MXFP8 row- and
  // column-wise for those marked, a BF16 copy for the rest) and the param buffer only stages the
  // all-gathers; after a group's gather its params are quantized (or copied) out of it.
  bool fp8_param_gather = false;
  Fp8Format mxfp8_elem = Fp8Format::kE4M3;
  ScaleMode mxfp8_scale_mode = ScaleMode::kRceil;
  // With fp8_param_gather: no param buffer of its own; gathers stage in the grad buffer, so they
  // may only run while no gradients live there (see DistributedOptimizer::zero_grad).
  bool reuse_grad_buf_for_mxfp8_param_ag = false;

  LayoutOptions layout_options(int dp) const;
};

// Throws Error naming what DistributedDataParallel refuses in this config and params.
void check_ddp_config(const DdpConfig& config, const std::vector<ParamSpec>& params);

// Every DdpConfig field, once (config_fields.h): `mxddp train`'s flags, its report's "ddp" section
// and a checkpoint manifest's "ddp" section come from here. The fields FsdpConfig has too come
// first, from their shared description (data_parallel_fields.h). A field without a flag is set by
// the command (grad_reduce_in_fp32 and param_dtype keep the GPT's defaults; train() forces
// use_distributed_optimizer on).
constexpr auto describe_fields(std::type_identity<DdpConfig>) {
  using C = DdpConfig;
  return std::tuple_cat(describe_shared_data_parallel_fields<C>(), std::tuple{
      ConfigField<C, bool>{"use_distributed_optimizer", "", "Shard the optimizer state (always on in mxddp train)",
                           &C::use_distributed_optimizer},
      ConfigField<C, std::optional<int64_t>>{"bucket_size", "--bucket-size,--ddp-bucket-size",
                                             "Bucket size in elements (with --overlap-grad-reduce)", &C::bucket_size,
                                             kPositive},
      ConfigField<C, bool>{"pad_buckets_for_high_nccl_busbw",
                           "--pad-buckets-for-high-nccl-busbw,--ddp-pad-buckets-for-high-nccl-busbw",
                           "Pad bucket ends to lcm(dp, 128, 65536)", &C::pad_buckets_for_high_nccl_busbw},
      ConfigField<C, bool>{"average_in_collective", "--average-in-collective,--ddp-average-in-collective",
                           "Average in the collective instead of pre-scaling by 1/dp", &C::average_in_collective},
      ConfigField<C, bool>{"check_for_nan_in_grad", "--check-for-nan-in-grad",
                           "DDP: fail on the rank that finds a NaN or Inf gradient, before reducing its bucket",
                           &C::check_for_nan_in_grad},
      ConfigField<C, bool>{"force_all_reduce", "--force-all-reduce",
                           "All-reduce gradients even with the distributed optimizer", &C::force_all_reduce},
      ConfigField<C, int>{"buckets_per_group", "--buckets-per-group",
                          "Buckets per bucket group (one collective call each)", &C::buckets_per_group, kPositive},
      ConfigField<C, bool>{"overlap_param_gather_with_optimizer_step", "--overlap-param-gather-with-optimizer-step",
                           "Start each group's gather as soon as the optimizer has updated it",
                           &C::overlap_param_gather_with_optimizer_step},
      ConfigField<C, bool>{"fp8_param_gather", "--fp8-param-gather",
                           "Keep the linear weights as MXFP8 (DDP: quantized after each gather; FSDP: sharded row- "
                           "and column-wise payloads)",
                           &C::fp8_param_gather},
      ConfigField<C, bool>{"reuse_grad_buf_for_mxfp8_param_ag", "--reuse-grad-buf-for-mxfp8-param-ag",
                           "Stage the param all-gather in the grad buffer (no BF16 param buffer)",
                           &C::reuse_grad_buf_for_mxfp8_param_ag},
  });
}

class ModelParamStore;  // src/ddp/model_params.h
class ParamSync;        // src/ddp/param_sync.h: the param all-gather and the MXFP8 reuse mechanism

class DistributedDataParallel final : public DataParallel {
 public:
  // comm and tracker must outlive this object. initial_values: as for ParamAndGradBuffer.
  DistributedDataParallel(Communicator& comm, const std::vector<ParamSpec>& params, const DdpConfig& config,
                          MemoryTracker& tracker, const std::vector<TensorView>& initial_values = {});
  ~DistributedDataParallel() override;  // waits for collectives still in flight
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  const DdpConfig& config() const { return config_; }
  Communicator& communicator() const override { return comm_; }
  Compute& compute() const override { return buffer_.compute(); }  // the buffers': the communicator's
  const std::vector<ParamSpec>& params() const override { return buffer_.params(); }
  DType param_dtype() const override { return config_.param_dtype; }
  DType grad_dtype() const override { return buffer_.grad_buffer().dtype; }
  std::string describe() const override { return "ddp"; }
  ParamAndGradBuffer& buffer() { return buffer_; }
  const ParamAndGradBuffer& buffer() const { return buffer_; }
  ParamSync& param_sync() { return *param_sync_; }

  // ---- The model's side (DataParallel). With fp8_param_gather param() is the param's own copy,
  // and a param marked mxfp8 has none: use mxfp8_param.
  TensorView param(int index) const override;
  bool is_mxfp8(int index) const override;
  Mxfp8View mxfp8_param(int index, QuantAxis axis) const override;  // in compute()'s memory
  TensorView main_grad(int index) override { return buffer_.main_grad(index); }
  TensorView main_grad(int index) const { return buffer_.main_grad(index); }
  // The gradient of param `index` in main_grad is final for this micro-batch. Throws if it was
  // already reported in this micro-batch.
  void grad_ready(int index) override;
  // The forward pre-hook: waits for the param gathers these params need (overlap_param_gather).
  void before_forward(const std::vector<int>& module_params) override;
  // DDP keeps every param resident and reduces buckets as their gradients are reported, so the
  // other hooks have nothing to do.
  void after_forward(const std::vector<int>&) override {}
  void before_backward(const std::vector<int>&) override {}
  void after_backward(const std::vector<int>&) override {}
  void release_gathered_params() override {}
  // True once a gradient has been reported since the last zero_grad_buffer.
  bool grads_live() const { return grads_live_; }

  // Issues what has not been issued (everything, without overlap), waits for all collectives and
  // starts the next iteration's bookkeeping. With overlap on, every param must have reported
  // grad_ready; the error names those that did not.
  void finish_grad_sync() override;
  // Zeroes the whole grad buffer (after waiting for any collective still reading it).
  void zero_grad_buffer() override;
  // Copies rank 0's param buffer to every rank.
  void broadcast_params();

  // ---- The optimizer's side (DataParallel): buckets, shards, and the param sync. Without
  // use_distributed_optimizer the optimizer is replicated: optimizer_bucket(b) updates the whole
  // bucket and owns this rank's layout shard, optimizer_io(b) and initial_params(b) are the whole
  // bucket, step_and_sync_params and force_param_sync gather nothing.
  const ParamLayout& layout() const override { return buffer_.layout(); }
  OptimizerBucket optimizer_bucket(int bucket) const override;
  OptimizerBucketIo optimizer_io(int bucket) const override;
  TensorView initial_params(int bucket) const override;
  void step_and_sync_params(const std::function<void(int bucket)>& update) override;
  void start_iteration(const std::function<void()>& stage) override;
  void force_param_sync(const std::function<void()>& stage) override;
  // Starts a param sync of what is staged in this rank's shards (see ParamSync::start). Throws
  // without use_distributed_optimizer, where every rank holds all of its params already.
  void start_param_sync(bool force_sync = false);
  bool param_sync_pending() const;
  // Whether param `index`'s bucket group has a gather still to land (a sync under way, its group
  // not yet waited for by a forward pre-hook or a finish).
  bool param_gather_pending(int index) const;
  int next_param_gather_group() const;
  int group_of_param(int index) const { return group_of_param_.at(static_cast<size_t>(index)); }

  using DataParallel::no_sync;

  // Observability for tests and benchmarks.
  int num_bucket_groups() const { return static_cast<int>(buffer_.bucket_groups().size()); }
  bool bucket_group_issued(int group) const;     // its collectives were handed to the communicator
  bool bucket_group_completed(int group) const;  // and have all finished

 protected:
  void enter_no_sync() override { ++no_sync_depth_; }
  void exit_no_sync() override;

 private:
  void issue_group(int group);
  void issue_ready_groups_in_order();
  void wait_all_issued();
  void reset_iteration();
  void check_finite(int bucket) const;
  bool replicated_optimizer() const { return !config_.use_distributed_optimizer; }

  Communicator& comm_;
  DdpConfig config_;
  ParamAndGradBuffer buffer_;
  std::vector<int> group_of_param_;   // [num params]
  std::vector<int> group_param_count_;  // [num groups]
  // Iteration state (touched only by the thread that drives the model).
  std::vector<bool> ready_;             // [num params], this micro-batch
  int ready_count_ = 0;
  std::vector<int> group_remaining_;    // [num groups] params not yet ready
  int next_group_ = 0;                  // groups [0, next_group_) are issued
  std::vector<std::vector<Work>> works_;  // [num groups]
  int no_sync_depth_ = 0;
  bool grads_live_ = false;
  std::unique_ptr<ModelParamStore> store_;  // with fp8_param_gather
  std::unique_ptr<ParamSync> param_sync_;
};

}  // namespace mxddp
