// DistributedOptimizer: see optim.h. Everything here touches only this rank's shards; the one
// collective of its own is the grad-norm all-reduce (plus the param all-gather it starts).
#include <cmath>
#include <cstring>

#include <mxddp/optim.h>

namespace mxddp {

namespace {

void validate(const OptimizerConfig& c, const DistributedDataParallel& ddp) {
  MXDDP_CHECK(ddp.config().use_distributed_optimizer,
              "DistributedOptimizer needs a DistributedDataParallel built with use_distributed_optimizer");
  MXDDP_CHECK(c.optimizer == "adam" || c.optimizer == "sgd", "optimizer '{}' is not supported; valid: adam, sgd",
              c.optimizer);
  MXDDP_CHECK(std::isfinite(c.lr) && c.lr >= 0, "lr must be finite and >= 0; got {}", c.lr);
  MXDDP_CHECK(c.weight_decay >= 0, "weight_decay must be >= 0; got {}", c.weight_decay);
  MXDDP_CHECK(c.adam_beta1 >= 0 && c.adam_beta1 < 1, "adam_beta1 must be in [0, 1); got {}", c.adam_beta1);
  MXDDP_CHECK(c.adam_beta2 >= 0 && c.adam_beta2 < 1, "adam_beta2 must be in [0, 1); got {}", c.adam_beta2);
  MXDDP_CHECK(c.adam_eps > 0, "adam_eps must be > 0; got {}", c.adam_eps);
  MXDDP_CHECK(c.sgd_momentum >= 0 && c.sgd_momentum < 1, "sgd_momentum must be in [0, 1); got {}", c.sgd_momentum);
  MXDDP_CHECK(c.clip_grad >= 0, "clip_grad must be >= 0 (0 disables clipping); got {}", c.clip_grad);
}

float grad_at(const TensorView& grads, int64_t i) {
  return grads.dtype == DType::kF32 ? grads.data_as<const float>()[i] : bf16_to_f32(grads.data_as<const bf16_bits>()[i]);
}

}  // namespace

DistributedOptimizer::DistributedOptimizer(DistributedDataParallel& ddp, const OptimizerConfig& config,
                                           MemoryTracker& tracker)
    : ddp_(ddp), config_(config) {
  validate(config, ddp);
  const ParamAndGradBuffer& buf = ddp.buffer();
  const int rank = ddp.communicator().rank();
  const int num_buckets = static_cast<int>(buf.layout().buckets.size());
  state_.resize(config.optimizer == "adam" ? 2 : 1);
  for (int b = 0; b < num_buckets; ++b) {
    const TensorView shard = buf.param_shard(b, rank);
    const auto n = static_cast<size_t>(shard.numel());
    HostBuffer main(n * sizeof(float), MemoryCategory::kMainParams, tracker);
    if (shard.dtype == DType::kF32) std::memcpy(main.data(), shard.data, n * sizeof(float));
    else convert_bf16_to_f32(shard.data_as<const bf16_bits>(), static_cast<float*>(main.data()), n);
    main_.push_back(std::move(main));
    for (auto& s : state_) {
      HostBuffer zeros(n * sizeof(float), MemoryCategory::kOptimizerState, tracker);
      std::memset(zeros.data(), 0, n * sizeof(float));
      s.push_back(std::move(zeros));
    }
  }
}

void DistributedOptimizer::set_lr(float lr) {
  MXDDP_CHECK(std::isfinite(lr) && lr >= 0, "lr must be finite and >= 0; got {}", lr);
  config_.lr = lr;
}

TensorView DistributedOptimizer::main_params(int bucket) const {
  const HostBuffer& b = main_.at(static_cast<size_t>(bucket));
  return b.view(DType::kF32, Shape{static_cast<int64_t>(b.size_bytes() / sizeof(float))});
}

TensorView DistributedOptimizer::state(int index, int bucket) const {
  const HostBuffer& b = state_.at(static_cast<size_t>(index)).at(static_cast<size_t>(bucket));
  return b.view(DType::kF32, Shape{static_cast<int64_t>(b.size_bytes() / sizeof(float))});
}

std::string_view DistributedOptimizer::state_name(int index) const {
  if (config_.optimizer == "sgd") return "momentum_buffer";
  return index == 0 ? "exp_avg" : "exp_avg_sq";
}

double DistributedOptimizer::local_grad_sum_of_squares() const {
  const ParamAndGradBuffer& buf = ddp_.buffer();
  const int rank = ddp_.communicator().rank();
  double sum = 0;
  for (size_t b = 0; b < main_.size(); ++b) {
    const TensorView grads = buf.grad_shard(static_cast<int>(b), rank);
    for (const ShardParamRange& r : buf.layout().shards[static_cast<size_t>(rank)][b].params)
      for (int64_t i = r.in_shard.start; i < r.in_shard.end; ++i) {
        const double g = grad_at(grads, i);
        sum += g * g;
      }
  }
  return sum;
}

StepResult DistributedOptimizer::step() {
  StepResult result;
  // The norm travels as an f32 pair (hi + lo) so the all-reduce keeps most of the f64 sum.
  const double local = local_grad_sum_of_squares();
  float pair[2] = {static_cast<float>(local), 0.0f};
  pair[1] = static_cast<float>(local - static_cast<double>(pair[0]));
  ddp_.communicator().all_reduce(TensorView{pair, DType::kF32, Shape{2}, Device::cpu()});
  result.grad_norm = std::sqrt(static_cast<double>(pair[0]) + static_cast<double>(pair[1]));
  if (!std::isfinite(result.grad_norm)) {
    result.skipped = true;
    return result;
  }
  if (config_.clip_grad > 0) {
    const double coeff = config_.clip_grad / (result.grad_norm + 1e-6);
    if (coeff < 1.0) result.clip_coeff = coeff;
  }
  ++step_count_;
  update(result.clip_coeff);
  ddp_.start_param_sync();
  return result;
}

void DistributedOptimizer::update(double clip_coeff) {
  const ParamAndGradBuffer& buf = ddp_.buffer();
  const int rank = ddp_.communicator().rank();
  const bool adam = config_.optimizer == "adam";
  const float lr = config_.lr;
  const auto coeff = static_cast<float>(clip_coeff);
  const float b1 = config_.adam_beta1, b2 = config_.adam_beta2, eps = config_.adam_eps;
  const auto t = static_cast<double>(step_count_);
  const auto bias_correction1 = static_cast<float>(1.0 - std::pow(static_cast<double>(b1), t));
  const auto bias_correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(static_cast<double>(b2), t)));
  const float step_size = lr / bias_correction1;
  for (size_t b = 0; b < main_.size(); ++b) {
    const TensorView grads = buf.grad_shard(static_cast<int>(b), rank);
    float* main = static_cast<float*>(main_[b].data());
    float* s0 = static_cast<float*>(state_[0][b].data());
    float* s1 = adam ? static_cast<float*>(state_[1][b].data()) : nullptr;
    for (const ShardParamRange& r : buf.layout().shards[static_cast<size_t>(rank)][b].params) {
      const bool decay = buf.params()[static_cast<size_t>(r.param)].shape.ndim() >= 2;
      const float wd = decay ? config_.weight_decay : 0.0f;
      for (int64_t i = r.in_shard.start; i < r.in_shard.end; ++i) {
        float g = grad_at(grads, i) * coeff;
        float p = main[i];
        if (adam) {
          // AdamW, in PyTorch's order: decoupled decay, moments, bias-corrected step.
          p *= 1.0f - lr * wd;
          s0[i] = b1 * s0[i] + (1.0f - b1) * g;
          s1[i] = b2 * s1[i] + (1.0f - b2) * g * g;
          const float denom = std::sqrt(s1[i]) / bias_correction2_sqrt + eps;
          p -= step_size * s0[i] / denom;
        } else {
          // SGD with momentum, PyTorch's form: L2 decay in the gradient, no dampening.
          g += wd * p;
          s0[i] = config_.sgd_momentum * s0[i] + g;
          p -= lr * s0[i];
        }
        main[i] = p;
      }
    }
  }
  stage_main_params();
}

void DistributedOptimizer::stage_main_params() {
  const ParamAndGradBuffer& buf = ddp_.buffer();
  const int rank = ddp_.communicator().rank();
  for (size_t b = 0; b < main_.size(); ++b) {
    const TensorView shard = buf.param_shard(static_cast<int>(b), rank);
    const auto* main = static_cast<const float*>(main_[b].data());
    if (shard.dtype == DType::kF32) std::memcpy(shard.data, main, shard.nbytes());
    else convert_f32_to_bf16(main, shard.data_as<bf16_bits>(), static_cast<size_t>(shard.numel()));
  }
}

void DistributedOptimizer::force_param_sync() {
  // A gather in flight reads the shards: let it finish before they are re-staged.
  ddp_.wait_param_gathers_in_flight();
  stage_main_params();
  if (ddp_.param_sync_pending()) ddp_.complete_param_sync();  // gathers only what is left
  else ddp_.start_param_sync(/*force_sync=*/true);
}

}  // namespace mxddp
