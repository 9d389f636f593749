// mxddp._C.DistributedOptimizer: the C++ distributed optimizer (F32 main shards, AdamW or SGD,
// global grad norm and clipping) stepping on a DistributedDataParallel's buffers; its step ends
// with the param all-gather into the param buffer the torch params view. The GIL is released while
// it works.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "bindings.h"
#include "runtime.h"

namespace nb = nanobind;

namespace mxddp::python {

// PyOptimizer (bindings.h).
PyOptimizer::PyOptimizer(PyDataParallel& dp, const OptimizerConfig& config) : dp_(dp) {
  // FSDP always shards the optimizer; a DDP only with the distributed optimizer.
  const auto* ddp = dynamic_cast<const DistributedDataParallel*>(&dp.data_parallel());
  MXDDP_CHECK(ddp == nullptr || ddp->config().use_distributed_optimizer,
              "DistributedOptimizer needs a DistributedDataParallel built with use_distributed_optimizer=True");
  Runtime& runtime = Runtime::get();
  {
    nb::gil_scoped_release release;
    optimizer_ = std::make_unique<DistributedOptimizer>(dp.data_parallel(), config, runtime.tracker());
  }
  dp.add_optimizer();
  runtime.add_user();
}

DistributedOptimizer& PyOptimizer::optimizer() {
  MXDDP_CHECK(optimizer_ != nullptr, "this DistributedOptimizer was closed");
  return *optimizer_;
}

void PyOptimizer::close() {
  if (!optimizer_) return;
  optimizer_.reset();
  dp_.remove_optimizer();
  Runtime::get().remove_user();
}

void bind_optimizer(nb::module_& m) {
  nb::class_<OptimizerConfig>(m, "OptimizerConfig", "mxddp::OptimizerConfig (fields as Megatron names them).")
      .def(nb::init<>())
      .def_prop_rw(
          "optimizer", [](const OptimizerConfig& c) { return std::string(optimizer_name(c.optimizer)); },
          [](OptimizerConfig& c, const std::string& name) { c.optimizer = parse_optimizer(name); })
      .def_rw("lr", &OptimizerConfig::lr)
      .def_rw("weight_decay", &OptimizerConfig::weight_decay)
      .def_rw("adam_beta1", &OptimizerConfig::adam_beta1)
      .def_rw("adam_beta2", &OptimizerConfig::adam_beta2)
      .def_rw("adam_eps", &OptimizerConfig::adam_eps)
      .def_rw("sgd_momentum", &OptimizerConfig::sgd_momentum)
      .def_rw("clip_grad", &OptimizerConfig::clip_grad);

  nb::class_<PyOptimizer>(m, "DistributedOptimizer",
                          "The C++ distributed optimizer over a DistributedDataParallel's or FullyShardedDataParallel's buffers.")
      .def(nb::init<PyDataParallel&, const OptimizerConfig&>(), nb::arg("ddp"), nb::arg("config"), nb::keep_alive<1, 2>())
      .def("step",
           [](PyOptimizer& s) {
             DistributedOptimizer& opt = s.optimizer();
             StepResult r;
             {
               nb::gil_scoped_release release;
               r = opt.step();
             }
             return std::make_tuple(r.skipped, r.grad_norm, r.clip_coeff);
           },
           "Collective. Returns (skipped, grad_norm, clip_coeff); skipped when the grad norm is NaN or Inf.")
      .def("nonfinite_grad_params",
           [](PyOptimizer& s) {
             DistributedOptimizer& opt = s.optimizer();
             nb::gil_scoped_release release;
             return opt.nonfinite_grad_params();
           },
           "Collective, after finish_grad_sync. The params (registration indices, increasing) whose reduced "
           "gradients hold a NaN or Inf on any rank.")
      .def("zero_grad",
           [](PyOptimizer& s) {
             DistributedOptimizer& opt = s.optimizer();
             nb::gil_scoped_release release;
             opt.zero_grad();
           })
      .def("force_param_sync",
           [](PyOptimizer& s) {
             DistributedOptimizer& opt = s.optimizer();
             nb::gil_scoped_release release;
             opt.force_param_sync();
           })
      .def_prop_rw(
          "lr", [](PyOptimizer& s) { return s.optimizer().lr(); },
          [](PyOptimizer& s, float lr) { s.optimizer().set_lr(lr); })
      .def_prop_ro("step_count", [](PyOptimizer& s) { return s.optimizer().step_count(); })
      .def_prop_ro("closed", &PyOptimizer::closed)
      .def("close", &PyOptimizer::close);
}

}  // namespace mxddp::python
