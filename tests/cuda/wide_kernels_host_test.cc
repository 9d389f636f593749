// The wide CUDA kernels (mxfp8_wide_cuda.cu, optim_cuda.cu's adamw_wide_kernel), thread by thread
// on the host against their CPU references, so that CI checks them where no GPU is: each kernel's
// per-thread work is host-and-device code (mxfp8_wide.h, adamw_wide.h), and this file plays the
// grid (every group), the warp's shuffles (a max over the lanes that share a block or a column) and
// the column kernel's barriers (its phases in turn over all 256 threads of a tile). The FP8
// conversion here is cuda_fp8.h's host form, checked first against fp8::encode; the device's
// instruction is checked on the GPU machine (tests/cuda/kernels_test.cc runs these kernels there).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include <mxddp/quant.h>

#include "optim/adamw_kernel.h"
#include "optim/adamw_wide.h"
#include "quant/mxfp8_wide.h"

namespace mxddp::testing {
namespace {

namespace wide = cuda_kernels::wide;

// The hardware conversion's host form against fp8::encode on every 97th bit pattern (44 million
// floats, every binade and both signs) and the specials: equal on every finite value and on
// +-Inf (both saturate); on NaN both give a NaN code.
TEST(WideKernelsHost, HardwareFp8ConversionMatchesTheEncoder) {
  for (bool e4m3 : {true, false}) {
    const fp8::Spec spec = fp8::spec_of(e4m3);
    int64_t bad = 0;
    const auto check = [&](float a, float b) {
      const uint32_t pair = e4m3 ? wide::encode2<true>(a, b) : wide::encode2<false>(a, b);
      const float xs[2] = {a, b};
      for (int k = 0; k < 2; ++k) {
        const auto got = static_cast<uint8_t>(pair >> (8 * k));
        if (std::isnan(xs[k])) bad += !std::isnan(fp8::decode(got, spec));
        else bad += got != fp8::encode(xs[k], spec);
      }
    };
    for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 2 * 97) {
      float a, b;
      const auto ua = static_cast<uint32_t>(u), ub = static_cast<uint32_t>(u + 97);
      std::memcpy(&a, &ua, 4);
      std::memcpy(&b, &ub, 4);
      check(a, b);
    }
    const float inf = std::numeric_limits<float>::infinity();
    check(inf, -inf);
    check(spec.max, -spec.max);
    check(std::nextafter(spec.max, inf), -std::nextafter(spec.max, inf));
    check(std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN());
    check(std::numeric_limits<float>::denorm_min(), -0.0f);
    // Every code's value and the midpoint between neighbours (the ties).
    for (int c = 0; c < 127; ++c) {
      const float lo = fp8::decode(static_cast<uint8_t>(c), spec), hi = fp8::decode(static_cast<uint8_t>(c + 1), spec);
      if (std::isfinite(hi)) check(lo, -(lo + hi) / 2);
    }
    EXPECT_EQ(bad, 0) << (e4m3 ? "E4M3" : "E5M2");
  }
}

// Values across many binades, most within FP8's reach of their block's largest after scaling; one
// in eight from f32's subnormals up (blocks of tiny values, products that underflow).
std::vector<float> values(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mant(-2.0f, 2.0f);
  std::uniform_int_distribution<int> exp(-40, 20), wide_exp(-150, 20), pick(0, 7);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = std::ldexp(mant(rng), pick(rng) == 0 ? wide_exp(rng) : exp(rng));
  return v;
}

struct WideCase {
  int64_t rows, cols;
  Fp8Format elem;
  ScaleMode mode;
  DType dtype;
};

class WideMx : public ::testing::TestWithParam<WideCase> {};

// The row kernel: every group's load, the max over each block's four lanes, every group's store.
template <bool E4M3, typename T>
void emulate_rows(const T* in, int64_t n, bool rceil, uint8_t* data, uint8_t* scales) {
  const int64_t groups = n / wide::kRowGroup;
  for (int64_t g0 = 0; g0 < groups; g0 += wide::kBlock / wide::kRowGroup) {
    float v[4][wide::kRowGroup];
    uint32_t amax = 0;
    for (int l = 0; l < 4; ++l) amax = wide::max_bits(amax, wide::row_group_load(in, g0 + l, v[l]));
    for (int l = 0; l < 4; ++l) wide::row_group_store<E4M3>(v[l], amax, g0 + l, rceil, data, scales);
  }
}

// The column kernel: per (tile, band), its three phases over all 256 threads.
template <bool E4M3, typename T>
void emulate_cols(const T* in, int64_t rows, int64_t cols, bool rceil, uint8_t* data, uint8_t* scales) {
  auto tile = std::make_unique<wide::ColTile>();
  for (int64_t c0 = 0; c0 < cols; c0 += wide::kTileCols) {
    for (int64_t band = 0; band * wide::kBlock < rows; ++band) {
      const int64_t r0 = band * wide::kBlock;
      for (int t = 0; t < wide::kTileThreads; ++t) wide::col_tile_load(in, rows, cols, r0, c0, t, *tile);
      uint32_t partial[wide::kTileThreads];
      for (int t = 0; t < wide::kTileThreads; ++t) partial[t] = wide::col_tile_partial_amax(*tile, t);
      for (int t = 0; t < wide::kTileThreads; t += 4) {
        const uint32_t amax = std::max({partial[t], partial[t + 1], partial[t + 2], partial[t + 3]});
        wide::col_tile_scale<E4M3>(amax, cols, band, c0, t, rceil, scales, *tile);
      }
      for (int t = 0; t < wide::kTileThreads; ++t) wide::col_tile_store<E4M3>(*tile, rows, cols, r0, c0, t, data);
    }
  }
}

template <typename T>
void emulate_dequantize(const uint8_t* data, const uint8_t* scales, int64_t n, int64_t cols, bool colwise, bool e4m3,
                        T* out) {
  float table[256];
  for (int c = 0; c < 256; ++c) table[c] = fp8::decode(static_cast<uint8_t>(c), fp8::spec_of(e4m3));
  for (int64_t g = 0; g < n / wide::kDecodeGroup; ++g) wide::dequantize_group(data, scales, table, cols, colwise, g, out);
}

template <typename T>
void emulate_quantize(const T* in, const WideCase& c, QuantAxis axis, uint8_t* data, uint8_t* scales) {
  const bool rceil = c.mode == ScaleMode::kRceil;
  const bool e4m3 = c.elem == Fp8Format::kE4M3;
  if (axis == QuantAxis::kRow) {
    if (e4m3) emulate_rows<true>(in, c.rows * c.cols, rceil, data, scales);
    else emulate_rows<false>(in, c.rows * c.cols, rceil, data, scales);
  } else {
    if (e4m3) emulate_cols<true>(in, c.rows, c.cols, rceil, data, scales);
    else emulate_cols<false>(in, c.rows, c.cols, rceil, data, scales);
  }
}

bool same_bits_or_both_nan(float a, float b) { return (std::isnan(a) && std::isnan(b)) || std::memcmp(&a, &b, 4) == 0; }

TEST_P(WideMx, QuantizeAndDequantizeMatchTheCpu) {
  const WideCase c = GetParam();
  const int64_t n = c.rows * c.cols;
  auto x = values(n, static_cast<uint32_t>(n));
  // Row 0's first block (and column 0's first) all zero; an Inf and a NaN further on.
  for (int64_t k = 0; k < 32 && k < n; ++k) x[static_cast<size_t>(k)] = 0.0f;
  for (int64_t r = 0; r < 32 && r < c.rows; ++r) x[static_cast<size_t>(r * c.cols)] = 0.0f;
  if (n > 1000) x[static_cast<size_t>(n / 2 + 3)] = INFINITY, x[static_cast<size_t>(n - 5)] = NAN;
  std::vector<bf16_bits> xb(x.size());
  convert_f32_to_bf16(x.data(), xb.data(), x.size());
  const Shape shape{c.rows, c.cols};
  for (QuantAxis axis : {QuantAxis::kRow, QuantAxis::kCol}) {
    const bool colwise = axis == QuantAxis::kCol;
    if (c.cols % (colwise ? wide::kRowGroup : wide::kBlock) != 0) continue;  // the element kernels' case
    const QuantizeOptions o{c.elem, c.mode, axis};
    const Shape scale_shape = mx_scale_shape(c.rows, c.cols, axis);
    const auto scale_n = static_cast<size_t>(scale_shape.numel());
    // Storage as the allocator gives it: aligned well past 16 bytes.
    std::vector<uint8_t> want_data(x.size()), want_scales(scale_n);
    const TensorView host_in = c.dtype == DType::kF32 ? TensorView{x.data(), DType::kF32, shape, Device::cpu()}
                                                      : TensorView{xb.data(), DType::kBF16, shape, Device::cpu()};
    mx_quantize(host_in, TensorView{want_data.data(), DType::kU8, shape, Device::cpu()},
                TensorView{want_scales.data(), DType::kU8, scale_shape, Device::cpu()}, o);
    ASSERT_TRUE(wide::quantize_fits(host_in.data, want_data.data(), c.cols, colwise)) << "the case must take the wide path";

    std::vector<uint8_t> data(x.size(), 0xAB), scales(scale_n, 0xAB);
    if (c.dtype == DType::kF32) emulate_quantize(x.data(), c, axis, data.data(), scales.data());
    else emulate_quantize(xb.data(), c, axis, data.data(), scales.data());
    EXPECT_EQ(scales, want_scales) << (colwise ? "column-wise" : "row-wise");
    EXPECT_EQ(data, want_data) << (colwise ? "column-wise" : "row-wise");

    if (c.cols % (colwise ? wide::kDecodeGroup : wide::kBlock) != 0) continue;
    std::vector<float> want_f(x.size()), got_f(x.size());
    std::vector<bf16_bits> want_b(x.size()), got_b(x.size());
    const TensorView dv{want_data.data(), DType::kU8, shape, Device::cpu()};
    const TensorView sv{want_scales.data(), DType::kU8, scale_shape, Device::cpu()};
    mx_dequantize(dv, sv, TensorView{want_f.data(), DType::kF32, shape, Device::cpu()}, o);
    mx_dequantize(dv, sv, TensorView{want_b.data(), DType::kBF16, shape, Device::cpu()}, o);
    ASSERT_TRUE(wide::dequantize_fits(want_data.data(), want_scales.data(), got_f.data(), c.cols, colwise));
    const bool e4m3 = c.elem == Fp8Format::kE4M3;
    emulate_dequantize(want_data.data(), want_scales.data(), n, c.cols, colwise, e4m3, got_f.data());
    emulate_dequantize(want_data.data(), want_scales.data(), n, c.cols, colwise, e4m3, got_b.data());
    int64_t bad = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      bad += !same_bits_or_both_nan(got_f[i], want_f[i]);
      bad += !same_bits_or_both_nan(bf16_to_f32(got_b[i]), bf16_to_f32(want_b[i]));
    }
    EXPECT_EQ(bad, 0) << "dequantize " << (colwise ? "column-wise" : "row-wise");
  }
}

