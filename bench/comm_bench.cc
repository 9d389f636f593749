// Collective bandwidth sweep, nccl-tests style: for reduce_scatter, all_gather and all_reduce at
// 1 MiB .. 256 MiB (the size of the full buffer: all_reduce's buffer, reduce_scatter's input,
// all_gather's output), f32, it prints the bus bandwidth and its ratio to this machine's
// single-thread memcpy bandwidth, and on the MPI backend the ratio to a raw MPI loop. Both use the
// in-place forms training uses (reduce-scatter into this rank's shard of the grad buffer,
// all-gather from this rank's shard of the param buffer).
//
//   busbw = size / time x (all_reduce: 2(n-1)/n, reduce_scatter and all_gather: (n-1)/n)
//
// Local:  comm_bench --backend local --ranks 2,4
// MPI:    mpirun -np 2 comm_bench --backend mpi
#include <cstdio>
#include <mutex>

#include <CLI/CLI.hpp>
#include <mpi.h>

#include <mxddp/comm.h>

#include "bench_util.h"

namespace mxddp::bench {
namespace {

enum class Op { kReduceScatter, kAllGather, kAllReduce };
constexpr Op kOps[] = {Op::kReduceScatter, Op::kAllGather, Op::kAllReduce};
const char* op_name(Op op) {
  return op == Op::kReduceScatter ? "reduce_scatter" : op == Op::kAllGather ? "all_gather" : "all_reduce";
}
double bus_factor(Op op, int n) {
  return (op == Op::kAllReduce ? 2.0 : 1.0) * (n - 1) / n;
}

struct Args {
  std::string backend = "local";
  std::string ranks = "2,4";
  int64_t min_bytes = int64_t{1} << 20;
  int64_t max_bytes = int64_t{256} << 20;
  int runs = 5;
};

// A rank's full buffer of `bytes`, f32; reduce_scatter and all_gather use its block `rank` in place.
struct Buffers {
  std::vector<float> big;
  int64_t block_numel;
  Buffers(size_t bytes, int n) : big(bytes / 4, 1.0f), block_numel(static_cast<int64_t>(bytes / 4) / n) {}
};

// Seconds per collective on this rank: `iters` back-to-back blocking calls between barriers.
double time_op(Communicator& comm, Op op, Buffers& b, int iters) {
  TensorView big{b.big.data(), DType::kF32, Shape{b.block_numel * comm.size()}, Device::cpu()};
  TensorView small = big.slice(comm.rank() * b.block_numel, b.block_numel);
  auto once = [&] {
    if (op == Op::kAllReduce) comm.all_reduce(big);
    else if (op == Op::kReduceScatter) comm.reduce_scatter(big, small);
    else comm.all_gather(small, big);
  };
  once();  // warm-up: first touch of the pages
  comm.barrier();
  const double t0 = now_s();
  for (int i = 0; i < iters; ++i) once();
  comm.barrier();
  return (now_s() - t0) / iters;
}

int iters_for(size_t bytes) { return static_cast<int>(std::clamp<size_t>((size_t{512} << 20) / bytes, 2, 50)); }

std::vector<size_t> sizes(const Args& a) {
  std::vector<size_t> s;
  for (int64_t b = a.min_bytes; b <= a.max_bytes; b *= 4) s.push_back(static_cast<size_t>(b));
  return s;
}

void run_local_sweep(const Args& args, double memcpy_bw) {
  std::printf("%-6s %-15s %10s %12s %12s\n", "ranks", "op", "size", "busbw_GBps", "vs_memcpy");
  for (const int64_t ranks : parse_int_list(args.ranks)) {
    const auto n = static_cast<int>(ranks);
    for (Op op : kOps)
      for (size_t bytes : sizes(args)) {
        std::vector<double> times;
        std::mutex mutex;
        std::vector<Buffers> bufs;
        for (int r = 0; r < n; ++r) bufs.emplace_back(bytes, n);
        for (int run = 0; run < args.runs; ++run)
          run_local(n, [&](Communicator& comm) {
            const double t = time_op(comm, op, bufs[static_cast<size_t>(comm.rank())], iters_for(bytes));
            if (comm.rank() == 0) { std::lock_guard lock(mutex); times.push_back(t); }
          });
        const double busbw = static_cast<double>(bytes) / median(times) * bus_factor(op, n);
        std::printf("%-6d %-15s %10s %12.2f %12.2f\n", n, op_name(op), mib(bytes).c_str(), busbw / 1e9, busbw / memcpy_bw);
        std::fflush(stdout);
      }
  }
}

// The raw MPI loop the MPI backend is compared with: the same call with nothing around it.
// (MPI's in-place reduce-scatter leaves the result in block 0, a copy cheaper than ours, which
// puts it in this rank's block and leaves the rest of the input untouched.)
double time_raw_mpi(Op op, Buffers& b, int iters, int size) {
  const int block = static_cast<int>(b.block_numel);
  auto once = [&] {
    if (op == Op::kAllReduce) MPI_Allreduce(MPI_IN_PLACE, b.big.data(), block * size, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    else if (op == Op::kReduceScatter)
      MPI_Reduce_scatter_block(MPI_IN_PLACE, b.big.data(), block, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    else MPI_Allgather(MPI_IN_PLACE, block, MPI_FLOAT, b.big.data(), block, MPI_FLOAT, MPI_COMM_WORLD);
  };
  once();
  MPI_Barrier(MPI_COMM_WORLD);
  const double t0 = now_s();
  for (int i = 0; i < iters; ++i) once();
  MPI_Barrier(MPI_COMM_WORLD);
  return (now_s() - t0) / iters;
}

void run_mpi_sweep(const Args& args, double memcpy_bw) {
  auto checked = make_mpi_communicator({.check_consistency = true});
  auto unchecked = make_mpi_communicator({.check_consistency = false});
  const int n = checked->size();
  const bool root = checked->rank() == 0;
  if (root)
    std::printf("%-6s %-15s %10s %12s %10s %10s %14s\n", "ranks", "op", "size", "busbw_GBps", "vs_memcpy", "vs_raw_mpi",
                "vs_raw_nocheck");
  for (Op op : kOps)
    for (size_t bytes : sizes(args)) {
      Buffers b(bytes, n);
      std::vector<double> ours, ours_nocheck, raw;
      for (int run = 0; run < args.runs; ++run) {
        raw.push_back(time_raw_mpi(op, b, iters_for(bytes), n));
        ours.push_back(time_op(*checked, op, b, iters_for(bytes)));
        ours_nocheck.push_back(time_op(*unchecked, op, b, iters_for(bytes)));
      }
      const double busbw = static_cast<double>(bytes) / median(ours) * bus_factor(op, n);
      if (root)
        std::printf("%-6d %-15s %10s %12.2f %10.2f %10.3f %14.3f\n", n, op_name(op), mib(bytes).c_str(), busbw / 1e9,
                    busbw / memcpy_bw, median(raw) / median(ours), median(raw) / median(ours_nocheck));
      std::fflush(stdout);
    }
}

}  // namespace
}  // namespace mxddp::bench

int main(int argc, char** argv) {
  using namespace mxddp::bench;
  Args args;
  CLI::App app{"mxddp collective bandwidth sweep"};
  app.add_option("--backend", args.backend)->check(CLI::IsMember({"local", "mpi"}))->capture_default_str();
  app.add_option("--ranks", args.ranks, "local: comma-separated rank counts")->capture_default_str();
  app.add_option("--min-bytes", args.min_bytes)->capture_default_str();
  app.add_option("--max-bytes", args.max_bytes)->capture_default_str();
  app.add_option("--runs", args.runs, "runs per point; the median is reported")->check(CLI::Range(1, 100))->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    if (args.backend == "mpi") {
      mxddp::MpiRuntime runtime(&argc, &argv);
      // Rank 0 measures memcpy alone (the other processes would contend for the same memory).
      double bw = 0;
      if (mxddp::MpiRuntime::world_rank() == 0) bw = memcpy_bandwidth_bytes_per_s(static_cast<size_t>(args.max_bytes));
      MPI_Bcast(&bw, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
      if (mxddp::MpiRuntime::world_rank() == 0)
        std::printf("memcpy (1 thread, %s): %.2f GB/s\n", mib(static_cast<size_t>(args.max_bytes)).c_str(), bw / 1e9);
      run_mpi_sweep(args, bw);
    } else {
      const double bw = memcpy_bandwidth_bytes_per_s(static_cast<size_t>(args.max_bytes));
      std::printf("memcpy (1 thread, %s): %.2f GB/s\n", mib(static_cast<size_t>(args.max_bytes)).c_str(), bw / 1e9);
      run_local_sweep(args, bw);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "comm_bench: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
