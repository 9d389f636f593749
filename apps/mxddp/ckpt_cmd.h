// `mxddp ckpt`: checkpoint tools.
//   inspect DIR [--json]: prints what a checkpoint (a --save directory's newest) holds and runs
//     every check a load runs that does not need the model (manifest checksum, file sizes and
//     CRC-32s, safetensors headers, each tensor's dtype and size, the coverage of every param), as
//     text (columns sized to the longest name) or one JSON object. A history that another run's
//     save changes during the read is read again (checkpoint_history::read_while_unchanged): what
//     that save removed is not reported as damage.
//   export DIR --out FILE [--dtype f32|bf16] [--overwrite]: the params whole, in one safetensors
//     file (ckpt_export.h).
#pragma once

#include <string>

#include <CLI/CLI.hpp>

#include "ckpt_export.h"

namespace mxddp::app {

struct CkptArgs {
  std::string dir;
  bool json = false;
  CkptExportArgs export_args;
  CLI::App* export_cmd = nullptr;  // to tell which subcommand the command line chose
};

// Adds `ckpt` with its subcommands; returns `ckpt`.
CLI::App* add_ckpt_command(CLI::App& app, CkptArgs& args);
// Runs the chosen subcommand; returns the process exit status.
int run_ckpt_command(const CkptArgs& args);
// Returns the process exit status: 0 if the checkpoint passes every check, 1 if not. An
// untrustworthy manifest throws Error in text mode; with --json it is reported as a problem.
int run_ckpt_inspect(const CkptArgs& args);

}  // namespace mxddp::app
