// Uses an installed mxddp through its public headers only: a 2-rank all_reduce on the local
// backend, then a few iterations of the reference GPT with a checkpoint save, which links every
// layer (oneDNN, OpenMP, zlib, nlohmann-json, MPI included). Built by the CMake package and by
// pkg-config (tests/install_consumer.cmake). Usage: mxddp_consumer CHECKPOINT_DIR
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include <mxddp/checkpoint.h>
#include <mxddp/comm.h>
#include <mxddp/train.h>

// The consumer's CMakeLists.txt sets no standard: C++20 must come from mxddp::mxddp (or mxddp.pc).
static_assert(__cplusplus >= 202002L, "mxddp's headers need C++20; the package should have asked for it");

namespace {

constexpr int kRanks = 2;

// Each rank contributes (rank + 1) * (i % 7); the sum over 2 ranks is exactly 3 * (i % 7).
bool all_reduce_sums() {
  constexpr int64_t kCount = 100'003;
  std::vector<std::vector<float>> results(kRanks);
  mxddp::run_local(kRanks, [&](mxddp::Communicator& comm) {
    std::vector<float> values(kCount);
    for (int64_t i = 0; i < kCount; ++i) values[i] = static_cast<float>((comm.rank() + 1) * (i % 7));
    mxddp::TensorView view{values.data(), mxddp::DType::kF32, mxddp::Shape{kCount}, mxddp::Device::cpu()};
    comm.all_reduce(view, {.op = mxddp::ReduceOp::kSum, .async_op = true}).wait();
    results[comm.rank()] = std::move(values);
  });
  for (const std::vector<float>& r : results)
    for (int64_t i = 0; i < kCount; ++i)
      if (r[i] != static_cast<float>(3 * (i % 7))) {
        std::fprintf(stderr, "all_reduce: element %lld is %g, expected %d\n", static_cast<long long>(i), r[i],
                     static_cast<int>(3 * (i % 7)));
        return false;
      }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CHECKPOINT_DIR\n", argv[0]);
    return 2;
  }
  try {
    if (!all_reduce_sums()) return 1;

    mxddp::TrainConfig config;  // the tiny GPT
    config.train_iters = 3;
    config.micro_batch_size = 2;
    config.global_batch_size = 4;
    config.lr_warmup_iters = 1;
    config.corpus_bytes = 1 << 16;
    config.eval_iters = 0;
    config.compute_threads = 1;
    config.save_dir = argv[1];
    std::vector<double> losses;
    std::string saved;  // the checkpoint written after the last iteration (somewhere under save_dir)
    mxddp::TrainCallbacks callbacks;
    callbacks.on_save = [&](int64_t, const std::string& dir) { saved = dir; };  // the same on every rank
    mxddp::run_local(kRanks, [&](mxddp::Communicator& comm) {
      mxddp::TrainResult result = mxddp::train(comm, config, comm.rank() == 0 ? callbacks : mxddp::TrainCallbacks{});
      if (comm.rank() == 0)
        for (const mxddp::StepRecord& step : result.steps) losses.push_back(step.loss);
    });
    if (losses.size() != 3 || !std::isfinite(losses.front()) || !std::isfinite(losses.back())) {
      std::fprintf(stderr, "train: expected 3 finite losses, got %zu\n", losses.size());
      return 1;
    }
    if (saved.empty()) {
      std::fprintf(stderr, "train: no checkpoint saved under %s\n", argv[1]);
      return 1;
    }
    mxddp::CheckpointInfo info = mxddp::inspect_checkpoint(saved);
    if (!info.ok() || info.step != 3 || info.saved_dp != kRanks) {
      std::fprintf(stderr, "checkpoint: ok %d step %lld dp %d\n", info.ok(), static_cast<long long>(info.step),
                   info.saved_dp);
      return 1;
    }
    std::printf("mxddp consumer: all_reduce over %d ranks exact, 3 GPT iterations with loss %.3f -> %.3f, checkpoint "
                "at step %lld ok\n",
                kRanks, losses.front(), losses.back(), static_cast<long long>(info.step));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
