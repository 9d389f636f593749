// The model's matrix products on each library linked here, single- and multi-threaded: the
// measurements behind docs/compute.md's choice. For each of the model's product shapes (the
// forward, data-gradient and weight-gradient layouts of the small preset's linear layers, and an
// attention head's products) it prints GFLOP/s of oneDNN in F32 and BF16 compute through the
// model's gemm entry point (model/gemm.h, plan cache and BF16 rounding of the operands included),
// and of OpenBLAS's cblas_sgemm, with the kernel each library runs (oneDNN's implementation name,
// OpenBLAS's core name). Medians of --runs after a warm-up.
#include <cstdio>
#include <thread>

#include <cblas.h>
#include <CLI/CLI.hpp>

#include <mxddp/model.h>

#include "bench_util.h"
#include "model/gemm.h"

extern "C" char* openblas_get_corename();
extern "C" void openblas_set_num_threads(int threads);

namespace {

using namespace mxddp;
using namespace mxddp::bench;
using model::Op;

struct ProductShape {
  const char* what;
  Op op_a, op_b;
  int m, n, k;
};

template <typename Product>
double gflops(const ProductShape& s, int runs, Product product) {
  std::vector<double> rates;
  for (int r = 0; r < runs + 1; ++r) {
    const double t0 = now_s();
    product();
    if (r > 0) rates.push_back(2.0 * s.m * s.n * s.k / (now_s() - t0) / 1e9);
  }
  return median(rates);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"The model's matrix products on oneDNN (F32, BF16) and OpenBLAS"};
  std::vector<int> thread_counts = {1, static_cast<int>(std::max(1u, std::thread::hardware_concurrency()))};
  int runs = 7, rows = 2048, hidden = 384, seq = 256, head_dim = 64;
  app.add_option("--threads", thread_counts, "Thread counts")->delimiter(',');
  app.add_option("--runs", runs, "Timed runs per figure")->check(CLI::Range(1, 1000));
  app.add_option("--rows", rows, "Tokens per micro-batch (micro x seq)")->check(CLI::PositiveNumber);
  app.add_option("--hidden", hidden, "Hidden size C")->check(CLI::PositiveNumber);
  app.add_option("--seq", seq, "Sequence length T (attention products)")->check(CLI::PositiveNumber);
  app.add_option("--head-dim", head_dim, "Head dimension (attention products)")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);

  const int n = rows, c = hidden;
  const std::vector<ProductShape> shapes = {
      {"fc1 forward   x W^T", Op::kN, Op::kT, n, 4 * c, c},
      {"fc2 forward   x W^T", Op::kN, Op::kT, n, c, 4 * c},
      {"fc2 data grad dy W", Op::kN, Op::kN, n, 4 * c, c},
      {"fc1 data grad dy W", Op::kN, Op::kN, n, c, 4 * c},
      {"fc1 wgrad  dy^T x", Op::kT, Op::kN, 4 * c, c, n},
      {"qkv forward   x W^T", Op::kN, Op::kT, n, 3 * c, c},
      {"attn q k^T", Op::kN, Op::kT, seq, seq, head_dim},
      {"attn p v", Op::kN, Op::kN, seq, head_dim, seq},
  };
  const ComputeInfo info = compute_info();
  std::printf("CPU: %s; oneDNN: %s, ISA %s (f32 %s, bf16 %s); OpenBLAS core %s\n", info.cpu.c_str(),
              info.library.c_str(), info.isa.c_str(), info.f32_kernel.c_str(),
              info.bf16_supported ? info.bf16_kernel.c_str() : "not native", openblas_get_corename());
  std::printf("GFLOP/s, median of %d runs\n%-22s %16s %4s %12s %12s %13s\n", runs, "product", "m x n x k", "thr",
              "oneDNN_f32", "oneDNN_bf16", "OpenBLAS_f32");
  for (int threads : thread_counts) {
    set_compute_threads(threads);
    openblas_set_num_threads(threads);
    for (const ProductShape& s : shapes) {
      const int a_cols = s.op_a == Op::kN ? s.k : s.m, b_cols = s.op_b == Op::kN ? s.n : s.k;
      std::vector<float> a(static_cast<size_t>(s.m) * s.k, 0.01f), b(static_cast<size_t>(s.k) * s.n, 0.02f),
          out(static_cast<size_t>(s.m) * s.n);
      auto ours = [&] { model::gemm(s.op_a, s.op_b, s.m, s.n, s.k, 1.0f, a.data(), a_cols, b.data(), b_cols, 1.0f, out.data(), s.n); };
      const double f32 = gflops(s, runs, ours);
      double bf16 = 0;
      if (info.bf16_supported) {
        const model::ScopedGemmDType scope(model::GemmDType::kBF16);
        bf16 = gflops(s, runs, ours);
      }
      const double blas = gflops(s, runs, [&] {
        cblas_sgemm(CblasRowMajor, s.op_a == Op::kT ? CblasTrans : CblasNoTrans, s.op_b == Op::kT ? CblasTrans : CblasNoTrans,
                    s.m, s.n, s.k, 1.0f, a.data(), a_cols, b.data(), b_cols, 1.0f, out.data(), s.n);
      });
      char dims[48];
      std::snprintf(dims, sizeof dims, "%dx%dx%d", s.m, s.n, s.k);
      std::printf("%-22s %16s %4d %12.1f %12.1f %13.1f\n", s.what, dims, threads, f32, bf16, blas);
      std::fflush(stdout);
    }
  }
  return 0;
}
