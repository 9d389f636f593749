// mxddp._C.FullyShardedDataParallel: the C++ FSDP (fsdp.h) over one of the runtime's communicators, for
// mxddp.torch.FullyShardedDataParallel, which calls its hooks from torch module hooks. A param's
// torch view (param(i), on the base class) is of its gathered storage, valid from its module's
// pre-hook to its post-hook; the Python side swaps the torch params onto and off it. The GIL is
// released while the library works (a hook may wait for a gather).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "../../src/fsdp/fsdp_engine.h"
#include "bindings.h"
#include "runtime.h"
#include "views.h"

namespace nb = nanobind;

namespace mxddp::python {
namespace {

std::unique_ptr<DataParallel> make_fsdp(const std::vector<ParamSpec>& params, const std::vector<std::vector<int>>& units,
                                        const FsdpConfig& config, const std::vector<TensorView>& initial_values,
                                        const CommHandle& handle, const CommHandle* replica_handle) {
  Runtime& runtime = Runtime::get();
  Communicator& comm = handle.comm();
  Communicator* replica = replica_handle ? &replica_handle->comm() : nullptr;
  MXDDP_CHECK(replica != &comm, "FSDP's replica communicator must not be its shard communicator (id {})", handle.id);
  nb::gil_scoped_release release;
  return std::make_unique<FullyShardedDataParallel>(comm, params, units, config, runtime.tracker(), initial_values,
                                                    replica);
}

GatherSlot parse_gather_slot(const std::string& name) {
  for (GatherSlot s : {GatherSlot::kValues, GatherSlot::kRowwise, GatherSlot::kColwise})
    if (gather_slot_name(s) == name) return s;
  MXDDP_FAIL("gather slot '{}' is not valid: values, rowwise or colwise", name);
}

// Runs a hook without the GIL: it may wait for a collective.
template <typename Fn>
void hook(PyFsdp& s, Fn&& fn) {
  FullyShardedDataParallel& fsdp = s.fsdp();
  nb::gil_scoped_release release;
  fn(fsdp);
}

void bind_fsdp_config(nb::module_& m) {
  nb::class_<FsdpConfig>(m, "FsdpConfig", "mxddp::FsdpConfig: the C++ FSDP's options (fields as Megatron names them).")
      .def(nb::init<>())
      .def_prop_rw(
          "data_parallel_sharding_strategy",
          [](const FsdpConfig& c) { return std::string(sharding_strategy_name(c.data_parallel_sharding_strategy)); },
          [](FsdpConfig& c, const std::string& name) { c.data_parallel_sharding_strategy = parse_sharding_strategy(name); })
      .def_rw("overlap_param_gather", &FsdpConfig::overlap_param_gather)
      .def_rw("overlap_grad_reduce", &FsdpConfig::overlap_grad_reduce)
      .def_rw("suggested_communication_unit_size", &FsdpConfig::suggested_communication_unit_size, nb::arg().none())
      .def_rw("fsdp_double_buffer", &FsdpConfig::fsdp_double_buffer)
      .def_rw("grad_reduce_in_fp32", &FsdpConfig::grad_reduce_in_fp32)
      .def_prop_rw(
          "param_dtype", [](const FsdpConfig& c) { return std::string(dtype_name(c.param_dtype)); },
          [](FsdpConfig& c, const std::string& name) { c.param_dtype = parse_param_dtype(name); })
      .def_prop_ro(
          "grad_dtype", [](const FsdpConfig& c) { return std::string(dtype_name(fsdp_grad_dtype(c))); },
          "The unsharded grads' and main_grad's dtype: f32 with grad_reduce_in_fp32, else param_dtype.");
}

}  // namespace

PyFsdp::PyFsdp(const std::vector<ParamSpec>& params, const std::vector<std::vector<int>>& units, const FsdpConfig& config,
               const std::vector<TensorView>& initial_values, const CommHandle& comm, const CommHandle* replica)
    : PyDataParallel(make_fsdp(params, units, config, initial_values, comm, replica)) {}

void bind_fsdp(nb::module_& m) {
  bind_fsdp_config(m);
  nb::class_<PyFsdp, PyDataParallel>(m, "FullyShardedDataParallel",
                                     "The C++ FullyShardedDataParallel: a bucket per unit, each rank keeping what the "
                                     "strategy shards; units gathered and released by the module hooks.")
      .def("__init__",
           [](PyFsdp* self, const std::vector<PyParam>& params, const std::vector<std::vector<int>>& units,
              const FsdpConfig& config, const std::vector<bool>& mxfp8, const std::vector<HostArray>& initial_values,
              const std::vector<bool>& mxfp8_colwise_forward, const CommHandle* comm, const CommHandle* replica) {
             new (self) PyFsdp(to_specs(params, mxfp8, mxfp8_colwise_forward), units, config, to_views(initial_values),
                               comm ? *comm : CommHandle{}, replica);
           },
           nb::arg("params"), nb::arg("units"), nb::arg("config"), nb::arg("mxfp8"), nb::arg("initial_values"),
           nb::arg("mxfp8_colwise_forward") = std::vector<bool>{}, nb::arg("comm").none() = nb::none(),
           nb::arg("replica").none() = nb::none(),
           "params: [(name, shape, shared_embedding)] in registration order; units: each unit's params "
           "(registration indices) in forward order; mxfp8: [] or a flag per param; initial_values: each param's "
           "values (f32 or the param dtype), of which each rank keeps what its strategy keeps; "
           "mxfp8_colwise_forward: [] or a flag per param, set for MXFP8 weights whose forward reads the "
           "column-wise copy (HF Conv1D's W [in, out]), so that forward gathers that copy; comm: the communicator to "
           "shard over (a handle from add_torch_group), None: the world's; replica: HSDP's replica group (the ranks "
           "of the other shard groups with this rank's shard index; a handle from add_torch_group), None: plain FSDP.")
      .def("after_forward", [](PyFsdp& s, const std::vector<int>& p) { hook(s, [&](auto& f) { f.after_forward(p); }); },
           nb::arg("params"))
      .def("before_backward", [](PyFsdp& s, const std::vector<int>& p) { hook(s, [&](auto& f) { f.before_backward(p); }); },
           nb::arg("params"))
      .def("after_backward", [](PyFsdp& s, const std::vector<int>& p) { hook(s, [&](auto& f) { f.after_backward(p); }); },
           nb::arg("params"))
      .def("release_gathered_params", [](PyFsdp& s) { hook(s, [](auto& f) { f.release_gathered_params(); }); },
           "A forward-only pass is over: every gathered param is released.")
      .def_prop_ro("num_units", [](PyFsdp& s) { return s.fsdp().num_units(); })
      .def_prop_ro("shards_params", [](PyFsdp& s) {
        return fsdp_shards_params(s.fsdp().config().data_parallel_sharding_strategy);
      }, "Whether params are gathered per unit (optim_grads_params) rather than resident.")
      .def_prop_ro("phase", [](PyFsdp& s) { return std::string(fsdp_phase_name(fsdp_engine(s.fsdp()).phase())); },
                   "The pass the last hook was in: 'forward', 'backward' or 'recompute' (a unit's forward re-run in "
                   "backward, from its pre-forward to its post-forward).")
      .def("peak_gathered_bytes", [](PyFsdp& s, const std::string& slot) {
        return s.fsdp().peak_gathered_bytes(parse_gather_slot(slot));
      }, nb::arg("slot"), "The most bytes gathered (or in flight) at once in one slot ('values', 'rowwise', 'colwise').")
      .def("reset_peak_gathered_bytes", [](PyFsdp& s) { s.fsdp().reset_peak_gathered_bytes(); })
      // Observability for tests: every gather is released once.
      .def_prop_ro("gathers_started", [](PyFsdp& s) { return fsdp_engine(s.fsdp()).gathers_started(); })
      .def_prop_ro("releases_done", [](PyFsdp& s) { return fsdp_engine(s.fsdp()).releases_done(); })
      .def_prop_ro("anything_gathered", [](PyFsdp& s) { return fsdp_engine(s.fsdp()).anything_gathered(); });
}

}  // namespace mxddp::python
