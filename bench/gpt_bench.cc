// Reference GPT training throughput: tokens/s of `mxddp train`'s loop for each preset at each dp
// on the local backend, and the model's achieved FLOP/s (matrix-product FLOPs per token x tokens/s)
// as a fraction of OpenBLAS sgemm's FLOP/s, measured in the same run on the model's largest
// product (the first MLP layer's forward: [micro x seq, hidden] x [hidden, 4 hidden]) with every
// core. Each rank gets cores / dp BLAS threads, as `mxddp train` gives them. Figures are medians
// over the iterations after the first.
#include <cstdio>
#include <mutex>
#include <thread>

#include <cblas.h>
#include <CLI/CLI.hpp>

#include <mxddp/train.h>

#include "bench_util.h"

namespace {

using namespace mxddp;
using namespace mxddp::bench;

// FLOP/s of sgemm C[m, n] = A[m, k] B[k, n]^T (the model's forward layout), median of `runs`.
double sgemm_flops_per_s(int m, int n, int k, int runs) {
  std::vector<float> a(static_cast<size_t>(m) * k, 0.01f), b(static_cast<size_t>(n) * k, 0.02f), c(static_cast<size_t>(m) * n);
  std::vector<double> rates;
  for (int r = 0; r < runs + 1; ++r) {
    const double t0 = now_s();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, a.data(), k, b.data(), k, 0.0f, c.data(), n);
    if (r > 0) rates.push_back(2.0 * m * n * k / (now_s() - t0));  // the first run warms up
  }
  return median(rates);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Reference GPT training throughput against OpenBLAS sgemm"};
  std::vector<std::string> presets = {"small", "gpt2-124m"};
  std::vector<int> dps = {1, 2};
  int iters = 4;
  int micro_small = 4, micro_gpt2 = 1;
  app.add_option("--presets", presets, "Model presets")->delimiter(',');
  app.add_option("--dps", dps, "Data-parallel sizes (local backend)")->delimiter(',');
  app.add_option("--iters", iters, "Iterations per run; the first is not timed")->check(CLI::Range(2, 1000));
  app.add_option("--micro-batch-small", micro_small, "Micro-batch of small (and tiny)");
  app.add_option("--micro-batch-gpt2", micro_gpt2, "Micro-batch of gpt2-124m");
  CLI11_PARSE(app, argc, argv);

  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::printf("reference GPT training, local backend, %d cores; FLOP/s counts matrix products (fwd + bwd)\n", cores);
  std::printf("%-10s %3s %6s %12s %12s %14s %14s %9s\n", "preset", "dp", "micro", "step_ms", "tokens_per_s",
              "model_GFLOPs", "sgemm_GFLOPs", "fraction");
  for (const std::string& preset : presets) {
    TrainConfig c;
    c.model = gpt_preset(preset);
    c.micro_batch_size = preset == "gpt2-124m" ? micro_gpt2 : micro_small;
    c.train_iters = iters;
    c.eval_iters = 0;
    c.lr_warmup_iters = 1;
    c.corpus_bytes = 1 << 22;
    const int rows = c.micro_batch_size * c.model.seq_length, h = c.model.hidden_size;
    set_compute_threads(cores);
    const double sgemm = sgemm_flops_per_s(rows, 4 * h, h, 5);
    for (int dp : dps) {
      c.global_batch_size = c.micro_batch_size * dp;
      set_compute_threads(std::max(1, cores / dp));
      std::vector<double> step_ms;
      std::mutex mutex;
      run_local(dp, [&](Communicator& comm) {
        const TrainResult r = train(comm, c);
        if (comm.rank() != 0) return;
        std::lock_guard lock(mutex);
        for (size_t i = 1; i < r.steps.size(); ++i) step_ms.push_back(r.steps[i].step_ms);
      });
      const double ms = median(step_ms);
      const double tokens_per_s = static_cast<double>(c.global_batch_size) * c.model.seq_length / (ms / 1e3);
      const double model_flops = tokens_per_s * c.model.train_flops_per_token();
      std::printf("%-10s %3d %6d %12.1f %12.0f %14.2f %14.2f %9.3f\n", preset.c_str(), dp, c.micro_batch_size, ms,
                  tokens_per_s, model_flops / 1e9, sgemm / 1e9, model_flops / sgemm);
      std::fflush(stdout);
    }
    std::printf("%-10s largest product: [%d x %d] x [%d x %d]^T\n", preset.c_str(), rows, h, 4 * h, h);
  }
  return 0;
}
