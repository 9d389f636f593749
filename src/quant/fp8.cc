// FP8 elements and E8M0 scales: names, the decoder tables, and the per-block scale rule.
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>

#include "fp8_codec.h"

namespace mxddp {

std::string_view fp8_format_name(Fp8Format f) { return f == Fp8Format::kE4M3 ? "e4m3" : "e5m2"; }
std::string_view scale_mode_name(ScaleMode m) { return m == ScaleMode::kRceil ? "rceil" : "floor"; }

Fp8Format parse_fp8_format(std::string_view name) {
  if (name == "e4m3") return Fp8Format::kE4M3;
  if (name == "e5m2") return Fp8Format::kE5M2;
  MXDDP_FAIL("unknown FP8 element format '{}'; valid: e4m3, e5m2", name);
}

ScaleMode parse_scale_mode(std::string_view name) {
  if (name == "rceil") return ScaleMode::kRceil;
  if (name == "floor") return ScaleMode::kFloor;
  MXDDP_FAIL("unknown scale mode '{}'; valid: rceil, floor", name);
}

QuantAxis parse_quant_axis(std::string_view name) {
  if (name == "row") return QuantAxis::kRow;
  if (name == "col") return QuantAxis::kCol;
  MXDDP_FAIL("unknown quantization axis '{}'; valid: row, col", name);
}

std::string_view quant_axis_name(QuantAxis a) {
  switch (a) {
    case QuantAxis::kRow: return "row";
    case QuantAxis::kCol: return "col";
  }
  MXDDP_FAIL("unknown quantization axis {}", static_cast<int>(a));
}

float fp8_max(Fp8Format f) { return fp8::spec(f).max; }

uint8_t f32_to_fp8(float x, Fp8Format f) { return fp8::encode(x, fp8::spec(f)); }

namespace {
// Decoded value of every code (fp8_element.h's decode, shared with the CUDA kernels), looked up.
std::array<float, 256> build_table(const fp8::Spec& s) {
  std::array<float, 256> t{};
  for (int c = 0; c < 256; ++c) t[static_cast<size_t>(c)] = fp8::decode(static_cast<uint8_t>(c), s);
  return t;
}
const std::array<float, 256>& table(Fp8Format f) {
  static const std::array<float, 256> e4m3 = build_table(fp8::kE4M3);
  static const std::array<float, 256> e5m2 = build_table(fp8::kE5M2);
  return f == Fp8Format::kE4M3 ? e4m3 : e5m2;
}
}  // namespace

float fp8_to_f32(uint8_t code, Fp8Format f) { return table(f)[code]; }

// fp8_element.h has the rule (shared with the CUDA kernels).
uint8_t mx_scale_for_amax(float amax, Fp8Format f, ScaleMode m) {
  return fp8::scale_for_amax(amax, fp8::spec(f), m == ScaleMode::kRceil);
}

float e8m0_to_f32(uint8_t scale) { return fp8::e8m0_value(scale); }

}  // namespace mxddp