// Shapes that reach every edge of the layouts: one block, partial bands (rows % 32), partial
// column tiles (cols % 64 of 8 .. 56), columns a multiple of 8 or 16 but not 32 (column-wise only).
INSTANTIATE_TEST_SUITE_P(
    Shapes, WideMx,
    ::testing::Values(WideCase{1, 32, Fp8Format::kE4M3, ScaleMode::kRceil, DType::kF32},
                      WideCase{64, 96, Fp8Format::kE4M3, ScaleMode::kRceil, DType::kBF16},
                      WideCase{33, 64, Fp8Format::kE4M3, ScaleMode::kFloor, DType::kF32},
                      WideCase{50, 200, Fp8Format::kE5M2, ScaleMode::kRceil, DType::kBF16},
                      WideCase{77, 8, Fp8Format::kE4M3, ScaleMode::kRceil, DType::kF32},
                      WideCase{31, 48, Fp8Format::kE5M2, ScaleMode::kFloor, DType::kF32},
                      WideCase{130, 1056, Fp8Format::kE4M3, ScaleMode::kRceil, DType::kBF16},
                      WideCase{96, 384, Fp8Format::kE5M2, ScaleMode::kFloor, DType::kBF16}));

TEST(WideKernelsHost, TheFitRulesTakeAlignedMultiplesOnly) {
  alignas(64) static uint8_t bytes[256];
  EXPECT_TRUE(wide::quantize_fits(bytes, bytes, 64, false));
  EXPECT_FALSE(wide::quantize_fits(bytes, bytes, 48, false)) << "row-wise needs whole blocks";
  EXPECT_TRUE(wide::quantize_fits(bytes, bytes, 48, true));
  EXPECT_FALSE(wide::quantize_fits(bytes, bytes, 36, true)) << "column-wise needs 8-column groups";
  EXPECT_FALSE(wide::quantize_fits(bytes + 4, bytes, 64, false)) << "values need 16-byte loads";
  EXPECT_FALSE(wide::quantize_fits(bytes, bytes + 4, 64, true)) << "codes need 8-byte stores";
  EXPECT_TRUE(wide::dequantize_fits(bytes, bytes + 3, bytes, 64, false)) << "row-wise scales are read one by one";
  EXPECT_FALSE(wide::dequantize_fits(bytes, bytes + 3, bytes, 64, true));
  EXPECT_TRUE(wide::dequantize_fits(bytes, bytes, bytes, 16, true));
  EXPECT_FALSE(wide::dequantize_fits(bytes, bytes, bytes, 16, false));
  EXPECT_FALSE(wide::dequantize_fits(bytes + 8, bytes, bytes, 64, false));
  EXPECT_FALSE(wide::dequantize_fits(bytes, bytes, bytes + 8, 64, false));
  EXPECT_TRUE(wide::adamw_wide_fits(bytes + 8, 2, reinterpret_cast<float*>(bytes), reinterpret_cast<float*>(bytes + 16),
                                    reinterpret_cast<float*>(bytes + 32), bytes + 40, 2));
  EXPECT_FALSE(wide::adamw_wide_fits(bytes + 8, 4, reinterpret_cast<float*>(bytes), reinterpret_cast<float*>(bytes + 16),
                                     reinterpret_cast<float*>(bytes + 32), nullptr, 0))
      << "f32 grads need 16-byte loads";
  EXPECT_FALSE(wide::adamw_wide_fits(bytes, 4, reinterpret_cast<float*>(bytes + 4), reinterpret_cast<float*>(bytes + 16),
                                     reinterpret_cast<float*>(bytes + 32), nullptr, 0));
  EXPECT_TRUE(wide::adamw_wide_fits(bytes, 4, reinterpret_cast<float*>(bytes), reinterpret_cast<float*>(bytes + 16),
                                    reinterpret_cast<float*>(bytes + 32), bytes + 4, 0))
      << "an unstaged param's pointer is never read";
}

