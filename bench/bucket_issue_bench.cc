// The grad buffer's bucket-ready to collective-issued latency (issue 41's figure: < 20 us on the
// device). With overlap_grad_reduce, the grad_ready call that makes a bucket group's last gradient
// final issues that group's reduce-scatter (asynchronously) before it returns, so its duration is
// the latency from "ready" to "issued": DDP's bookkeeping and the communicator's hand-off to its
// backend, never the collective itself. The bench walks a GPT-2-124M param list in backward order
// with no compute between the calls and times every call, on the host's memory (cpu) or with
// every rank's buffers on one GPU, each rank its own stream (cuda, where the build has CUDA).
// Printed, over every rank's calls of --runs steps:
//   issue_us p50 / p90 / max: the calls that issued a group
//   other_us p50: the calls that issued nothing (the hook's bookkeeping alone)
//   vs_target: issue_us p50 / 20 us
//   raw_rs_ms: one reduce_scatter of the whole grad buffer (what the issue hands off, not waits for)
#include <algorithm>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include <mxddp/ddp.h>
#if MXDDP_BENCH_CUDA
#include <mxddp/cuda.h>
#endif

#include "bench_util.h"
#include "gpt2_params.h"

namespace mxddp::bench {
namespace {

constexpr double kTargetUs = 20.0;

struct Args {
  std::string device = "cpu";
  std::string dps = "2,4";
  std::string bucket_sizes = "1000000,4000000,40000000";
  int runs = 5;
};

struct Result {
  std::vector<double> issue_us, other_us, raw_ms;
  int groups = 0;
};

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * static_cast<double>(v.size() - 1) + 0.5)];
}

// Which calls of the backward walk issue a group: the one that makes a group's last param ready,
// since the buffer's reverse-order layout makes the groups complete in issue order.
std::vector<bool> issuing_calls(const DistributedDataParallel& ddp, const std::vector<int>& walk) {
  const auto& groups = ddp.buffer().bucket_groups();
  std::vector<int> group_of(static_cast<size_t>(ddp.num_params()), -1);
  std::vector<int> remaining(groups.size(), 0);
  for (size_t g = 0; g < groups.size(); ++g)
    for (int b : groups[g])
      for (int p : ddp.buffer().layout().buckets[static_cast<size_t>(b)].params) {
        group_of[static_cast<size_t>(p)] = static_cast<int>(g);
        ++remaining[g];
      }
  std::vector<bool> issues;
  size_t next = 0;
  for (int p : walk) {
    --remaining[static_cast<size_t>(group_of[static_cast<size_t>(p)])];
    bool issued = false;
    while (next < groups.size() && remaining[next] == 0) issued = true, ++next;
    issues.push_back(issued);
  }
  return issues;
}

