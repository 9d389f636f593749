// `mxddp ckpt inspect DIR [--json]`: prints what a checkpoint holds and runs every check a load
// runs that does not need the model (manifest checksum, file sizes and CRC-32s, safetensors
// headers, each tensor's dtype and size, the coverage of every param), as text or one JSON object.
#pragma once

#include <string>

#include <CLI/CLI.hpp>

namespace mxddp::app {

struct CkptArgs {
  std::string dir;
  bool json = false;
};

CLI::App* add_ckpt_command(CLI::App& app, CkptArgs& args);
// Returns the process exit status: 0 if the checkpoint passes every check, 1 if not. An
// untrustworthy manifest throws Error in text mode; with --json it is reported as a problem.
int run_ckpt_inspect(const CkptArgs& args);

}  // namespace mxddp::app
