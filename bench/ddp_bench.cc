// Gradient-sync overlap on a GPT-2-124M-shaped parameter list (a real model's registration order,
// tied embedding marked shared). A backward-like schedule walks the layers in reverse: each layer
// "computes" for --layer-compute-ms (a sleep, standing in for accelerator work that leaves the CPU
// to communication), then reports its params with grad_ready. Printed, medians of --runs:
//   exposed_ms: from the last grad_ready to finish_grad_sync returning (communication not hidden)
//   exposed_fraction: exposed with overlap / exposed without overlap (the whole sync)
//   sync_vs_raw: the whole sync without overlap / one raw reduce_scatter of the same bytes
// Distributed optimizer on (reduce-scatter), f32 grads, local backend.
#include <cstdio>
#include <mutex>
#include <thread>

#include <CLI/CLI.hpp>

#include <mxddp/ddp.h>

#include "bench_util.h"
#include "gpt2_params.h"

namespace mxddp::bench {
namespace {

struct Args {
  std::string dps = "2,4";
  std::string bucket_sizes = "1000000,4000000,40000000";
  double layer_compute_ms = 20;
  int runs = 3;
};

struct Result {
  double exposed_ms = 0;  // median
  double raw_ms = 0;      // median of one raw reduce_scatter of the whole buffer
  int buckets = 0;
};

Result measure(int dp, int64_t bucket_size, bool overlap, const Args& args) {
  std::vector<std::vector<int>> layers;
  const std::vector<ParamSpec> params = gpt2_124m_params(&layers);
  std::vector<double> exposed, raw;
  Result result;
  std::mutex mutex;
  run_local(dp, [&](Communicator& comm) {
    MemoryTracker tracker;
    DdpConfig cfg{.overlap_grad_reduce = overlap, .use_distributed_optimizer = true, .bucket_size = bucket_size, .average_in_collective = true};
    DistributedDataParallel ddp(comm, params, cfg, tracker);
    const auto compute = std::chrono::duration<double, std::milli>(args.layer_compute_ms);
    for (int run = 0; run < args.runs + 1; ++run) {  // run 0 warms up
      ddp.zero_grad_buffer();
      comm.barrier();
      for (const auto& layer : layers) {
        std::this_thread::sleep_for(compute);
        for (int p : layer) ddp.grad_ready(p);
      }
      const double t_last = now_s();
      ddp.finish_grad_sync();
      const double t_done = now_s();
      // The raw collective: the whole grad buffer in one in-place reduce_scatter.
      const TensorView all = ddp.buffer().grad_buffer();
      const int64_t shard = all.numel() / dp;
      comm.barrier();
      const double t_raw = now_s();
      comm.reduce_scatter(all, all.slice(comm.rank() * shard, shard));
      const double t_raw_done = now_s();
      if (comm.rank() == 0 && run > 0) {
        std::lock_guard lock(mutex);
        exposed.push_back((t_done - t_last) * 1e3);
        raw.push_back((t_raw_done - t_raw) * 1e3);
        result.buckets = static_cast<int>(ddp.buffer().layout().buckets.size());
      }
    }
  });
  result.exposed_ms = median(exposed);
  result.raw_ms = median(raw);
  return result;
}

}  // namespace
}  // namespace mxddp::bench

int main(int argc, char** argv) {
  using namespace mxddp::bench;
  Args args;
  CLI::App app{"DDP gradient-sync overlap on a GPT-2-124M parameter list"};
  app.add_option("--dp", args.dps, "comma-separated data-parallel sizes")->capture_default_str();
  app.add_option("--bucket-sizes", args.bucket_sizes, "comma-separated bucket sizes (elements)")->capture_default_str();
  app.add_option("--layer-compute-ms", args.layer_compute_ms, "simulated backward compute per layer")->capture_default_str();
  app.add_option("--runs", args.runs)->check(CLI::Range(1, 50))->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  std::printf("GPT-2 124M params, 14 backward layers x %.0f ms compute, local backend, medians of %d runs\n",
              args.layer_compute_ms, args.runs);
  std::printf("%-4s %12s %8s %17s %16s %17s %10s %12s\n", "dp", "bucket_size", "buckets", "exposed_ms_overlap",
              "exposed_ms_none", "exposed_fraction", "raw_rs_ms", "sync_vs_raw");
  for (int64_t dp : parse_int_list(args.dps))
    for (int64_t bucket : parse_int_list(args.bucket_sizes)) {
      const Result on = measure(static_cast<int>(dp), bucket, true, args);
      const Result off = measure(static_cast<int>(dp), bucket, false, args);
      std::printf("%-4lld %12lld %8d %17.1f %16.1f %17.3f %10.1f %12.2f\n", static_cast<long long>(dp),
                  static_cast<long long>(bucket), on.buckets, on.exposed_ms, off.exposed_ms,
                  on.exposed_ms / off.exposed_ms, off.raw_ms, off.exposed_ms / off.raw_ms);
      std::fflush(stdout);
    }
  return 0;
}
