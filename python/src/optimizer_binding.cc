// mxddp._C.DistributedOptimizer: the C++ distributed optimizer (F32 main shards, AdamW or SGD,
// per-param-group hyperparameters, global grad norm and clipping) stepping on a DataParallel's
// buffers; its step ends with the param all-gather into the param buffer the torch params view.
// The GIL is released while it works. Its main params and states are handed out as torch views
// (with the ranges that say which param elements they hold) for the torch-format state_dict.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "bindings.h"
#include "runtime.h"
#include "views.h"

namespace nb = nanobind;

namespace mxddp::python {

// PyOptimizer (bindings.h).
PyOptimizer::PyOptimizer(PyDataParallel& dp, const OptimizerConfig& config) : dp_(dp) {
  // A DDP without the distributed optimizer gets a replicated one (every rank updates the whole
  // model); what the DataParallel hands the optimizer says which.
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

namespace {

// (param, in_param start, in_param end, in_shard start, in_shard end) per range.
using RangeTuple = std::tuple<int, int64_t, int64_t, int64_t, int64_t>;
std::vector<RangeTuple> range_tuples(const std::vector<ShardParamRange>& ranges) {
  std::vector<RangeTuple> out;
  for (const ShardParamRange& r : ranges)
    out.emplace_back(r.param, r.in_param.start, r.in_param.end, r.in_shard.start, r.in_shard.end);
  return out;
}

ParamGroup make_group(float lr, float weight_decay, float beta1, float beta2, float eps, float momentum,
                      bool decoupled_weight_decay) {
  return ParamGroup{.lr = lr, .weight_decay = weight_decay, .beta1 = beta1, .beta2 = beta2, .eps = eps,
                    .momentum = momentum, .decoupled_weight_decay = decoupled_weight_decay};
}

}  // namespace

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
           [](PyOptimizer& s, double unscale, double clip_coeff, const std::vector<int>& frozen) {
             DistributedOptimizer& opt = s.optimizer();
             StepResult r;
             {
               nb::gil_scoped_release release;
               r = opt.step(StepOptions{.unscale = unscale, .clip_coeff = clip_coeff, .frozen = frozen});
             }
             return std::make_tuple(r.skipped, r.grad_norm, r.clip_coeff);
           },
           nb::arg("unscale") = 1.0, nb::arg("clip_coeff") = 1.0, nb::arg("frozen") = std::vector<int>{},
           "Collective. Returns (skipped, grad_norm, clip_coeff); skipped when the grad norm is NaN or Inf. "
           "unscale multiplies the grads (the norm is the unscaled grads'), clip_coeff is a coefficient decided "
           "earlier, frozen the registration indices this step leaves untouched.")
      .def("grad_norm",
           [](PyOptimizer& s, double unscale) {
             DistributedOptimizer& opt = s.optimizer();
             nb::gil_scoped_release release;
             return opt.grad_norm(unscale);
           },
           nb::arg("unscale") = 1.0,
           "Collective, after finish_grad_sync. The global L2 norm of the synchronized grads times unscale.")
      .def("set_param_groups",
           [](PyOptimizer& s, const std::vector<int>& group_of_param,
              const std::vector<std::tuple<float, float, float, float, float, float, bool>>& groups) {
             std::vector<ParamGroup> g;
             for (const auto& [lr, wd, b1, b2, eps, mom, decoupled] : groups)
               g.push_back(make_group(lr, wd, b1, b2, eps, mom, decoupled));
             s.optimizer().set_param_groups(group_of_param, g);
           },
           nb::arg("group_of_param"), nb::arg("groups"),
           "group_of_param: a group index per registration index (-1: not trained); groups: (lr, weight_decay, "
           "beta1, beta2, eps, momentum, decoupled_weight_decay) each.")
      .def("set_group",
           [](PyOptimizer& s, int group, float lr, float wd, float b1, float b2, float eps, float mom, bool decoupled) {
             s.optimizer().set_group(group, make_group(lr, wd, b1, b2, eps, mom, decoupled));
           },
           nb::arg("group"), nb::arg("lr"), nb::arg("weight_decay"), nb::arg("beta1"), nb::arg("beta2"),
           nb::arg("eps"), nb::arg("momentum"), nb::arg("decoupled_weight_decay"))
      .def("group",
           [](PyOptimizer& s, int group) {
             const ParamGroup& g = s.optimizer().group(group);
             return std::make_tuple(g.lr, g.weight_decay, g.beta1, g.beta2, g.eps, g.momentum, g.decoupled_weight_decay);
           })
      .def_prop_ro("num_groups", [](PyOptimizer& s) { return s.optimizer().num_groups(); })
      .def("group_of", [](PyOptimizer& s, int param) { return s.optimizer().group_of(param); })
      .def("param_step", [](PyOptimizer& s, int param) { return s.optimizer().param_step(param); })
      .def("set_param_step", [](PyOptimizer& s, int param, int64_t step) { s.optimizer().set_param_step(param, step); })
      .def("set_step_count", [](PyOptimizer& s, int64_t step) { s.optimizer().set_step_count(step); },
           "Sets the step count and every trained param's own count (a restored state).")
      .def_prop_ro("num_buckets", [](PyOptimizer& s) { return s.optimizer().num_buckets(); })
      .def("update_ranges", [](PyOptimizer& s, int b) { return range_tuples(s.optimizer().bucket(b).update); },
           "Bucket b's ranges this rank updates: (param, in_param start, end, in_shard start, end) each.")
      .def("owned_ranges", [](PyOptimizer& s, int b) { return range_tuples(s.optimizer().bucket(b).owned); },
           "Bucket b's ranges this rank owns (every element of the model on exactly one rank).")
      .def("main_params", [](nb::handle_t<PyOptimizer> self, int b) {
             return to_torch(nb::cast<PyOptimizer&>(self).optimizer().main_params(b), self);
           }, "Bucket b's f32 main params on this rank: a torch view [shard numel].")
      .def("state", [](nb::handle_t<PyOptimizer> self, int index, int b) {
             return to_torch(nb::cast<PyOptimizer&>(self).optimizer().state(index, b), self);
           }, "State `index` (state_names) of bucket b on this rank: a torch view [shard numel].")
      .def_prop_ro("state_names", [](PyOptimizer& s) {
             std::vector<std::string> names;
             for (int i = 0; i < s.optimizer().state_count(); ++i) names.emplace_back(s.optimizer().state_name(i));
             return names;
           })
      .def("nonfinite_grad_params",
           [](PyOptimizer& s) {
             DistributedOptimizer& opt = s.optimizer();
             nb::gil_scoped_release release;
             return opt.nonfinite_grad_params();
           },
           "Collective, after finish_grad_sync. The params (registration indices, increasing) whose reduced "
           "gradients hold a NaN or Inf on any rank.")
      .def("count_zero_grads",
           [](PyOptimizer& s) {
             DistributedOptimizer& opt = s.optimizer();
             nb::gil_scoped_release release;
             return opt.count_zero_grads();
           },
           "Collective, after finish_grad_sync. The elements of the synchronized grads that are zero, each counted "
           "once, summed across ranks (Megatron's num_zeros_in_grad).")
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
