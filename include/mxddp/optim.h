// mxddp optim: the distributed (ZeRO-1) optimizer.
//
// Owns: DistributedOptimizer. Each rank keeps FP32 main params and optimizer state for its shard
// of every bucket only (the layout's shard ranges), so optimizer memory per rank falls as 12/dp
// bytes per param (AdamW). A step:
//   1. global grad norm: local sum of squares of this rank's shard in f64 (padding excluded),
//      all-reduced, square-rooted; a NaN or Inf norm skips the step and changes nothing;
//   2. clipping: grads scaled by clip_grad / (norm + 1e-6) when that is below 1;
//   3. AdamW (or SGD with momentum) on the shard;
//   4. staging: the updated main params cast to BF16 (round to nearest even) into this rank's shard
//      of the param buffer (in the same pass as the update);
//   5. the param all-gather, started by the data-parallel side (DataParallel::step_and_sync_params):
//      at once or, with overlap_param_gather, group by group in the forward pre-hooks.
// It runs over any DataParallel: DistributedDataParallel with use_distributed_optimizer, or
// FullyShardedDataParallel; a DistributedDataParallel without use_distributed_optimizer and FSDP's
// no_shard keep a replicated optimizer: every rank updates the whole model (no all-gather), and owns
// only its layout shard for the grad norm and checkpoints.
// Hyperparameters are per param group (torch's param_groups): each registered param belongs to one
// group or to none (not trained). Built from an OptimizerConfig there are Megatron's two default
// groups: 0 decays the params of two or more dimensions, 1 holds the rest (biases, norms) without
// decay. Each param counts its own steps (torch's state['step']), which bias-correct its update: a
// param a step leaves untouched (StepOptions::frozen, torch's grad None) neither decays nor moves
// its moments nor counts the step.
#pragma once

#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <mxddp/config_fields.h>
#include <mxddp/data_parallel.h>
#include <mxddp/ddp.h>
#include <mxddp/memory.h>

