// The pieces of the mxddp._C extension module: each binds one layer's entry points, and the
// handles that Python holds.
#pragma once

#include <memory>
#include <vector>

#include <nanobind/nanobind.h>

#include <mxddp/ddp.h>
#include <mxddp/optim.h>

namespace mxddp::python {

void bind_runtime(nanobind::module_& m);    // init_mpi, finalize, memory figures, small collectives
void bind_ddp(nanobind::module_& m);        // DdpConfig, DistributedDataParallel
void bind_optimizer(nanobind::module_& m);  // DistributedOptimizer
void bind_plan(nanobind::module_& m);       // plan_ddp_memory (the memory planner)
void bind_checkpoint(nanobind::module_& m);  // save_checkpoint, load_checkpoint (the history layout)

// Python's handle on a DistributedDataParallel: the DDP itself (on the process's communicator and
// tracker), the no_sync scopes Python has open, and how many optimizers step on it. close()
// destroys the DDP (its buffers with it); the handle then refuses every call.
class PyDdp {
 public:
  // initial_values: as for DistributedDataParallel (one per param, or none: zeros).
  PyDdp(const std::vector<ParamSpec>& params, const DdpConfig& config, const std::vector<TensorView>& initial_values = {});
  ~PyDdp();
  PyDdp(const PyDdp&) = delete;
  PyDdp& operator=(const PyDdp&) = delete;

  DistributedDataParallel& ddp();  // throws once closed
  bool closed() const { return ddp_ == nullptr; }
  void close();
  void enter_no_sync();
  void exit_no_sync();
  int no_sync_depth() const { return static_cast<int>(no_sync_scopes_.size()); }
  void add_optimizer() { ++optimizers_; }
  void remove_optimizer() { --optimizers_; }
  int open_optimizers() const { return optimizers_; }

 private:
  std::unique_ptr<DistributedDataParallel> ddp_;
  std::vector<std::unique_ptr<DataParallel::NoSyncScope>> no_sync_scopes_;
  int optimizers_ = 0;
};

// Python's handle on a DistributedOptimizer: the optimizer and the DDP handle it steps on (kept
// alive by nb::keep_alive). close() destroys the optimizer; the handle then refuses every call.
class PyOptimizer {
 public:
  PyOptimizer(PyDdp& ddp, const OptimizerConfig& config);
  ~PyOptimizer() { close(); }
  PyOptimizer(const PyOptimizer&) = delete;
  PyOptimizer& operator=(const PyOptimizer&) = delete;

  DistributedOptimizer& optimizer();  // throws once closed
  bool closed() const { return optimizer_ == nullptr; }
  void close();

 private:
  PyDdp& ddp_;
  std::unique_ptr<DistributedOptimizer> optimizer_;
};

}  // namespace mxddp::python
