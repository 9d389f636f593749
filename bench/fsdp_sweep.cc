// `fsdp_bench sweep`: where FSDP's param gather sits between memory and time (issue 12). Sweeps
// the gather granularity {unit (a decoder layer), fine-grained (a submodule)} x the prefetch
// {0, 1, 2 units, unbounded} x the recompute {none, full, selective mlp} x the params {bf16, mxfp8}
// x an injected per-collective latency {0, 50, 500 us} (the local backend's delay decorator, on
// every all-gather, reduce-scatter and all-reduce), on the local backend, and measures per run
// (rank 0): the peak gathered bytes (all slots, and row-/column-wise for MXFP8), the peak of every
// byte the rank holds, the gathers per iteration, the exposed communication (waits for param
// gathers in the pre-hooks plus finish_grad_sync) and the step time, medians over the iterations
// after the first. Writes one JSON record per run; bench/fsdp_front.py draws the front.
//
// Prefetch k units: suggested_communication_unit_size = 2 k x the largest unit's elements (the
// budget is half of it, so k of the largest units fit); 0 turns overlap_param_gather off (every
// gather is synchronous in its hook); unbounded lifts the budget. A run that the recompute-aware
// policy refuses (MXFP8 with a selective mlp recompute and the unit gather) is recorded as refused.
#include "fsdp_sweep.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <mutex>
#include <thread>

#include <nlohmann/json.hpp>

#include <mxddp/output_file.h>
#include <mxddp/train.h>

#include "bench_util.h"
#include "fsdp/fsdp_engine.h"

