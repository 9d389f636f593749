// mxddp._C.plan_ddp_memory: the C++ memory planner (plan.h's plan_ddp_memory) over the params a
// torch module would register, for mxddp.torch.plan. It needs no MPI and no ranks: the plan is
// arithmetic over the layout, and every rank holds the same bytes.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <mxddp/plan.h>

#include "bindings.h"
#include "views.h"

namespace nb = nanobind;

namespace mxddp::python {
namespace {

// (name, shape, shared_embedding, mxfp8), as the DDP binding's params plus the MXFP8 mark.
using PlanParam = std::tuple<std::string, std::vector<int64_t>, bool, bool>;

nb::dict per_category(const std::array<int64_t, kNumMemoryCategories>& bytes) {
  nb::dict out;
  for (int c = 0; c < kNumMemoryCategories; ++c) {
    const auto name = memory_category_name(static_cast<MemoryCategory>(c));
    out[nb::str(name.data(), name.size())] = bytes[static_cast<size_t>(c)];
  }
  return out;
}

nb::dict plan_to_dict(const MemoryPlan& plan) {
  nb::dict out;
  out["dp"] = plan.dp;
  // From construction through a gradient sync and a step: the live bytes at the end and each
  // category's peak, as mxddp._C.memory_usage() reports them.
  out["live_bytes"] = per_category(plan.overall.live_bytes);
  out["peak_bytes"] = per_category(plan.overall.peak_bytes);
  out["total_live_bytes"] = plan.overall.total_live_bytes;
  out["total_peak_bytes"] = plan.overall.total_peak_bytes;
  const MemoryPlanLayout& l = plan.layout;
  nb::list buckets;
  for (const auto& [numel, end_padding] : l.bucket_numel_and_end_padding) buckets.append(nb::make_tuple(numel, end_padding));
  nb::dict layout;
  layout["params_numel"] = l.params_numel;
  layout["buffer_numel"] = l.buffer_numel;
  layout["num_buckets"] = l.num_buckets;
  layout["param_start_padding_numel"] = l.param_start_padding_numel;
  layout["bucket_end_padding_numel"] = l.bucket_end_padding_numel;
  layout["buckets"] = buckets;
  out["layout"] = layout;
  return out;
}

}  // namespace

void bind_plan(nb::module_& m) {
  m.def(
      "plan_ddp_memory",
      [](const std::vector<PlanParam>& params, const DdpConfig& config, const std::optional<std::string>& optimizer,
         int dp) {
        std::vector<ParamSpec> specs;
        for (const auto& [name, shape, shared, mxfp8] : params)
          specs.push_back(ParamSpec{.name = name, .shape = to_shape(shape, "param '" + name + "'"),
                                    .shared_embedding = shared, .mxfp8 = mxfp8});
        std::optional<OptimizerType> type;
        if (optimizer) type = parse_optimizer(*optimizer);
        // The package's ranks run on the mpi backend, whose gradient-sync staging the tracker counts.
        return plan_to_dict(plan_ddp_memory(specs, config, type, {.dp = dp, .mpi_backend = true}));
      },
      nb::arg("params"), nb::arg("config"), nb::arg("optimizer").none(), nb::arg("dp"),
      "Bytes per rank per category of a DistributedDataParallel over params (name, shape, shared_embedding, "
      "mxfp8) at dp ranks and, when optimizer ('adam' or 'sgd') is given, its DistributedOptimizer, after a "
      "gradient sync and a step: {dp, live_bytes, peak_bytes, total_live_bytes, total_peak_bytes, layout}.");
}

}  // namespace mxddp::python
