// FSDP against DDP (issue 11's benchmark): for each preset, dp and strategy, the resting bytes per
// param per rank against Megatron-FSDP's table, the peak gathered (transient) param bytes, and the
// step time and exposed communication against DDP with the distributed optimizer, on the local
// backend.
//
//   table (BF16 params, F32 grads and main params, Adam; dp = N), bytes per param per rank:
//     ddp + distributed optimizer  6 + 12/N      fsdp optim               6 + 12/N
//     fsdp no_shard               18              fsdp optim_grads         2 + 16/N
//                                                 fsdp optim_grads_params  18/N
//     fsdp optim_grads_params_mxfp8 (the linear weights MXFP8, --fp8-param-gather): their
//       (2 + 2/32)/N payload and scale bytes in place of 2/N (fsdp_storage_plan.h's table)
//   measured = live params + grads + MXFP8 payloads and scales + main params + optimizer state, in
//   the steady state, over the model's params; the difference from the table is the padding that
//   makes every bucket (and MXFP8 scale array) divide into dp equal shards.
//
// peak gathered: the most param bytes a rank held gathered at once, in largest units (a unit is a
// decoder layer; the non-unit params, embeddings and final norm, are gathered for the whole
// iteration on top). exposed comm: the time a rank waited for collectives (param gathers in the
// pre-hooks plus finish_grad_sync), as a share of the step. Times are medians over the iterations
// after the first, rank 0's. gpt2-124m runs at a shorter sequence than its 1024 by default (every
// byte figure is independent of it; the step is what a 2-core machine can afford).
//
// `fsdp_bench sweep` is issue 12's sweep of the param gather's memory/time front (fsdp_sweep.cc).
#include <cstdio>
#include <mutex>
#include <thread>

#include <CLI/CLI.hpp>

#include <mxddp/train.h>

#include "bench_util.h"
#include "fsdp/fsdp_engine.h"
#include "fsdp_sweep.h"

namespace {

using namespace mxddp;
using namespace mxddp::bench;

// The table's bytes per param, from FSDP's per-strategy storage table (fsdp_storage_plan.h);
// mxfp8_fraction: the share of the params that are MXFP8.
double table_bytes_per_param(const std::string& mode, int dp, double mxfp8_fraction) {
  if (mode == "ddp") return 6 + 12.0 / dp;
  const ShardingStrategy s = parse_sharding_strategy(mode == "optim_grads_params_mxfp8" ? "optim_grads_params" : mode);
  const double bf16 = fsdp_element_bytes(s, DType::kBF16, DType::kF32, dp, 2).total();
  const double mxfp8 = fsdp_element_bytes(s, DType::kBF16, DType::kF32, dp, 2, /*mxfp8=*/true).total();
  return (1 - mxfp8_fraction) * bf16 + mxfp8_fraction * mxfp8;
}

// The share of the model's params that --fp8-param-gather keeps as MXFP8.
double mxfp8_fraction(const GptConfig& model) {
  double mxfp8 = 0, all = 0;
  for (const ParamSpec& s : gpt_param_specs(model, true)) {
    all += static_cast<double>(s.shape.numel());
    mxfp8 += s.mxfp8 ? static_cast<double>(s.shape.numel()) : 0;
  }
  return mxfp8 / all;
}

struct RunFigures {
  double bytes_per_param = 0;  // rank 0's resting bytes / params
  int64_t peak_gathered_bytes = 0;
  int64_t unit_bytes_max = 0, non_unit_bytes = 0;  // gathered sizes of the largest unit and of the rest
  int64_t peak_total_bytes = 0;                    // rank 0, whole run
  double step_ms = 0, comm_ms = 0;
};

RunFigures run(const TrainConfig& c, int dp) {
  RunFigures f;
  std::vector<double> step_ms, comm_ms;
  std::mutex mutex;
  run_local(dp, [&](Communicator& comm) {
    TrainCallbacks callbacks;
    if (comm.rank() == 0)
      callbacks.wrap_data_parallel = [&](std::unique_ptr<DataParallel> dp_obj) {
        if (const auto* fsdp = dynamic_cast<const FullyShardedDataParallel*>(dp_obj.get())) {
          // What one forward pass gathers of a bucket: its values, or its row-wise payload and scales.
          const FsdpEngine& engine = fsdp_engine(*fsdp);
          auto forward_bytes = [&](int b) {
            const FsdpStoragePlan& storage = engine.storage_plan(b);
            return storage.gathered_bytes(GatherSlot::kValues) + storage.gathered_bytes(GatherSlot::kRowwise);
          };
          for (int u = 0; u < fsdp->num_units(); ++u) {
            int64_t bytes = 0;
            for (int b : engine.unit_buckets(u)) bytes += forward_bytes(b);
            f.unit_bytes_max = std::max(f.unit_bytes_max, bytes);
          }
          for (int b : engine.non_unit_buckets()) f.non_unit_bytes += forward_bytes(b);
        }
        return dp_obj;
      };
    const TrainResult r = train(comm, c, callbacks);
    if (comm.rank() != 0) return;
    std::lock_guard lock(mutex);
    const MemoryUsage& m = r.memory_by_rank[0].steady;
    const int64_t resting = m.live(MemoryCategory::kParams) + m.live(MemoryCategory::kGrads) +
                            m.live(MemoryCategory::kMxfp8) + m.live(MemoryCategory::kMainParams) +
                            m.live(MemoryCategory::kOptimizerState);
    f.bytes_per_param = static_cast<double>(resting) / static_cast<double>(c.model.num_params());
    f.peak_gathered_bytes = r.memory_by_rank[0].overall.peak(MemoryCategory::kGathered);
    f.peak_total_bytes = r.memory_by_rank[0].overall.total_peak_bytes;
    for (size_t i = 1; i < r.steps.size(); ++i) {
      step_ms.push_back(r.steps[i].step_ms);
      comm_ms.push_back(r.steps[i].comm_ms);
    }
  });
  f.step_ms = median(step_ms);
  f.comm_ms = median(comm_ms);
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"FSDP strategies against DDP: bytes per param, peak gathered bytes, step time, exposed comm"};
  std::vector<std::string> presets = {"small", "gpt2-124m"};
  std::vector<int> dps = {2, 4};
  std::vector<std::string> modes = {"ddp", "no_shard", "optim", "optim_grads", "optim_grads_params"};
  int iters = 4, micro = 2, gpt2_seq = 128;
  bool overlap = true, double_buffer = false;
  app.add_option("--presets", presets, "Model presets")->delimiter(',');
  app.add_option("--dps", dps, "Data-parallel sizes (local backend)")->delimiter(',')->check(CLI::Range(1, 64));
  app.add_option("--modes", modes, "ddp and FSDP strategies (optim_grads_params_mxfp8: with MXFP8 linear weights)")
      ->delimiter(',')
      ->check(CLI::IsMember({"ddp", "no_shard", "optim", "optim_grads", "optim_grads_params", "optim_grads_params_mxfp8"}));
  app.add_option("--iters", iters, "Iterations per run; the first is not timed")->check(CLI::Range(2, 1000));
  app.add_option("--micro-batch", micro, "Micro-batch size (one micro-batch per rank and iteration)")->check(CLI::Range(1, 4096));
  app.add_option("--gpt2-seq-length", gpt2_seq, "Sequence length gpt2-124m runs at")->check(CLI::Range(16, 1024));
  app.add_option("--overlap", overlap, "Overlap param gathers and grad reductions (both DDP and FSDP)");
  app.add_flag("--fsdp-double-buffer", double_buffer, "FSDP: at most two units gathered at once");
  add_sweep_command(app);
  CLI11_PARSE(app, argc, argv);
  if (const std::optional<int> status = run_sweep_if_chosen()) return *status;

