// DType metadata and the f32<->bf16, f32<->f16 conversions, exhaustively over all 16-bit patterns.
//
// The references are independent of the implementation's bit tricks:
//   - widening: the value is rebuilt from sign, exponent and mantissa with std::ldexp;
//   - narrowing: every f32 at, just around, and between each pair of neighbouring 16-bit values is
//     rounded by comparing distances in double (ties to the even pattern), and for f16 also by
//     the compiler's own _Float16 conversion.
#include <bit>
#include <cmath>
#include <limits>

#include <gtest/gtest.h>

#include <mxddp/core.h>

namespace mxddp {
namespace {

TEST(DType, SizesAndNamesRoundTrip) {
  EXPECT_EQ(dtype_size_bytes(DType::kF32), 4u);
  EXPECT_EQ(dtype_size_bytes(DType::kBF16), 2u);
  EXPECT_EQ(dtype_size_bytes(DType::kF16), 2u);
  for (DType d : {DType::kE4M3, DType::kE5M2, DType::kE8M0, DType::kU8}) EXPECT_EQ(dtype_size_bytes(d), 1u);
  for (DType d : kAllDTypes) EXPECT_EQ(parse_dtype(dtype_name(d)), d);
  try {
    parse_dtype("fp32");
    FAIL() << "parse_dtype accepted 'fp32'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'fp32'"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("valid: f32, bf16"), std::string::npos);
  }
}

// Decodes a 16-bit float with `exp_bits` exponent bits by arithmetic, not by bit placement.
double decode16(uint16_t bits, int exp_bits) {
  const int man_bits = 15 - exp_bits;
  const int bias = (1 << (exp_bits - 1)) - 1;
  const double sign = (bits & 0x8000) ? -1.0 : 1.0;
  const int e = (bits >> man_bits) & ((1 << exp_bits) - 1);
  const int m = bits & ((1 << man_bits) - 1);
  if (e == (1 << exp_bits) - 1) return m ? std::numeric_limits<double>::quiet_NaN() : sign * INFINITY;
  if (e == 0) return sign * std::ldexp(m, 1 - bias - man_bits);
  return sign * std::ldexp(m + (1 << man_bits), e - bias - man_bits);
}

// Round-to-nearest-even of x onto the 16-bit format, by searching neighbours: the answer is the
// finite pattern nearest in value, ties to an even mantissa; beyond the largest finite value by
// half an ulp or more (the next binade's first step), Inf.
uint16_t round16_reference(double x, int exp_bits) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(x);
  const uint16_t inf = static_cast<uint16_t>(((1 << exp_bits) - 1) << (15 - exp_bits));
  const uint16_t max_finite = static_cast<uint16_t>(inf - 1);
  const double max_v = decode16(max_finite, exp_bits);
  const double ulp_at_max = max_v - decode16(max_finite - 1, exp_bits);
  if (a >= max_v + ulp_at_max / 2) return sign | inf;
  // Binary search for the largest pattern with value <= a (positive patterns are ordered).
  uint16_t lo = 0, hi = max_finite;
  while (lo < hi) {
    const uint16_t mid = static_cast<uint16_t>((lo + hi + 1) / 2);
    if (decode16(mid, exp_bits) <= a) lo = mid; else hi = static_cast<uint16_t>(mid - 1);
  }
  if (lo == max_finite) return sign | lo;
  const double below = decode16(lo, exp_bits), above = decode16(lo + 1, exp_bits);
  if (a - below < above - a) return sign | lo;
  if (a - below > above - a) return sign | static_cast<uint16_t>(lo + 1);
  return sign | ((lo & 1) ? static_cast<uint16_t>(lo + 1) : lo);
}

struct Format16 {
  const char* name;
  int exp_bits;
  float (*widen)(uint16_t);
  uint16_t (*narrow)(float);
};

const Format16 kBF16{"bf16", 8, bf16_to_f32, f32_to_bf16};
const Format16 kF16{"f16", 5, f16_to_f32, f32_to_f16};

class Conversion16 : public ::testing::TestWithParam<Format16> {};

TEST_P(Conversion16, WideningIsExactForAllPatterns) {
  const Format16 f = GetParam();
  for (uint32_t b = 0; b <= 0xffff; ++b) {
    const auto bits = static_cast<uint16_t>(b);
    const double want = decode16(bits, f.exp_bits);
    const float got = f.widen(bits);
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << f.name << " 0x" << std::hex << b;
      ASSERT_EQ(std::signbit(got), (b & 0x8000) != 0) << f.name << " NaN sign 0x" << std::hex << b;
    } else {
      ASSERT_EQ(static_cast<double>(got), want) << f.name << " 0x" << std::hex << b;
      ASSERT_EQ(std::signbit(got), (b & 0x8000) != 0) << f.name << " sign 0x" << std::hex << b;
    }
  }
}

