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
// Decoded value of every code, built from the field definitions. E4M3 has no infinities and one
// NaN magnitude (S.1111.111); E5M2 is IEEE-like (exponent all ones: Inf or NaN).
std::array<float, 256> build_table(const fp8::Spec& s, bool ieee_specials) {
  const int exp_all_ones = (1 << (7 - s.mant_bits)) - 1;
  std::array<float, 256> t{};
  for (int c = 0; c < 256; ++c) {
    const int mag = c & 0x7f;
    const int exp_field = mag >> s.mant_bits;
    const int mant = mag & ((1 << s.mant_bits) - 1);
    float v;
    if (ieee_specials && exp_field == exp_all_ones) v = mant == 0 ? INFINITY : NAN;
    else if (!ieee_specials && mag == 0x7f) v = NAN;
    else if (exp_field == 0) v = std::ldexp(static_cast<float>(mant), s.emin - s.mant_bits);
    else v = std::ldexp(static_cast<float>(mant + (1 << s.mant_bits)), exp_field - s.bias - s.mant_bits);
    t[static_cast<size_t>(c)] = (c & 0x80) ? -v : v;
  }
  return t;
}
const std::array<float, 256>& table(Fp8Format f) {
  static const std::array<float, 256> e4m3 = build_table(fp8::kE4M3, false);
  static const std::array<float, 256> e5m2 = build_table(fp8::kE5M2, true);
  return f == Fp8Format::kE4M3 ? e4m3 : e5m2;
}
}  // namespace

float fp8_to_f32(uint8_t code, Fp8Format f) { return table(f)[code]; }

// Integer arithmetic on amax's bits, exact for both rules because both formats' largest value is
// 1.75 x 2^emax. With amax = m x 2^e (m in [1, 2)):
//   floor: X = e - emax
//   rceil: the smallest X with m x 2^e <= 1.75 x 2^(emax + X), which is e - emax, plus one when
//          m > 1.75, i.e. when the mantissa field exceeds 0.75 x 2^23 = 0x600000.
// Zero and f32 subnormals (e <= -127) give X < -127 in both rules: clamped to byte 0.
uint8_t mx_scale_for_amax(float amax, Fp8Format f, ScaleMode m) {
  const uint32_t bits = std::bit_cast<uint32_t>(amax) & 0x7fffffffu;
  if (bits >= 0x7f800000u) return kE8M0Nan;  // NaN or Inf
  if (bits < 0x00800000u) return 0;
  int x = static_cast<int>(bits >> 23) - 127 - fp8::spec(f).emax;
  if (m == ScaleMode::kRceil && (bits & 0x7fffffu) > 0x600000u) ++x;
  return static_cast<uint8_t>(std::clamp(x, -127, 127) + 127);
}

float e8m0_to_f32(uint8_t scale) {
  if (scale == kE8M0Nan) return NAN;
  return std::ldexp(1.0f, static_cast<int>(scale) - 127);
}

}  // namespace mxddp
