// Uses an installed mxddp through its public headers only: a 2-rank all_reduce on the local
// backend, an FSDP iteration of a user's own model whose params all belong to units (the structure
// the reference GPT never has: issue 30's defect), then a few iterations of the reference GPT with
// a checkpoint save, which links every layer (oneDNN, OpenMP, zlib, nlohmann-json, MPI included). Built by the CMake package and by
// pkg-config (tests/install_consumer.cmake). Usage: mxddp_consumer CHECKPOINT_DIR
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include <mxddp/checkpoint.h>
#include <mxddp/comm.h>
#include <mxddp/fsdp.h>
#include <mxddp/optim.h>
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

// A user's model of two linear layers, each its own FSDP unit (no non-unit params), under
// optim_grads_params: one iteration of hooks, a constant gradient and the optimizer step; every
// param must move and nothing may stay gathered.
bool fsdp_every_param_in_a_unit() {
  const std::vector<mxddp::ParamSpec> params{{.name = "fc1.weight", .shape = mxddp::Shape{8, 8}},
                                             {.name = "fc2.weight", .shape = mxddp::Shape{8, 8}}};
  const std::vector<std::vector<int>> units{{0}, {1}};
  bool ok = true;
  mxddp::run_local(kRanks, [&](mxddp::Communicator& comm) {
    std::vector<float> init(64, 0.5f);  // [8, 8] f32, both params
    const mxddp::TensorView init_view{init.data(), mxddp::DType::kF32, mxddp::Shape{8, 8}, mxddp::Device::cpu()};
    mxddp::MemoryTracker tracker;
    mxddp::FsdpConfig config;
    config.param_dtype = mxddp::DType::kF32;
    mxddp::FullyShardedDataParallel fsdp(comm, params, units, config, tracker, {init_view, init_view});
    mxddp::DistributedOptimizer optimizer(fsdp, mxddp::OptimizerConfig{.lr = 0.1f}, tracker);
    optimizer.zero_grad();
    for (int p : {0, 1}) {  // forward, unit by unit
      fsdp.before_forward({p});
      fsdp.after_forward({p});
    }
    for (int p : {1, 0}) {  // backward in reverse: each unit's grad is in before its post-backward
      fsdp.before_backward({p});
      mxddp::TensorView grad = fsdp.main_grad(p);
      for (int64_t i = 0; i < grad.numel(); ++i) grad.data_as<float>()[i] += 1.0f;
      fsdp.grad_ready(p);
      fsdp.after_backward({p});
    }
    fsdp.finish_grad_sync();
    optimizer.step();
    optimizer.zero_grad();
    for (int p : {0, 1}) {
      fsdp.before_forward({p});
      const float after = fsdp.param(p).data_as<const float>()[0];
      fsdp.after_forward({p});
      if (!(after < 0.5f)) ok = false;  // the step moved the param against its positive gradient
    }
    fsdp.release_gathered_params();
  });
  if (!ok) std::fprintf(stderr, "fsdp: a param did not move in the step\n");
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CHECKPOINT_DIR\n", argv[0]);
    return 2;
  }
  try {
    if (!all_reduce_sums()) return 1;
    if (!fsdp_every_param_in_a_unit()) return 1;

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
    std::printf("mxddp consumer: all_reduce over %d ranks exact, FSDP with every param in a unit ok, 3 GPT iterations with loss %.3f -> %.3f, checkpoint "
                "at step %lld ok\n",
                kRanks, losses.front(), losses.back(), static_cast<long long>(info.step));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
