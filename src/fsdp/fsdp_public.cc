// FullyShardedDataParallel (include/mxddp/fsdp.h): the public class, each call forwarded to its
// FsdpEngine (fsdp_engine.h), so that the hook schedule, the gather state and the observability the
// tests read stay out of the installed header.
#include <mxddp/fsdp.h>

#include "fsdp_engine.h"

namespace mxddp {

FullyShardedDataParallel::FullyShardedDataParallel(Communicator& comm, const std::vector<ParamSpec>& params,
                                                   const std::vector<std::vector<int>>& units, const FsdpConfig& config,
                                                   MemoryTracker& tracker, const std::vector<TensorView>& initial_values,
                                                   Communicator* replica)
    : engine_(std::make_unique<FsdpEngine>(comm, params, units, config, tracker, initial_values, replica)) {}

FullyShardedDataParallel::~FullyShardedDataParallel() = default;

FsdpEngine& fsdp_engine(FullyShardedDataParallel& fsdp) { return *fsdp.engine_; }
const FsdpEngine& fsdp_engine(const FullyShardedDataParallel& fsdp) {
  return fsdp_engine(const_cast<FullyShardedDataParallel&>(fsdp));
}

const FsdpConfig& FullyShardedDataParallel::config() const { return engine_->config(); }
Communicator& FullyShardedDataParallel::communicator() const { return engine_->communicator(); }
Communicator* FullyShardedDataParallel::replica_communicator() const { return engine_->replica_communicator(); }
Compute& FullyShardedDataParallel::compute() const { return engine_->compute(); }
const std::vector<ParamSpec>& FullyShardedDataParallel::params() const { return engine_->params(); }
DType FullyShardedDataParallel::param_dtype() const { return engine_->param_dtype(); }
DType FullyShardedDataParallel::grad_dtype() const { return engine_->grad_dtype(); }
std::string FullyShardedDataParallel::describe() const { return engine_->describe(); }

TensorView FullyShardedDataParallel::param(int index) const { return engine_->param(index); }
bool FullyShardedDataParallel::is_mxfp8(int index) const { return engine_->is_mxfp8(index); }
Mxfp8View FullyShardedDataParallel::mxfp8_param(int index, QuantAxis axis) const {
  return engine_->mxfp8_param(index, axis);
}
TensorView FullyShardedDataParallel::main_grad(int index) { return engine_->main_grad(index); }
void FullyShardedDataParallel::grad_ready(int index) { engine_->grad_ready(index); }
void FullyShardedDataParallel::before_forward(const std::vector<int>& module_params) {
  engine_->before_forward(module_params);
}
void FullyShardedDataParallel::after_forward(const std::vector<int>& module_params) {
  engine_->after_forward(module_params);
}
void FullyShardedDataParallel::before_backward(const std::vector<int>& module_params) {
  engine_->before_backward(module_params);
}
void FullyShardedDataParallel::after_backward(const std::vector<int>& module_params) {
  engine_->after_backward(module_params);
}
void FullyShardedDataParallel::release_gathered_params() { engine_->release_gathered_params(); }

void FullyShardedDataParallel::finish_grad_sync() { engine_->finish_grad_sync(); }
void FullyShardedDataParallel::zero_grad_buffer() { engine_->zero_grad_buffer(); }

const ParamLayout& FullyShardedDataParallel::layout() const { return engine_->layout(); }
OptimizerBucket FullyShardedDataParallel::optimizer_bucket(int bucket) const { return engine_->optimizer_bucket(bucket); }
OptimizerBucketIo FullyShardedDataParallel::optimizer_io(int bucket) const { return engine_->optimizer_io(bucket); }
TensorView FullyShardedDataParallel::initial_params(int bucket) const { return engine_->initial_params(bucket); }
void FullyShardedDataParallel::step_and_sync_params(const std::function<void(int bucket)>& update) {
  engine_->step_and_sync_params(update);
}
void FullyShardedDataParallel::start_iteration(const std::function<void()>& stage) { engine_->start_iteration(stage); }
void FullyShardedDataParallel::force_param_sync(const std::function<void()>& stage) {
  engine_->force_param_sync(stage);
}

int FullyShardedDataParallel::num_units() const { return engine_->num_units(); }
int64_t FullyShardedDataParallel::peak_gathered_bytes(GatherSlot slot) const {
  return engine_->peak_gathered_bytes(slot);
}
void FullyShardedDataParallel::reset_peak_gathered_bytes() { engine_->reset_peak_gathered_bytes(); }

void FullyShardedDataParallel::enter_no_sync() { engine_->enter_no_sync(); }
void FullyShardedDataParallel::exit_no_sync() { engine_->exit_no_sync(); }

}  // namespace mxddp
