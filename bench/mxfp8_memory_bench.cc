// Memory with MXFP8 params: per-rank bytes by category, as the memory tracker counts them, for
// the reference GPT's param list (`mxddp train --fp8-param-gather`: the linear weights marked
// MXFP8) of a preset (argument 1, default gpt2-124m), distributed optimizer with
// fp8_param_gather, reuse_grad_buf_for_mxfp8_param_ag off and on, at dp 1, 2, 4. The saving
// should be the BF16 param buffer: 2 bytes per buffer element.
#include <cstdio>
#include <mutex>

#include <CLI/CLI.hpp>

#include <mxddp/model.h>
#include <mxddp/optim.h>

int main(int argc, char** argv) {
  using namespace mxddp;
  CLI::App app{"Per-rank bytes with MXFP8 params (fp8_param_gather), reuse_grad_buf_for_mxfp8_param_ag off and on, "
               "dp 1, 2, 4"};
  std::string preset = "gpt2-124m";
  app.add_option("preset", preset, "Reference GPT preset whose param list is measured")
      ->check(CLI::IsMember(gpt_preset_names()))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  const GptConfig model = gpt_preset(preset);
  const std::vector<ParamSpec> params = gpt_param_specs(model, /*mxfp8_linear_weights=*/true);
  std::printf("reference GPT '%s' (%s), linear weights MXFP8 (E4M3, both orientations), AdamW; MiB per rank\n",
              preset.c_str(), model.describe().c_str());
  std::printf("%3s %6s %9s %9s %9s %12s %9s %10s %12s %18s\n", "dp", "reuse", "params", "grads", "mxfp8", "main_params",
              "opt_state", "total", "saving", "2 x buffer numel");
  for (int dp : {1, 2, 4}) {
    MemoryUsage usage[2];
    int64_t numel = 0;
    for (int reuse = 0; reuse < 2; ++reuse) {
      std::mutex mutex;
      run_local(dp, [&](Communicator& comm) {
        MemoryTracker tracker;
        DdpConfig cfg{.overlap_grad_reduce = true, .use_distributed_optimizer = true, .fp8_param_gather = true,
                      .reuse_grad_buf_for_mxfp8_param_ag = reuse == 1};
        DistributedDataParallel ddp(comm, params, cfg, tracker);
        DistributedOptimizer opt(ddp, {}, tracker);
        if (comm.rank() == 0) {
          std::lock_guard lock(mutex);
          usage[reuse] = tracker.usage();
          numel = ddp.buffer().layout().numel;
        }
      });
    }
    for (int reuse = 0; reuse < 2; ++reuse) {
      const MemoryUsage& u = usage[reuse];
      auto mib = [](int64_t b) { return static_cast<double>(b) / (1 << 20); };
      std::printf("%3d %6s %9.2f %9.2f %9.2f %12.2f %9.2f %10.2f %12s %18s\n", dp, reuse ? "on" : "off",
                  mib(u.live(MemoryCategory::kParams)), mib(u.live(MemoryCategory::kGrads)), mib(u.live(MemoryCategory::kMxfp8)),
                  mib(u.live(MemoryCategory::kMainParams)), mib(u.live(MemoryCategory::kOptimizerState)), mib(u.total_live_bytes),
                  reuse ? fmt::format("{} B", usage[0].total_live_bytes - usage[1].total_live_bytes).c_str() : "",
                  reuse ? fmt::format("{} B", 2 * numel).c_str() : "");
    }
  }
  return 0;
}