// The wide AdamW kernel's groups and its tail, every (grad, param) pair, against the CPU step.
template <typename G, typename P>
void check_adamw(const std::vector<G>& grad, const std::vector<float>& main, const std::vector<float>& m,
                 const std::vector<float>& v, const optim_kernel::AdamScalars& s) {
  const auto n = static_cast<int64_t>(grad.size());
  auto cm = main, ca = m, cv = v, wm = main, wa = m, wv = v;
  std::vector<P> cp(grad.size()), wp(grad.size());
  optim_kernel::adamw(grad.data(), cm.data(), ca.data(), cv.data(), cp.data(), n, s);
  const float decay = 1.0f - s.lr * s.weight_decay;
  const int64_t groups = n / wide::kAdamGroup;
  for (int64_t g = 0; g < groups; ++g) wide::adamw_group(grad.data(), wm.data(), wa.data(), wv.data(), wp.data(), g, s, decay);
  for (int64_t i = groups * wide::kAdamGroup; i < n; ++i)
    wide::adamw_at(grad.data(), wm.data(), wa.data(), wv.data(), wp.data(), i, s, decay);
  EXPECT_EQ(wm, cm) << "n " << n;
  EXPECT_EQ(wa, ca) << "n " << n;
  EXPECT_EQ(wv, cv) << "n " << n;
  EXPECT_EQ(wp, cp) << "n " << n;
}