  const ComputeInfo info = compute_info();
  std::printf("CPU: %s, %u cores; compute: %s; each rank runs cores / dp threads\n", info.cpu.c_str(),
              std::thread::hardware_concurrency(), info.describe(false).c_str());
  std::printf("local backend, overlap %s, f32 compute, bf16 params, f32 grads; medians over iterations 2..%d, rank 0\n\n",
              overlap ? "on" : "off", iters);
  std::printf("%-10s %2s %-24s %9s %9s %7s %12s %7s %9s %8s %7s %9s %10s\n", "preset", "dp", "mode", "B/param",
              "table", "ratio", "gathered", "units", "peak_MiB", "step_ms", "vs_ddp", "comm_ms", "comm_share");
  for (const std::string& preset : presets) {
    TrainConfig c;
    c.model = gpt_preset(preset);
    if (preset == "gpt2-124m") c.model.seq_length = gpt2_seq;
    c.micro_batch_size = micro;
    c.train_iters = iters;
    c.eval_iters = 0;
    c.lr_warmup_iters = 1;
    c.corpus_bytes = 1 << 22;
    c.ddp.overlap_grad_reduce = c.ddp.overlap_param_gather = overlap;
    c.fsdp.overlap_grad_reduce = c.fsdp.overlap_param_gather = overlap;
    c.fsdp.fsdp_double_buffer = double_buffer;
    for (int dp : dps) {
      c.global_batch_size = micro * dp;
      double ddp_step_ms = 0;
      for (const std::string& mode : modes) {
        c.use_megatron_fsdp = mode != "ddp";
        const bool mxfp8 = mode == "optim_grads_params_mxfp8";
        c.ddp.fp8_param_gather = mxfp8;
        if (c.use_megatron_fsdp)
          c.fsdp.data_parallel_sharding_strategy = parse_sharding_strategy(mxfp8 ? "optim_grads_params" : mode);
        const RunFigures f = run(c, dp);
        if (mode == "ddp") ddp_step_ms = f.step_ms;
        const double table = table_bytes_per_param(mode, dp, mxfp8 ? mxfp8_fraction(c.model) : 0.0);
        char gathered[32] = "-", units[32] = "-", vs_ddp[32] = "-";
        if (f.peak_gathered_bytes > 0 && f.unit_bytes_max > 0) {  // else the params stay resident: nothing gathered
          std::snprintf(gathered, sizeof gathered, "%.2f MiB", f.peak_gathered_bytes / 1048576.0);
          std::snprintf(units, sizeof units, "%.2f",
                        static_cast<double>(f.peak_gathered_bytes - f.non_unit_bytes) / static_cast<double>(f.unit_bytes_max));
        }
        if (ddp_step_ms > 0) std::snprintf(vs_ddp, sizeof vs_ddp, "%.2f", f.step_ms / ddp_step_ms);
        std::printf("%-10s %2d %-24s %9.3f %9.3f %7.3f %12s %7s %9.1f %8.1f %7s %9.1f %10.3f\n", preset.c_str(), dp,
                    mode.c_str(), f.bytes_per_param, table, f.bytes_per_param / table, gathered, units,
                    f.peak_total_bytes / 1048576.0, f.step_ms, vs_ddp, f.comm_ms, f.comm_ms / f.step_ms);
        std::fflush(stdout);
      }
    }
    std::printf("\n");
  }
  return 0;
}
