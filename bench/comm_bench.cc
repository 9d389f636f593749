// Collective bandwidth sweep, nccl-tests style: for all_reduce, reduce_scatter, all_gather and
// broadcast at 1 MiB .. 256 MiB (the size S of the full buffer: all_reduce's and broadcast's
// buffer, reduce_scatter's input, all_gather's output), f32 and bf16, in the in-place forms
// training uses (reduce-scatter into this rank's shard of the grad buffer, all-gather from this
// rank's shard of the param buffer). Each row starts with nccl-tests' columns (size in bytes,
// element count, type, redop, root, time in µs, algbw = S / time, busbw = algbw x the op's bus
// factor, all in GB/s); --json FILE writes the rows and the machine's figures as JSON. Then two
// ratios:
//
//   vs_memcpy  busbw over one thread's memcpy bandwidth (the old figure, kept for comparison):
//              busbw = S / time x (all_reduce: 2(n-1)/n, reduce_scatter and all_gather: (n-1)/n,
//              broadcast: 1)
//   vs_stream  the local backend's limit: the bytes the whole group must move (reads and writes,
//              every rank's buffer counted once) per second, over the all-core streaming
//              bandwidth (stream_bandwidth.h) measured in the same run on the same footprint
//              (n x S bytes: every rank's buffer). Bytes that must move, n ranks:
//                all_reduce      every buffer read and written once          2nS
//                reduce_scatter  every input read, every rank's block written (n+1)S
//                all_gather      every block read once, written to n-1 peers  nS
//                broadcast       the root's buffer read once, written n-1 times nS
//              1.0 means the collective streams as fast as the machine's best streaming kernel
//              touching the same bytes; per rank that is these bytes over n.
//
// On the MPI backend it prints vs_memcpy and the ratio to a raw MPI loop (f32).
//
// Local:  comm_bench --backend local --ranks 2,4
// MPI:    mpirun -np 2 comm_bench --backend mpi
#include <cstdio>
#include <map>
#include <mutex>

#include <CLI/CLI.hpp>
#include <mpi.h>
#include <nlohmann/json.hpp>

#include <mxddp/comm.h>
#include <mxddp/model.h>
#include <mxddp/output_file.h>

#include "compute/reduce.h"

#include "bench_util.h"
#include "stream_bandwidth.h"

