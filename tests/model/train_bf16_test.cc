// --bf16 (BF16 matrix products, F32 accumulation, F32 main_grad) against F32 products on the
// tiny preset for 100 iterations at dp 2, and the compute threads train() gives each rank.
//
// Margin: the loss curves, averaged over windows of 10 iterations (one iteration's loss is one
// batch's and noisy), stay within 0.03 nats + 2% of F32's, and the final validation losses
// within 3% (the margin the MXFP8 test allows BF16 params). BF16 rounds each product's operands to 8 significant bits, which perturbs every
// step a little; those perturbations must not add up to a different trajectory. Measured on
// the machine of docs/compute.md (AMX BF16): window differences at most 0.008 nats, final
// validation 1.63 (F32) vs 1.61 (BF16), -1.0%.
#include <cmath>
#include <cstdio>
#include <thread>

#include <gtest/gtest.h>
#include <omp.h>

#include <mxddp/comm.h>
#include <mxddp/model.h>

#include "train_util.h"

namespace mxddp::testing {
namespace {

TrainConfig tiny_100() {
  TrainConfig c;  // the tiny preset on the built-in corpus
  c.train_iters = 100;
  c.lr_decay_iters = 300;
  c.eval_iters = 4;
  c.eval_interval = 0;
  return c;
}

std::vector<double> window_means(const std::vector<double>& v, size_t window) {
  std::vector<double> out;
  for (size_t i = 0; i + window <= v.size(); i += window) {
    double s = 0;
    for (size_t j = i; j < i + window; ++j) s += v[j];
    out.push_back(s / static_cast<double>(window));
  }
  return out;
}

TEST(TrainBf16, LossCurveTracksF32) {
  TrainConfig f32 = tiny_100();
  TrainConfig bf16 = f32;
  bf16.bf16 = true;
  const TrainResult r32 = train_local(2, f32);
  const TrainResult r16 = train_local(2, bf16);
  const std::vector<double> w32 = window_means(losses(r32), 10), w16 = window_means(losses(r16), 10);
  ASSERT_EQ(w32.size(), 10u);
  ASSERT_EQ(w16.size(), 10u);
  double worst = 0;
  for (size_t i = 0; i < w32.size(); ++i) {
    std::printf("iterations %3zu-%3zu: mean loss f32 %.4f, bf16 %.4f\n", 10 * i + 1, 10 * i + 10, w32[i], w16[i]);
    EXPECT_LE(std::abs(w16[i] - w32[i]), 0.03 + 0.02 * w32[i]) << "window " << i;
    worst = std::max(worst, std::abs(w16[i] - w32[i]));
  }
  const double v32 = r32.evals.back().loss, v16 = r16.evals.back().loss;
  std::printf("worst window difference %.4f nats; final validation f32 %.4f, bf16 %.4f (%+.2f%%); products in %s\n",
              worst, v32, v16, 100.0 * (v16 / v32 - 1.0), compute_info().bf16_supported ? "bf16" : "f32 (no native bf16)");
  EXPECT_LT(w32.back(), 0.8 * w32.front()) << "the comparison is only meaningful once the model learns";
  EXPECT_LT(std::abs(v16 / v32 - 1.0), 0.03);
  if (compute_info().bf16_supported) {
    // The BF16 run really computed differently (the same losses would mean F32 products ran).
    EXPECT_NE(losses(r16), losses(r32));
  } else {
    EXPECT_EQ(losses(r16), losses(r32));
  }
}

// Issue 28's goal 3, written as the MXFP8 test's (train_mxfp8_test.cc) is: the default model,
// data and length, --bf16 against F32 on the same seeds, the final validation loss over 8 global
// batches. One seed's final loss is chaotic in small perturbations, so the claim is made of the
// mean over three seeds, with a wider bound per seed that a systematic BF16 fault would cross; the
// margins are the MXFP8 test's (3% mean, 6% per seed: its paired differences had sd 1.6%).
// Measured (BF16 / F32 - 1, seeds 1-3): -1.64%, -0.59%, -2.58%, mean -1.60%; with attention in
// BF16 products (an earlier version) +0.04%, -0.70%, -0.41%: the spread is the seeds' chaos.
TEST(TrainBf16, FinalLossWithinThreePercentOfF32OnTheDefaultRunOverThreeSeeds) {
  const double mean_ratio = mean_final_loss_ratio([](TrainConfig& c) { c.bf16 = true; }, "f32", "bf16");
  std::printf("(products in %s)\n", compute_info().bf16_supported ? "bf16" : "f32: no native bf16 here");
  EXPECT_LT(std::abs(mean_ratio), 0.03);
}

TEST(TrainBf16, EachRankThreadGetsItsComputeThreads) {
  // train() sets the thread count in the rank's own thread: cores / ranks by default, or the
  // configured count. Read back in the same rank thread after train() returns.
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  TrainConfig c = small_train_config();
  c.train_iters = 1;
  c.eval_iters = 0;
  for (int dp : {1, 2}) {
    for (int configured : {0, 1}) {
      c.compute_threads = configured;
      std::vector<int> seen(static_cast<size_t>(dp), -1);
      run_local(dp, [&](Communicator& comm) {
        train(comm, c);
        seen[static_cast<size_t>(comm.rank())] = compute_threads();
      });
      const int want = std::min(configured > 0 ? configured : std::max(1, cores / dp), omp_get_thread_limit());
      for (int r = 0; r < dp; ++r) EXPECT_EQ(seen[static_cast<size_t>(r)], want) << "dp " << dp << " rank " << r;
    }
  }
  c.compute_threads = -1;
  EXPECT_THROW(c.validate(1), Error);
}

}  // namespace
}  // namespace mxddp::testing
