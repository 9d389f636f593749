// `mxddp quantize`: see quantize_cmd.h.
#include "quantize_cmd.h"

#include <cstdio>
#include <filesystem>
#include <vector>

#include <mxddp/input_file.h>
#include <mxddp/output_file.h>
#include <mxddp/quant.h>

#include "cli_checks.h"

namespace mxddp::app {

namespace {

// Both outputs are checked before the input is read, and they must be two files: with one path
// for both the scales would silently overwrite the elements.
void check_outputs(const QuantizeArgs& a) {
  check_output_file_path(a.out_data, "--out-data");
  check_output_file_path(a.out_scales, "--out-scales");
  namespace fs = std::filesystem;
  std::error_code ec;
  const bool same = fs::weakly_canonical(a.out_data, ec) == fs::weakly_canonical(a.out_scales, ec) ||
                    fs::equivalent(a.out_data, a.out_scales, ec);  // hard links to one file
  MXDDP_CHECK(!same, "--out-data '{}' and --out-scales '{}' name the same file: give two different files", a.out_data,
              a.out_scales);
}

std::string_view as_chars(const std::vector<uint8_t>& bytes) {
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

}  // namespace

CLI::App* add_quantize_command(CLI::App& app, QuantizeArgs& a) {
  auto* cmd = app.add_subcommand("quantize", "MXFP8-quantize a raw f32/bf16 matrix file into element and scale files");
  cmd->add_option("--input", a.input, "Raw little-endian input file")->required();
  cmd->add_option("--dtype", a.dtype, "Input element type")->check(CLI::IsMember({"f32", "bf16"}))->capture_default_str();
  cmd->add_option("--shape", a.shape, "MxN")->required();
  cmd->add_option("--axis", a.axis, "row: 1x32 blocks along N; col: 32x1 blocks along M")
      ->check(CLI::IsMember({"row", "col"}))->capture_default_str();
  cmd->add_option("--elem", a.elem, "FP8 element format")->check(CLI::IsMember({"e4m3", "e5m2"}))->capture_default_str();
  cmd->add_option("--scale-mode", a.scale_mode, "rceil (no saturation) or floor (the OCP spec's rule)")
      ->check(CLI::IsMember({"rceil", "floor"}))->capture_default_str();
  cmd->add_option("--out-data", a.out_data, "Output: M*N element bytes, row-major")->required();
  cmd->add_option("--out-scales", a.out_scales, "Output: E8M0 scale bytes, row-major")->required();
  return cmd;
}

void run_quantize_command(const QuantizeArgs& a) {
  const auto [rows, cols] = parse_matrix_shape(a.shape);
  check_outputs(a);
  const DType dtype = parse_dtype(a.dtype);
  const QuantizeOptions o{parse_fp8_format(a.elem), parse_scale_mode(a.scale_mode), parse_quant_axis(a.axis)};
  // Every size below comes from the flags, so each is computed with overflow checks, and the
  // input's size is checked against the shape before anything is read or allocated.
  const int64_t numel = checked_mul(rows, cols, fmt::format("--shape {}: elements", a.shape));
  const int64_t want = checked_mul(numel, static_cast<int64_t>(dtype_size_bytes(dtype)),
                                   fmt::format("--shape {}: bytes of {}", a.shape, a.dtype));
  InputFile in(a.input, "--input");
  MXDDP_CHECK(in.size_bytes() == want, "--input '{}' holds {} bytes; a {} {}x{} matrix is {} bytes", a.input,
              in.size_bytes(), a.dtype, rows, cols, want);
  std::vector<char> raw = in.read_all();
  const Shape scale_shape = mx_scale_shape(rows, cols, o.axis);
  std::vector<uint8_t> data(static_cast<size_t>(numel)), scales(static_cast<size_t>(scale_shape.numel()));
  mx_quantize(TensorView{raw.data(), dtype, Shape{rows, cols}}, TensorView{data.data(), DType::kU8, Shape{rows, cols}},
              TensorView{scales.data(), DType::kU8, scale_shape}, o);
  write_output_file(a.out_data, as_chars(data), "--out-data");
  write_output_file(a.out_scales, as_chars(scales), "--out-scales");
  std::printf("quantized %lldx%lld %s (%s-wise, %s, %s): %zu element bytes -> %s, %s scales -> %s\n",
              static_cast<long long>(rows), static_cast<long long>(cols), a.dtype.c_str(), a.axis.c_str(), a.elem.c_str(),
              a.scale_mode.c_str(), data.size(), a.out_data.c_str(), scale_shape.to_string().c_str(), a.out_scales.c_str());
}

}  // namespace mxddp::app