namespace mxddp::bench {
namespace {

enum class Op { kAllReduce, kReduceScatter, kAllGather, kBroadcast };
constexpr Op kOps[] = {Op::kAllReduce, Op::kReduceScatter, Op::kAllGather, Op::kBroadcast};
const char* op_name(Op op) {
  switch (op) {
    case Op::kAllReduce: return "all_reduce";
    case Op::kReduceScatter: return "reduce_scatter";
    case Op::kAllGather: return "all_gather";
    case Op::kBroadcast: return "broadcast";
  }
  return "?";
}
double bus_factor(Op op, int n) {
  if (op == Op::kBroadcast) return 1.0;
  return (op == Op::kAllReduce ? 2.0 : 1.0) * (n - 1) / n;
}
// Bytes the whole group must move for one collective on full buffers of `bytes` (see the top).
double group_bytes_moved(Op op, int n, double bytes) {
  switch (op) {
    case Op::kAllReduce: return 2.0 * n * bytes;
    case Op::kReduceScatter: return (n + 1.0) * bytes;
    case Op::kAllGather:
    case Op::kBroadcast: return n * bytes;
  }
  return 0;
}

struct Args {
  std::string backend = "local";
  std::string ranks = "2,4";
  std::string dtypes = "f32,bf16";
  std::vector<std::string> ops = {"all_reduce", "reduce_scatter", "all_gather", "broadcast"};
  int64_t min_bytes = int64_t{1} << 20;
  int64_t max_bytes = int64_t{256} << 20;
  int runs = 5;
  std::string json;  // --json: the rows and the machine's figures, written at the end
};

// nccl-tests' leading columns of one row; the backend's ratios follow them.
struct Row {
  int ranks = 0;
  Op op = Op::kAllReduce;
  DType dtype = DType::kF32;
  size_t bytes = 0;
  double time_s = 0;
};
const char* redop_name(Op op) { return op == Op::kAllReduce || op == Op::kReduceScatter ? "sum" : "none"; }
constexpr const char* kRowHeader = "%-5s %-14s %11s %10s %5s %5s %5s %10s %8s %8s";
void print_row_start(const Row& r) {
  const double algbw = static_cast<double>(r.bytes) / r.time_s;
  std::printf("%-5d %-14s %11zu %10zu %5s %5s %5d %10.1f %8.2f %8.2f", r.ranks, op_name(r.op), r.bytes,
              r.bytes / dtype_size_bytes(r.dtype), std::string(dtype_name(r.dtype)).c_str(), redop_name(r.op),
              r.op == Op::kBroadcast ? 0 : -1, r.time_s * 1e6, algbw / 1e9, algbw * bus_factor(r.op, r.ranks) / 1e9);
}
nlohmann::json row_json(const Row& r) {
  const double algbw = static_cast<double>(r.bytes) / r.time_s;
  return {{"ranks", r.ranks},
          {"op", op_name(r.op)},
          {"size_bytes", r.bytes},
          {"count", r.bytes / dtype_size_bytes(r.dtype)},
          {"type", dtype_name(r.dtype)},
          {"redop", redop_name(r.op)},
          {"root", r.op == Op::kBroadcast ? 0 : -1},
          {"time_us", r.time_s * 1e6},
          {"algbw_GBps", algbw / 1e9},
          {"busbw_GBps", algbw * bus_factor(r.op, r.ranks) / 1e9}};
}

// A rank's full buffer of `bytes`; reduce_scatter and all_gather use its block `rank` in place.
// Every f32 word is 1.0f, so as bf16 the elements alternate 0 and 1.0: finite, never subnormal.
struct Buffers {
  std::vector<float> big;
  Buffers(size_t bytes) : big(bytes / 4, 1.0f) {}
};

// Seconds per collective on this rank: `iters` back-to-back blocking calls between barriers.
double time_op(Communicator& comm, Op op, DType dtype, Buffers& b, int iters) {
  const int64_t numel = static_cast<int64_t>(b.big.size() * 4 / dtype_size_bytes(dtype)) / comm.size() * comm.size();
  const int64_t block = numel / comm.size();
  TensorView big{b.big.data(), dtype, Shape{numel}, Device::cpu()};
  TensorView small = big.slice(comm.rank() * block, block);
  auto once = [&] {
    switch (op) {
      case Op::kAllReduce: comm.all_reduce(big); break;
      case Op::kReduceScatter: comm.reduce_scatter(big, small); break;
      case Op::kAllGather: comm.all_gather(small, big); break;
      case Op::kBroadcast: comm.broadcast(big); break;
    }
  };
  once();  // warm-up: first touch of the pages
  comm.barrier();
  const double t0 = now_s();
  for (int i = 0; i < iters; ++i) once();
  comm.barrier();
  return (now_s() - t0) / iters;
}

std::vector<Op> selected_ops(const Args& args) {
  std::vector<Op> ops;
  for (Op op : kOps)
    if (std::find(args.ops.begin(), args.ops.end(), op_name(op)) != args.ops.end()) ops.push_back(op);
  return ops;
}

int iters_for(size_t bytes) { return static_cast<int>(std::clamp<size_t>((size_t{512} << 20) / bytes, 2, 50)); }

std::vector<size_t> sizes(const Args& a) {
  std::vector<size_t> s;
  for (int64_t b = a.min_bytes; b <= a.max_bytes; b *= 4) s.push_back(static_cast<size_t>(b));
  return s;
}

std::vector<DType> parse_dtypes(const std::string& text) {
  std::vector<DType> v;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t comma = text.find(',', pos);
    const std::string name = text.substr(pos, comma - pos);
    MXDDP_CHECK(name == "f32" || name == "bf16", "--dtypes: {} is not f32 or bf16", name);
    v.push_back(name == "f32" ? DType::kF32 : DType::kBF16);
    pos = comma == std::string::npos ? text.size() : comma + 1;
  }
  return v;
}

nlohmann::json run_local_sweep(const Args& args, double memcpy_bw) {
  nlohmann::json rows = nlohmann::json::array();
  std::map<size_t, StreamBandwidth> stream;  // footprint -> bandwidth, measured once per footprint
  std::printf(kRowHeader, "ranks", "op", "size", "count", "type", "redop", "root", "time_us", "algbw", "busbw");
  std::printf(" %9s %10s %11s %9s\n", "vs_memcpy", "moved_GBps", "stream_GBps", "vs_stream");
  for (const int64_t ranks : parse_int_list(args.ranks)) {
    const auto n = static_cast<int>(ranks);
    for (Op op : selected_ops(args))
      for (DType dtype : parse_dtypes(args.dtypes))
        for (size_t bytes : sizes(args)) {
          const size_t footprint = bytes * static_cast<size_t>(n);
          if (!stream.count(footprint)) stream[footprint] = stream_bandwidth(footprint);
          const double stream_bw = stream[footprint].best();
          std::vector<double> times;
          std::mutex mutex;
          std::vector<Buffers> bufs;
          for (int r = 0; r < n; ++r) bufs.emplace_back(bytes);
          for (int run = 0; run < args.runs; ++run)
            run_local(n, [&](Communicator& comm) {
              const double t = time_op(comm, op, dtype, bufs[static_cast<size_t>(comm.rank())], iters_for(bytes));
              if (comm.rank() == 0) { std::lock_guard lock(mutex); times.push_back(t); }
            });
          const Row row{n, op, dtype, bytes, median(times)};
          const double busbw = static_cast<double>(bytes) / row.time_s * bus_factor(op, n);
          const double moved = group_bytes_moved(op, n, static_cast<double>(bytes)) / row.time_s;
          print_row_start(row);
          std::printf(" %9.2f %10.2f %11.2f %9.2f\n", busbw / memcpy_bw, moved / 1e9, stream_bw / 1e9, moved / stream_bw);
          std::fflush(stdout);
          nlohmann::json j = row_json(row);
          j["vs_memcpy"] = busbw / memcpy_bw;
          j["moved_GBps"] = moved / 1e9;
          j["stream_GBps"] = stream_bw / 1e9;
          j["vs_stream"] = moved / stream_bw;
          rows.push_back(std::move(j));
        }
  }
  return rows;
}

// The raw MPI loop the MPI backend is compared with: the same call with nothing around it.
// (MPI's in-place reduce-scatter leaves the result in block 0, a copy cheaper than ours, which
// puts it in this rank's block and leaves the rest of the input untouched.)
double time_raw_mpi(Op op, Buffers& b, int iters, int size) {
  const int block = static_cast<int>(b.big.size()) / size;
  auto once = [&] {
    switch (op) {
      case Op::kAllReduce:
        MPI_Allreduce(MPI_IN_PLACE, b.big.data(), block * size, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        break;
      case Op::kReduceScatter:
        MPI_Reduce_scatter_block(MPI_IN_PLACE, b.big.data(), block, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        break;
      case Op::kAllGather:
        MPI_Allgather(MPI_IN_PLACE, block, MPI_FLOAT, b.big.data(), block, MPI_FLOAT, MPI_COMM_WORLD);
        break;
      case Op::kBroadcast: MPI_Bcast(b.big.data(), block * size, MPI_FLOAT, 0, MPI_COMM_WORLD); break;
    }
  };
  once();
  MPI_Barrier(MPI_COMM_WORLD);
  const double t0 = now_s();
  for (int i = 0; i < iters; ++i) once();
  MPI_Barrier(MPI_COMM_WORLD);
  return (now_s() - t0) / iters;
}

nlohmann::json run_mpi_sweep(const Args& args, double memcpy_bw) {
  auto checked = make_mpi_communicator({.check_consistency = true});
  auto unchecked = make_mpi_communicator({.check_consistency = false});
  const int n = checked->size();
  const bool root = checked->rank() == 0;
  nlohmann::json rows = nlohmann::json::array();
  if (root) {
    std::printf(kRowHeader, "ranks", "op", "size", "count", "type", "redop", "root", "time_us", "algbw", "busbw");
    std::printf(" %9s %10s %14s\n", "vs_memcpy", "vs_raw_mpi", "vs_raw_nocheck");
  }
  for (Op op : selected_ops(args))
    for (size_t bytes : sizes(args)) {
      Buffers b(bytes);
      std::vector<double> ours, ours_nocheck, raw;
      for (int run = 0; run < args.runs; ++run) {
        raw.push_back(time_raw_mpi(op, b, iters_for(bytes), n));
        ours.push_back(time_op(*checked, op, DType::kF32, b, iters_for(bytes)));
        ours_nocheck.push_back(time_op(*unchecked, op, DType::kF32, b, iters_for(bytes)));
      }
      const Row row{n, op, DType::kF32, bytes, median(ours)};
      const double busbw = static_cast<double>(bytes) / row.time_s * bus_factor(op, n);
      if (root) {
        print_row_start(row);
        std::printf(" %9.2f %10.3f %14.3f\n", busbw / memcpy_bw, median(raw) / row.time_s, median(raw) / median(ours_nocheck));
        nlohmann::json j = row_json(row);
        j["vs_memcpy"] = busbw / memcpy_bw;
        j["vs_raw_mpi"] = median(raw) / row.time_s;
        j["vs_raw_nocheck"] = median(raw) / median(ours_nocheck);
        rows.push_back(std::move(j));
      }
      std::fflush(stdout);
    }
  return rows;
}

}  // namespace
}  // namespace mxddp::bench

int main(int argc, char** argv) {
  using namespace mxddp::bench;
  Args args;
  CLI::App app{"mxddp collective bandwidth sweep"};
  app.add_option("--backend", args.backend)->check(CLI::IsMember({"local", "mpi"}))->capture_default_str();
  app.add_option("--ranks", args.ranks, "local: comma-separated rank counts")->capture_default_str();
  app.add_option("--dtypes", args.dtypes, "local: comma-separated, f32 and/or bf16")->capture_default_str();
  app.add_option("--ops", args.ops, "collectives to run")
      ->check(CLI::IsMember({"all_reduce", "reduce_scatter", "all_gather", "broadcast"}))
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--min-bytes", args.min_bytes)->capture_default_str();
  app.add_option("--max-bytes", args.max_bytes)->capture_default_str();
  app.add_option("--runs", args.runs, "runs per point; the median is reported")->check(CLI::Range(1, 100))->capture_default_str();
  app.add_option("--json", args.json, "also write the rows and the machine's figures to this JSON file");
  CLI11_PARSE(app, argc, argv);
  try {
    if (!args.json.empty()) mxddp::check_output_file_path(args.json, "--json");  // before minutes of runs
    nlohmann::json doc = {{"backend", args.backend}, {"cpu", mxddp::compute_info().cpu},
                          {"reduce_kernel_isa", mxddp::reduce_kernel_isa()}};
    bool write = true;
    if (args.backend == "mpi") {
      mxddp::MpiRuntime runtime(&argc, &argv);
      // Rank 0 measures memcpy alone (the other processes would contend for the same memory).
      double bw = 0;
      if (mxddp::MpiRuntime::world_rank() == 0) bw = memcpy_bandwidth_bytes_per_s(static_cast<size_t>(args.max_bytes));
      MPI_Bcast(&bw, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
      write = mxddp::MpiRuntime::world_rank() == 0;
      if (write)
        std::printf("memcpy (1 thread, %s): %.2f GB/s\n", mib(static_cast<size_t>(args.max_bytes)).c_str(), bw / 1e9);
      doc["memcpy_GBps"] = bw / 1e9;
      doc["rows"] = run_mpi_sweep(args, bw);
    } else {
      const double bw = memcpy_bandwidth_bytes_per_s(static_cast<size_t>(args.max_bytes));
      std::printf("CPU: %s; reduction and copy kernels: %s\n", mxddp::compute_info().cpu.c_str(),
                  std::string(mxddp::reduce_kernel_isa()).c_str());
      std::printf("memcpy (1 thread, %s): %.2f GB/s\n", mib(static_cast<size_t>(args.max_bytes)).c_str(), bw / 1e9);
      const StreamBandwidth big = stream_bandwidth(static_cast<size_t>(args.max_bytes) * 4);
      std::printf("stream (%d threads, %s footprint, GB/s): copy_nt %.2f, triad %.2f, add %.2f; stream_GBps below "
                  "is the best of the three on each row's footprint (n x size)\n",
                  big.threads, mib(static_cast<size_t>(args.max_bytes) * 4).c_str(), big.copy_bytes_per_s / 1e9,
                  big.triad_bytes_per_s / 1e9, big.add_bytes_per_s / 1e9);
      std::printf("size in bytes, time in us, algbw and busbw in GB/s (nccl-tests' columns)\n");
      doc["memcpy_GBps"] = bw / 1e9;
      doc["stream"] = {{"threads", big.threads},
                       {"footprint_bytes", args.max_bytes * 4},
                       {"copy_nt_GBps", big.copy_bytes_per_s / 1e9},
                       {"triad_GBps", big.triad_bytes_per_s / 1e9},
                       {"add_GBps", big.add_bytes_per_s / 1e9}};
      doc["rows"] = run_local_sweep(args, bw);
    }
    if (write && !args.json.empty()) mxddp::write_output_file(args.json, doc.dump(1) + "\n", "--json");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "comm_bench: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