TEST_P(Conversion16, NarrowingRoundsToNearestEvenAroundEveryPattern) {
  const Format16 f = GetParam();
  for (uint32_t b = 0; b <= 0xffff; ++b) {
    const auto bits = static_cast<uint16_t>(b);
    const float v = f.widen(bits);
    if (std::isnan(v)) {
      const uint16_t back = f.narrow(v);
      ASSERT_TRUE(std::isnan(f.widen(back))) << f.name << ": NaN 0x" << std::hex << b << " did not stay NaN";
      ASSERT_EQ(back & 0x8000, bits & 0x8000) << f.name << ": NaN sign lost";
      continue;
    }
    ASSERT_EQ(f.narrow(v), bits) << f.name << ": 0x" << std::hex << b << " does not round-trip";
    if (std::isinf(v)) continue;
    // Probe f32 values around v and halfway to the next pattern up (in magnitude).
    const float next = f.widen(static_cast<uint16_t>(bits + 1));
    const float mid = static_cast<float>((static_cast<double>(v) + static_cast<double>(next)) / 2);
    for (float probe : {std::nextafter(v, 0.0f), std::nextafter(v, 2 * v + 1), mid, std::nextafter(mid, 0.0f),
                        std::nextafter(mid, INFINITY), std::nextafter(mid, -INFINITY)}) {
      if (std::isnan(probe) || std::isinf(probe)) continue;
      ASSERT_EQ(f.narrow(probe), round16_reference(probe, f.exp_bits))
          << f.name << ": f32 " << probe << " (0x" << std::hex << std::bit_cast<uint32_t>(probe) << ")";
    }
  }
}

TEST_P(Conversion16, SpecialValues) {
  const Format16 f = GetParam();
  EXPECT_EQ(f.narrow(0.0f), 0x0000);
  EXPECT_EQ(f.narrow(-0.0f), 0x8000);
  EXPECT_TRUE(std::isinf(f.widen(f.narrow(INFINITY))));
  EXPECT_TRUE(std::isinf(f.widen(f.narrow(std::numeric_limits<float>::max()))));
  EXPECT_EQ(f.narrow(std::numeric_limits<float>::denorm_min()), 0x0000);  // f32 subnormals round to 0
  EXPECT_EQ(f.narrow(-std::numeric_limits<float>::denorm_min()), 0x8000);
}

INSTANTIATE_TEST_SUITE_P(Formats, Conversion16, ::testing::Values(kBF16, kF16),
                         [](const ::testing::TestParamInfo<Format16>& info) { return std::string(info.param.name); });

// bf16 keeps f32's exponent range: f32 subnormals are bf16 subnormals, rounded like any value.
TEST(BF16, F32SubnormalsRoundToNearestEven) {
  for (uint32_t u : {0x00000001u, 0x00008000u, 0x00008001u, 0x00018000u, 0x007fffffu, 0x80010000u}) {
    const float x = std::bit_cast<float>(u);
    EXPECT_EQ(f32_to_bf16(x), round16_reference(x, 8)) << std::hex << u;
  }
}

// The compiler's own binary16 conversion is a second, independent reference over a dense sample.
TEST(F16, MatchesCompilerFloat16OnDenseSample) {
  for (uint64_t u = 0; u <= 0xffffffffu; u += 0x1003) {
    const float x = std::bit_cast<float>(static_cast<uint32_t>(u));
    const _Float16 h = static_cast<_Float16>(x);
    const uint16_t want = std::bit_cast<uint16_t>(h);
    const uint16_t got = f32_to_f16(x);
    if (std::isnan(x)) {
      ASSERT_TRUE(std::isnan(f16_to_f32(got)));
      continue;
    }
    ASSERT_EQ(got, want) << "f32 0x" << std::hex << u;
  }
}

TEST(BulkConversion, MatchesScalar) {
  std::vector<float> in = {0.0f, -1.5f, 3.14159f, 1e-40f, 65504.0f, INFINITY};
  std::vector<bf16_bits> mid(in.size());
  std::vector<float> back(in.size());
  convert_f32_to_bf16(in.data(), mid.data(), in.size());
  convert_bf16_to_f32(mid.data(), back.data(), in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    EXPECT_EQ(mid[i], f32_to_bf16(in[i]));
    EXPECT_EQ(back[i], bf16_to_f32(mid[i]));
  }
}

}  // namespace
}  // namespace mxddp