namespace mxddp {

// The update rule: kAdam is AdamW (decoupled weight decay), kSgd SGD with momentum.
enum class OptimizerType : uint8_t { kAdam, kSgd };
std::string_view optimizer_name(OptimizerType optimizer);  // "adam", "sgd": what reports and manifests write
// The inverse of optimizer_name; throws Error "optimizer 'X' is not supported; valid: adam, sgd".
OptimizerType parse_optimizer(std::string_view name);

template <>
struct FieldEnum<OptimizerType> {
  static std::string_view name(OptimizerType o) { return optimizer_name(o); }
  static OptimizerType parse(std::string_view s) { return parse_optimizer(s); }
  static std::vector<std::string> names() { return {"adam", "sgd"}; }
};

struct OptimizerConfig {
  OptimizerType optimizer = OptimizerType::kAdam;
  float lr = 1e-3f;
  float weight_decay = 0.01f;
  float adam_beta1 = 0.9f;
  float adam_beta2 = 0.999f;
  float adam_eps = 1e-8f;
  float sgd_momentum = 0.9f;
  float clip_grad = 1.0f;  // max global grad norm; 0 disables clipping
};

// Every OptimizerConfig field, once (config_fields.h): `mxddp train`'s flags, its report's
// "optimizer" section and a checkpoint manifest's "optimizer" section come from here. lr has no
// flag of its own: `mxddp train` sets it every iteration from the schedule (--lr, --min-lr, ...).
constexpr auto describe_fields(std::type_identity<OptimizerConfig>) {
  using C = OptimizerConfig;
  return std::tuple{
      ConfigField<C, OptimizerType>{"optimizer", "--optimizer", "adam (AdamW) or sgd", &C::optimizer},
      ConfigField<C, float>{"lr", "", "Learning rate (mxddp train: the schedule's, from --lr)", &C::lr, kNonNegative},
      ConfigField<C, float>{"weight_decay", "--weight-decay", "Decoupled weight decay (2-D params only)",
                            &C::weight_decay, kNonNegative},
      // Adam's bias correction divides by 1 - beta^t, which is 0 for beta = 1 (PyTorch refuses it too).
      ConfigField<C, float>{"adam_beta1", "--adam-beta1", "Adam beta1", &C::adam_beta1, {.lo = 0, .hi = 1, .open_high = true}},
      ConfigField<C, float>{"adam_beta2", "--adam-beta2", "Adam beta2", &C::adam_beta2, {.lo = 0, .hi = 1, .open_high = true}},
      ConfigField<C, float>{"adam_eps", "--adam-eps", "Adam epsilon", &C::adam_eps, {.lo = 0, .open_low = true}},
      ConfigField<C, float>{"sgd_momentum", "--sgd-momentum", "SGD momentum", &C::sgd_momentum, {.lo = 0, .hi = 1, .open_high = true}},
      ConfigField<C, float>{"clip_grad", "--clip-grad", "Max global grad norm (0: no clipping)", &C::clip_grad,
                            kNonNegative},
  };
}

// One param group's hyperparameters, as torch's param_groups hold them. decoupled_weight_decay:
// AdamW's decay (p *= 1 - lr * weight_decay); false is torch's Adam with L2 (weight_decay * p added
// to the grad). SGD always decays by L2, as torch.optim.SGD does; its dampening is 0, nesterov off.
struct ParamGroup {
  float lr = 1e-3f;
  float weight_decay = 0.0f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float momentum = 0.0f;
  bool decoupled_weight_decay = true;
};
// Throws Error naming the field, its value and what is valid.
void validate_param_group(const ParamGroup& group);

// What one step does besides the update. unscale multiplies every grad (GradScaler's 1/scale): the
// grad norm reported and clipped by is the unscaled grads'. clip_coeff is a further coefficient in
// [0, 1] decided before the step (a clip_grad_norm_ call; 0 zeroes the grads). frozen: registration
// indices this step leaves untouched (agreed across ranks).
struct StepOptions {
  double unscale = 1.0;
  double clip_coeff = 1.0;
  std::vector<int> frozen;
};

struct StepResult {
  bool skipped = false;   // the grad norm was NaN or Inf: nothing changed
  double grad_norm = 0;   // before clipping
  double clip_coeff = 1;  // applied to the grads (1 when not clipped)
};

// The names of an optimizer's per-element states, in order, as checkpoints store them:
// adam: exp_avg, exp_avg_sq; sgd: momentum_buffer. The name form (a checkpoint manifest's) throws
// Error for another optimizer.
std::vector<std::string_view> optimizer_state_names(OptimizerType optimizer);
std::vector<std::string_view> optimizer_state_names(std::string_view optimizer);

// Megatron's rule for the main params: where a bucket's param shard is f32 it is the main param
// itself (the update writes it in place: no copy, no staging); a shard of another dtype (bf16,
// MXFP8's bf16 staging) gets an f32 copy, charged as kMainParams. The planners charge by it too.
inline bool main_params_alias_param_shard(DType param_shard_dtype) { return param_shard_dtype == DType::kF32; }

class DistributedOptimizer {
 public:
  // dp (a DDP with use_distributed_optimizer, or an FSDP) and tracker must outlive this object.
  // Main params are initialized from dp's current params.
  DistributedOptimizer(DataParallel& dp, const OptimizerConfig& config, MemoryTracker& tracker);

  // Call after finish_grad_sync(). Collective: every rank must call it.
  // With reuse_grad_buf_for_mxfp8_param_ag the step only updates the main params: staging and the
  // gathers wait for zero_grad(), when no gradients live in the buffer they stage in.
  StepResult step() { return step(StepOptions{}); }
  StepResult step(const StepOptions& options);
  // The global L2 norm of the synchronized grads times unscale (each element counted once, on the
  // rank that owns it). unscale is applied to each rank's sum of squares before the all-reduce,
  // which carries it in f32: scaled grads whose squares sum beyond f32 still give a finite norm.
  // Collective; call after finish_grad_sync().
  double grad_norm(double unscale = 1.0);
  // The params whose reduced gradients hold a NaN or Inf anywhere on any rank, as registration
  // indices in increasing order; call after finish_grad_sync(). Collective.
  std::vector<int> nonfinite_grad_params();
  // The elements of the synchronized grads that are zero (+0 or -0), each counted once, on the rank
  // that owns it, and summed across dp exactly: Megatron's num_zeros_in_grad (log_num_zeros_in_grad).
  // Padding is not counted. Collective; call after finish_grad_sync().
  int64_t count_zero_grads();
  // Starts an iteration: zeroes the grad buffer, and with reuse_grad_buf_for_mxfp8_param_ag then
  // stages the main params and starts the param sync (the design's steps 1 and 2).
  void zero_grad();

