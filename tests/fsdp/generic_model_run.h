// Runs the generic model (generic_model.h) on one rank under DDP or an FSDP strategy and checks it
// against the serial reference: the main params after every iteration's step (bit for bit, or
// within a tolerance where the engine sums in its own order), and for FSDP every gather released,
// no unit gathered when backward ends, nothing gathered by or after finish_grad_sync. Shared by the
// local suite (fsdp_any_structure_test.cc) and the mpirun one (fsdp_any_structure_mpi_test.cc).
#pragma once

#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <gtest/gtest.h>

#include <mxddp/checkpoint.h>
#include <mxddp/ddp.h>
#include <mxddp/fsdp.h>
#include <mxddp/optim.h>

#include "fsdp/fsdp_engine.h"
#include "fsdp/generic_model.h"
#include "fsdp/hsdp_grid.h"

namespace mxddp::testing {

// What runs the model: DDP with a replicated optimizer (no distributed optimizer: every rank steps
// the whole model from its all-reduced grads, PlainAdamW), DDP with the distributed optimizer, or an
// FSDP strategy under the distributed optimizer.
enum class DpMode : uint8_t { kDdp, kDdpDistOpt, kNoShard, kOptim, kOptimGrads, kOptimGradsParams };
inline constexpr DpMode kDpModes[] = {DpMode::kDdp,   DpMode::kDdpDistOpt, DpMode::kNoShard,
                                      DpMode::kOptim, DpMode::kOptimGrads, DpMode::kOptimGradsParams};

inline std::string dp_mode_name(DpMode m) {
  switch (m) {
    case DpMode::kDdp: return "ddp";
    case DpMode::kDdpDistOpt: return "ddp_distopt";
    case DpMode::kNoShard: return "no_shard";
    case DpMode::kOptim: return "optim";
    case DpMode::kOptimGrads: return "optim_grads";
    case DpMode::kOptimGradsParams: return "optim_grads_params";
  }
  return "?";
}
inline bool is_fsdp(DpMode m) { return m != DpMode::kDdp && m != DpMode::kDdpDistOpt; }
// MXFP8 params: DDP's fp8_param_gather (distributed optimizer) and FSDP optim_grads_params only.
inline bool mxfp8_valid(DpMode m) { return m == DpMode::kDdpDistOpt || m == DpMode::kOptimGradsParams; }
inline ShardingStrategy strategy_of(DpMode m) {
  switch (m) {
    case DpMode::kNoShard: return ShardingStrategy::kNoShard;
    case DpMode::kOptim: return ShardingStrategy::kOptim;
    case DpMode::kOptimGrads: return ShardingStrategy::kOptimGrads;
    default: return ShardingStrategy::kOptimGradsParams;
  }
}
// FSDP's sharded grads reduce every micro-batch, except on one rank in all, where the grads go
// straight into the shard and accumulate there (FsdpStoragePlan::grads_in_shard), as DDP's do.
inline GradOrder grad_order_of(DpMode m, int dp) {
  return (m == DpMode::kOptimGrads || m == DpMode::kOptimGradsParams) && dp > 1 ? GradOrder::kReduceEachMicroBatch
                                                                               : GradOrder::kAccumulateThenReduce;
}

struct GenericCase {
  StructureClass structure = StructureClass::kAllInUnits;
  uint64_t seed = 1;
  DpMode mode = DpMode::kOptimGradsParams;
  bool fine_grained = false;
  bool mxfp8 = false;
  bool overlap_grad_reduce = false;
  bool overlap_param_gather = false;  // DDP: with the distributed optimizer only
  GenericRunShape run;