namespace mxddp::bench {

namespace {

struct SweepArgs {
  std::string preset = "tiny";
  int dp = 2, iters = 4, micro = 2;
  std::vector<std::string> gathers = {"unit", "fine"};
  std::vector<std::string> prefetches = {"0", "1", "2", "unbounded"};
  std::vector<std::string> recomputes = {"none", "full", "selective"};
  std::vector<std::string> params = {"bf16", "mxfp8"};
  std::vector<int64_t> latencies_us = {0, 50, 500};
  std::string json = "fsdp_sweep.json";
};

SweepArgs g_args;
CLI::App* g_sweep = nullptr;

// The largest gather unit's elements, padded as the layout pads a bucket (every param start to 64
// elements, each of a unit's one or two buckets to lcm(dp, 128)).
int64_t largest_unit_numel(const GptConfig& model, bool fine_grained, bool mxfp8, int dp) {
  const std::vector<ParamSpec> specs = gpt_param_specs(model, mxfp8);
  const int64_t bucket_align = std::lcm(int64_t{dp}, int64_t{128});
  int64_t largest = 0;
  for (const std::vector<int>& unit : gpt_fsdp_units(model, fine_grained)) {
    int64_t n = 2 * bucket_align;
    for (int p : unit) n += (specs[static_cast<size_t>(p)].shape.numel() + 63) / 64 * 64;
    largest = std::max(largest, n);
  }
  return largest;
}

nlohmann::json run_one(const TrainConfig& base, const std::string& gather, const std::string& prefetch,
                       const std::string& recompute, const std::string& params, int64_t latency_us) {
  TrainConfig c = base;
  const bool fine = gather == "fine", mxfp8 = params == "mxfp8";
  c.fsdp.megatron_fsdp_enable_fine_grained_param_gather = fine;
  c.ddp.fp8_param_gather = mxfp8;
  if (recompute == "full") c.recompute_granularity = RecomputeGranularity::kFull;
  if (recompute == "selective") {
    c.recompute_granularity = RecomputeGranularity::kSelective;
    c.recompute_modules = {RecomputeModule::kMlp};
  }
  c.fsdp.overlap_param_gather = prefetch != "0";
  if (prefetch == "unbounded") c.fsdp.suggested_communication_unit_size = std::numeric_limits<int64_t>::max() / 4;
  else if (prefetch != "0")
    c.fsdp.suggested_communication_unit_size = 2 * std::stoll(prefetch) * largest_unit_numel(c.model, fine, mxfp8, g_args.dp);
  nlohmann::json rec = {{"gather", gather}, {"prefetch", prefetch}, {"recompute", recompute},
                        {"params", params}, {"latency_us", latency_us}};
  try {
    c.validate(g_args.dp);
  } catch (const Error& e) {
    rec["refused"] = e.message();
    return rec;
  }
  std::vector<double> step_ms, comm_ms;
  int64_t gathers_first = 0, gathers_last = 0;
  std::array<int64_t, kGatherSlots> slot_peaks{};
  int64_t gathered_peak = 0, total_peak = 0;
  LocalOptions options;
  options.injected_delay = {.min_us = latency_us, .max_us = latency_us, .all_reduce = true, .reduce_scatter = true,
                            .all_gather = true};
  run_local(
      g_args.dp,
      [&](Communicator& comm) {
        const FullyShardedDataParallel* fsdp = nullptr;
        TrainCallbacks callbacks;
        callbacks.wrap_data_parallel = [&](std::unique_ptr<DataParallel> d) {
          fsdp = dynamic_cast<const FullyShardedDataParallel*>(d.get());
          return d;
        };
        callbacks.on_step = [&](const StepRecord& s) {
          if (comm.rank() != 0) return;
          if (s.iteration == 1) gathers_first = fsdp_engine(*fsdp).gathers_started();
          gathers_last = fsdp_engine(*fsdp).gathers_started();
        };
        const TrainResult r = train(comm, c, callbacks);
        if (comm.rank() != 0) return;
        const RankMemory& m = r.memory_by_rank[0];
        slot_peaks = m.peak_gathered_bytes_by_slot;
        gathered_peak = m.overall.peak(MemoryCategory::kGathered);
        total_peak = m.overall.total_peak_bytes;
        for (size_t i = 1; i < r.steps.size(); ++i) {
          step_ms.push_back(r.steps[i].step_ms);
          comm_ms.push_back(r.steps[i].comm_ms);
        }
      },
      options);
  rec["peak_gathered_bytes"] = gathered_peak;
  rec["peak_gathered_bytes_by_orientation"] = {
      {"values", slot_peaks[0]}, {"rowwise", slot_peaks[1]}, {"colwise", slot_peaks[2]}};
  rec["peak_total_bytes"] = total_peak;
  rec["gathers_per_iteration"] = static_cast<double>(gathers_last - gathers_first) / std::max(1, g_args.iters - 1);
  rec["param_wait_ms"] = median(comm_ms);
  rec["step_ms"] = median(step_ms);
  return rec;
}

void run_sweep() {
  const SweepArgs& a = g_args;
  check_output_file_path(a.json, "--json");  // a bad path fails now, not after every run
  TrainConfig base;
  base.model = gpt_preset(a.preset);
  if (a.preset == "gpt2-124m") base.model.seq_length = 128;
  base.micro_batch_size = a.micro;
  base.global_batch_size = a.micro * a.dp;
  base.train_iters = a.iters;
  base.eval_iters = 0;
  base.lr_warmup_iters = 1;
  base.corpus_bytes = 1 << 22;
  base.use_megatron_fsdp = true;
  base.fsdp.data_parallel_sharding_strategy = ShardingStrategy::kOptimGradsParams;
  base.fsdp.overlap_grad_reduce = true;
  const ComputeInfo info = compute_info();
  std::printf("CPU: %s, %u cores; compute: %s; preset %s, dp %d (local backend), %d iterations, micro-batch %d\n",
              info.cpu.c_str(), std::thread::hardware_concurrency(), info.describe(false).c_str(), a.preset.c_str(), a.dp,
              a.iters, a.micro);
  std::printf("%-5s %-9s %-9s %-5s %6s %12s %10s %10s %12s %8s %8s %8s\n", "gath", "prefetch", "recompute", "param",
              "lat_us", "gathered_B", "row_B", "col_B", "peak_total_B", "gathers", "wait_ms", "step_ms");
  nlohmann::json runs = nlohmann::json::array();
  for (int64_t latency : a.latencies_us)
    for (const std::string& params : a.params)
      for (const std::string& recompute : a.recomputes)
        for (const std::string& gather : a.gathers)
          for (const std::string& prefetch : a.prefetches) {
            nlohmann::json r = run_one(base, gather, prefetch, recompute, params, latency);
            if (r.contains("refused")) {
              std::printf("%-5s %-9s %-9s %-5s %6lld refused (the recompute-aware policy requires fine-grained)\n",
                          gather.c_str(), prefetch.c_str(), recompute.c_str(), params.c_str(), static_cast<long long>(latency));
            } else {
              std::printf("%-5s %-9s %-9s %-5s %6lld %12lld %10lld %10lld %12lld %8.1f %8.2f %8.2f\n", gather.c_str(),
                          prefetch.c_str(), recompute.c_str(), params.c_str(), static_cast<long long>(latency),
                          r["peak_gathered_bytes"].get<long long>(),
                          r["peak_gathered_bytes_by_orientation"]["rowwise"].get<long long>(),
                          r["peak_gathered_bytes_by_orientation"]["colwise"].get<long long>(),
                          r["peak_total_bytes"].get<long long>(), r["gathers_per_iteration"].get<double>(),
                          r["param_wait_ms"].get<double>(), r["step_ms"].get<double>());
            }
            std::fflush(stdout);
            runs.push_back(std::move(r));
          }
  const nlohmann::json doc = {{"cpu", info.cpu}, {"compute", info.describe(false)}, {"preset", a.preset},
                              {"dp", a.dp}, {"iters", a.iters}, {"micro_batch", a.micro}, {"runs", runs}};
  write_output_file(a.json, doc.dump(1) + "\n", "--json");
  std::printf("\nwrote %zu runs to %s (bench/fsdp_front.py draws the front)\n", runs.size(), a.json.c_str());
}

}  // namespace

void add_sweep_command(CLI::App& app) {
  SweepArgs& a = g_args;
  g_sweep = app.add_subcommand("sweep", "Issue 12's sweep: unit/fine-grained x prefetch x recompute x bf16/mxfp8 x latency");
  g_sweep->add_option("--preset", a.preset, "Model preset")->check(CLI::IsMember({"tiny", "small", "gpt2-124m"}));
  g_sweep->add_option("--dp", a.dp, "Data-parallel size (local backend)")->check(CLI::Range(1, 64));
  g_sweep->add_option("--iters", a.iters, "Iterations per run; the first is not timed")->check(CLI::Range(2, 1000));
  g_sweep->add_option("--micro-batch", a.micro, "Micro-batch size")->check(CLI::Range(1, 4096));
  g_sweep->add_option("--gathers", a.gathers, "unit, fine")->delimiter(',')->check(CLI::IsMember({"unit", "fine"}));
  g_sweep->add_option("--prefetches", a.prefetches, "Units of prefetch: 0, 1, 2, unbounded")
      ->delimiter(',')
      ->check(CLI::IsMember({"0", "1", "2", "3", "4", "unbounded"}));
  g_sweep->add_option("--recomputes", a.recomputes, "none, full, selective (mlp)")
      ->delimiter(',')
      ->check(CLI::IsMember({"none", "full", "selective"}));
  g_sweep->add_option("--params", a.params, "bf16, mxfp8")->delimiter(',')->check(CLI::IsMember({"bf16", "mxfp8"}));
  g_sweep->add_option("--latencies-us", a.latencies_us, "Injected latency per collective, us")
      ->delimiter(',')
      ->check(CLI::Range(int64_t{0}, int64_t{1'000'000}));
  g_sweep->add_option("--json", a.json, "Where the runs are written");
}

std::optional<int> run_sweep_if_chosen() {
  if (g_sweep == nullptr || !g_sweep->parsed()) return std::nullopt;
  try {
    run_sweep();
  } catch (const Error& e) {
    std::fprintf(stderr, "fsdp_bench sweep: error: %s\n", e.message().c_str());
    return 1;
  }
  return 0;
}

}  // namespace mxddp::bench
