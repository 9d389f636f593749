// MXFP8 blocks: the scale rule at its boundaries, the NaN/Inf and zero policies, partial blocks,
// row-wise vs column-wise (the transpose), bf16 input, the parallel path, and error bounds.
#include <algorithm>
#include <bit>
#include <cmath>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include <mxddp/quant.h>

namespace mxddp {
namespace {

constexpr Fp8Format E4 = Fp8Format::kE4M3, E5 = Fp8Format::kE5M2;
constexpr ScaleMode RCEIL = ScaleMode::kRceil, FLOOR = ScaleMode::kFloor;

TEST(MxScale, BoundaryCases) {
  // E4M3, max 448 = 1.75 x 2^8.
  EXPECT_EQ(mx_scale_for_amax(448, E4, RCEIL), 127);  // fits exactly: 2^0
  EXPECT_EQ(mx_scale_for_amax(448, E4, FLOOR), 127);  // floor(log2 448) = 8, minus emax 8
  EXPECT_EQ(mx_scale_for_amax(480, E4, RCEIL), 128);  // 480/448 > 1: 2^1
  EXPECT_EQ(mx_scale_for_amax(480, E4, FLOOR), 127);  // still binade 8: 480 will saturate
  EXPECT_EQ(mx_scale_for_amax(500, E4, RCEIL), 128);
  EXPECT_EQ(mx_scale_for_amax(500, E4, FLOOR), 127);
  EXPECT_EQ(mx_scale_for_amax(448.00003f, E4, RCEIL), 128) << "one ulp above a power-of-two fit";
  EXPECT_EQ(mx_scale_for_amax(224, E4, RCEIL), 126);
  // f32 max ~ 2^128: rceil ceil(log2(3.4e38 / 448)) = 120; floor 127 - 8 = 119.
  EXPECT_EQ(mx_scale_for_amax(3.4028235e38f, E4, RCEIL), 127 + 120);
  EXPECT_EQ(mx_scale_for_amax(3.4028235e38f, E4, FLOOR), 127 + 119);
  EXPECT_EQ(mx_scale_for_amax(3.4028235e38f, E5, RCEIL), 127 + 113);  // 57344 = 1.75 x 2^15
  // Subnormal blocks clamp to E8M0's smallest scale, 2^-127 (byte 0).
  EXPECT_EQ(mx_scale_for_amax(1e-40f, E4, RCEIL), 0);
  EXPECT_EQ(mx_scale_for_amax(1e-40f, E4, FLOOR), 0);
  EXPECT_EQ(mx_scale_for_amax(0.0f, E4, RCEIL), 0) << "a zero block gets scale byte 0";
  EXPECT_EQ(mx_scale_for_amax(NAN, E4, RCEIL), kE8M0Nan);
  EXPECT_EQ(mx_scale_for_amax(INFINITY, E5, FLOOR), kE8M0Nan);
  EXPECT_TRUE(std::isnan(e8m0_to_f32(kE8M0Nan)));
  EXPECT_EQ(e8m0_to_f32(127), 1.0f);
  EXPECT_EQ(e8m0_to_f32(0), std::ldexp(1.0f, -127));
}

// The scale rules from their definitions, in double: floor(log2 amax) - emax_elem, and the smallest
// X with amax <= max_elem x 2^X; clamped to E8M0's range.
int reference_scale(float amax, Fp8Format f, ScaleMode m) {
  if (std::isnan(amax) || std::isinf(amax)) return kE8M0Nan;
  if (amax == 0.0f) return 0;
  const int emax = f == E4 ? 8 : 15;
  int x;
  if (m == FLOOR) {
    x = static_cast<int>(std::floor(std::log2(static_cast<double>(amax)))) - emax;
  } else {
    x = static_cast<int>(std::ceil(std::log2(static_cast<double>(amax) / fp8_max(f)))) - 2;
    while (static_cast<double>(amax) > std::ldexp(static_cast<double>(fp8_max(f)), x)) ++x;  // exact fix-up of log2
  }
  return std::clamp(x, -127, 127) + 127;
}

TEST(MxScale, MatchesTheDefinitionsForEveryBf16AmaxAndAnF32Sample) {
  for (Fp8Format f : {E4, E5})
    for (ScaleMode m : {RCEIL, FLOOR}) {
      for (uint32_t b = 0; b <= 0x7fff; ++b) {
        const float amax = bf16_to_f32(static_cast<bf16_bits>(b));
        ASSERT_EQ(mx_scale_for_amax(amax, f, m), reference_scale(amax, f, m)) << amax;
      }
      for (uint64_t u = 0; u < 0x7f800000u; u += 997) {
        const float amax = std::bit_cast<float>(static_cast<uint32_t>(u));
        ASSERT_EQ(mx_scale_for_amax(amax, f, m), reference_scale(amax, f, m)) << amax;
      }
    }
}

struct Quantized {
  std::vector<uint8_t> data, scales;
  std::vector<float> back;
};

Quantized run(const std::vector<float>& x, int64_t rows, int64_t cols, QuantizeOptions o) {
  Quantized q;
  const Shape ss = mx_scale_shape(rows, cols, o.axis);
  q.data.resize(static_cast<size_t>(rows * cols));
  q.scales.resize(static_cast<size_t>(ss.numel()));
  q.back.resize(x.size());
  const TensorView in{const_cast<float*>(x.data()), DType::kF32, Shape{rows, cols}};
  const TensorView data{q.data.data(), DType::kU8, Shape{rows, cols}};
  const TensorView scales{q.scales.data(), DType::kU8, ss};
  mx_quantize(in, data, scales, o);
  mx_dequantize(data, scales, TensorView{q.back.data(), DType::kF32, Shape{rows, cols}}, o);
  return q;
}

TEST(MxQuantize, SaturationDependsOnScaleMode) {
  std::vector<float> x(32, 1.0f);
  x[5] = 480.0f;
  x[6] = 500.0f;
  const Quantized floor_q = run(x, 1, 32, {E4, FLOOR, QuantAxis::kRow});
  EXPECT_EQ(floor_q.back[5], 448.0f) << "floor mode saturates the top of the block";
  EXPECT_EQ(floor_q.back[6], 448.0f);
  const Quantized rceil_q = run(x, 1, 32, {E4, RCEIL, QuantAxis::kRow});
  EXPECT_EQ(rceil_q.back[5], 480.0f) << "rceil never saturates: 480 = 240 x 2";
  EXPECT_EQ(rceil_q.back[6], 512.0f) << "500/2 = 250 rounds to 256 in E4M3";
  EXPECT_EQ(rceil_q.back[0], 1.0f);
}

TEST(MxQuantize, NanOrInfPoisonsOnlyItsBlock) {
  for (float bad : {NAN, INFINITY, -INFINITY})
    for (QuantAxis axis : {QuantAxis::kRow, QuantAxis::kCol}) {
      std::vector<float> x(64 * 64, 0.5f);
      x[3 * 64 + 40] = bad;  // row 3, column 40
      const Quantized q = run(x, 64, 64, {E4, RCEIL, axis});
      for (int64_t r = 0; r < 64; ++r)
        for (int64_t c = 0; c < 64; ++c) {
          const bool same_block = axis == QuantAxis::kRow ? (r == 3 && c / 32 == 1) : (c == 40 && r / 32 == 0);
          const float v = q.back[static_cast<size_t>(r * 64 + c)];
          if (same_block) ASSERT_TRUE(std::isnan(v)) << r << "," << c;
          else ASSERT_EQ(v, 0.5f) << r << "," << c;
        }
    }
}

TEST(MxQuantize, ZeroAndSubnormalBlocks) {
  std::vector<float> x(64, 0.0f);
  x[33] = -0.0f;
  for (int i = 40; i < 64; ++i) x[static_cast<size_t>(i)] = 1e-40f * static_cast<float>(i - 39);  // f32 subnormals
  const Quantized q = run(x, 1, 64, {E4, RCEIL, QuantAxis::kRow});
  EXPECT_EQ(q.scales[0], 0);
  EXPECT_EQ(q.scales[1], 0) << "clamped to E8M0's smallest";
  for (int i = 0; i < 32; ++i) EXPECT_EQ(q.back[static_cast<size_t>(i)], 0.0f);
  EXPECT_TRUE(std::signbit(q.back[33]));
  // 1e-40 x 2^127 = 0.017: inside E4M3's range, within its precision.
  for (int i = 40; i < 64; ++i) EXPECT_NEAR(q.back[static_cast<size_t>(i)], x[static_cast<size_t>(i)], 0.07 * x[static_cast<size_t>(i)]);
}

// The error of every element is at most half a quantum of its binade in the scaled domain.
TEST(MxQuantize, RoundTripErrorBounds) {
  std::mt19937 rng(11);
  std::normal_distribution<float> d(0, 1);
  for (Fp8Format f : {E4, E5})
    for (ScaleMode m : {RCEIL, FLOOR}) {
      const int mant = f == E4 ? 3 : 2;
      const int emin = f == E4 ? -6 : -14;
      std::vector<float> x(96 * 80);
      for (float& v : x) v = d(rng) * std::exp2(static_cast<float>(static_cast<int>(rng() % 16) - 8));
      const Quantized q = run(x, 96, 80, {f, m, QuantAxis::kRow});
      for (int64_t r = 0; r < 96; ++r)
        for (int64_t c = 0; c < 80; ++c) {
          const float scale = e8m0_to_f32(q.scales[static_cast<size_t>(r * 3 + c / 32)]);
          const double y = std::fabs(x[static_cast<size_t>(r * 80 + c)]) / scale;
          const double max_elem = fp8_max(f);
          const int e = std::max(y > 0 ? std::ilogb(y) : emin, emin);
          const double half_quantum = std::ldexp(0.5, e - mant) * scale;
          const double err = std::fabs(q.back[static_cast<size_t>(r * 80 + c)] - x[static_cast<size_t>(r * 80 + c)]);
          if (y <= max_elem) ASSERT_LE(err, half_quantum) << fp8_format_name(f) << " " << scale_mode_name(m);
          else ASSERT_EQ(std::fabs(q.back[static_cast<size_t>(r * 80 + c)]), max_elem * scale) << "saturated";
        }
    }
}

// Column-wise quantization of X is row-wise quantization of X transposed, for shapes with
// partial blocks in both dimensions; both agree with a per-block scalar reference.
TEST(MxQuantize, ColumnWiseIsRowWiseOfTransposeWithPartialBlocks) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> d(-3, 3);
  for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{33, 70}, {1, 1}, {64, 31}, {95, 95}}) {
    std::vector<float> x(static_cast<size_t>(rows * cols)), xt(x.size());
    for (float& v : x) v = d(rng) * std::exp2(static_cast<float>(static_cast<int>(rng() % 8)));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) xt[static_cast<size_t>(c * rows + r)] = x[static_cast<size_t>(r * cols + c)];
    const Quantized col = run(x, rows, cols, {E4, RCEIL, QuantAxis::kCol});
    const Quantized row_t = run(xt, cols, rows, {E4, RCEIL, QuantAxis::kRow});
    const int64_t blocks = (rows + 31) / 32;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        ASSERT_EQ(col.data[static_cast<size_t>(r * cols + c)], row_t.data[static_cast<size_t>(c * rows + r)]);
    for (int64_t b = 0; b < blocks; ++b)
      for (int64_t c = 0; c < cols; ++c)
        ASSERT_EQ(col.scales[static_cast<size_t>(b * cols + c)], row_t.scales[static_cast<size_t>(c * blocks + b)]);
    // Scalar reference of the row-wise blocks of xt.
    for (int64_t r = 0; r < cols; ++r)
      for (int64_t b = 0; b < blocks; ++b) {
        float amax = 0;
        for (int64_t k = b * 32; k < std::min(rows, b * 32 + 32); ++k) amax = std::max(amax, std::fabs(xt[static_cast<size_t>(r * rows + k)]));
        const uint8_t s = mx_scale_for_amax(amax, E4, RCEIL);
        ASSERT_EQ(row_t.scales[static_cast<size_t>(r * blocks + b)], s);
        for (int64_t k = b * 32; k < std::min(rows, b * 32 + 32); ++k)
          ASSERT_EQ(row_t.data[static_cast<size_t>(r * rows + k)], f32_to_fp8(xt[static_cast<size_t>(r * rows + k)] / e8m0_to_f32(s), E4));
      }
  }
}

