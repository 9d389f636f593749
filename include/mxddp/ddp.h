// mxddp ddp: data-parallel gradient synchronization over a ParamAndGradBuffer.
//
// Owns: DistributedDataParallel, which turns the model's "this gradient is final" notifications
// into bucket collectives: an in-place reduce-scatter into this rank's shard with the distributed
// optimizer, an all-reduce without it. With overlap_grad_reduce a bucket group's collective starts
// the moment its last gradient is reported, while backward goes on.
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

#include <mxddp/buffer.h>
#include <mxddp/comm.h>
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

class DistributedDataParallel {
 public:
  // comm and tracker must outlive this object. initial_values: as for ParamAndGradBuffer.
  DistributedDataParallel(Communicator& comm, const std::vector<ParamSpec>& params, const DdpConfig& config,
                          MemoryTracker& tracker, const std::vector<TensorView>& initial_values = {});
  ~DistributedDataParallel();  // waits for collectives still in flight
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  const DdpConfig& config() const { return config_; }
  Communicator& communicator() const { return comm_; }
  ParamAndGradBuffer& buffer() { return buffer_; }
  const ParamAndGradBuffer& buffer() const { return buffer_; }
  int num_params() const { return buffer_.num_params(); }
  // The model's view of a param (bf16). With fp8_param_gather this is the param's own copy, and a
  // param marked mxfp8 has none: use mxfp8_param.
  TensorView param(int index) const;
  const Mxfp8Tensor& mxfp8_param(int index) const;
  TensorView main_grad(int index) const { return buffer_.main_grad(index); }
  // True once a gradient has been reported since the last zero_grad_buffer.
  bool grads_live() const { return grads_live_; }
  // With reuse_grad_buf_for_mxfp8_param_ag, the initial params stay in the (shared) param buffer
  // only until the first zero_grad_buffer; the optimizer takes its main params from them.
  bool param_buffer_holds_initial_params() const { return param_buffer_holds_params_; }

  // The gradient of param `index` in main_grad is final for this micro-batch. Throws if it was
  // already reported in this micro-batch.
  void grad_ready(int index);
  // Issues what has not been issued (everything, without overlap), waits for all collectives and
  // starts the next iteration's bookkeeping. With overlap on, every param must have reported
  // grad_ready; the error names those that did not.
  void finish_grad_sync();
  // Zeroes the whole grad buffer (after waiting for any collective still reading it).
  void zero_grad_buffer();
  // Copies rank 0's param buffer to every rank.
  void broadcast_params();

  // ---- Param sync (distributed optimizer): all-gathers every bucket's shards of the param buffer.
  // Groups are gathered in reverse index order, so the first gather holds the first layers.
  //
  // Starts a param sync of what the optimizer has staged into this rank's shards. With
  // overlap_param_gather (and not force_sync) only the first group is dispatched, and before_forward
  // gathers the rest as the model reaches them; otherwise everything is gathered before returning.
  void start_param_sync(bool force_sync = false);
  // The pieces of start_param_sync for a caller that dispatches group by group (the optimizer with
  // overlap_param_gather_with_optimizer_step): begin a sync with nothing dispatched, then dispatch
  // the gathers one at a time, in gather order (groups num_groups-1 down to 0).
  void begin_param_sync();
  void dispatch_next_param_gather();
  // The bucket group whose gather dispatch_next_param_gather would dispatch (-1 when none is left).
  int next_param_gather_group() const;
  // Waits for `group`'s gather and those of the groups gathered before it (dispatching them if
  // needed), then dispatches the next group so it overlaps the caller's compute.
  void finish_param_sync(int group);
  // The forward pre-hook: call before a module uses these params (registration indices).
  void before_forward(const std::vector<int>& params);
  // Waits for the gathers already dispatched, dispatching nothing new (before the shards change).
  void wait_param_gathers_in_flight();
  // Dispatches every gather not yet dispatched and waits for all of them.
  void complete_param_sync();
  bool param_sync_pending() const { return gather_pending_; }
  int group_of_param(int index) const { return group_of_param_.at(static_cast<size_t>(index)); }

  // While a scope is alive, grad_ready only records readiness (gradient accumulation across
  // micro-batches); nothing is communicated.
  class NoSyncScope {
   public:
    explicit NoSyncScope(DistributedDataParallel& ddp);
    ~NoSyncScope();
    NoSyncScope(const NoSyncScope&) = delete;
    NoSyncScope& operator=(const NoSyncScope&) = delete;

   private:
    DistributedDataParallel& ddp_;
  };
  [[nodiscard]] NoSyncScope no_sync() { return NoSyncScope(*this); }

  // Observability for tests and benchmarks.
  int num_bucket_groups() const { return static_cast<int>(buffer_.bucket_groups().size()); }
  bool bucket_group_issued(int group) const;     // its collectives were handed to the communicator
  bool bucket_group_completed(int group) const;  // and have all finished

 private:
  void issue_group(int group);
  void dispatch_gather(int position);  // position k gathers group num_groups-1-k
  void wait_gather(int group);         // waits, then (once) moves the group's params out
  void on_group_gathered(int group);   // MXFP8 quantize / BF16 copy, and zero the staging (reuse)
  void check_no_live_grads_under_staging() const;
  void issue_ready_groups_in_order();
  void wait_all_issued();
  void reset_iteration();
  void check_finite(int bucket) const;

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
  // Param sync state.
  bool gather_pending_ = false;
  int gather_next_position_ = 0;                 // positions [0, this) are dispatched
  std::vector<std::vector<Work>> gather_works_;  // [num groups]
  std::vector<bool> gather_waited_;              // [num groups]
  bool grads_live_ = false;
  bool param_buffer_holds_params_ = true;
  // fp8_param_gather storage, [num params]: one of the two per param.
  std::vector<std::unique_ptr<Mxfp8Tensor>> mxfp8_;
  std::vector<HostBuffer> own_bf16_;
};

}  // namespace mxddp
