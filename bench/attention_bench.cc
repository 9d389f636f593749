// Block-causal attention (src/model/causal_attention.h) forward + backward, f32 or BF16 (--bf16), on the presets'
// shapes, for several block sizes: block = T is one product per head over all T x T scores (what
// the model did before, minus the old serial loop over heads), smaller blocks skip the scores
// above the diagonal block at the price of more, smaller products. Prints ms per call (median)
// and the fraction of the full score products each block size computes. Never asserts.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include <CLI/CLI.hpp>

#include <mxddp/model.h>

#include "model/causal_attention.h"
#include "model/gemm.h"

namespace {

struct Case {
  const char* preset;
  int batch, seq, c, heads;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Block-causal attention forward + backward, f32, per block size"};
  int threads = 1, runs = 5;
  bool bf16 = false;
  app.add_flag("--bf16", bf16, "BF16 products (kBF16; f32 where the CPU has no native BF16)");
  app.add_option("--threads", threads, "OpenMP threads (the rank's compute threads)")->check(CLI::PositiveNumber);
  app.add_option("--runs", runs, "Timed runs per case")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  mxddp::set_compute_threads(threads);
  const mxddp::model::ScopedGemmDType dtype(bf16 ? mxddp::model::GemmDType::kBF16 : mxddp::model::GemmDType::kF32);
  const Case cases[] = {{"tiny", 8, 64, 64, 4}, {"small", 8, 256, 384, 6}, {"gpt2-124m", 1, 1024, 768, 12}};
  std::printf("%s products; threads %d; ms per forward + backward (median of %d)\n",
              bf16 && mxddp::model::bf16_gemm_supported() ? "bf16" : "f32", threads, runs);
  std::printf("%-9s %5s %6s %12s %10s\n", "preset", "T", "block", "fraction", "ms");
  for (const Case& cs : cases) {
    const size_t n = size_t(cs.batch) * cs.seq;
    std::mt19937 rng(1);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    std::vector<float> qkv(n * 3 * cs.c), dy(n * cs.c), y(n * cs.c), dqkv(n * 3 * cs.c);
    for (float& x : qkv) x = dist(rng);
    for (float& x : dy) x = dist(rng);
    std::vector<float> stats(size_t(mxddp::model::attention_stats_numel(cs.batch, cs.seq, cs.heads)));
    std::vector<int> blocks;
    for (int b : {16, 32, 64, 128, 256}) if (b < cs.seq) blocks.push_back(b);
    blocks.push_back(cs.seq);
    for (int block : blocks) {
      std::vector<float> scratch(size_t(mxddp::model::attention_scratch_numel(cs.seq, 0, block)));
      std::vector<double> ms;
      for (int r = 0; r <= runs; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        mxddp::model::attention_forward(qkv.data(), stats.data(), y.data(), scratch.data(), cs.batch, cs.seq, cs.c,
                                        cs.heads, block);
        mxddp::model::attention_backward(dy.data(), qkv.data(), stats.data(), dqkv.data(), scratch.data(), cs.batch,
                                         cs.seq, cs.c, cs.heads, block);
        const double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        if (r > 0) ms.push_back(t);  // the first call compiles the products' kernels
      }
      double computed = 0;
      for (int i0 = 0; i0 < cs.seq; i0 += block) computed += double(std::min(block, cs.seq - i0)) * std::min(cs.seq, i0 + block);
      std::printf("%-9s %5d %6d %12.3f %10.2f\n", cs.preset, cs.seq, block, computed / (double(cs.seq) * cs.seq),
                  median(ms));
    }
  }
  return 0;
}