TEST(MxQuantize, Bf16InputAndParallelPathMatchTheSerialF32Path) {
  const int64_t rows = 512, cols = 1024;  // large enough for the threaded path
  std::mt19937 rng(8);
  std::uniform_real_distribution<float> d(-2, 2);
  std::vector<float> x(static_cast<size_t>(rows * cols));
  std::vector<bf16_bits> xb(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    xb[i] = f32_to_bf16(d(rng));
    x[i] = bf16_to_f32(xb[i]);
  }
  for (QuantAxis axis : {QuantAxis::kRow, QuantAxis::kCol}) {
    const QuantizeOptions o{E5, FLOOR, axis};
    const Quantized f = run(x, rows, cols, o);
    std::vector<uint8_t> data(x.size()), scales(static_cast<size_t>(mx_scale_shape(rows, cols, axis).numel()));
    mx_quantize(TensorView{xb.data(), DType::kBF16, Shape{rows, cols}}, TensorView{data.data(), DType::kU8, Shape{rows, cols}},
                TensorView{scales.data(), DType::kU8, mx_scale_shape(rows, cols, axis)}, o);
    EXPECT_EQ(data, f.data);
    EXPECT_EQ(scales, f.scales);
    // Serial reference for a few rows (the threads split the rows).
    if (axis == QuantAxis::kRow)
      for (int64_t r : {int64_t{0}, rows / 2 - 1, rows / 2, rows - 1}) {
        const Quantized one = run(std::vector<float>(x.begin() + r * cols, x.begin() + (r + 1) * cols), 1, cols, o);
        for (int64_t c = 0; c < cols; ++c) ASSERT_EQ(f.data[static_cast<size_t>(r * cols + c)], one.data[static_cast<size_t>(c)]);
      }
  }
}

