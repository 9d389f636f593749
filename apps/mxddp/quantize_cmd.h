// `mxddp quantize`: MXFP8-quantizes a raw little-endian f32 or bf16 [M, N] file and writes the
// element bytes and the E8M0 scale bytes (both row-major) to two files any tool can check.
#pragma once

#include <string>

#include <CLI/CLI.hpp>

namespace mxddp::app {

struct QuantizeArgs {
  std::string input, dtype = "f32", shape, axis = "row", elem = "e4m3", scale_mode = "rceil";
  std::string out_data, out_scales;
};

CLI::App* add_quantize_command(CLI::App& app, QuantizeArgs& args);
void run_quantize_command(const QuantizeArgs& args);

}  // namespace mxddp::app
