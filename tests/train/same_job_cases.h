// The field classes a launch check must catch (launch_check.h): one field of each, as a change to a
// TrainConfig and the flag the refusal must name. Shared by the in-process and the mpirun suites.
#pragma once

#include <functional>
#include <vector>

#include <mxddp/train.h>

namespace mxddp::testing {

struct Mismatch {
  const char* what;    // the field class
  const char* flag;    // the name the message must give
  std::function<void(TrainConfig&)> change;
};

// One field of each class that must agree.
inline std::vector<Mismatch> mismatches() {
  return {
      {"model shape", "--hidden-size", [](TrainConfig& c) { c.model.hidden_size = 64; }},
      {"model depth", "--num-layers", [](TrainConfig& c) { c.model.num_layers = 3; }},
      {"batch", "--global-batch-size", [](TrainConfig& c) { c.global_batch_size = 16; }},
      {"schedule", "--train-iters", [](TrainConfig& c) { c.train_iters = 2; }},
      {"learning rate", "--lr", [](TrainConfig& c) { c.lr = 5e-3f; }},
      {"optimizer", "--weight-decay", [](TrainConfig& c) { c.optimizer.weight_decay = 0.5f; }},
      {"clipping", "--clip-grad", [](TrainConfig& c) { c.optimizer.clip_grad = 0.01f; }},
      {"DDP", "--overlap-grad-reduce", [](TrainConfig& c) { c.ddp.overlap_grad_reduce = true; }},
      {"FSDP", "--use-megatron-fsdp", [](TrainConfig& c) { c.use_megatron_fsdp = true; }},
      {"precision", "--bf16", [](TrainConfig& c) { c.bf16 = true; }},
      {"recompute", "--recompute-granularity", [](TrainConfig& c) { c.recompute_granularity = RecomputeGranularity::kFull; }},
      {"seed", "--seed", [](TrainConfig& c) { c.seed = 2; }},
      {"data", "--corpus-bytes", [](TrainConfig& c) { c.corpus_bytes = 1 << 17; }},
      {"vocabulary", "--vocab-size", [](TrainConfig& c) { c.tokenizer_vocab_size = 200; }},
      {"checkpoint", "--load", [](TrainConfig& c) { c.load_dir = "/nonexistent/history"; }},
  };
}

}  // namespace mxddp::testing
