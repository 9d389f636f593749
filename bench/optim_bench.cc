// Distributed-optimizer costs.
//  1. Step time per param against memory bandwidth: an AdamW step on N params at dp 1 moves
//     4 (grad-norm pass: grad) + 16 (grad, main, exp_avg, exp_avg_sq read) + 12 (main and the two
//     moments written) + 2 (BF16 param staged) = 34 bytes per element; achieved bytes/s over
//     memcpy's bytes/s (read + written) measured in the same run, at each --threads count (the
//     update and the grad-norm pass run on the rank's compute threads).
//  2. Bytes per param per rank, as the memory tracker counts them, for the GPT-2-124M param list at
//     dp 1, 2, 4, 8, next to the formula 2 + 4 + 12/dp (BF16 params, FP32 grads, FP32 main params
//     and two Adam moments); the difference is padding.
#include <cstdio>
#include <mutex>

#include <CLI/CLI.hpp>

#include <mxddp/model.h>
#include <mxddp/optim.h>

#include "bench_util.h"
#include "gpt2_params.h"

int main(int argc, char** argv) {
  using namespace mxddp;
  using namespace mxddp::bench;
  CLI::App app{"AdamW step time against memcpy bandwidth, and bytes per param per rank (GPT-2-124M params, dp 1-8)"};
  std::vector<int> thread_counts{1, 2};
  app.add_option("--threads", thread_counts, "The rank's compute threads for the AdamW step")
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  constexpr double kBytesPerElement = 34;
  const double memcpy_bw = memcpy_bandwidth_bytes_per_s(size_t{256} << 20);
  std::printf("memcpy (1 thread, 256 MiB): %.2f GB/s copied = %.2f GB/s read + written\n\n", memcpy_bw / 1e9,
              2 * memcpy_bw / 1e9);
  std::printf("AdamW step, dp 1, %g bytes moved per element\n%8s %12s %12s %14s %16s %12s\n", kBytesPerElement,
              "threads", "params", "step_ms", "ns_per_param", "traffic_GBps", "vs_memcpy");
  for (int threads : thread_counts) {
    for (int64_t n : {int64_t{1} << 22, int64_t{1} << 24, int64_t{1} << 26}) {
      run_local(1, [&](Communicator& comm) {
        set_compute_threads(threads);
        MemoryTracker tracker;
        DistributedDataParallel ddp(comm, {{"w", Shape{n}}}, {.use_distributed_optimizer = true}, tracker);
        DistributedOptimizer opt(ddp, {.clip_grad = 1.0f}, tracker);
        std::fill_n(ddp.main_grad(0).data_as<float>(), n, 1e-3f);
        std::vector<double> ms;
        for (int run = 0; run < 8; ++run) {
          const double t0 = now_s();
          opt.step();
          if (run > 0) ms.push_back((now_s() - t0) * 1e3);  // run 0 warms up
        }
        const double step_ms = median(ms);
        const double traffic = static_cast<double>(n) * kBytesPerElement / (step_ms / 1e3);
        std::printf("%8d %12lld %12.2f %14.3f %16.2f %12.2f\n", threads, static_cast<long long>(n), step_ms,
                    step_ms * 1e6 / static_cast<double>(n), traffic / 1e9, traffic / (2 * memcpy_bw));
      });
    }
  }
  const std::vector<ParamSpec> gpt2 = gpt2_124m_params();
  std::printf("\nbytes per param per rank, GPT-2 124M (%s), AdamW, BF16 params, FP32 grads\n", "tied wte");
  std::printf("%4s %14s %14s %12s %12s %16s %16s\n", "dp", "params+grads", "main+state", "total", "formula",
              "total/formula", "padding_elems");
  for (int dp : {1, 2, 4, 8}) {
    std::vector<MemoryUsage> usage(static_cast<size_t>(dp));
    int64_t numel_unpadded = 0, numel = 0;
    std::mutex mutex;
    run_local(dp, [&](Communicator& comm) {
      MemoryTracker tracker;
      DistributedDataParallel ddp(comm, gpt2, {.overlap_grad_reduce = true, .use_distributed_optimizer = true}, tracker);
      DistributedOptimizer opt(ddp, {}, tracker);
      std::lock_guard lock(mutex);
      usage[static_cast<size_t>(comm.rank())] = tracker.usage();
      numel_unpadded = ddp.buffer().layout().numel_unpadded();
      numel = ddp.buffer().layout().numel;
    });
    // Shards are equal in size, so every rank holds the same bytes; rank 0's are shown.
    const MemoryUsage& u = usage[0];
    const auto n = static_cast<double>(numel_unpadded);
    const double pg = static_cast<double>(u.live(MemoryCategory::kParams) + u.live(MemoryCategory::kGrads)) / n;
    const double opt_bytes = static_cast<double>(u.live(MemoryCategory::kMainParams) + u.live(MemoryCategory::kOptimizerState)) / n;
    const double formula = 2 + 4 + 12.0 / dp;
    std::printf("%4d %14.6f %14.6f %12.6f %12.6f %16.8f %16lld\n", dp, pg, opt_bytes, pg + opt_bytes, formula,
                (pg + opt_bytes) / formula, static_cast<long long>(numel - numel_unpadded));
  }
  return 0;
}
