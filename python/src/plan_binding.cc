// mxddp._C.plan_ddp_memory and plan_fsdp_memory: the C++ memory planner (plan.h) over the params a
// torch module would register, for mxddp.torch.plan (plan_fsdp_memory takes the _C.FsdpConfig that
// fsdp_binding.cc binds). It needs no MPI and no ranks: the plan is arithmetic over the layout, and
// every rank holds the same bytes.
#include <nanobind/nanobind.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <mxddp/fsdp.h>
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
  // After the first iteration (the tracker's peaks reset then): what every later one reaches.
  out["steady_peak_bytes"] = per_category(plan.steady.peak_bytes);
  out["steady_total_peak_bytes"] = plan.steady.total_peak_bytes;
  nb::dict gathered;  // FSDP: the most bytes gathered at once per slot (0 where nothing is)
  for (int s = 0; s < kGatherSlots; ++s) {
    const auto name = gather_slot_name(static_cast<GatherSlot>(s));
    gathered[nb::str(name.data(), name.size())] = plan.peak_gathered_bytes_by_slot[static_cast<size_t>(s)];
  }
  out["peak_gathered_bytes"] = gathered;
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
  layout["largest_unit_numel"] = l.largest_unit_numel;
  out["layout"] = layout;
  // Each place's own figures, as mxddp._C.memory_usage(place) reports them.
  nb::dict by_place;
  for (const MemoryPlace place : {MemoryPlace::kHost, MemoryPlace::kDevice}) {
    const MemoryAmounts& a = plan.overall.at(place);
    nb::dict one;
    one["live_bytes"] = per_category(a.live_bytes);
    one["peak_bytes"] = per_category(a.peak_bytes);
    one["total_live_bytes"] = a.total_live_bytes;
    one["total_peak_bytes"] = a.total_peak_bytes;
    const auto name = memory_place_name(place);
    by_place[nb::str(name.data(), name.size())] = one;
  }
  out["by_place"] = by_place;
  return out;
}

// "host" or "device": where the data-parallel buffers and the optimizer's state are planned.
MemoryPlace parse_place(const std::string& place) {
  if (place == "host") return MemoryPlace::kHost;
  if (place == "device") return MemoryPlace::kDevice;
  MXDDP_FAIL("place '{}' is not valid; valid: host, device", place);
}

// The DDP binding's params (bindings.h's to_specs, which checks them) from the plan's tuples.
std::vector<ParamSpec> to_specs(const std::vector<PlanParam>& params, const std::vector<bool>& mxfp8_colwise_forward = {}) {
  std::vector<PyParam> plain;
  std::vector<bool> mxfp8;
  for (const auto& [name, shape, shared, marked] : params) {
    plain.emplace_back(name, shape, shared);
    mxfp8.push_back(marked);
  }
  return mxddp::python::to_specs(plain, mxfp8, mxfp8_colwise_forward);
}

std::optional<OptimizerType> to_optimizer(const std::optional<std::string>& optimizer) {
  if (!optimizer) return std::nullopt;
  return parse_optimizer(*optimizer);
}

}  // namespace

void bind_plan(nb::module_& m) {
  m.def(
      "plan_ddp_memory",
      [](const std::vector<PlanParam>& params, const DdpConfig& config, const std::optional<std::string>& optimizer,
         int dp, const std::string& place) {
        // On the host the package's ranks run on the mpi backend, whose gradient-sync staging the
        // tracker counts; on a device on NCCL, which has none (the staged engine's is not planned).
        const MemoryPlace where = parse_place(place);
        return plan_to_dict(plan_ddp_memory(to_specs(params), config, to_optimizer(optimizer),
                                            {.dp = dp, .mpi_backend = where == MemoryPlace::kHost,
                                             .data_parallel_place = where}));
      },
      nb::arg("params"), nb::arg("config"), nb::arg("optimizer").none(), nb::arg("dp"), nb::arg("place") = "host",
      "Bytes per rank per category of a DistributedDataParallel over params (name, shape, shared_embedding, "
      "mxfp8) at dp ranks and, when optimizer ('adam' or 'sgd') is given, its DistributedOptimizer, after a "
      "gradient sync and a step: {dp, live_bytes, peak_bytes, total_live_bytes, total_peak_bytes, "
      "steady_peak_bytes, steady_total_peak_bytes, peak_gathered_bytes, layout, by_place}. place: where the "
      "buffers and the optimizer's state live, 'host' (the mpi backend's staging counted) or 'device' (NCCL: none).");
  m.def(
      "plan_fsdp_memory",
      [](const std::vector<PlanParam>& params, const std::vector<std::vector<int>>& units,
         const std::vector<std::tuple<std::vector<int>, int, int>>& hooked, const FsdpConfig& config,
         const std::optional<std::string>& optimizer, int dp, int micro_batches,
         const std::vector<bool>& mxfp8_colwise_forward, const std::vector<bool>& fused_grads,
         int num_distributed_optimizer_instances, const std::string& place) {
        std::vector<FsdpHookedModule> modules;
        for (const auto& [module_params, unit, region] : hooked) modules.push_back({module_params, unit, region});
        const MemoryPlace where = parse_place(place);
        return plan_to_dict(plan_fsdp_memory(
            to_specs(params, mxfp8_colwise_forward), units, modules, config, to_optimizer(optimizer),
            {.dp = dp, .mpi_backend = where == MemoryPlace::kHost, .micro_batches = micro_batches,
             .fused_grads = fused_grads, .num_distributed_optimizer_instances = num_distributed_optimizer_instances,
             .data_parallel_place = where}));
      },
      nb::arg("params"), nb::arg("units"), nb::arg("hooked"), nb::arg("config"), nb::arg("optimizer").none(),
      nb::arg("dp"), nb::arg("micro_batches"), nb::arg("mxfp8_colwise_forward") = std::vector<bool>{},
      nb::arg("fused_grads") = std::vector<bool>{}, nb::arg("num_distributed_optimizer_instances") = 1,
      nb::arg("place") = "host",
      "Bytes per rank per category of a FullyShardedDataParallel over params (name, shape, shared_embedding, "
      "mxfp8) with units (param indices per unit, forward order), driven through hooked ((params, unit, "
      "recompute_region) per hooked module in forward order, unit -1 for a non-unit module, region -1 for none) "
      "as mxddp.torch drives it, at dp ranks and "
      "micro_batches per iteration, and, when optimizer ('adam' or 'sgd') is given, its DistributedOptimizer "
      "(mxfp8_colwise_forward: as FullyShardedDataParallel's; fused_grads: [] or a flag per param whose modules "
      "add its weight gradient into main_grad themselves): "
      "overall from construction through any number of iterations, steady after the first; the dict of "
      "plan_ddp_memory. num_distributed_optimizer_instances: HSDP's replica groups (plan.h), 1: plain FSDP. "
      "place: as plan_ddp_memory's.");
}

}  // namespace mxddp::python
