// FP8 elements against an independent brute-force reference: decode every code by the format's
// field definitions, then for each input pick the nearest finite code of the input's sign (ties to
// the even code; beyond the largest finite value, that value: saturation). Inputs: all 2^16 bf16
// patterns and a dense sample of f32 patterns, for E4M3 and E5M2.
#include <bit>
#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include <mxddp/quant.h>

namespace mxddp {
namespace {

struct Format {
  Fp8Format f;
  int exp_bits, mant_bits, bias;
  bool ieee_specials;  // E5M2: exponent all ones is Inf/NaN; E4M3: only S.1111.111 is NaN
};
const Format kFormats[] = {{Fp8Format::kE4M3, 4, 3, 7, false}, {Fp8Format::kE5M2, 5, 2, 15, true}};

// The value of `code`, or NaN for non-finite codes, from the field definitions alone.
double decode(const Format& fm, int code) {
  const int mag = code & 0x7f;
  const int e = mag >> fm.mant_bits, m = mag & ((1 << fm.mant_bits) - 1);
  const int all_ones = (1 << fm.exp_bits) - 1;
  if (fm.ieee_specials && e == all_ones) return NAN;     // Inf and NaN: never a rounding target
  if (!fm.ieee_specials && e == all_ones && m == (1 << fm.mant_bits) - 1) return NAN;
  const double v = e == 0 ? std::ldexp(m, 1 - fm.bias - fm.mant_bits) : std::ldexp(m + (1 << fm.mant_bits), e - fm.bias - fm.mant_bits);
  return (code & 0x80) ? -v : v;
}

int reference_encode(const Format& fm, float x) {
  const int sign = std::signbit(x) ? 0x80 : 0;
  if (std::isnan(x)) return -1;  // checked separately
  // At or beyond the largest finite value, that value is the nearest (saturation). Stated outright
  // because far out (|x| ~ 1e20) the distances below tie in double precision.
  const int max_mag = fm.ieee_specials ? 0x7B : 0x7E;
  if (std::fabs(static_cast<double>(x)) >= decode(fm, max_mag)) return sign | max_mag;
  int best = -1;
  double best_d = INFINITY;
  for (int mag = 0; mag < 128; ++mag) {
    const double v = decode(fm, sign | mag);
    if (std::isnan(v)) continue;
    const double d = std::fabs(v - static_cast<double>(x));
    if (d < best_d || (d == best_d && (mag & 1) == 0)) {
      best_d = d;
      best = sign | mag;
    }
  }
  return best;
}

void check_input(const Format& fm, float x) {
  const uint8_t got = f32_to_fp8(x, fm.f);
  if (std::isnan(x)) {
    ASSERT_TRUE(std::isnan(fp8_to_f32(got, fm.f))) << "NaN input must give a NaN code";
    ASSERT_EQ(got & 0x80, std::signbit(x) ? 0x80 : 0);
    return;
  }
  ASSERT_EQ(got, reference_encode(fm, x)) << fp8_format_name(fm.f) << " x = " << x << " (0x" << std::hex
                                          << std::bit_cast<uint32_t>(x) << ")";
}

class Fp8Elements : public ::testing::TestWithParam<Format> {};

TEST_P(Fp8Elements, AllBf16PatternsMatchBruteForce) {
  for (uint32_t b = 0; b <= 0xffff; ++b) check_input(GetParam(), bf16_to_f32(static_cast<bf16_bits>(b)));
}

TEST_P(Fp8Elements, DenseF32SampleMatchesBruteForce) {
  // Every 4099th pattern (an odd stride, so all mantissa residues are visited), plus every exact
  // midpoint between neighbouring codes and its f32 neighbours: where rounding decisions live.
  for (uint64_t u = 0; u <= 0xffffffffu; u += 4099) check_input(GetParam(), std::bit_cast<float>(static_cast<uint32_t>(u)));
  const Format& fm = GetParam();
  for (int code = 0; code < 256; ++code) {
    const double a = decode(fm, code), b = decode(fm, code + 1 < 256 ? code + 1 : code);
    if (std::isnan(a) || std::isnan(b) || ((code ^ (code + 1)) & 0x80)) continue;
    const auto mid = static_cast<float>((a + b) / 2);
    for (float x : {mid, std::nextafter(mid, -INFINITY), std::nextafter(mid, INFINITY)}) check_input(fm, x);
  }
}

TEST_P(Fp8Elements, DecoderAgreesWithFieldDefinitions) {
  const Format& fm = GetParam();
  for (int code = 0; code < 256; ++code) {
    const double want = decode(fm, code);
    const float got = fp8_to_f32(static_cast<uint8_t>(code), fm.f);
    if (std::isnan(want)) {
      // E5M2's exponent-all-ones codes are Inf (mantissa 0) or NaN.
      EXPECT_TRUE(std::isnan(got) || std::isinf(got)) << code;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << code;
    }
  }
  EXPECT_EQ(fp8_to_f32(fm.f == Fp8Format::kE4M3 ? 0x7E : 0x7B, fm.f), fp8_max(fm.f));
}

TEST_P(Fp8Elements, SaturatesInfinitiesAndKeepsSignedZero) {
  const Format& fm = GetParam();
  EXPECT_EQ(fp8_to_f32(f32_to_fp8(INFINITY, fm.f), fm.f), fp8_max(fm.f));
  EXPECT_EQ(fp8_to_f32(f32_to_fp8(-INFINITY, fm.f), fm.f), -fp8_max(fm.f));
  EXPECT_EQ(f32_to_fp8(1e30f, fm.f), f32_to_fp8(fp8_max(fm.f), fm.f));
  EXPECT_EQ(f32_to_fp8(0.0f, fm.f), 0x00);
  EXPECT_EQ(f32_to_fp8(-0.0f, fm.f), 0x80);
}

INSTANTIATE_TEST_SUITE_P(Formats, Fp8Elements, ::testing::ValuesIn(kFormats),
                         [](const ::testing::TestParamInfo<Format>& info) { return std::string(fp8_format_name(info.param.f)); });

}  // namespace
}  // namespace mxddp