TEST(WideKernelsHost, AdamWGroupsAndTailMatchTheCpuStepBitForBit) {
  const optim_kernel::AdamScalars s{3e-4f, 0.1f, 0.9f, 0.95f, 1e-8f, 3e-4f / (1.0f - 0.9f * 0.9f), std::sqrt(1.0f - 0.95f * 0.95f),
                                    0.7f, 0.0f};
  for (const int64_t n : {int64_t{1}, int64_t{3}, int64_t{4}, int64_t{7}, int64_t{100'001}}) {
    std::mt19937 rng(static_cast<uint32_t>(n));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> grad(n), main(n), m(n), v(n);
    for (int64_t i = 0; i < n; ++i) {
      grad[i] = normal(rng) * 1e-2f;
      main[i] = normal(rng);
      m[i] = normal(rng) * 1e-3f;
      v[i] = std::abs(normal(rng)) * 1e-5f;
    }
    std::vector<bf16_bits> grad_b(grad.size());
    convert_f32_to_bf16(grad.data(), grad_b.data(), grad.size());
    check_adamw<float, float>(grad, main, m, v, s);
    check_adamw<bf16_bits, bf16_bits>(grad_b, main, m, v, s);
    check_adamw<bf16_bits, float>(grad_b, main, m, v, s);
    check_adamw<float, bf16_bits>(grad, main, m, v, s);
  }
}

}  // namespace
}  // namespace mxddp::testing
