// `mxddp data`: the samples `mxddp train` reads from Megatron indexed datasets, printed as token
// ids (docs/data.md): the same flags as train's data and vocabulary flags, plus which samples.
// For checking a dataset, and for an independent reference to compare the sample index against.
#pragma once

#include <cstdint>
#include <string>

#include <CLI/CLI.hpp>

#include "data_flags.h"

namespace mxddp::app {

struct DataArgs {
  DataFlags data;
  int seq_length = 64;  // the tiny preset's, as train's default
  uint64_t seed = 1234;
  std::string split = "train";  // which split's samples: train, valid or test
  int64_t first = 0;            // sample numbers [first, first + count) of that split's stream
  int64_t count = 1;
};

CLI::App* add_data_command(CLI::App& app, DataArgs& args);
// Prints {"split": ..., "first": ..., "samples": [[ids], ...]} (one sample a line); throws Error.
void run_data_command(DataArgs& args);

}  // namespace mxddp::app