TEST(Mxfp8Tensor, HoldsBothOrientationsChargedAsMxfp8) {
  MemoryTracker tracker;
  Mxfp8Tensor t(70, 33, E4, RCEIL, tracker);
  EXPECT_EQ(tracker.usage().live(MemoryCategory::kMxfp8), 70 * 33 * 2 + 70 * 2 + 3 * 33);
  std::vector<float> x(70 * 33);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(static_cast<float>(i));
  t.quantize_from(TensorView{x.data(), DType::kF32, Shape{70, 33}});
  std::vector<float> back(x.size());
  for (QuantAxis axis : {QuantAxis::kRow, QuantAxis::kCol}) {
    mx_dequantize(t.data(axis), t.scales(axis), TensorView{back.data(), DType::kF32, Shape{70, 33}}, t.options(axis));
    for (size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(back[i], x[i], 0.07 * std::fabs(x[i]) + 1e-3);
  }
}

TEST(MxQuantize, RejectsBadShapesAndNames) {
  std::vector<float> x(64);
  std::vector<uint8_t> d(64), s(2);
  const TensorView in{x.data(), DType::kF32, Shape{2, 32}};
  EXPECT_THROW(mx_quantize(in, TensorView{d.data(), DType::kU8, Shape{2, 32}}, TensorView{s.data(), DType::kU8, Shape{1, 2}}, {}),
               Error);
  EXPECT_THROW(mx_quantize(TensorView{x.data(), DType::kF32, Shape{64}}, TensorView{d.data(), DType::kU8, Shape{64}},
                           TensorView{s.data(), DType::kU8, Shape{2}}, {}),
               Error);
  EXPECT_NO_THROW(mx_quantize(in, TensorView{d.data(), DType::kU8, Shape{2, 32}}, TensorView{s.data(), DType::kU8, Shape{2, 1}}, {}));
  EXPECT_THROW(parse_fp8_format("e3m4"), Error);
  EXPECT_THROW(parse_scale_mode("ceil"), Error);
  EXPECT_EQ(parse_quant_axis("col"), QuantAxis::kCol);
}

}  // namespace
}  // namespace mxddp
