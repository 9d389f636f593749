// `fsdp_bench sweep`: the memory/time front of FSDP's param gather (issue 12), see fsdp_sweep.cc.
#pragma once

#include <optional>

#include <CLI/CLI.hpp>

namespace mxddp::bench {

// Adds the `sweep` subcommand to app; run_sweep_if_chosen runs it when it was given on the command
// line (after parsing) and returns the exit status (1 after printing an error), else nullopt.
void add_sweep_command(CLI::App& app);
std::optional<int> run_sweep_if_chosen();

}  // namespace mxddp::bench
