// DistributedOptimizer: see optim.h. Everything here touches only this rank's shards; the one
// collective of its own is the grad-norm all-reduce (plus the param all-gather it starts, and the
// zero count's all-reduce where a caller asks for it).
#include <algorithm>
#include <cmath>
#include <vector>

#include <mxddp/optim.h>

#include "../comm/host_collectives.h"

namespace mxddp {

namespace {

void validate(const OptimizerConfig& c, const DataParallel& dp) {
  MXDDP_ASSERT(!dp.layout().shards.empty());  // every DDP and FSDP layout has them (the norm's owned ranges)
  MXDDP_CHECK(c.optimizer == OptimizerType::kAdam || c.optimizer == OptimizerType::kSgd,
              "optimizer {} is not supported; valid: adam, sgd", static_cast<int>(c.optimizer));
  MXDDP_CHECK(std::isfinite(c.lr) && c.lr >= 0, "lr must be finite and >= 0; got {}", c.lr);
  MXDDP_CHECK(c.weight_decay >= 0, "weight_decay must be >= 0; got {}", c.weight_decay);
  MXDDP_CHECK(c.adam_beta1 >= 0 && c.adam_beta1 < 1, "adam_beta1 must be in [0, 1); got {}", c.adam_beta1);
  MXDDP_CHECK(c.adam_beta2 >= 0 && c.adam_beta2 < 1, "adam_beta2 must be in [0, 1); got {}", c.adam_beta2);
  MXDDP_CHECK(c.adam_eps > 0, "adam_eps must be > 0; got {}", c.adam_eps);
  MXDDP_CHECK(c.sgd_momentum >= 0 && c.sgd_momentum < 1, "sgd_momentum must be in [0, 1); got {}", c.sgd_momentum);
  MXDDP_CHECK(c.clip_grad >= 0, "clip_grad must be >= 0 (0 disables clipping); got {}", c.clip_grad);
}

// Megatron's default groups: 0 decays the params of two or more dimensions, 1 (biases, norms) not.
std::vector<ParamGroup> default_groups(const OptimizerConfig& c) {
  ParamGroup decay{.lr = c.lr, .weight_decay = c.weight_decay, .beta1 = c.adam_beta1, .beta2 = c.adam_beta2,
                   .eps = c.adam_eps, .momentum = c.sgd_momentum, .decoupled_weight_decay = true};
  ParamGroup no_decay = decay;
  no_decay.weight_decay = 0.0f;
  return {decay, no_decay};
}

// Calls run(first, range) for each longest stretch of consecutive ranges that touch in the shard
// and that joins(first, next) accepts for every later member; a range keep(i) rejects is left out
// and ends the stretch. On a device each stretch is a launch or two rather than one per param
// (param starts are 64-aligned, so most params touch; padding between them never joins a stretch).
template <typename Keep, typename Joins, typename Run>
void for_each_run(const std::vector<ShardParamRange>& ranges, Keep keep, Joins joins, Run run) {
  for (size_t i = 0; i < ranges.size();) {
    if (!keep(i)) {
      ++i;
      continue;
    }
    const size_t first = i;
    Range stretch = ranges[i].in_shard;
    for (++i; i < ranges.size() && keep(i) && joins(first, i) && ranges[i].in_shard.start == stretch.end; ++i)
      stretch.end = ranges[i].in_shard.end;
    run(first, stretch);
  }
}

}  // namespace

void validate_param_group(const ParamGroup& g) {
  MXDDP_CHECK(std::isfinite(g.lr) && g.lr >= 0, "param group lr must be finite and >= 0; got {}", g.lr);
  MXDDP_CHECK(std::isfinite(g.weight_decay) && g.weight_decay >= 0,
              "param group weight_decay must be finite and >= 0; got {}", g.weight_decay);
  MXDDP_CHECK(g.beta1 >= 0 && g.beta1 < 1, "param group beta1 must be in [0, 1); got {}", g.beta1);
  MXDDP_CHECK(g.beta2 >= 0 && g.beta2 < 1, "param group beta2 must be in [0, 1); got {}", g.beta2);
  MXDDP_CHECK(std::isfinite(g.eps) && g.eps > 0, "param group eps must be finite and > 0; got {}", g.eps);
  MXDDP_CHECK(g.momentum >= 0 && g.momentum < 1, "param group momentum must be in [0, 1); got {}", g.momentum);
}

DistributedOptimizer::DistributedOptimizer(DataParallel& dp, const OptimizerConfig& config, MemoryTracker& tracker)
    : dp_(dp), config_(config), compute_(dp.compute()) {
  validate(config, dp);
  groups_ = default_groups(config);
  for (const ParamSpec& p : dp.params()) group_of_param_.push_back(p.shape.ndim() >= 2 ? 0 : 1);
  param_steps_.assign(group_of_param_.size(), 0);
  const int num_buckets = static_cast<int>(dp.layout().buckets.size());
  state_.resize(optimizer_state_names(config.optimizer).size());
  for (int b = 0; b < num_buckets; ++b) {
    buckets_.push_back(dp.optimizer_bucket(b));
    const TensorView initial = dp.initial_params(b);
    const int64_t n = buckets_.back().numel;
    MXDDP_ASSERT(initial.numel() == n);
    const Shape shard{n};
    if (main_params_alias_param_shard(initial.dtype)) {
      // The shard the update writes is the one it started from (DDP's param buffer, FSDP's shard).
      const OptimizerBucketIo io = dp.optimizer_io(b);
      MXDDP_ASSERT(io.params.data == initial.data && io.stage_in_step);
      main_copies_.emplace_back();
      main_.push_back(initial.flat());
    } else {
      ComputeBuffer main = compute_.allocate(static_cast<size_t>(n) * sizeof(float), MemoryCategory::kMainParams, tracker);
      compute_.convert(initial.flat(), main.view(DType::kF32, shard));
      main_.push_back(main.view(DType::kF32, shard));
      main_copies_.push_back(std::move(main));
    }
    for (auto& s : state_)  // zeroed by allocate
      s.push_back(compute_.allocate(static_cast<size_t>(n) * sizeof(float), MemoryCategory::kOptimizerState, tracker));
  }
  if (!dp.communicator().device().is_cpu()) {
    const size_t floats = std::max<size_t>(2, static_cast<size_t>(dp.num_params()));
    scalars_ = compute_.allocate(floats * sizeof(float), MemoryCategory::kScratch, scalars_tracker_);
  }
}

void DistributedOptimizer::all_reduce_scalars(std::span<float> values, ReduceOp op) {
  Communicator& comm = dp_.communicator();
  const auto n = static_cast<int64_t>(values.size());
  if (comm.device().is_cpu()) {
    comm.all_reduce(TensorView{values.data(), DType::kF32, Shape{n}, Device::cpu()}, {.op = op});
    return;
  }
  // The collective reads the communicator's memory (as Megatron all-reduces its norm as a GPU
  // tensor): the values go there and come back.
  const TensorView staged = scalars_.view(DType::kF32, Shape{n});
  compute_.copy_from_host(staged.data, values.data(), values.size_bytes());
  const Work work = comm.all_reduce(staged, {.op = op});
  compute_.copy_to_host(values.data(), staged.data, values.size_bytes());
  work.wait();  // again: a stream-ordered engine's failure found during the copy is not a result
}

void DistributedOptimizer::set_lr(float lr) {
  MXDDP_CHECK(std::isfinite(lr) && lr >= 0, "lr must be finite and >= 0; got {}", lr);
  config_.lr = lr;
  for (ParamGroup& g : groups_) g.lr = lr;
}

void DistributedOptimizer::set_param_groups(const std::vector<int>& group_of_param, const std::vector<ParamGroup>& groups) {
  MXDDP_CHECK(group_of_param.size() == group_of_param_.size(),
              "set_param_groups: {} group indices for {} registered params; give one per param (-1: not trained)",
              group_of_param.size(), group_of_param_.size());
  for (const ParamGroup& g : groups) validate_param_group(g);
  const auto count = static_cast<int>(groups.size());
  for (size_t p = 0; p < group_of_param.size(); ++p)
    MXDDP_CHECK(group_of_param[p] >= -1 && group_of_param[p] < count,
                "set_param_groups: param {} has group {}; valid: -1 (not trained) or 0..{}", p, group_of_param[p],
                count - 1);
  groups_ = groups;
  group_of_param_ = group_of_param;
}

void DistributedOptimizer::set_group(int group, const ParamGroup& hyper) {
  MXDDP_CHECK(group >= 0 && group < num_groups(), "param group {} does not exist; valid: 0..{}", group,
              num_groups() - 1);
  validate_param_group(hyper);
  groups_[static_cast<size_t>(group)] = hyper;
}

void DistributedOptimizer::set_param_step(int param, int64_t step) {
  MXDDP_CHECK(param >= 0 && param < dp_.num_params(), "param {} is not registered; valid: 0..{}", param,
              dp_.num_params() - 1);
  MXDDP_CHECK(step >= 0 && step <= (int64_t{1} << 53), "param {}'s step count must be in [0, 2^53]; got {}", param, step);
  param_steps_[static_cast<size_t>(param)] = step;
}

void DistributedOptimizer::set_step_count(int64_t step) {
  step_count_ = step;
  for (size_t p = 0; p < param_steps_.size(); ++p)
    if (group_of_param_[p] >= 0) param_steps_[p] = step;
}

TensorView DistributedOptimizer::main_params(int bucket) const { return main_.at(static_cast<size_t>(bucket)); }

TensorView DistributedOptimizer::state(int index, int bucket) const {
  const ComputeBuffer& b = state_.at(static_cast<size_t>(index)).at(static_cast<size_t>(bucket));
  return b.view(DType::kF32, Shape{static_cast<int64_t>(b.size_bytes() / sizeof(float))});
}

std::string_view optimizer_name(OptimizerType optimizer) {
  switch (optimizer) {
    case OptimizerType::kAdam: return "adam";
    case OptimizerType::kSgd: return "sgd";
  }
  MXDDP_FAIL("optimizer {} is not supported; valid: adam, sgd", static_cast<int>(optimizer));
}

OptimizerType parse_optimizer(std::string_view name) {
  if (name == "adam") return OptimizerType::kAdam;
  if (name == "sgd") return OptimizerType::kSgd;
  MXDDP_FAIL("optimizer '{}' is not supported; valid: adam, sgd", name);
}

std::vector<std::string_view> optimizer_state_names(OptimizerType optimizer) {
  switch (optimizer) {
    case OptimizerType::kAdam: return {"exp_avg", "exp_avg_sq"};
    case OptimizerType::kSgd: return {"momentum_buffer"};
  }
  MXDDP_FAIL("optimizer {} is not supported; valid: adam, sgd", static_cast<int>(optimizer));
}

std::vector<std::string_view> optimizer_state_names(std::string_view optimizer) {
  return optimizer_state_names(parse_optimizer(optimizer));
}

std::string_view DistributedOptimizer::state_name(int index) const {
  return optimizer_state_names(config_.optimizer).at(static_cast<size_t>(index));
}

std::vector<TensorView> DistributedOptimizer::owned_grad_runs() const {
  // Params that touch in the shard are one run (GPT-2's 148 params were ~300 launches per norm).
  std::vector<TensorView> runs;
  const auto any = [](size_t...) { return true; };
  for (size_t b = 0; b < main_.size(); ++b) {
    const TensorView grads = dp_.optimizer_io(static_cast<int>(b)).grads.flat();
    for_each_run(buckets_[b].owned, any, any,
                 [&](size_t, Range r) { runs.push_back(grads.slice(r.start, r.size())); });
  }
  return runs;
}

double DistributedOptimizer::local_grad_sum_of_squares() const {
  // Over the owned elements only: every element of the model is counted on exactly one rank.
  return compute_.sum_of_squares(owned_grad_runs());
}

double DistributedOptimizer::grad_norm(double unscale) {
  // The norm travels as an f32 pair (hi + lo) so the all-reduce keeps most of the f64 sum. An
  // infinite hi (an Inf gradient, or a sum beyond f32's range) carries no low part: inf - inf would
  // make the norm NaN where torch and Megatron report Inf.
  const double local = local_grad_sum_of_squares() * unscale * unscale;
  float pair[2] = {static_cast<float>(local), 0.0f};
  if (std::isfinite(pair[0])) pair[1] = static_cast<float>(local - static_cast<double>(pair[0]));
  all_reduce_scalars(pair, ReduceOp::kSum);
  return std::sqrt(static_cast<double>(pair[0]) + static_cast<double>(pair[1]));
}

StepResult DistributedOptimizer::step(const StepOptions& options) {
  MXDDP_CHECK(std::isfinite(options.unscale) && options.unscale > 0, "step: unscale must be finite and > 0; got {}",
              options.unscale);
  // 0: clip_grad_norm_(max_norm=0) zeroes the grads, as torch's does.
  MXDDP_CHECK(std::isfinite(options.clip_coeff) && options.clip_coeff >= 0 && options.clip_coeff <= 1,
              "step: clip_coeff must be in [0, 1]; got {}", options.clip_coeff);
  std::vector<char> skip(group_of_param_.size(), 0);
  for (size_t p = 0; p < skip.size(); ++p) skip[p] = group_of_param_[p] < 0;
  for (int p : options.frozen) {
    MXDDP_CHECK(p >= 0 && p < dp_.num_params(), "step: frozen param {} is not registered; valid: 0..{}", p,
                dp_.num_params() - 1);
    skip[static_cast<size_t>(p)] = 1;
  }
  StepResult result;
  result.grad_norm = grad_norm(options.unscale);
  if (!std::isfinite(result.grad_norm)) {
    result.skipped = true;
    return result;
  }
  if (config_.clip_grad > 0) {
    const double coeff = config_.clip_grad / (result.grad_norm + 1e-6);
    if (coeff < 1.0) result.clip_coeff = coeff;
  }
  // A step count restored from a checkpoint is bounded (2^53), so this never wraps; kept as a
  // check since the count is state a caller can set.
  MXDDP_CHECK(step_count_ < INT64_MAX, "optimizer step count {} cannot grow further", step_count_);
  ++step_count_;
  for (size_t p = 0; p < skip.size(); ++p)
    if (!skip[p]) ++param_steps_[p];
  const double grad_coeff = options.unscale * options.clip_coeff * result.clip_coeff;
  dp_.step_and_sync_params([&](int bucket) { update_bucket(bucket, grad_coeff, skip); });
  return result;
}

std::vector<int> DistributedOptimizer::nonfinite_grad_params() {
  // flags [num_params]: 1 where this rank's owned slices of the param's gradient are not finite;
  // a max all-reduce gives every rank every param's answer.
  std::vector<float> flags(static_cast<size_t>(dp_.num_params()), 0.0f);
  for (size_t b = 0; b < main_.size(); ++b) {
    const TensorView grads = dp_.optimizer_io(static_cast<int>(b)).grads;
    for (const ShardParamRange& r : buckets_[b].owned)
      if (!compute_.all_finite(grads.flat().slice(r.in_shard.start, r.in_shard.size())))
        flags[static_cast<size_t>(r.param)] = 1.0f;
  }
  all_reduce_scalars(flags, ReduceOp::kMax);
  std::vector<int> params;
  for (size_t p = 0; p < flags.size(); ++p)
    if (flags[p] != 0.0f) params.push_back(static_cast<int>(p));
  return params;
}

int64_t DistributedOptimizer::count_zero_grads() {
  int64_t zeros = compute_.count_zeros(owned_grad_runs());
  // Exact at any count: an i64, through the communicator's memory (a device's, staged).
  all_reduce_host(dp_.communicator(), TensorView{&zeros, DType::kI64, Shape{1}, Device::cpu()}, {.op = ReduceOp::kSum});
  return zeros;
}

void DistributedOptimizer::zero_grad() {
  dp_.start_iteration([this] { stage_main_params(); });
}

void DistributedOptimizer::update_bucket(int bucket, double grad_coeff, const std::vector<char>& skip) {
  const OptimizerType type = config_.optimizer;
  const auto b = static_cast<size_t>(bucket);
  // The param shard is written as the update goes: staging fused in, no second pass. Padding
  // needs none: it is zero in both buffers. At dp 1 with two threads the update of gpt2-124m took
  // a fifth of the BF16 step on one (cpu_compute spreads each run over the rank's threads).
  const OptimizerBucketIo io = dp_.optimizer_io(bucket);
  const TensorView grads = io.grads.flat();
  MXDDP_ASSERT(io.params.data != nullptr);
  const TensorView params = io.params.flat();
  float* main = main_[b].data_as<float>();
  float* s0 = static_cast<float*>(state_[0][b].data());
  float* s1 = type == OptimizerType::kAdam ? static_cast<float*>(state_[1][b].data()) : nullptr;
  // Params that touch in the shard and share their group and step count update as one run (the
  // update is elementwise: the same bits). A skipped param is left as it is: values, moments and
  // step count.
  const auto& ranges = buckets_[b].update;
  const auto param_of = [&](size_t i) { return static_cast<size_t>(ranges[i].param); };
  const auto kept = [&](size_t i) { return !skip[param_of(i)]; };
  const auto joins = [&](size_t first, size_t i) {
    return group_of_param_[param_of(i)] == group_of_param_[param_of(first)] &&
           param_steps_[param_of(i)] == param_steps_[param_of(first)];
  };
  for_each_run(ranges, kept, joins, [&](size_t first, Range run) {
    const ParamGroup& g = groups_[static_cast<size_t>(group_of_param_[param_of(first)])];
    const auto t = static_cast<double>(param_steps_[param_of(first)]);
    const int64_t at = run.start, n = run.size();
    // An aliased f32 shard is main itself (written once, as main); unstaged, the params wait for
    // zero_grad() (MXFP8 reuse).
    const ShardUpdate shard{.grads = grads.slice(at, n), .main = main + at, .state0 = s0 + at,
                            .state1 = s1 != nullptr ? s1 + at : nullptr,
                            .params = io.stage_in_step ? params.slice(at, n) : TensorView{}};
    if (type == OptimizerType::kAdam) {
      const float decoupled = g.decoupled_weight_decay ? g.weight_decay : 0.0f;
      compute_.adamw(shard, {.lr = g.lr, .weight_decay = decoupled, .beta1 = g.beta1, .beta2 = g.beta2, .eps = g.eps,
                             .step_size = static_cast<float>(
                                 g.lr / static_cast<float>(1.0 - std::pow(static_cast<double>(g.beta1), t))),
                             .bias_correction2_sqrt =
                                 static_cast<float>(std::sqrt(1.0 - std::pow(static_cast<double>(g.beta2), t))),
                             .clip_coeff = static_cast<float>(grad_coeff),
                             .l2 = g.decoupled_weight_decay ? 0.0f : g.weight_decay});
    } else {
      compute_.sgd(shard, {.lr = g.lr, .weight_decay = g.weight_decay, .momentum = g.momentum,
                           .clip_coeff = static_cast<float>(grad_coeff)});
    }
  });
}

void DistributedOptimizer::stage_main_params() {
  for (size_t b = 0; b < main_.size(); ++b) {
    const TensorView shard = dp_.optimizer_io(static_cast<int>(b)).params;
    MXDDP_ASSERT(shard.data != nullptr);
    if (shard.data == main_[b].data) continue;  // the f32 shard is the main param
    compute_.convert(main_[b], shard.flat());
  }
}

void DistributedOptimizer::force_param_sync() {
  dp_.force_param_sync([this] { stage_main_params(); });
}

}  // namespace mxddp
