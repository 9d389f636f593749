// Helpers for the training tests: a small, fast config and a local-backend run that returns
// every rank's result.
#pragma once

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <vector>

#include <gtest/gtest.h>

#include <mxddp/train.h>

namespace mxddp::testing {

// 2 layers x 32, seq 32; global batch 8 in micro-batches of 2; a schedule that does not depend on
// train_iters (lr_decay_iters fixed), so a run cut short is a prefix of a longer one.
inline TrainConfig small_train_config() {
  TrainConfig c;
  c.model = GptConfig{.num_layers = 2, .hidden_size = 32, .num_attention_heads = 2, .seq_length = 32};
  c.micro_batch_size = 2;
  c.global_batch_size = 8;
  c.train_iters = 4;
  c.lr = 1e-2f;
  c.min_lr = 1e-3f;
  c.lr_warmup_iters = 1;
  c.lr_decay_iters = 8;
  c.corpus_bytes = 1 << 16;
  c.eval_iters = 1;
  c.eval_interval = 0;
  return c;
}

// Runs train() on dp in-process ranks; result [rank].
inline std::vector<TrainResult> train_local_all(int dp, const TrainConfig& config) {
  set_compute_threads(1);  // ranks are threads already
  std::vector<TrainResult> results(static_cast<size_t>(dp));
  run_local(dp, [&](Communicator& comm) { results[static_cast<size_t>(comm.rank())] = train(comm, config); });
  return results;
}

inline TrainResult train_local(int dp, const TrainConfig& config) { return train_local_all(dp, config).front(); }

// A precision's claim on the default run (model, data, length) at dp 2: the final validation loss
// (8 global batches) of the default config and of `variant` (the default with vary applied) over
// seeds 1..3. Each seed's ratio variant / base - 1 is printed and expected within 6%, with the base
// expected to have learned (loss below 1); returns the mean ratio, the tests' claim.
inline double mean_final_loss_ratio(const std::function<void(TrainConfig&)>& vary, const char* base_name,
                                    const char* variant_name) {
  constexpr int kSeeds = 3;
  double ratio_sum = 0;
  for (uint64_t seed = 1; seed <= kSeeds; ++seed) {
    TrainConfig base;
    base.seed = seed;
    base.eval_iters = 8;
    base.eval_interval = 0;
    TrainConfig variant = base;
    vary(variant);
    const double loss_base = train_local(2, base).evals.back().loss;
    const double loss_variant = train_local(2, variant).evals.back().loss;
    const double ratio = loss_variant / loss_base - 1.0;
    std::printf("seed %d final validation loss: %s %.4f, %s %.4f (%+.2f%%)\n", static_cast<int>(seed), base_name,
                loss_base, variant_name, loss_variant, 100.0 * ratio);
    EXPECT_LT(loss_base, 1.0) << "the comparison is only meaningful once the model has learned";
    EXPECT_LT(std::abs(ratio), 0.06) << "seed " << seed;
    ratio_sum += ratio;
  }
  const double mean_ratio = ratio_sum / kSeeds;
  std::printf("mean over %d seeds: %s %+.2f%% of %s\n", kSeeds, variant_name, 100.0 * mean_ratio, base_name);
  return mean_ratio;
}

// Runs train() on dp in-process ranks that are expected to fail; each rank's Error message [rank]
// ("" where a rank returned).
inline std::vector<std::string> train_local_errors(int dp, const TrainConfig& config, const TrainCallbacks& callbacks = {}) {
  set_compute_threads(1);
  std::vector<std::string> errors(static_cast<size_t>(dp));
  run_local(dp, [&](Communicator& comm) {
    try {
      train(comm, config, callbacks);
    } catch (const Error& e) {
      errors[static_cast<size_t>(comm.rank())] = e.what();
    }
  });
  return errors;
}

inline std::vector<double> losses(const TrainResult& r) {
  std::vector<double> v;
  for (const StepRecord& s : r.steps) v.push_back(s.loss);
  return v;
}

inline void expect_close(const std::vector<double>& a, const std::vector<double>& b, double rel, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], rel * std::abs(b[i])) << what << ", step " << i + 1;
}

// A fresh directory under the temp dir, removed when the test ends.
struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& name)
      : path(std::filesystem::temp_directory_path() / (name + "_" + std::to_string(::getpid()))) {
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  std::string operator/(const std::string& leaf) const { return (path / leaf).string(); }
};

}  // namespace mxddp::testing
