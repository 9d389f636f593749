// Reference GPT training throughput as model FLOP utilisation (MFU), issue 10's figure:
//
//   MFU = tokens/s x (6 N + 12 L C T) / (cores x the best single-thread sgemm FLOP/s)
//
// with N the params (the tied embedding counted once: it is also the LM head's product), L layers,
// C hidden, T sequence. The sgemm peak is measured in the same run on the preset's largest product
// (the first MLP layer's forward: [micro x seq, C] x [4C, C]^T), single-threaded, on every library
// linked here (oneDNN, which the model runs on, and OpenBLAS), taking the best. BF16 runs are also
// given against the single-thread BF16 product's rate (their own limit). Each preset runs at each
// dp on the local backend, in F32 and BF16 compute, with cores / dp threads per rank, as `mxddp
// train` gives them; figures are medians over the iterations after the first. The CPU model, the
// library, ISA and kernels are printed first.
//
// --breakdown adds, per run, where rank 0's step time went (model/step_profile.h's parts, then
// the optimizer, the exposed communication and the rest of the step), medians over the same
// iterations; the products' and casts' lines are oneDNN's time, the rest this library's.
#include <cstdio>
#include <mutex>
#include <thread>

#include <cblas.h>
#include <CLI/CLI.hpp>

#include <mxddp/train.h>

#include "bench_util.h"
#include "model/gemm.h"
#include "model/step_profile.h"

extern "C" char* openblas_get_corename();
extern "C" void openblas_set_num_threads(int threads);

namespace {

using namespace mxddp;
using namespace mxddp::bench;

// FLOP/s of C[m, n] = A[m, k] B[n, k]^T (the forward layout) on one thread, median of `runs`
// after a warm-up; `product` runs it once.
template <typename Product>
double flops_per_s(int m, int n, int k, int runs, Product product) {
  std::vector<double> rates;
  for (int r = 0; r < runs + 1; ++r) {
    const double t0 = now_s();
    product();
    if (r > 0) rates.push_back(2.0 * m * n * k / (now_s() - t0));
  }
  return median(rates);
}

struct Peaks {
  double onednn_f32 = 0, openblas_f32 = 0, onednn_bf16 = 0;
  double best_f32() const { return std::max(onednn_f32, openblas_f32); }
};

Peaks single_thread_peaks(int m, int n, int k, int runs) {
  std::vector<float> a(static_cast<size_t>(m) * k, 0.01f), b(static_cast<size_t>(n) * k, 0.02f), c(static_cast<size_t>(m) * n);
  Peaks p;
  set_compute_threads(1);
  auto onednn = [&] {
    model::gemm(model::Op::kN, model::Op::kT, m, n, k, 1.0f, a.data(), k, b.data(), k, 0.0f, c.data(), n);
  };
  p.onednn_f32 = flops_per_s(m, n, k, runs, onednn);
  {
    const model::ScopedGemmDType bf16(model::GemmDType::kBF16);
    p.onednn_bf16 = model::bf16_gemm_supported() ? flops_per_s(m, n, k, runs, onednn) : 0.0;
  }
  openblas_set_num_threads(1);
  p.openblas_f32 = flops_per_s(m, n, k, runs, [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, a.data(), k, b.data(), k, 0.0f, c.data(), n);
  });
  set_compute_threads(0);
  return p;
}

// Rank 0's step, part by part: medians over iterations 2.. of each part on its own (so the parts
// need not add up to the median step exactly; "rest of step" is the median of what is left).
void print_breakdown(const std::vector<model::profile::MicroBatch>& records, const std::vector<StepRecord>& steps) {
  namespace prof = model::profile;
  std::vector<std::pair<std::string, std::vector<double>>> rows;
  for (int p = 0; p < prof::kPartCount; ++p) rows.emplace_back(prof::part_name(static_cast<prof::Part>(p)), std::vector<double>{});
  rows.emplace_back("model other (embedding sums, hooks)", std::vector<double>{});
  rows.emplace_back("optimizer", std::vector<double>{});
  rows.emplace_back("exposed communication", std::vector<double>{});
  rows.emplace_back("rest of step (staging, loop)", std::vector<double>{});
  std::vector<double> step_ms;
  for (size_t i = 1; i < steps.size() && i < records.size(); ++i) {
    const StepRecord& s = steps[i];
    double parts = 0;
    for (int p = 0; p < prof::kPartCount; ++p) {
      rows[static_cast<size_t>(p)].second.push_back(records[i][static_cast<size_t>(p)]);
      parts += records[i][static_cast<size_t>(p)];
    }
    rows[prof::kPartCount].second.push_back(s.forward_ms + s.backward_ms - parts);
    rows[prof::kPartCount + 1].second.push_back(s.optimizer_ms);
    rows[prof::kPartCount + 2].second.push_back(s.comm_ms);
    rows[prof::kPartCount + 3].second.push_back(s.step_ms - s.forward_ms - s.backward_ms - s.optimizer_ms - s.comm_ms);
    step_ms.push_back(s.step_ms);
  }
  if (step_ms.empty()) return;
  const double step = median(step_ms);
  for (const auto& [name, ms] : rows)
    std::printf("    %-36s %9.1f ms %5.1f%%\n", name.c_str(), median(ms), 100.0 * median(ms) / step);
}