Result measure(int dp, int64_t bucket_size, const Args& args) {
  std::vector<std::vector<int>> layers;
  const std::vector<ParamSpec> params = gpt2_124m_params(&layers);
  std::vector<int> walk;
  for (const auto& layer : layers) walk.insert(walk.end(), layer.rbegin(), layer.rend());
  Result result;
  std::mutex mutex;
  LocalOptions options;
#if MXDDP_BENCH_CUDA
  // Each rank's work and its collectives on streams of their own (LocalOptions::comm_computes): the
  // issuing call records the event its collective waits for.
  std::vector<OwnedCudaStream> streams, comm_streams;
  std::vector<std::unique_ptr<Compute>> computes, comm_computes;
  if (args.device == "cuda") {
    streams.resize(static_cast<size_t>(dp));
    comm_streams.resize(static_cast<size_t>(dp));
    for (size_t r = 0; r < streams.size(); ++r) {
      computes.push_back(make_cuda_compute(streams[r].get()));
      options.computes.push_back(computes.back().get());
      comm_computes.push_back(make_cuda_compute(comm_streams[r].get()));
      options.comm_computes.push_back(comm_computes.back().get());
    }
  }
#endif
  run_local(
      dp,
      [&](Communicator& comm) {
        MemoryTracker tracker;
        DdpConfig cfg{.overlap_grad_reduce = true, .use_distributed_optimizer = true, .bucket_size = bucket_size};
        DistributedDataParallel ddp(comm, params, cfg, tracker);
        const std::vector<bool> issues = issuing_calls(ddp, walk);
        std::vector<double> issue_us, other_us, raw_ms;
        for (int run = 0; run < args.runs + 1; ++run) {  // run 0 warms up
          ddp.zero_grad_buffer();
          comm.compute().synchronize();
          comm.barrier();
          for (size_t k = 0; k < walk.size(); ++k) {
            const double t0 = now_s();
            ddp.grad_ready(walk[k]);
            const double us = (now_s() - t0) * 1e6;
            if (run > 0) (issues[k] ? issue_us : other_us).push_back(us);
          }
          ddp.finish_grad_sync();
          const TensorView all = ddp.buffer().grad_buffer();
          const int64_t shard = all.numel() / dp;
          comm.barrier();
          const double t_raw = now_s();
          comm.reduce_scatter(all, all.slice(comm.rank() * shard, shard));
          comm.compute().synchronize();
          if (run > 0) raw_ms.push_back((now_s() - t_raw) * 1e3);
        }
        std::lock_guard lock(mutex);
        result.issue_us.insert(result.issue_us.end(), issue_us.begin(), issue_us.end());
        result.other_us.insert(result.other_us.end(), other_us.begin(), other_us.end());
        result.raw_ms.insert(result.raw_ms.end(), raw_ms.begin(), raw_ms.end());
        result.groups = static_cast<int>(ddp.buffer().bucket_groups().size());
      },
      options);
  return result;
}

}  // namespace
}  // namespace mxddp::bench

int main(int argc, char** argv) {
  using namespace mxddp::bench;
  Args args;
  CLI::App app{"The grad buffer's bucket-ready to collective-issued latency (GPT-2-124M params, local backend)"};
  app.add_option("--device", args.device, "where the ranks' buffers live: cpu, or cuda (one GPU, a stream per rank)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  app.add_option("--dp", args.dps, "comma-separated data-parallel sizes")->capture_default_str();
  app.add_option("--bucket-sizes", args.bucket_sizes, "comma-separated bucket sizes (elements)")->capture_default_str();
  app.add_option("--runs", args.runs, "measured steps (after one warm-up)")->check(CLI::Range(1, 100))->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (args.device == "cuda") {
#if MXDDP_BENCH_CUDA
    std::string why;
    if (mxddp::cuda_device_count(&why) == 0) {
      std::printf("SKIP: %s\n", why.c_str());
      return 77;
    }
#else
    std::fprintf(stderr, "--device cuda: this build has no CUDA (configure with MXDDP_CUDA on)\n");
    return 2;
#endif
  }
  std::printf("bucket-ready -> collective-issued on %s, GPT-2 124M params, f32 grads, local backend, %d steps\n",
              args.device.c_str(), args.runs);
  std::printf("%-4s %12s %7s %13s %13s %13s %13s %10s %10s\n", "dp", "bucket_size", "groups", "issue_us_p50",
              "issue_us_p90", "issue_us_max", "other_us_p50", "vs_target", "raw_rs_ms");
  for (int64_t dp : parse_int_list(args.dps))
    for (int64_t bucket : parse_int_list(args.bucket_sizes)) {
      const Result r = measure(static_cast<int>(dp), bucket, args);
      const double p50 = percentile(r.issue_us, 0.5);
      std::printf("%-4lld %12lld %7d %13.1f %13.1f %13.1f %13.2f %10.2f %10.2f\n", static_cast<long long>(dp),
                  static_cast<long long>(bucket), r.groups, p50, percentile(r.issue_us, 0.9),
                  percentile(r.issue_us, 1.0), percentile(r.other_us, 0.5), p50 / kTargetUs, median(r.raw_ms));
      std::fflush(stdout);
    }
  return 0;
}
