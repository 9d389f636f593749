// `mxddp train --load-hf DIR` and `--skip-train` (docs/hf.md): the flags, and the model config an
// HF GPT-2 directory gives the run.
#pragma once

#include <CLI/CLI.hpp>

#include "train_cmd.h"

namespace mxddp::app {

// Adds --load-hf and --skip-train to the group.
void add_hf_train_flags(CLI::App* group, TrainArgs& args);

// With --load-hf: args.config.model becomes the directory's config (read_hf_gpt2_config), and its
// notes (for the banner) are returned. The model flags (args.model_overrides) are applied over it: one that
// changes a field is refused naming it and both values, except --seq-length up to n_positions
// (the run then uses the first positions); --model is refused. Without --load-hf, nothing changes.
std::vector<std::string> apply_load_hf(TrainArgs& args);

// --skip-train's summary: what was evaluated and, per split, Megatron's line ("validation loss at
// iteration N on validation set | lm loss value: ... | lm loss PPL: ... |").
void print_skip_train_summary(const TrainConfig& config, const TrainResult& result);

}  // namespace mxddp::app
