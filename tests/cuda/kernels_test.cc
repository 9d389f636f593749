// Every CUDA kernel against its CPU reference (include/mxddp/cuda.h): the casts, scale, grad
// accumulation, the NaN/Inf count and zero, MXFP8 quantize
// (row- and column-wise, E4M3 and E5M2, rceil and floor, f32 and bf16 inputs, partial blocks,
// NaN/Inf/zero blocks) and dequantize, AdamW and SGD on a shard, bit for bit; the grad norm's sum
// of squares, the same on every run and within f64 rounding of the CPU's; device memory charged to
// the tracker and served by a replaced allocator, the global memory buffer there. MXFP8 and AdamW run
// on their wide kernels and, on views skewed off alignment, on their element kernels. Needs a device
// (device_main.cc skips without).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include <mxddp/compute.h>
#include <mxddp/cuda.h>

#include "cuda/fp8_conversion_check.h"
#include "optim/adamw_kernel.h"

namespace mxddp::testing {
namespace {

// A host vector's copy on the device, and back.
template <typename T>
struct DeviceCopy {
  MemoryTracker tracker;
  DeviceBuffer buffer;
  int64_t n;
  explicit DeviceCopy(const std::vector<T>& host)
      : buffer(std::max<size_t>(1, host.size() * sizeof(T)), MemoryCategory::kScratch, tracker, nullptr),
        n(static_cast<int64_t>(host.size())) {
    cuda_copy(buffer.data(), host.data(), host.size() * sizeof(T), nullptr);
  }
  T* data() const { return static_cast<T*>(buffer.data()); }
  std::vector<T> to_host() const {
    std::vector<T> out(static_cast<size_t>(n));
    cuda_copy(out.data(), buffer.data(), out.size() * sizeof(T), nullptr);
    cuda_synchronize(nullptr);
    return out;
  }
};

// Finite values across many binades, with the specials and rounding ties mixed in.
std::vector<float> awkward_floats(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mant(-2.0f, 2.0f);
  std::uniform_int_distribution<int> exp(-140, 130);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = std::ldexp(mant(rng), exp(rng));
  const float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, 1.0f + 0x1p-8f /* a bf16 tie */,
                            std::numeric_limits<float>::denorm_min(), 3.0e38f, 448.0f, 57344.0f};
  for (size_t i = 0; i < std::size(specials) && i * 7 < v.size(); ++i) v[i * 7] = specials[i];
  return v;
}

bool same_bits_or_both_nan(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || std::memcmp(&a, &b, sizeof a) == 0;
}

TEST(CudaKernels, CastsMatchTheCpuBitForBit) {
  const auto x = awkward_floats(100'003, 1);
  std::vector<bf16_bits> want(x.size());
  convert_f32_to_bf16(x.data(), want.data(), x.size());
  DeviceCopy<float> in(x);
  DeviceCopy<bf16_bits> out{std::vector<bf16_bits>(x.size())};
  cuda_convert_f32_to_bf16(in.data(), out.data(), in.n, nullptr);
  EXPECT_EQ(out.to_host(), want);

  std::vector<float> back(x.size());
  convert_bf16_to_f32(want.data(), back.data(), want.size());
  DeviceCopy<bf16_bits> bf(want);
  DeviceCopy<float> widened{std::vector<float>(x.size())};
  cuda_convert_bf16_to_f32(bf.data(), widened.data(), bf.n, nullptr);
  const auto got = widened.to_host();
  EXPECT_EQ(std::memcmp(got.data(), back.data(), got.size() * sizeof(float)), 0);
}

TEST(CudaKernels, ScaleAccumulateZeroAndTheNonfiniteAndZeroCountsMatchTheCpu) {
  const auto x = awkward_floats(50'001, 5);
  const auto y = awkward_floats(50'001, 6);
  std::vector<bf16_bits> xb(x.size()), yb(y.size());
  convert_f32_to_bf16(x.data(), xb.data(), x.size());
  convert_f32_to_bf16(y.data(), yb.data(), y.size());
  const float factor = 0.3f;
  {  // scale, f32 and bf16 (through f32, rounded once)
    std::vector<float> want(x);
    for (auto& v : want) v = v * factor;
    std::vector<bf16_bits> want_b(xb);
    for (auto& v : want_b) v = f32_to_bf16(bf16_to_f32(v) * factor);
    DeviceCopy<float> d(x);
    DeviceCopy<bf16_bits> db(xb);
    cuda_scale(d.data(), DType::kF32, d.n, factor, nullptr);
    cuda_scale(db.data(), DType::kBF16, db.n, factor, nullptr);
    const auto got = d.to_host();
    int64_t bad = 0;
    for (size_t i = 0; i < got.size(); ++i) bad += !same_bits_or_both_nan(got[i], want[i]);
    EXPECT_EQ(bad, 0);
    const auto got_b = db.to_host();
    bad = 0;
    for (size_t i = 0; i < got_b.size(); ++i) bad += !same_bits_or_both_nan(bf16_to_f32(got_b[i]), bf16_to_f32(want_b[i]));
    EXPECT_EQ(bad, 0);
  }
  {  // main_grad += grad, f32 and bf16 grads
    for (DType gd : {DType::kF32, DType::kBF16}) {
      std::vector<float> want(x);
      for (size_t i = 0; i < want.size(); ++i) want[i] = want[i] + (gd == DType::kF32 ? y[i] : bf16_to_f32(yb[i]));
      DeviceCopy<float> main_grad(x), g(y);
      DeviceCopy<bf16_bits> gb(yb);
      cuda_accumulate(main_grad.data(), gd == DType::kF32 ? static_cast<const void*>(g.data()) : gb.data(), gd,
                      main_grad.n, nullptr);
      const auto got = main_grad.to_host();
      int64_t bad = 0;
      for (size_t i = 0; i < got.size(); ++i) bad += !same_bits_or_both_nan(got[i], want[i]);
      EXPECT_EQ(bad, 0) << dtype_name(gd) << " grads";
    }
  }
  {  // the NaN/Inf count against all_finite, and zero
    int64_t want = 0;
    for (float v : x) want += !std::isfinite(v);
    ASSERT_GT(want, 0);
    DeviceCopy<float> d(x);
    DeviceCopy<bf16_bits> db(xb);
    DeviceCopy<int64_t> count{std::vector<int64_t>{-1}};
    cuda_count_nonfinite(d.data(), DType::kF32, d.n, count.data(), nullptr);
    EXPECT_EQ(count.to_host()[0], want);
    int64_t want_b = 0;
    for (bf16_bits v : xb) want_b += !std::isfinite(bf16_to_f32(v));
    cuda_count_nonfinite(db.data(), DType::kBF16, db.n, count.data(), nullptr);
    EXPECT_EQ(count.to_host()[0], want_b);
    cuda_zero(d.data(), static_cast<size_t>(d.n) * sizeof(float), nullptr);
    cuda_count_nonfinite(d.data(), DType::kF32, d.n, count.data(), nullptr);
    EXPECT_EQ(count.to_host()[0], 0);
    const auto zeros = d.to_host();
    EXPECT_TRUE(all_finite(TensorView{const_cast<float*>(zeros.data()), DType::kF32, Shape{d.n}, Device::cpu()}));
    EXPECT_EQ(std::count(zeros.begin(), zeros.end(), 0.0f), d.n);
  }
  {  // the zero count against count_zeros, added up over an f32 and a bf16 run
    const int64_t want = count_zeros(TensorView{const_cast<float*>(x.data()), DType::kF32, Shape{static_cast<int64_t>(x.size())}, Device::cpu()});
    const int64_t want_b = count_zeros(TensorView{const_cast<bf16_bits*>(xb.data()), DType::kBF16, Shape{static_cast<int64_t>(xb.size())}, Device::cpu()});
    ASSERT_GT(want, 0) << "awkward_floats holds zeros";
    DeviceCopy<float> d(x);
    DeviceCopy<bf16_bits> db(xb);
    DeviceCopy<int64_t> count{std::vector<int64_t>{0}};
    cuda_count_zeros(d.data(), DType::kF32, d.n, count.data(), nullptr);
    EXPECT_EQ(count.to_host()[0], want);
    cuda_count_zeros(db.data(), DType::kBF16, db.n, count.data(), nullptr);
    EXPECT_EQ(count.to_host()[0], want + want_b) << "added to the count, not overwriting it";
  }
}

struct MxCase {
  int64_t rows, cols;
  Fp8Format elem;
  ScaleMode mode;
  QuantAxis axis;
  DType dtype;
  int skew = 0;  // elements every device view starts past its allocation: 1 misaligns them, so a
                 // shape the wide kernels take runs on the element kernels instead
};

// A host vector behind skew filler elements, so that its device copy's data starts skew elements in.
template <typename T>
std::vector<T> skewed(const std::vector<T>& v, int skew) {
  std::vector<T> out(static_cast<size_t>(skew), T{});
  out.insert(out.end(), v.begin(), v.end());
  return out;
}
template <typename T>
std::vector<T> unskewed(const std::vector<T>& v, int skew) {
  return std::vector<T>(v.begin() + skew, v.end());
}

class CudaMx : public ::testing::TestWithParam<MxCase> {};

TEST_P(CudaMx, QuantizeAndDequantizeMatchTheCpu) {
  const MxCase c = GetParam();
  const QuantizeOptions o{c.elem, c.mode, c.axis};
  auto x = awkward_floats(c.rows * c.cols, 7);
  for (auto& v : x) v = std::isfinite(v) ? std::fmod(v, 1.0e6f) : v;  // mostly within FP8's reach
  // A zero block, an Inf block and a NaN block (row 0's or column 0's first block), then finite.
  for (int64_t k = 0; k < 32 && k < c.cols; ++k) x[static_cast<size_t>(k)] = 0.0f;
  if (c.rows > 40) x[static_cast<size_t>(40 * c.cols)] = INFINITY;
  std::vector<bf16_bits> xb(x.size());
  convert_f32_to_bf16(x.data(), xb.data(), x.size());
  const Shape shape{c.rows, c.cols}, scale_shape = mx_scale_shape(c.rows, c.cols, c.axis);
  std::vector<uint8_t> want_data(x.size()), want_scales(static_cast<size_t>(scale_shape.numel()));
  const TensorView host_in = c.dtype == DType::kF32 ? TensorView{x.data(), DType::kF32, shape, Device::cpu()}
                                                    : TensorView{xb.data(), DType::kBF16, shape, Device::cpu()};
  mx_quantize(host_in, TensorView{want_data.data(), DType::kU8, shape, Device::cpu()},
              TensorView{want_scales.data(), DType::kU8, scale_shape, Device::cpu()}, o);

  const int k = c.skew;
  DeviceCopy<float> in_f32(skewed(x, k));
  DeviceCopy<bf16_bits> in_bf16(skewed(xb, k));
  DeviceCopy<uint8_t> data{std::vector<uint8_t>(x.size() + k, 0xAB)};
  DeviceCopy<uint8_t> scales{std::vector<uint8_t>(want_scales.size() + k, 0xAB)};
  const TensorView dev_in = c.dtype == DType::kF32 ? TensorView{in_f32.data() + k, DType::kF32, shape, Device::cuda(0)}
                                                   : TensorView{in_bf16.data() + k, DType::kBF16, shape, Device::cuda(0)};
  const TensorView dev_data{data.data() + k, DType::kU8, shape, Device::cuda(0)};
  const TensorView dev_scales{scales.data() + k, DType::kU8, scale_shape, Device::cuda(0)};
  cuda_mx_quantize(dev_in, dev_data, dev_scales, o, nullptr);
  EXPECT_EQ(unskewed(scales.to_host(), k), want_scales);
  EXPECT_EQ(unskewed(data.to_host(), k), want_data);

  for (DType out_dtype : {DType::kF32, DType::kBF16}) {
    std::vector<float> want_f(x.size());
    std::vector<bf16_bits> want_b(x.size());
    mx_dequantize(TensorView{want_data.data(), DType::kU8, shape, Device::cpu()},
                  TensorView{want_scales.data(), DType::kU8, scale_shape, Device::cpu()},
                  out_dtype == DType::kF32 ? TensorView{want_f.data(), DType::kF32, shape, Device::cpu()}
                                           : TensorView{want_b.data(), DType::kBF16, shape, Device::cpu()},
                  o);
    DeviceCopy<float> out_f{std::vector<float>(x.size() + k)};
    DeviceCopy<bf16_bits> out_b{std::vector<bf16_bits>(x.size() + k)};
    cuda_mx_dequantize(dev_data, dev_scales,
                       out_dtype == DType::kF32 ? TensorView{out_f.data() + k, DType::kF32, shape, Device::cuda(0)}
                                                : TensorView{out_b.data() + k, DType::kBF16, shape, Device::cuda(0)},
                       o, nullptr);
    // NaN blocks decode to NaN on both; the payload is the hardware's (x86 keeps the operand's,
    // the GPU writes its canonical NaN), so NaNs compare as NaNs.
    int64_t bad = 0;
    if (out_dtype == DType::kF32) {
      const auto got = unskewed(out_f.to_host(), k);
      for (size_t i = 0; i < got.size(); ++i) bad += !same_bits_or_both_nan(got[i], want_f[i]);
    } else {
      const auto got = unskewed(out_b.to_host(), k);
      for (size_t i = 0; i < got.size(); ++i) bad += !same_bits_or_both_nan(bf16_to_f32(got[i]), bf16_to_f32(want_b[i]));
    }
    EXPECT_EQ(bad, 0) << "dequantize to " << dtype_name(out_dtype);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaMx,
    ::testing::Values(MxCase{64, 96, Fp8Format::kE4M3, ScaleMode::kRceil, QuantAxis::kRow, DType::kF32},
                      MxCase{64, 96, Fp8Format::kE4M3, ScaleMode::kRceil, QuantAxis::kCol, DType::kF32},
                      MxCase{77, 45, Fp8Format::kE4M3, ScaleMode::kFloor, QuantAxis::kRow, DType::kBF16},
                      MxCase{77, 45, Fp8Format::kE5M2, ScaleMode::kRceil, QuantAxis::kCol, DType::kBF16},
                      MxCase{41, 130, Fp8Format::kE5M2, ScaleMode::kFloor, QuantAxis::kRow, DType::kF32},
                      MxCase{1, 1, Fp8Format::kE4M3, ScaleMode::kRceil, QuantAxis::kCol, DType::kF32},
                      MxCase{1024, 1536, Fp8Format::kE4M3, ScaleMode::kRceil, QuantAxis::kCol, DType::kBF16},
                      // The wide kernels' edges (mxfp8_wide.h): partial bands, partial column tiles,
                      // columns a multiple of 8 or 16 only, one block; and wide shapes skewed onto
                      // the element kernels.
                      MxCase{33, 64, Fp8Format::kE4M3, ScaleMode::kFloor, QuantAxis::kRow, DType::kF32},
                      MxCase{50, 200, Fp8Format::kE5M2, ScaleMode::kRceil, QuantAxis::kCol, DType::kBF16},
                      MxCase{77, 8, Fp8Format::kE4M3, ScaleMode::kRceil, QuantAxis::kCol, DType::kF32},
                      MxCase{31, 48, Fp8Format::kE5M2, ScaleMode::kFloor, QuantAxis::kCol, DType::kF32},
                      MxCase{1, 32, Fp8Format::kE4M3, ScaleMode::kRceil, QuantAxis::kRow, DType::kBF16},
                      MxCase{130, 1056, Fp8Format::kE4M3, ScaleMode::kRceil, QuantAxis::kRow, DType::kBF16},
                      MxCase{64, 96, Fp8Format::kE4M3, ScaleMode::kRceil, QuantAxis::kRow, DType::kF32, 1},
                      MxCase{64, 96, Fp8Format::kE5M2, ScaleMode::kFloor, QuantAxis::kCol, DType::kBF16, 1}));

// The wide MXFP8 kernels encode with the device's conversion instruction: it must give
// fp8::encode's byte for every float, in both formats.
TEST(CudaKernels, TheDeviceFp8ConversionMatchesTheEncoderOnEveryFloat) {
  EXPECT_EQ(fp8_conversion_mismatches(true), 0) << "E4M3";
  EXPECT_EQ(fp8_conversion_mismatches(false), 0) << "E5M2";
}

TEST(CudaKernels, AdamWAndSgdMatchTheCpuStepBitForBit) {
  const int64_t n = 70'001;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> grad(n), main(n), m(n), v(n), mom(n);
  for (int64_t i = 0; i < n; ++i) {
    grad[i] = normal(rng) * 1e-2f;
    main[i] = normal(rng);
    m[i] = normal(rng) * 1e-3f;
    v[i] = std::abs(normal(rng)) * 1e-5f;
    mom[i] = normal(rng) * 1e-2f;
  }
  std::vector<bf16_bits> grad_b(n);
  convert_f32_to_bf16(grad.data(), grad_b.data(), grad.size());
  const AdamWScalars a{.lr = 3e-4f, .weight_decay = 0.1f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
                    .step_size = 3e-4f / (1.0f - 0.9f * 0.9f * 0.9f), .bias_correction2_sqrt = std::sqrt(1.0f - 0.95f * 0.95f * 0.95f),
                    .clip_coeff = 0.7f, .l2 = 0.0f};
  const optim_kernel::AdamScalars s{a.lr, a.weight_decay, a.beta1, a.beta2, a.eps, a.step_size, a.bias_correction2_sqrt,
                                    a.clip_coeff, a.l2};
  // Skew 0: the wide kernel (four elements per thread, then n % 4 = 1 alone); skew 1: every
  // pointer one element off 16 bytes, the element kernel.
  for (int k : {0, 1}) {
  for (DType gd : {DType::kF32, DType::kBF16}) {
    for (DType pd : {DType::kF32, DType::kBF16}) {
      auto cm = main, ca = m, cv = v;
      std::vector<float> cp_f(n);
      std::vector<bf16_bits> cp_b(n);
      const auto run_cpu = [&](auto* g) {
        if (pd == DType::kF32) optim_kernel::adamw(g, cm.data(), ca.data(), cv.data(), cp_f.data(), n, s);
        else optim_kernel::adamw(g, cm.data(), ca.data(), cv.data(), cp_b.data(), n, s);
      };
      gd == DType::kF32 ? run_cpu(grad.data()) : run_cpu(grad_b.data());
      DeviceCopy<float> g_f(skewed(grad, k)), dm(skewed(main, k)), da(skewed(m, k)), dv(skewed(v, k));
      DeviceCopy<float> p_f{std::vector<float>(n + k)};
      DeviceCopy<bf16_bits> g_b(skewed(grad_b, k)), p_b{std::vector<bf16_bits>(n + k)};
      cuda_adamw(gd == DType::kF32 ? static_cast<const void*>(g_f.data() + k) : g_b.data() + k, gd, dm.data() + k,
                 da.data() + k, dv.data() + k, pd == DType::kF32 ? static_cast<void*>(p_f.data() + k) : p_b.data() + k,
                 pd, n, a, nullptr);
      EXPECT_EQ(unskewed(dm.to_host(), k), cm) << dtype_name(gd) << " grads, " << dtype_name(pd) << " params, skew " << k;
      EXPECT_EQ(unskewed(da.to_host(), k), ca);
      EXPECT_EQ(unskewed(dv.to_host(), k), cv);
      if (pd == DType::kF32) EXPECT_EQ(unskewed(p_f.to_host(), k), cp_f);
      else EXPECT_EQ(unskewed(p_b.to_host(), k), cp_b);
    }
  }
  }
  // SGD with momentum, and AdamW without staging (nullptr param).
  const SgdScalars sg{.lr = 0.05f, .weight_decay = 0.01f, .momentum = 0.9f, .clip_coeff = 0.5f};
  auto cm = main, cb = mom;
  std::vector<bf16_bits> cp(n);
  optim_kernel::sgd(grad_b.data(), cm.data(), cb.data(), cp.data(), n, optim_kernel::SgdScalars{sg.lr, sg.weight_decay, sg.momentum, sg.clip_coeff});
  DeviceCopy<bf16_bits> g_b(grad_b), p_b{std::vector<bf16_bits>(n)};
  DeviceCopy<float> dm(main), db(mom);
  cuda_sgd(g_b.data(), DType::kBF16, dm.data(), db.data(), p_b.data(), DType::kBF16, n, sg, nullptr);
  EXPECT_EQ(dm.to_host(), cm);
  EXPECT_EQ(db.to_host(), cb);
  EXPECT_EQ(p_b.to_host(), cp);
  auto am = main, aa = m, av = v;
  optim_kernel::NoStage* none = nullptr;
  optim_kernel::adamw(grad.data(), am.data(), aa.data(), av.data(), none, n, s);
  DeviceCopy<float> g(grad), m2(main), a2(m), v2(v);
  cuda_adamw(g.data(), DType::kF32, m2.data(), a2.data(), v2.data(), nullptr, DType::kF32, n, a, nullptr);
  EXPECT_EQ(m2.to_host(), am);
}

TEST(CudaKernels, SumOfSquaresIsDeterministicAndMatchesTheCpu) {
  for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{1000}, int64_t{3'000'017}}) {
    const auto x = awkward_floats(n, 11);
    std::vector<float> finite(x.size());
    for (size_t i = 0; i < x.size(); ++i) finite[i] = std::isfinite(x[i]) ? std::fmod(x[i], 100.0f) : 1.0f;
    const double want = optim_kernel::sum_of_squares(finite.data(), n);
    DeviceCopy<float> g(finite);
    DeviceCopy<double> out{std::vector<double>(kCudaSumOfSquaresNumel)};
    cuda_sum_of_squares(g.data(), DType::kF32, n, out.data(), nullptr);
    const double first = out.to_host()[0];
    cuda_sum_of_squares(g.data(), DType::kF32, n, out.data(), nullptr);
    const double second = out.to_host()[0];
    EXPECT_EQ(std::memcmp(&first, &second, sizeof first), 0) << "n " << n << ": the order must be fixed";
    EXPECT_NEAR(first, want, 1e-12 * std::abs(want)) << "n " << n;
  }
}

// An allocator that counts, over the runtime's pool: what a framework plugs in (torch's caching
// allocator under mxddp.torch).
struct CountingAllocator final : DeviceAllocator {
  int64_t live_bytes = 0, calls = 0;
  void* allocate(size_t bytes, CudaStream stream) override {
    ++calls;
    live_bytes += static_cast<int64_t>(bytes);
    return cuda_pool_allocator().allocate(bytes, stream);
  }
  void deallocate(void* data, size_t bytes, CudaStream stream) noexcept override {
    live_bytes -= static_cast<int64_t>(bytes);
    cuda_pool_allocator().deallocate(data, bytes, stream);
  }
  std::string_view name() const override { return "counting"; }
};

TEST(CudaKernels, DeviceBuffersAreChargedAndServedByThePluggedAllocator) {
  MemoryTracker tracker;
  CountingAllocator counting;
  set_device_allocator(&counting);
  {
    DeviceBuffer grads(1 << 20, MemoryCategory::kGrads, tracker, nullptr);
    DeviceBuffer state(3 << 20, MemoryCategory::kOptimizerState, tracker, nullptr);
    EXPECT_EQ(tracker.usage().live(MemoryCategory::kGrads), 1 << 20);
    EXPECT_EQ(tracker.usage().live(MemoryCategory::kOptimizerState), 3 << 20);
    EXPECT_EQ(tracker.usage().at(MemoryPlace::kDevice).total_live_bytes, 4 << 20);
    EXPECT_EQ(tracker.usage().at(MemoryPlace::kHost).total_live_bytes, 0);
    EXPECT_EQ(counting.live_bytes, 4 << 20);
    EXPECT_FALSE(grads.view(DType::kF32, Shape{1 << 18}).device.is_cpu());
    EXPECT_THROW(grads.view(DType::kF32, Shape{(1 << 18) + 1}), Error);
  }
  set_device_allocator(nullptr);
  EXPECT_EQ(counting.live_bytes, 0);
  EXPECT_EQ(counting.calls, 2);
  EXPECT_EQ(tracker.usage().total_live_bytes, 0);
  EXPECT_EQ(&device_allocator(), &cuda_pool_allocator());
  // A request no device can hold is OutOfMemory, naming the bytes.
  EXPECT_THROW(DeviceBuffer(size_t{1} << 60, MemoryCategory::kScratch, tracker, nullptr), OutOfMemory);
  EXPECT_EQ(tracker.usage().total_live_bytes, 0);
}

// The global memory buffer on a device: its storage comes from the plugged allocator on the
// compute's stream, is charged as device scratch, and keeps what the compute wrote into it.
TEST(CudaKernels, TheGlobalMemoryBufferLivesOnTheDevice) {
  MemoryTracker tracker;
  CountingAllocator counting;
  set_device_allocator(&counting);
  {
    OwnedCudaStream stream;
    const std::unique_ptr<Compute> compute = make_cuda_compute(stream.get());
    GlobalMemoryBuffer pool(tracker, {.compute = compute.get()});
    const TensorView a = pool.get_tensor(Shape{1 << 16}, DType::kF32, "act");
    EXPECT_EQ(a.device, compute->device());
    EXPECT_EQ(counting.live_bytes, 4 << 16);
    EXPECT_EQ(tracker.usage().at(MemoryPlace::kDevice).live(MemoryCategory::kScratch), 4 << 16);
    const std::vector<float> x = awkward_floats(1 << 16, 9);
    compute->copy_from_host(a.data, x.data(), x.size() * sizeof(float));
    std::vector<float> back(x.size());
    compute->copy_to_host(back.data(), pool.get_tensor(Shape{1 << 16}, DType::kF32, "act").data, back.size() * sizeof(float));
    compute->synchronize();
    EXPECT_EQ(std::memcmp(back.data(), x.data(), x.size() * sizeof(float)), 0);
    EXPECT_EQ(pool.allocation_count(), 1);
  }
  set_device_allocator(nullptr);
  EXPECT_EQ(counting.live_bytes, 0);
  EXPECT_EQ(tracker.usage().total_live_bytes, 0);
}

}  // namespace
}  // namespace mxddp::testing
