// The pieces of the mxddp._C extension module: each binds one layer's entry points, and the
// handles that Python holds.
#pragma once

#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <nanobind/nanobind.h>

#include <mxddp/ddp.h>
#include <mxddp/fsdp.h>
#include <mxddp/optim.h>

#include "runtime.h"

namespace mxddp::python {

void bind_runtime(nanobind::module_& m);    // init_mpi, init_torch, finalize, communicators, memory figures, small collectives
void bind_ddp(nanobind::module_& m);        // DataParallel (the handles' base), DdpConfig, DistributedDataParallel
void bind_fsdp(nanobind::module_& m);       // FsdpConfig, FullyShardedDataParallel
void bind_optimizer(nanobind::module_& m);  // DistributedOptimizer
void bind_plan(nanobind::module_& m);       // plan_ddp_memory (the memory planner)
void bind_checkpoint(nanobind::module_& m);  // save_checkpoint, load_checkpoint (the history layout)

// Python's handle on one of the runtime's communicators (mxddp._C.Communicator): the world's
// (id Runtime::kWorld) or a torch process group's (Runtime::add_torch_group). The runtime owns the
// communicator; the handle only names it, so one used after finalize() fails with a clear Error.
struct CommHandle {
  int id = Runtime::kWorld;
  Communicator& comm() const { return Runtime::get().comm(id); }
};

// A param as Python names it: (name, shape, shared_embedding).
using PyParam = std::tuple<std::string, std::vector<int64_t>, bool>;
// The specs of params; mxfp8: empty (no param is MXFP8) or one flag per param.
// mxfp8, mxfp8_colwise_forward: [] or a flag per param (ParamSpec's fields).
std::vector<ParamSpec> to_specs(const std::vector<PyParam>& params, const std::vector<bool>& mxfp8,
                                const std::vector<bool>& mxfp8_colwise_forward = {});

// Python's handle on a DataParallel (DDP or FSDP): the object itself (on the process's
// communicator and tracker), the no_sync scopes Python has open, and how many optimizers step on
// it. close() destroys it (its buffers with it); the handle then refuses every call.
class PyDataParallel {
 public:
  virtual ~PyDataParallel();
  PyDataParallel(const PyDataParallel&) = delete;
  PyDataParallel& operator=(const PyDataParallel&) = delete;

  DataParallel& data_parallel();  // throws once closed
  bool closed() const { return dp_ == nullptr; }
  void close();
  void enter_no_sync();
  void exit_no_sync();
  int no_sync_depth() const { return static_cast<int>(no_sync_scopes_.size()); }
  void add_optimizer() { ++optimizers_; }
  void remove_optimizer() { --optimizers_; }
  int open_optimizers() const { return optimizers_; }

 protected:
  // Registers with the runtime as a user of its communicator.
  explicit PyDataParallel(std::unique_ptr<DataParallel> dp);

 private:
  std::unique_ptr<DataParallel> dp_;
  std::vector<std::unique_ptr<DataParallel::NoSyncScope>> no_sync_scopes_;
  int optimizers_ = 0;
};

class PyDdp final : public PyDataParallel {
 public:
  // initial_values: as for DistributedDataParallel (one per param, or none: zeros). comm: the
  // communicator it reduces over (the world's by default).
  PyDdp(const std::vector<ParamSpec>& params, const DdpConfig& config, const std::vector<TensorView>& initial_values = {},
        const CommHandle& comm = {});
  DistributedDataParallel& ddp() { return static_cast<DistributedDataParallel&>(data_parallel()); }
};

class PyFsdp final : public PyDataParallel {
 public:
  PyFsdp(const std::vector<ParamSpec>& params, const std::vector<std::vector<int>>& units, const FsdpConfig& config,
         const std::vector<TensorView>& initial_values, const CommHandle& comm = {},
         const CommHandle* replica = nullptr);  // replica: HSDP's replica group (fsdp.h), null without
  FullyShardedDataParallel& fsdp() { return static_cast<FullyShardedDataParallel&>(data_parallel()); }
};

// Python's handle on a DistributedOptimizer: the optimizer and the DDP or FSDP handle it steps on
// (kept alive by nb::keep_alive). close() destroys the optimizer; the handle then refuses every call.
class PyOptimizer {
 public:
  PyOptimizer(PyDataParallel& dp, const OptimizerConfig& config);
  ~PyOptimizer() { close(); }
  PyOptimizer(const PyOptimizer&) = delete;
  PyOptimizer& operator=(const PyOptimizer&) = delete;

  DistributedOptimizer& optimizer();  // throws once closed
  bool closed() const { return optimizer_ == nullptr; }
  void close();

 private:
  PyDataParallel& dp_;
  std::unique_ptr<DistributedOptimizer> optimizer_;
};

}  // namespace mxddp::python
