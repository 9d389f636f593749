// plan_fsdp_memory (plan.h): a FullyShardedDataParallel and its optimizer over a torch module's
// params, driven through the hooked modules as the Python package's FullyShardedDataParallel drives
// the C++ one, replayed against a MemoryTracker with nothing allocated. The FSDP's charges and
// decisions are FsdpMemorySim's (the same hook schedule as the real object); this file only says
// which hooks a torch module calls, in what order.
#include <algorithm>
#include <limits>
#include <set>

#include <mxddp/plan.h>

#include "../fsdp/fsdp_storage_plan.h"
#include "data_parallel_sim.h"

namespace mxddp {

namespace {

// Every category together holds at most a few dozen bytes per element (plan_ddp_memory's bound).
constexpr int64_t kBytesPerElementMax = 64;

// [param] the first hooked module that names it: where a non-unit param reports its grad in
// backward. Throws Error naming a hooked module that breaks plan.h's rules.
std::vector<int> check_hooked_modules(const std::vector<ParamSpec>& params, const std::vector<std::vector<int>>& units,
                                      const std::vector<FsdpHookedModule>& hooked) {
  const std::vector<int> unit_of_param = fsdp_unit_of_param(params.size(), units);
  std::vector<int> first_use(params.size(), -1);
  std::vector<bool> unit_hooked(units.size(), false);
  for (size_t j = 0; j < hooked.size(); ++j) {
    const FsdpHookedModule& h = hooked[j];
    MXDDP_CHECK(!h.params.empty(), "hooked module {} names no params; a module without trainable params has no hooks", j);
    MXDDP_CHECK(h.unit >= -1 && h.unit < static_cast<int>(units.size()),
                "hooked module {} has unit {}; valid: -1 (a non-unit module) or 0..{}", j, h.unit, units.size() - 1);
    std::set<int> seen;
    for (int p : h.params) {
      MXDDP_CHECK(p >= 0 && p < static_cast<int>(params.size()), "hooked module {} names param {}; valid: 0..{}", j, p,
                  params.size() - 1);
      MXDDP_CHECK(seen.insert(p).second, "hooked module {} names param '{}' twice", j, params[static_cast<size_t>(p)].name);
      const int unit = unit_of_param[static_cast<size_t>(p)];
      MXDDP_CHECK(unit == h.unit,
                  "hooked module {} (unit {}) names param '{}' of unit {}: a unit's params are hooked by its module "
                  "only, and a non-unit module names non-unit params only (-1: none)",
                  j, h.unit, params[static_cast<size_t>(p)].name, unit);
      if (first_use[static_cast<size_t>(p)] < 0) first_use[static_cast<size_t>(p)] = static_cast<int>(j);
    }
    if (h.unit < 0) continue;
    MXDDP_CHECK(!unit_hooked[static_cast<size_t>(h.unit)],
                "hooked module {} is unit {}, which an earlier hooked module is: each unit is one hooked module", j,
                h.unit);
    MXDDP_CHECK(h.params.size() == units[static_cast<size_t>(h.unit)].size(),
                "hooked module {} names {} of unit {}'s {} params; a unit's module names all of them", j,
                h.params.size(), h.unit, units[static_cast<size_t>(h.unit)].size());
    unit_hooked[static_cast<size_t>(h.unit)] = true;
  }
  for (size_t u = 0; u < units.size(); ++u)
    MXDDP_CHECK(unit_hooked[u], "unit {} has no hooked module; each unit is one", u);
  std::set<int> regions_closed;  // regions whose last module has passed: a region is one run of modules
  for (size_t j = 0; j < hooked.size(); ++j) {
    const int r = hooked[j].recompute_region;
    MXDDP_CHECK(r >= -1, "hooked module {} has recompute region {}; valid: -1 (none) or at least 0", j, r);
    if (r < 0) continue;
    MXDDP_CHECK(!regions_closed.contains(r),
                "hooked module {} is in recompute region {}, which other modules ended before it: a region's "
                "modules are consecutive in forward order", j, r);
    if (j + 1 == hooked.size() || hooked[j + 1].recompute_region != r) regions_closed.insert(r);
  }
  for (size_t p = 0; p < params.size(); ++p)
    MXDDP_CHECK(first_use[p] >= 0, "param '{}' is in no hooked module: its gradient would never be reported",
                params[p].name);
  return first_use;
}

}  // namespace

int fsdp_shard_group_size(const MemoryPlanOptions& opts, const FsdpConfig& config) {
  const int dp = opts.dp, instances = opts.num_distributed_optimizer_instances;
  MXDDP_CHECK(instances >= 1 && dp % instances == 0,
              "num_distributed_optimizer_instances {} is not valid at dp {}: a divisor of dp (each of that many "
              "replica groups is a shard group of dp / it ranks)", instances, dp);
  // The replica all-reduce of bf16 grads stages them in f32 on the mpi (and torch) backend, in a
  // communicator of its own, at a moment the simulation does not replay: refused, not guessed.
  MXDDP_CHECK(instances == 1 || !opts.mpi_backend || fsdp_grad_dtype(config) == DType::kF32,
              "num_distributed_optimizer_instances {} on the mpi backend with {} grads is not planned: the replica "
              "all-reduce's f32 staging is not modelled; plan with f32 grads (grad_reduce_in_fp32) or the local backend",
              instances, dtype_name(fsdp_grad_dtype(config)));
  return dp / instances;
}

MemoryPlan plan_fsdp_memory(const std::vector<ParamSpec>& params, const std::vector<std::vector<int>>& units,
                            const std::vector<FsdpHookedModule>& hooked, const FsdpConfig& config,
                            std::optional<OptimizerType> optimizer, const MemoryPlanOptions& opts) {
  const int dp = opts.dp;
  MXDDP_CHECK(dp >= 1, "dp {} is not valid: at least 1", dp);
  MXDDP_CHECK(opts.micro_batches >= 1, "micro_batches {} is not valid: at least 1", opts.micro_batches);
  MXDDP_CHECK(!params.empty(), "the param list is empty: a FullyShardedDataParallel needs at least one param");
  int64_t n = 0;
  for (const ParamSpec& p : params) n = checked_add(n, p.shape.numel(), "the param list's elements");
  MXDDP_CHECK(n <= std::numeric_limits<int64_t>::max() / kBytesPerElementMax,
              "the param list's {} elements are more than mxddp plans: their bytes would not fit in a 64-bit count", n);
  check_fsdp_config(config, params, units);
  const std::vector<int> first_use = check_hooked_modules(params, units, hooked);
  MXDDP_CHECK(opts.fused_grads.empty() || opts.fused_grads.size() == params.size(),
              "fused_grads has {} flags for {} params; valid: none, or one per param", opts.fused_grads.size(),
              params.size());
  auto fused = [&](int p) { return !opts.fused_grads.empty() && opts.fused_grads[static_cast<size_t>(p)]; };
  // [param] the last hooked module naming it: where backward first reaches it.
  std::vector<int> last_use(params.size(), -1);
  for (size_t j = 0; j < hooked.size(); ++j)
    for (int p : hooked[j].params) last_use[static_cast<size_t>(p)] = static_cast<int>(j);

  // HSDP: every figure is FSDP's over the shard group (the replica all-reduce is in place), but a
  // shard group of one keeps the transient grads that FSDP on one rank in all does without.
  const int shard = fsdp_shard_group_size(opts, config);
  MemoryTracker tracker;
  place_data_parallel_state(tracker, opts.data_parallel_place);
  DataParallelSim dpsim(tracker, nullptr);
  dpsim.build_fsdp(params, units, config, shard, opts.mpi_backend, dp / shard);
  if (optimizer) dpsim.build_optimizer(*optimizer);

  // [hooked module] its params as backward reports them: a unit's in decreasing registration
  // index; a non-unit module's in reverse list order, those it reads first.
  // A fused non-unit param is reported where its first reader ends its backward too, but its
  // main_grad comes earlier (fused_first_grads), at its last reader's.
  std::vector<std::vector<int>> backward_reports(hooked.size());
  std::vector<std::vector<int>> fused_first_grads(hooked.size());
  for (size_t j = 0; j < hooked.size(); ++j) {
    const FsdpHookedModule& h = hooked[j];
    std::vector<int>& r = backward_reports[j];
    for (auto it = h.params.rbegin(); it != h.params.rend(); ++it) {
      if (h.unit >= 0 || first_use[static_cast<size_t>(*it)] == static_cast<int>(j)) r.push_back(*it);
      if (h.unit < 0 && fused(*it) && last_use[static_cast<size_t>(*it)] == static_cast<int>(j))
        fused_first_grads[j].push_back(*it);
    }
    if (h.unit >= 0) std::sort(r.begin(), r.end(), std::greater<>());
  }
  // The non-unit params, gathered together as a forward starts (a module may read them outside
  // its own forward: a tied head reads the embedding's weight).
  std::vector<int> non_unit_params;
  size_t held_back_max = 0;  // the non-unit params whose reports are held back: the unfused ones
  for (size_t p = 0; p < params.size(); ++p)
    if (first_use[p] >= 0 && hooked[static_cast<size_t>(first_use[p])].unit < 0) {
      non_unit_params.push_back(static_cast<int>(p));
      if (!fused(static_cast<int>(p))) ++held_back_max;
    }
  // With sharded grads the non-unit params' grads are handed over together once the last arrives
  // (all main_grad, then all grad_ready): taking a final norm's at once would allocate the
  // non-unit bucket's unsharded grads at the start of backward.
  const bool defer_non_unit = fsdp_shards_grads(config.data_parallel_sharding_strategy);
  auto micro_batch = [&] {
    if (!non_unit_params.empty()) dpsim.before_forward(non_unit_params);
    for (const FsdpHookedModule& h : hooked) {
      if (h.unit < 0) continue;  // a non-unit module has no hooks
      dpsim.before_forward(h.params);
      dpsim.after_forward(h.params);
    }
    std::vector<int> deferred;  // non-unit params whose grads are held back, in arrival order
    for (size_t j = hooked.size(); j-- > 0;) {
      const FsdpHookedModule& h = hooked[j];
      if (h.unit >= 0) dpsim.before_backward(h.params);
      const int region = h.recompute_region;
      if (region >= 0 && (j + 1 == hooked.size() || hooked[j + 1].recompute_region != region)) {
        size_t first = j;  // the region's first module
        while (first > 0 && hooked[first - 1].recompute_region == region) --first;
        for (size_t k = first; k <= j; ++k) {
          if (hooked[k].unit < 0) continue;  // a non-unit module re-runs too, but has no hooks
          dpsim.before_forward(hooked[k].params);
          dpsim.after_forward(hooked[k].params);
        }
      }
      for (int p : fused_first_grads[j]) dpsim.main_grad(p);
      for (int p : backward_reports[j]) {
        if (h.unit < 0 && fused(p)) {
          if (last_use[static_cast<size_t>(p)] != static_cast<int>(j)) dpsim.main_grad(p);  // (its other uses')
          dpsim.grad_ready(p);
          continue;
        }
        if (h.unit < 0 && defer_non_unit) {
          deferred.push_back(p);
          if (deferred.size() < held_back_max) continue;
          for (int d : deferred) dpsim.main_grad(d);
          for (int d : deferred) dpsim.grad_ready(d);
          deferred.clear();
          continue;
        }
        dpsim.main_grad(p);
        dpsim.grad_ready(p);
      }
      if (h.unit >= 0) dpsim.after_backward(h.params);
    }
  };
  // Micro-batches under no_sync repeat the second one's allocations (plan_train_memory's
  // argument): up to three of them and the synced last give an iteration's peaks.
  const int micro_batches = std::min(opts.micro_batches, 4);
  auto iteration = [&] {
    if (optimizer) dpsim.start_iteration();  // the optimizer's zero_grad
    else dpsim.zero_grad_buffer();
    for (int m = 0; m < micro_batches; ++m) {
      dpsim.set_no_sync(m + 1 < micro_batches);
      micro_batch();
      dpsim.set_no_sync(false);
    }
    dpsim.finish_grad_sync();
    if (optimizer) dpsim.step();
  };
  // The first iteration frees the MXFP8 buckets' initial staging and allocates the mpi staging;
  // every later one repeats the second's allocations from the same state.
  iteration();
  const MemoryUsage first = tracker.usage();
  tracker.reset_peaks();
  iteration();
  MemoryPlan plan = data_parallel_plan(dpsim, dp, tracker.usage(), first);
  plan.num_distributed_optimizer_instances = dp / shard;
  return plan;
}

}  // namespace mxddp