  // Brings every rank's model params up to date with the main params, at any point between
  // iterations (checkpoint save, evaluation, end of training): waits for a gather in flight
  // rather than issuing it again, re-stages the main params into the param buffer, and gathers
  // what has not been gathered. With reuse_grad_buf_for_mxfp8_param_ag it first zeroes the grad
  // buffer (the staging area) and then re-stages and gathers everything. Collective.
  void force_param_sync();
  // Casts the main params (BF16, round to nearest even) into where each bucket stages its params
  // (this rank's shards of the param buffer); nothing to do for an f32 shard, which is its own
  // main param.
  void stage_main_params();

  const OptimizerConfig& config() const { return config_; }
  float lr() const { return config_.lr; }
  // Sets the config's lr and every group's.
  void set_lr(float lr);
  // The steps taken (those not skipped for a NaN or Inf norm).
  int64_t step_count() const { return step_count_; }

  // Param groups: group_of_param[i] is registration index i's group, or -1 (not trained).
  // Replaces the groups (the constructor sets Megatron's two); validates everything first.
  void set_param_groups(const std::vector<int>& group_of_param, const std::vector<ParamGroup>& groups);
  // A group's hyperparameters, cheap enough to call before every step (an lr schedule).
  void set_group(int group, const ParamGroup& hyper);
  int num_groups() const { return static_cast<int>(groups_.size()); }
  const ParamGroup& group(int group) const { return groups_.at(static_cast<size_t>(group)); }
  int group_of(int param) const { return group_of_param_.at(static_cast<size_t>(param)); }
  // Param i's own step count (torch's state['step']): the steps that updated it.
  int64_t param_step(int param) const { return param_steps_.at(static_cast<size_t>(param)); }
  void set_param_step(int param, int64_t step);
  DataParallel& data_parallel() const { return dp_; }
  int num_buckets() const { return static_cast<int>(main_.size()); }
  // Which elements each bucket's views hold (see OptimizerBucket).
  const OptimizerBucket& bucket(int b) const { return buckets_.at(static_cast<size_t>(b)); }

  // This rank's state, one f32 view per bucket: [OptimizerBucket::numel] (the shard; padding
  // included, kept at zero). main_params(b) is the param shard itself where that is f32
  // (main_params_alias_param_shard): writing it writes this rank's model params.
  // state_count() is 2 for adam (exp_avg, exp_avg_sq) and 1 for sgd (momentum_buffer).
  TensorView main_params(int bucket) const;
  int state_count() const { return static_cast<int>(state_.size()); }
  TensorView state(int index, int bucket) const;
  std::string_view state_name(int index) const;

  // Restores a checkpointed state (used by the checkpoint loader after it has validated
  // everything): the caller has already written main params and states through the views above.
  // Every trained param's own count becomes `step` too.
  void set_step_count(int64_t step);

 private:
  // This rank's owned slices of every bucket's synchronized grads (padding left out): every element
  // of the model is in exactly one rank's runs.
  std::vector<TensorView> owned_grad_runs() const;
  double local_grad_sum_of_squares() const;
  // The update of one bucket's shard, with the staging into the param buffer fused in; params
  // with skip[param] set are left as they are.
  void update_bucket(int bucket, double grad_coeff, const std::vector<char>& skip);
  // values all-reduced with op across dp: in place on the host, or staged through scalars_ where
  // the communicator's buffers are on a device.
  void all_reduce_scalars(std::span<float> values, ReduceOp op);

  DataParallel& dp_;
  std::vector<OptimizerBucket> buckets_;        // [bucket]
  OptimizerConfig config_;
  int64_t step_count_ = 0;
  std::vector<ParamGroup> groups_;
  std::vector<int> group_of_param_;             // [param] group index, -1: not trained
  std::vector<int64_t> param_steps_;            // [param]
  Compute& compute_;                               // dp's: where the shards live and the step runs
  std::vector<ComputeBuffer> main_copies_;         // [bucket] f32 [shard size], kMainParams; empty where aliased
  std::vector<TensorView> main_;                   // [bucket] f32 [shard size]: main_copies_[b] or the param shard
  std::vector<std::vector<ComputeBuffer>> state_;  // [state][bucket] f32 [shard size], kOptimizerState
  MemoryTracker scalars_tracker_;                  // their few bytes are not the rank's model state
  ComputeBuffer scalars_;                          // f32 [max(2, num_params)] on a device; none on the host
};

}  // namespace mxddp
