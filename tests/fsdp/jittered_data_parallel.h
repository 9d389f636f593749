// JitteredDataParallel: a DataParallel decorator for race-flushing parity tests. It forwards every
// call to the DDP or FSDP object it owns and sleeps a random, per-rank time after each module's
// forward, so compute and the collectives it overlaps with interleave differently on every rank
// and every run. With an FSDP inside it also keeps the collective log when training ends.
#pragma once

#include <chrono>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include <mxddp/fsdp.h>

namespace mxddp::testing {

class JitteredDataParallel final : public DataParallel {
 public:
  // log_out /*out*/: the inner FSDP's collective log, written when this object is destroyed.
  JitteredDataParallel(std::unique_ptr<DataParallel> inner, int64_t max_sleep_us, uint64_t seed,
                       std::vector<FsdpCollective>* log_out)
      : inner_(std::move(inner)), max_sleep_us_(max_sleep_us), log_out_(log_out) {
    std::seed_seq seq{seed, static_cast<uint64_t>(inner_->communicator().rank())};
    rng_.seed(seq);
  }
  ~JitteredDataParallel() override {
    if (auto* fsdp = dynamic_cast<const FullyShardedDataParallel*>(inner_.get()); fsdp && log_out_)
      *log_out_ = fsdp->collective_log();
  }

  Communicator& communicator() const override { return inner_->communicator(); }
  const std::vector<ParamSpec>& params() const override { return inner_->params(); }
  DType param_dtype() const override { return inner_->param_dtype(); }
  DType grad_dtype() const override { return inner_->grad_dtype(); }
  std::string describe() const override { return inner_->describe(); }
  TensorView param(int index) const override { return inner_->param(index); }
  bool is_mxfp8(int index) const override { return inner_->is_mxfp8(index); }
  const Mxfp8Tensor& mxfp8_param(int index) const override { return inner_->mxfp8_param(index); }
  TensorView main_grad(int index) override { return inner_->main_grad(index); }
  void grad_ready(int index) override { inner_->grad_ready(index); }
  void before_forward(const std::vector<int>& m) override { inner_->before_forward(m); }
  void after_forward(const std::vector<int>& m) override {
    inner_->after_forward(m);
    sleep();
  }
  void before_backward(const std::vector<int>& m) override { inner_->before_backward(m); }
  void after_backward(const std::vector<int>& m) override { inner_->after_backward(m); }
  void release_gathered_params() override { inner_->release_gathered_params(); }
  void finish_grad_sync() override { inner_->finish_grad_sync(); }
  void zero_grad_buffer() override { inner_->zero_grad_buffer(); }
  const ParamLayout& layout() const override { return inner_->layout(); }
  OptimizerBucket optimizer_bucket(int bucket) const override { return inner_->optimizer_bucket(bucket); }
  OptimizerBucketIo optimizer_io(int bucket) const override { return inner_->optimizer_io(bucket); }
  TensorView initial_params(int bucket) const override { return inner_->initial_params(bucket); }
  void step_and_sync_params(const std::function<void(int)>& update) override { inner_->step_and_sync_params(update); }
  void start_iteration(const std::function<void()>& stage) override { inner_->start_iteration(stage); }
  void force_param_sync(const std::function<void()>& stage) override { inner_->force_param_sync(stage); }

 protected:
  // enter/exit_no_sync are protected: reach the inner object's through its public scope.
  void enter_no_sync() override { no_sync_.push_back(std::make_unique<NoSyncScope>(*inner_)); }
  void exit_no_sync() override { no_sync_.pop_back(); }

 private:
  void sleep() {
    const int64_t us = std::uniform_int_distribution<int64_t>(0, max_sleep_us_)(rng_);
    std::this_thread::sleep_for(std::chrono::microseconds(us));
  }

  std::unique_ptr<DataParallel> inner_;
  const int64_t max_sleep_us_;
  std::vector<FsdpCollective>* log_out_;
  std::mt19937_64 rng_;
  std::vector<std::unique_ptr<NoSyncScope>> no_sync_;
};

}  // namespace mxddp::testing
