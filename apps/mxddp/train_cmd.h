// `mxddp train`: trains the reference GPT on the local (ranks as threads) or MPI backend with every
// DDP and optimizer option, shows progress, and writes a JSON report. Flags use the config names
// of the library in kebab-case (Megatron's names), with Megatron's command-line spellings as
// aliases where they differ (--ddp-bucket-size for --bucket-size, ...).
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include <mxddp/train.h>

#include "data_flags.h"
#include "megatron_flags.h"

namespace mxddp::app {

struct TrainArgs {
  std::string backend;  // "" when not given: the launcher decides (launcher.h)
  int ranks = 4;
  const CLI::Option* ranks_option = nullptr;  // whether --ranks was given
  int64_t timeout_ms = 600'000;
  std::string model = "tiny";
  const CLI::Option* model_option = nullptr;  // whether --model was given (--load-hf gives the model)
  // Overrides of the preset (--num-layers, ...: GptConfig's described fields), applied in order
  // over --model's config.
  std::vector<std::function<void(GptConfig&)>> model_overrides;
  // Recompute flags, resolved into config.recompute_* by the command: --recompute-activations is
  // full granularity here, --recompute-granularity "" is none, --recompute-modules empty is
  // Megatron's default (core_attn) with selective.
  bool recompute_activations = false;
  std::string recompute_granularity;
  std::vector<std::string> recompute_modules;
  int64_t log_interval = 0;  // plain-line progress every N iterations (0: about 20 lines)
  const CLI::Option* log_interval_option = nullptr;  // given: plain lines even on a terminal
  std::string report;
  std::string metrics_file;
  bool exit_signal_handler = false;  // a stop signal finishes the iteration, saves, exits 0
  std::string exit_signal;            // --exit-signal: the one signal that does; "": SIGTERM and SIGUSR1
  MegatronFlags megatron;            // Megatron's spellings without an mxddp flag of their own
  DataFlags data;                    // --data-path, --split, the vocabulary and tokenizer flags
  const CLI::Option* bucket_size_option = nullptr;  // whether --ddp-bucket-size was given
  std::vector<std::string> notes;    // what those flags changed or did not, for the banner
  TrainConfig config;
};

CLI::App* add_train_command(CLI::App& app, TrainArgs& args);
// Every flag of `mxddp train` on cmd (`mxddp plan` takes the same).
void add_train_flags(CLI::App* cmd, TrainArgs& args);
// Puts the flags together into args.config (the preset and its overrides, the FSDP fields the
// DDP flags share: copy_shared_data_parallel_fields, recompute); throws Error naming a
// contradiction.
void finish_train_config(TrainArgs& args);
// Runs the training; returns the exit status. argc/argv go to MPI_Init with --backend mpi.
int run_train_command(int argc, char** argv, TrainArgs& args);

}  // namespace mxddp::app
