// MXFP8 shard quantization (mx_shard_scales, mx_shard_encode) against the whole-tensor codec: for
// every way of cutting a tensor into dp equal flat shards (blocks straddling ranks included), the
// element-wise MAX of the shards' scales is mx_quantize's scales, and each shard's encoding is
// mx_quantize's data at its offset, bitwise, for both orientations, both element formats, both
// scale modes, f32 and bf16 inputs, and blocks holding zeros, subnormals, NaN and Inf.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include <mxddp/quant.h>

namespace mxddp {
namespace {

struct Case {
  int64_t rows, cols;
  DType dtype;
};

// Values spanning many binades, with special blocks: row 0 all zeros, a subnormal, a NaN, an Inf.
std::vector<float> values_for(int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-30, 30);
  std::vector<float> v(static_cast<size_t>(rows * cols));
  for (float& x : v) x = std::ldexp(normal(gen), exponent(gen) / 3);
  for (int64_t c = 0; c < cols; ++c) v[static_cast<size_t>(c)] = 0.0f;
  if (rows > 2) {
    v[static_cast<size_t>(cols + 1)] = std::numeric_limits<float>::denorm_min() * 7;
    v[static_cast<size_t>(2 * cols + cols / 2)] = std::numeric_limits<float>::quiet_NaN();
  }
  if (rows > 40) v[static_cast<size_t>(40 * cols + cols - 1)] = -std::numeric_limits<float>::infinity();
  return v;
}

// The same values in the case's dtype, as a flat [M*N] view over `storage`.
TensorView as_dtype(const std::vector<float>& v, DType dtype, std::vector<char>& storage) {
  storage.assign(v.size() * dtype_size_bytes(dtype), 0);
  if (dtype == DType::kF32) std::memcpy(storage.data(), v.data(), v.size() * sizeof(float));
  else convert_f32_to_bf16(v.data(), reinterpret_cast<bf16_bits*>(storage.data()), v.size());
  return TensorView{storage.data(), dtype, Shape{static_cast<int64_t>(v.size())}, Device::cpu()};
}

TensorView flat_part(const TensorView& flat, int64_t offset, int64_t n) {
  return TensorView{static_cast<char*>(flat.data) + static_cast<size_t>(offset) * dtype_size_bytes(flat.dtype),
                    flat.dtype, Shape{n}, flat.device};
}

TEST(Mxfp8Shard, MaxOfShardScalesAndShardEncodingEqualTheWholeTensorsQuantization) {
  const std::vector<Case> cases = {{64, 96, DType::kF32}, {64, 96, DType::kBF16}, {45, 70, DType::kF32},
                                   {33, 31, DType::kBF16}, {1, 100, DType::kF32}, {100, 1, DType::kF32}};
  int checked = 0;
  for (const Case& k : cases)
    for (Fp8Format elem : {Fp8Format::kE4M3, Fp8Format::kE5M2})
      for (ScaleMode mode : {ScaleMode::kRceil, ScaleMode::kFloor})
        for (QuantAxis axis : {QuantAxis::kRow, QuantAxis::kCol})
          for (int dp : {1, 2, 3, 4, 7}) {
            const Shape shape{k.rows, k.cols};
            const QuantizeOptions o{elem, mode, axis};
            std::vector<char> storage;
            const TensorView flat = as_dtype(values_for(k.rows, k.cols, 17 + static_cast<uint32_t>(dp)), k.dtype, storage);
            const TensorView input{flat.data, flat.dtype, shape, flat.device};
            const Shape scale_shape = mx_scale_shape(k.rows, k.cols, axis);
            std::vector<uint8_t> want_data(static_cast<size_t>(shape.numel())), want_scales(static_cast<size_t>(scale_shape.numel()));
            mx_quantize(input, TensorView{want_data.data(), DType::kU8, shape, Device::cpu()},
                        TensorView{want_scales.data(), DType::kU8, scale_shape, Device::cpu()}, o);
            // dp shards of ceil(numel / dp) elements (the last one shorter), as a padded bucket cuts them.
            const int64_t per = (shape.numel() + dp - 1) / dp;
            std::vector<uint8_t> max_scales(want_scales.size(), 0), part(want_scales.size());
            for (int r = 0; r < dp; ++r) {
              const int64_t at = std::min(shape.numel(), r * per), n = std::min(per, shape.numel() - at);
              mx_shard_scales(flat_part(flat, at, n), at, shape, TensorView{part.data(), DType::kU8, scale_shape, Device::cpu()}, o);
              for (size_t i = 0; i < part.size(); ++i) max_scales[i] = std::max(max_scales[i], part[i]);
            }
            ASSERT_EQ(max_scales, want_scales) << k.rows << "x" << k.cols << " dp " << dp;
            for (int r = 0; r < dp; ++r) {
              const int64_t at = std::min(shape.numel(), r * per), n = std::min(per, shape.numel() - at);
              std::vector<uint8_t> got(static_cast<size_t>(n));
              mx_shard_encode(flat_part(flat, at, n), at, shape, TensorView{max_scales.data(), DType::kU8, scale_shape, Device::cpu()},
                              TensorView{got.data(), DType::kU8, Shape{n}, Device::cpu()}, o);
              ASSERT_TRUE(std::equal(got.begin(), got.end(), want_data.begin() + at))
                  << k.rows << "x" << k.cols << " dp " << dp << " rank " << r;
            }
            ++checked;
          }
  EXPECT_EQ(checked, 6 * 2 * 2 * 2 * 5);
}

// The property the MAX all-reduce rests on: a block's scale never decreases as its amax grows.
TEST(Mxfp8Shard, ScaleIsNondecreasingInAmax) {
  for (Fp8Format elem : {Fp8Format::kE4M3, Fp8Format::kE5M2})
    for (ScaleMode mode : {ScaleMode::kRceil, ScaleMode::kFloor}) {
      uint8_t prev = 0;
      // Every 2^12-th f32 bit pattern from 0 to +Inf, then NaN.
      for (uint64_t bits = 0; bits <= 0x7f800000u; bits += 0x1000u) {
        const uint8_t s = mx_scale_for_amax(std::bit_cast<float>(static_cast<uint32_t>(bits)), elem, mode);
        ASSERT_GE(s, prev) << std::hex << bits;
        prev = s;
      }
      EXPECT_EQ(mx_scale_for_amax(std::numeric_limits<float>::quiet_NaN(), elem, mode), kE8M0Nan);
    }
}

TEST(Mxfp8Shard, RefusesAShardThatDoesNotFitAndWrongScales) {
  std::vector<float> v(64, 1.0f);
  std::vector<uint8_t> scales(2), data(64);
  const TensorView shard{v.data(), DType::kF32, Shape{64}, Device::cpu()};
  const TensorView s{scales.data(), DType::kU8, Shape{2}, Device::cpu()};
  EXPECT_THROW(mx_shard_scales(shard, 1, Shape{2, 32}, s, {}), Error);
  EXPECT_THROW(mx_shard_scales(shard, 0, Shape{2, 32}, TensorView{scales.data(), DType::kU8, Shape{1}, Device::cpu()}, {}), Error);
  EXPECT_THROW(mx_shard_encode(shard, 0, Shape{2, 32}, s, TensorView{data.data(), DType::kU8, Shape{63}, Device::cpu()}, {}), Error);
  mx_shard_scales(shard, 0, Shape{2, 32}, s, {});
  EXPECT_EQ(scales[0], scales[1]);
}

}  // namespace
}  // namespace mxddp
