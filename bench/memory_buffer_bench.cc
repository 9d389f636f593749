// Global memory buffer: the median latency of get_tensor on a warm key, against what it saves: a
// fresh tracked allocation of the same size plus its first touch (one write per 4 KiB page, which
// is where a fresh allocation's cost lies), for 1 KiB .. 64 MiB.
#include <cstdio>

#include <CLI/CLI.hpp>

#include <mxddp/compute.h>

#include "bench_util.h"

int main(int argc, char** argv) {
  using namespace mxddp;
  using namespace mxddp::bench;
  CLI::App app{"Global memory buffer: get_tensor on a warm key against a fresh allocation plus its first touch"};
  CLI11_PARSE(app, argc, argv);
  MemoryTracker tracker;
  GlobalMemoryBuffer pool(tracker);
  std::printf("%10s %16s %20s %10s\n", "size", "get_tensor_ns", "alloc+touch_ns", "speedup");
  for (size_t bytes = 1024; bytes <= (size_t{64} << 20); bytes *= 4) {
    const Shape shape{static_cast<int64_t>(bytes / 4)};
    pool.get_tensor(shape, DType::kF32, "bench");
    std::vector<double> get_ns, fresh_ns;
    constexpr int kBatch = 1000;
    for (int run = 0; run < 15; ++run) {
      const double t0 = now_s();
      void* sink = nullptr;
      for (int i = 0; i < kBatch; ++i) sink = pool.get_tensor(shape, DType::kF32, "bench").data;
      get_ns.push_back((now_s() - t0) / kBatch * 1e9);
      static_cast<char*>(sink)[0] = 1;
      const double t1 = now_s();
      {
        HostBuffer fresh(bytes, MemoryCategory::kScratch, tracker);
        auto* p = static_cast<volatile char*>(fresh.data());
        for (size_t off = 0; off < bytes; off += 4096) p[off] = 1;
      }
      fresh_ns.push_back((now_s() - t1) * 1e9);
    }
    const double g = median(get_ns), f = median(fresh_ns);
    std::printf("%10s %16.1f %20.1f %10.1f\n", bytes < (1 << 20) ? fmt::format("{} KiB", bytes >> 10).c_str() : mib(bytes).c_str(),
                g, f, f / g);
  }
  return 0;
}