  std::string name() const {
    return fmt::format("{}/seed{} {}{}{} grad_overlap={} param_overlap={} dp{} mb{} {}{}", structure_class_name(structure),
                       seed, dp_mode_name(mode), fine_grained ? " fine" : "", mxfp8 ? " mxfp8" : "",
                       overlap_grad_reduce, overlap_param_gather, run.dp, run.micro_batches,
                       dtype_name(run.param_dtype), run.recompute ? " recompute" : "");
  }
};

// The optimizer every case runs: AdamW, no clipping (the global norm's partial sums follow the
// shard boundaries, which differ between strategies; the reference has no shards).
inline OptimizerConfig generic_optimizer_config() {
  return OptimizerConfig{.optimizer = OptimizerType::kAdam, .lr = 1e-2f, .weight_decay = 0.1f, .clip_grad = 0.0f};
}

inline GenericModel generic_model_of(const GenericCase& c) {
  return make_generic_model(c.structure, c.seed, c.fine_grained, c.mxfp8);
}

inline std::vector<std::vector<std::vector<float>>> generic_reference_of(const GenericCase& c, const GenericModel& model) {
  return generic_reference(model, c.run, grad_order_of(c.mode, c.run.dp), generic_optimizer_config());
}

// Main param elements that differ from the reference: tol 0 asks for the same bits (NaN equal to
// NaN), otherwise |got - want| <= tol * max(1, |want|).
struct Mismatches {
  int64_t count = 0;
  std::string first;
  void check(float got, float want, double tol, const std::string& param, int64_t element) {
    const bool same = tol == 0 ? (std::memcmp(&got, &want, sizeof got) == 0 || (std::isnan(got) && std::isnan(want)))
                               : std::fabs(static_cast<double>(got) - want) <= tol * std::max(1.0, std::fabs(static_cast<double>(want)));
    if (same) return;
    if (count++ == 0) first = fmt::format("param '{}' element {}: {} vs reference {}", param, element, got, want);
  }
};

// What a rank of an HSDP run adds (tests/fsdp/hsdp_grid.h's grid), and what a run may record.
struct GenericRankExtras {
  // HSDP: comm is the rank's shard group and replica its replica group (FSDP modes only); the
  // rank's data is that of global rank replica->rank() * comm.size() + comm.rank().
  Communicator* replica = nullptr;
  // If set, every main param element this rank updated, in the order checked, appended after
  // each iteration: the trace two runs of the same job are compared by, bit for bit.
  std::vector<float>* updated_mains = nullptr;
  // The iterations this run takes, [first_iteration, end_iteration) (-1: c.run.iterations), and
  // checkpoints (the distributed optimizer's modes): loaded before the first, saved after the last.
  int first_iteration = 0;
  int end_iteration = -1;
  std::string load_dir;
  std::string save_dir;
};

// Runs case c on this rank (comm.size() == c.run.dp, or times the replica group's size under HSDP)
// and checks it against `want` (the reference's main params after each iteration). tol 0: bit for
// bit; otherwise |got - want| <= tol * max(1, |want|).
// wrap: decorates the DataParallel the model and the optimizer see (the jitter tests), or none.
inline void run_generic_case(Communicator& comm, const GenericCase& c, const GenericModel& model,
                             const std::vector<std::vector<std::vector<float>>>& want, double tol,
                             const std::function<std::unique_ptr<DataParallel>(std::unique_ptr<DataParallel>)>& wrap = {},
                             const GenericRankExtras& extras = {}) {
  const int replicas = extras.replica ? extras.replica->size() : 1;
  MXDDP_CHECK(comm.size() * replicas == c.run.dp, "case {} wants dp {}; the communicators have {} x {} ranks", c.name(),
              c.run.dp, comm.size(), replicas);
  MXDDP_CHECK(!extras.replica || is_fsdp(c.mode), "case {}: HSDP needs an FSDP mode", c.name());
  const int rank = extras.replica ? extras.replica->rank() * comm.size() + comm.rank() : comm.rank();
  const std::string what = fmt::format("{} rank {}", c.name(), rank);
  MemoryTracker tracker;
  const GenericInitialValues init(model);

  std::unique_ptr<DataParallel> owned;
  const FsdpEngine* fsdp = nullptr;  // FSDP's observability (gathers, releases)
  if (is_fsdp(c.mode)) {
    FsdpConfig fc;
    fc.data_parallel_sharding_strategy = strategy_of(c.mode);
    fc.overlap_grad_reduce = c.overlap_grad_reduce;
    fc.overlap_param_gather = c.overlap_param_gather;
    fc.param_dtype = c.run.param_dtype;
    auto f = std::make_unique<FullyShardedDataParallel>(comm, model.specs, model.units, fc, tracker, init.views,
                                                        extras.replica);
    fsdp = &fsdp_engine(*f);
    owned = std::move(f);
  } else {
    DdpConfig dc;
    dc.overlap_grad_reduce = c.overlap_grad_reduce;
    dc.use_distributed_optimizer = c.mode == DpMode::kDdpDistOpt;
    dc.overlap_param_gather = c.overlap_param_gather && dc.use_distributed_optimizer;
    dc.bucket_size = 200;  // several buckets on these models
    dc.param_dtype = c.run.param_dtype;
    dc.fp8_param_gather = c.mxfp8;
    owned = std::make_unique<DistributedDataParallel>(comm, model.specs, dc, tracker, init.views);
  }
  std::unique_ptr<DataParallel> dp = wrap ? wrap(std::move(owned)) : std::move(owned);
  std::optional<DistributedOptimizer> opt;
  std::optional<PlainAdamW> replicated;  // DDP without the distributed optimizer
  if (c.mode == DpMode::kDdp) replicated.emplace(generic_optimizer_config(), model, c.run.param_dtype);
  else opt.emplace(*dp, generic_optimizer_config(), tracker);
  MXDDP_CHECK(opt || (extras.load_dir.empty() && extras.save_dir.empty() && extras.first_iteration == 0),
              "case {}: checkpoints need the distributed optimizer", c.name());
  if (!extras.load_dir.empty()) load_checkpoint(extras.load_dir, *opt);
  const int end_iteration = extras.end_iteration >= 0 ? extras.end_iteration : c.run.iterations;

  DataParallelModelAccess access(*dp);
  for (int it = extras.first_iteration; it < end_iteration; ++it) {
    if (opt) opt->zero_grad();
    else dp->zero_grad_buffer();
    for (int m = 0; m < c.run.micro_batches; ++m) {
      const auto micro_batch = [&] {
        generic_forward_backward(model, access, it, c.run.first_sample(rank, m), c.run.micro_batch_size, c.run.loss_scale(),
                                 c.run.recompute);
      };
      if (m + 1 < c.run.micro_batches) {
        auto scope = dp->no_sync();
        micro_batch();
      } else {
        micro_batch();
      }
      // Every unit's post-backward released it: only the non-unit params may still be held.
      if (fsdp) {
        EXPECT_EQ(fsdp->units_gathered(), 0) << what << ": a unit is still gathered after backward, iteration " << it;
      }
    }
    const int64_t gathers_before_sync = fsdp ? fsdp->gathers_started() : 0;
    dp->finish_grad_sync();
    if (fsdp) {
      EXPECT_FALSE(fsdp->anything_gathered()) << what << ": gathered after finish_grad_sync, iteration " << it;
      EXPECT_EQ(fsdp->gathers_started(), gathers_before_sync) << what << ": finish_grad_sync gathered, iteration " << it;
    }

    // Every rank goes on after a mismatch (a rank that stopped would leave its peers waiting in a
    // collective); the first mismatch of the iteration is reported with the count.
    Mismatches bad;
    if (opt) {
      opt->step();
      // This rank's updated elements of every bucket against the reference.
      for (int b = 0; b < opt->num_buckets(); ++b) {
        const TensorView main_view = opt->main_params(b);  // the compute's memory: read a host copy
        std::vector<float> main(static_cast<size_t>(main_view.numel()));
        dp->compute().copy_to_host(main.data(), main_view.data, main_view.nbytes());
        for (const ShardParamRange& r : opt->bucket(b).update)
          for (int64_t k = 0; k < r.in_param.size(); ++k) {
            if (extras.updated_mains) extras.updated_mains->push_back(main[r.in_shard.start + k]);
            bad.check(main[r.in_shard.start + k], want[static_cast<size_t>(it)][static_cast<size_t>(r.param)][static_cast<size_t>(r.in_param.start + k)],
                      tol, model.specs[static_cast<size_t>(r.param)].name, r.in_param.start + k);
          }
      }
    } else {
      std::vector<std::vector<float>> grads;
      for (int p = 0; p < dp->num_params(); ++p) {
        const TensorView g = dp->main_grad(p);
        grads.emplace_back(g.data_as<const float>(), g.data_as<const float>() + g.numel());
      }
      replicated->step(grads, model.specs);
      for (int p = 0; p < dp->num_params(); ++p) {
        const std::vector<float>& main = replicated->main[static_cast<size_t>(p)];
        const TensorView param = dp->param(p);
        for (size_t k = 0; k < main.size(); ++k) {
          if (param.dtype == DType::kF32) param.data_as<float>()[k] = main[k];
          else param.data_as<bf16_bits>()[k] = f32_to_bf16(main[k]);
          bad.check(main[k], want[static_cast<size_t>(it)][static_cast<size_t>(p)][k], tol, model.specs[static_cast<size_t>(p)].name,
                    static_cast<int64_t>(k));
        }
      }
    }
    EXPECT_EQ(bad.count, 0) << what << ": iteration " << it << ": " << bad.count << " main param element(s) differ from the "
                            << "reference; first: " << bad.first;
  }
  if (!extras.save_dir.empty()) save_checkpoint(extras.save_dir, *opt, {.overwrite = true});
  if (fsdp) {
    EXPECT_EQ(fsdp->gathers_started(), fsdp->releases_done()) << what << ": a gather was never released";
    if (c.mode == DpMode::kOptimGradsParams) {
      EXPECT_GT(fsdp->gathers_started(), 0) << what;
    }
  }
}

// HSDP: case c (c.run.dp = shard x replicas) on tests/fsdp/hsdp_grid.h's grid, each rank checked
// against want within tol; computes: one per global rank (their memory), or none (the host's).
// Returns every main param element each global rank updated, in order (GenericRankExtras).
inline std::vector<std::vector<float>> run_hsdp_generic_case(const GenericCase& c, const GenericModel& model,
                                                             const std::vector<std::vector<std::vector<float>>>& want,
                                                             double tol, int shard, int replicas,
                                                             const std::vector<Compute*>& computes = {},
                                                             const LocalOptions& options = {}) {
  std::vector<std::vector<float>> updated(static_cast<size_t>(c.run.dp));
  run_grid(
      shard, replicas,
      [&](Communicator& comm, Communicator& replica, int rank) {
        run_generic_case(comm, c, model, want, tol, {}, {.replica = &replica, .updated_mains = &updated[static_cast<size_t>(rank)]});
      },
      options, computes);
  return updated;
}

// Two runs' updated main params (run_hsdp_generic_case), rank by rank: the same bits, and not none.
inline void expect_same_updated_mains(const std::vector<std::vector<float>>& on_host,
                                      const std::vector<std::vector<float>>& on_device) {
  ASSERT_EQ(on_device.size(), on_host.size());
  for (size_t r = 0; r < on_host.size(); ++r) {
    ASSERT_EQ(on_device[r].size(), on_host[r].size()) << "rank " << r;
    EXPECT_GT(on_host[r].size(), 0u) << "rank " << r << " updated nothing";
    // NaN payloads may differ on a GPU (docs/cuda.md); these models hold no NaN, so the bits must agree.
    EXPECT_EQ(std::memcmp(on_device[r].data(), on_host[r].data(), on_host[r].size() * sizeof(float)), 0)
        << "rank " << r << ": the device run's main params differ from the host run's";
  }
}

}  // namespace mxddp::testing
