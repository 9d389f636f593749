// ForwardingDataParallel: a DataParallel decorator that forwards every call to the DDP or FSDP
// object it owns. Tests derive from it and override the one hook they perturb (a sleep after each
// module's forward, a corrupted replica after a param sync), plugged in through
// TrainCallbacks::wrap_data_parallel.
#pragma once

#include <memory>
#include <vector>

#include <mxddp/data_parallel.h>

namespace mxddp::testing {

class ForwardingDataParallel : public DataParallel {
 public:
  explicit ForwardingDataParallel(std::unique_ptr<DataParallel> inner) : inner_(std::move(inner)) {}

  Communicator& communicator() const override { return inner_->communicator(); }
  Compute& compute() const override { return inner_->compute(); }
  const std::vector<ParamSpec>& params() const override { return inner_->params(); }
  DType param_dtype() const override { return inner_->param_dtype(); }
  DType grad_dtype() const override { return inner_->grad_dtype(); }
  std::string describe() const override { return inner_->describe(); }
  TensorView param(int index) const override { return inner_->param(index); }
  bool is_mxfp8(int index) const override { return inner_->is_mxfp8(index); }
  Mxfp8View mxfp8_param(int index, QuantAxis axis) const override { return inner_->mxfp8_param(index, axis); }
  TensorView main_grad(int index) override { return inner_->main_grad(index); }
  void grad_ready(int index) override { inner_->grad_ready(index); }
  void before_forward(const std::vector<int>& m) override { inner_->before_forward(m); }
  void after_forward(const std::vector<int>& m) override { inner_->after_forward(m); }
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
  DataParallel& inner() const { return *inner_; }
  // enter/exit_no_sync are protected: reach the inner object's through its public scope.
  void enter_no_sync() override { no_sync_.push_back(std::make_unique<NoSyncScope>(*inner_)); }
  void exit_no_sync() override { no_sync_.pop_back(); }

 private:
  std::unique_ptr<DataParallel> inner_;
  std::vector<std::unique_ptr<NoSyncScope>> no_sync_;
};

}  // namespace mxddp::testing
