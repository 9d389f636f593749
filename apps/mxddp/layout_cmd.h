// `mxddp layout`: prints the ParamLayout of a param list given as shapes, as a table or as JSON,
// so a layout can be checked by eye or by a script without writing any C++.
#pragma once

#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace mxddp::app {

struct LayoutArgs {
  std::string shapes;          // "95x95,95,..."
  int dp = 1;
  std::string bucket_size = "none";  // elements, "none" (one bucket) or "default" (Megatron's)
  bool use_distributed_optimizer = false;
  bool pad_buckets_for_high_nccl_busbw = false;
  std::vector<int> shared_embedding;  // param indices
  bool json = false;
};

CLI::App* add_layout_command(CLI::App& app, LayoutArgs& args);
// Prints the layout to stdout; throws Error on bad arguments.
void run_layout_command(const LayoutArgs& args);

}  // namespace mxddp::app
