// `mxddp ckpt inspect DIR`: prints what a checkpoint holds and whether every file is intact.
#pragma once

#include <string>

#include <CLI/CLI.hpp>

namespace mxddp::app {

struct CkptArgs {
  std::string dir;
};

CLI::App* add_ckpt_command(CLI::App& app, CkptArgs& args);
// Returns the process exit status: 0 if the checkpoint is intact, 1 if a file is damaged.
int run_ckpt_inspect(const CkptArgs& args);

}  // namespace mxddp::app