double mfu_flops_per_token(const GptConfig& m) {
  return 6.0 * static_cast<double>(m.num_params()) + 12.0 * m.num_layers * m.hidden_size * m.seq_length;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Reference GPT training MFU against the best single-thread sgemm"};
  std::vector<std::string> presets = {"small", "gpt2-124m"};
  std::vector<int> dps = {1, 2};
  std::vector<std::string> dtypes = {"f32", "bf16"};
  int iters = 4;
  int micro_small = 8, micro_gpt2 = 1;
  int peak_runs = 7;
  app.add_option("--presets", presets, "Model presets")->delimiter(',');
  app.add_option("--dps", dps, "Data-parallel sizes (local backend)")->delimiter(',');
  app.add_option("--dtypes", dtypes, "Compute dtypes: f32, bf16")->delimiter(',')->check(CLI::IsMember({"f32", "bf16"}));
  app.add_option("--iters", iters, "Iterations per run; the first is not timed")->check(CLI::Range(2, 1000));
  app.add_option("--micro-batch-small", micro_small, "Micro-batch of small (and tiny)")->check(CLI::PositiveNumber);
  app.add_option("--micro-batch-gpt2", micro_gpt2, "Micro-batch of gpt2-124m")->check(CLI::PositiveNumber);
  bool breakdown = false;
  app.add_flag("--breakdown", breakdown, "Print where rank 0's step time goes (products, casts, row kernels, ...)");
  app.add_option("--peak-runs", peak_runs, "Timed runs of the single-thread sgemm peak")->check(CLI::Range(1, 1000));
  CLI11_PARSE(app, argc, argv);

  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const ComputeInfo info = compute_info();
  std::printf("CPU: %s, %d cores; OpenBLAS core %s (f64 and the peak comparison only)\n", info.cpu.c_str(), cores,
              openblas_get_corename());
  std::printf("compute: %s\n", info.describe(false).c_str());
  if (info.bf16_supported) std::printf("         bf16 products on %s\n", info.bf16_kernel.c_str());
  std::printf("MFU = tokens/s x (6N + 12 L C T) / (%d cores x best single-thread sgemm on the largest product); "
              "medians over iterations 2..%d\n\n", cores, iters);
  std::printf("%-10s %3s %5s %4s %7s %10s %11s %10s %6s %9s\n", "preset", "dp", "micro", "thr", "dtype", "step_ms",
              "tokens/s", "GFLOP/s", "MFU", "MFU_bf16");
  for (const std::string& preset : presets) {
    TrainConfig c;
    c.model = gpt_preset(preset);
    c.micro_batch_size = preset == "gpt2-124m" ? micro_gpt2 : micro_small;
    c.train_iters = iters;
    c.eval_iters = 0;
    c.lr_warmup_iters = 1;
    c.corpus_bytes = 1 << 22;
    const int rows = c.micro_batch_size * c.model.seq_length, h = c.model.hidden_size;
    const Peaks peak = single_thread_peaks(rows, 4 * h, h, peak_runs);
    const double machine_peak = cores * peak.best_f32();
    for (int dp : dps) {
      for (const std::string& dtype : dtypes) {
        c.global_batch_size = c.micro_batch_size * dp;
        c.bf16 = dtype == "bf16";
        c.compute_threads = 0;  // cores / dp, set by train() in each rank's thread
        std::vector<double> step_ms;
        std::vector<StepRecord> rank0_steps;
        std::vector<model::profile::MicroBatch> rank0_profile;
        int threads = 0;
        std::mutex mutex;
        run_local(dp, [&](Communicator& comm) {
          model::profile::set_enabled(breakdown && comm.rank() == 0);
          const TrainResult r = train(comm, c);
          if (comm.rank() != 0) return;
          std::lock_guard lock(mutex);
          rank0_profile = model::profile::records();
          model::profile::set_enabled(false);
          rank0_steps = r.steps;
          threads = compute_threads();  // what train() gave this rank
          for (size_t i = 1; i < r.steps.size(); ++i) step_ms.push_back(r.steps[i].step_ms);
        });
        const double ms = median(step_ms);
        const double tokens_per_s = static_cast<double>(c.global_batch_size) * c.model.seq_length / (ms / 1e3);
        const double model_flops = tokens_per_s * mfu_flops_per_token(c.model);
        const bool bf16_ran = c.bf16 && info.bf16_supported;
        char mfu_bf16[32] = "-";
        if (bf16_ran) std::snprintf(mfu_bf16, sizeof mfu_bf16, "%.3f", model_flops / (cores * peak.onednn_bf16));
        std::printf("%-10s %3d %5d %4d %7s %10.1f %11.0f %10.2f %6.3f %9s\n", preset.c_str(), dp, c.micro_batch_size,
                    threads, c.bf16 ? (bf16_ran ? "bf16" : "bf16->f32") : "f32", ms, tokens_per_s, model_flops / 1e9,
                    model_flops / machine_peak, mfu_bf16);
        if (breakdown) print_breakdown(rank0_profile, rank0_steps);
        std::fflush(stdout);
      }
    }
    std::printf("%-10s largest product [%d x %d] x [%d x %d]^T, single thread: oneDNN f32 %.1f, OpenBLAS f32 %.1f, "
                "oneDNN bf16 %.1f GFLOP/s; MFU's peak %d x %.1f GFLOP/s\n\n",
                preset.c_str(), rows, h, 4 * h, h, peak.onednn_f32 / 1e9, peak.openblas_f32 / 1e9,
                peak.onednn_bf16 / 1e9, cores, peak.best_f32() / 1e9);
  }
  return 0;
}
