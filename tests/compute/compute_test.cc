// Every operation of compute.h on every implementation this process can use (the CPU's always,
// CUDA's where the build has it and a device is usable) against the CPU reference: core.h's casts
// and finiteness test, and the optimizer kernels (src/optim/adamw_kernel.h) run on one thread.
// Equal bits everywhere but the sum of squares, whose order is each implementation's own.
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <omp.h>

#include <gtest/gtest.h>

#include <mxddp/compute.h>
#if MXDDP_TEST_CUDA
#include <mxddp/cuda.h>
#endif

#include "optim/adamw_kernel.h"

namespace mxddp::testing {
namespace {

// The implementations to test, by name: "cpu", and "cuda" where a device is usable.
std::vector<std::string> usable_computes() {
  std::vector<std::string> names{"cpu"};
#if MXDDP_TEST_CUDA
  if (cuda_device_count() > 0) names.push_back("cuda");
#endif
  return names;
}

class ComputeConformance : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    // Four threads where the CPU's implementation splits a run, so that the split is exercised.
    omp_set_num_threads(4);
    if (GetParam() == "cpu") {
      compute_ = &cpu_compute();
#if MXDDP_TEST_CUDA
    } else {
      owned_ = make_cuda_compute(nullptr);
      compute_ = owned_.get();
#endif
    }
    ASSERT_NE(compute_, nullptr) << GetParam();
  }

  // A buffer of the implementation's memory holding host's values.
  template <typename T>
  ComputeBuffer upload(const std::vector<T>& host) {
    ComputeBuffer b = compute_->allocate(host.size() * sizeof(T), MemoryCategory::kScratch, tracker_);
    compute_->copy_from_host(b.data(), host.data(), host.size() * sizeof(T));
    return b;
  }
  template <typename T>
  std::vector<T> download(const ComputeBuffer& b, size_t n) {
    std::vector<T> host(n);
    compute_->copy_to_host(host.data(), b.data(), n * sizeof(T));
    return host;
  }

  Compute* compute_ = nullptr;
  std::unique_ptr<Compute> owned_;
  MemoryTracker tracker_;
};

// Floats that exercise the casts: normals, subnormals, ties, the largest, Inf and NaN.
std::vector<float> awkward_floats(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    uint32_t bits = static_cast<uint32_t>(rng());
    if (i % 7 == 0) bits = (bits & 0xFFFF0000u) | 0x8000u;  // a tie at bf16's rounding point
    std::memcpy(&v[i], &bits, sizeof bits);
  }
  v[0] = std::numeric_limits<float>::infinity();
  v[1] = std::numeric_limits<float>::max();
  v[2] = std::numeric_limits<float>::denorm_min();
  v[3] = 0.0f;
  return v;
}

bool same_value(float a, float b) { return (std::isnan(a) && std::isnan(b)) || std::memcmp(&a, &b, sizeof a) == 0; }

TEST_P(ComputeConformance, AllocateChargesTheTrackerAtItsPlaceAndZeroes) {
  {
    ComputeBuffer b = compute_->allocate(4096, MemoryCategory::kOptimizerState, tracker_);
    EXPECT_EQ(b.device(), compute_->device());
    EXPECT_EQ(tracker_.usage().at(compute_->place()).live(MemoryCategory::kOptimizerState), 4096);
    for (uint8_t byte : download<uint8_t>(b, 4096)) ASSERT_EQ(byte, 0);
    EXPECT_THROW(b.view(DType::kF32, Shape{1025}), Error) << "1025 floats do not fit 4096 bytes";
    EXPECT_EQ(b.view(DType::kF32, Shape{1024}).device, compute_->device());
  }
  EXPECT_EQ(tracker_.usage().live(MemoryCategory::kOptimizerState), 0);
}

TEST_P(ComputeConformance, ZeroAndCopy) {
  std::vector<float> host(300'000);
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<float>(i) * 0.5f;
  ComputeBuffer a = upload(host);
  ComputeBuffer b = compute_->allocate(host.size() * sizeof(float), MemoryCategory::kScratch, tracker_);
  compute_->copy(b.data(), a.data(), host.size() * sizeof(float));
  EXPECT_EQ(download<float>(b, host.size()), host);
  compute_->zero(static_cast<float*>(a.data()) + 10, 1000 * sizeof(float));
  const std::vector<float> zeroed = download<float>(a, host.size());
  for (size_t i = 0; i < host.size(); ++i) ASSERT_EQ(zeroed[i], i >= 10 && i < 1010 ? 0.0f : host[i]) << i;
}

TEST_P(ComputeConformance, ConvertMatchesCoreCasts) {
  const std::vector<float> values = awkward_floats(200'003, 11);
  const auto n = static_cast<int64_t>(values.size());
  std::vector<bf16_bits> want(values.size());
  convert_f32_to_bf16(values.data(), want.data(), values.size());
  ComputeBuffer in = upload(values);
  ComputeBuffer half = compute_->allocate(values.size() * sizeof(bf16_bits), MemoryCategory::kScratch, tracker_);
  compute_->convert(in.view(DType::kF32, Shape{n}), half.view(DType::kBF16, Shape{n}));
  const std::vector<bf16_bits> got = download<bf16_bits>(half, values.size());
  for (size_t i = 0; i < values.size(); ++i)
    if (!std::isnan(values[i])) ASSERT_EQ(got[i], want[i]) << i << ": " << values[i];
    else ASSERT_TRUE(std::isnan(bf16_to_f32(got[i]))) << i;

  std::vector<float> widened(values.size());
  convert_bf16_to_f32(want.data(), widened.data(), values.size());
  ComputeBuffer back = compute_->allocate(values.size() * sizeof(float), MemoryCategory::kScratch, tracker_);
  ComputeBuffer halves = upload(want);
  compute_->convert(halves.view(DType::kBF16, Shape{n}), back.view(DType::kF32, Shape{n}));
  const std::vector<float> got32 = download<float>(back, values.size());
  for (size_t i = 0; i < values.size(); ++i) ASSERT_TRUE(same_value(got32[i], widened[i])) << i;

  EXPECT_THROW(compute_->convert(in.view(DType::kF32, Shape{n}), half.view(DType::kBF16, Shape{n - 1})), Error);
}

TEST_P(ComputeConformance, AllFiniteMatchesCore) {
  std::vector<float> v(100'000, 1.5f);
  ComputeBuffer finite = upload(v);
  EXPECT_TRUE(compute_->all_finite(finite.view(DType::kF32, Shape{100'000})));
  v[77'777] = std::numeric_limits<float>::quiet_NaN();
  ComputeBuffer nan = upload(v);
  EXPECT_FALSE(compute_->all_finite(nan.view(DType::kF32, Shape{100'000})));
  std::vector<bf16_bits> h(5000, f32_to_bf16(2.0f));
  h[4999] = f32_to_bf16(-std::numeric_limits<float>::infinity());
  ComputeBuffer inf = upload(h);
  EXPECT_FALSE(compute_->all_finite(inf.view(DType::kBF16, Shape{5000})));
  EXPECT_TRUE(compute_->all_finite(inf.view(DType::kBF16, Shape{4999})));
  EXPECT_THROW(compute_->all_finite(finite.view(DType::kI64, Shape{10})), Error) << "f32 or bf16 only";
}

TEST_P(ComputeConformance, SumOfSquaresOverRunsMatchesTheReference) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> d(-2, 2);
  std::vector<float> a(150'001);
  for (float& x : a) x = d(rng);
  std::vector<bf16_bits> b(7'777);
  for (bf16_bits& x : b) x = f32_to_bf16(d(rng));
  ComputeBuffer da = upload(a), db = upload(b);
  const TensorView va = da.view(DType::kF32, Shape{150'001}), vb = db.view(DType::kBF16, Shape{7'777});
  const std::vector<TensorView> runs{va.slice(0, 100'000), vb, va.slice(100'000, 50'001), vb.slice(0, 0)};
  const double want = optim_kernel::sum_of_squares(a.data(), 100'000) + optim_kernel::sum_of_squares(b.data(), 7'777) +
                      optim_kernel::sum_of_squares(a.data() + 100'000, 50'001);
  const double got = compute_->sum_of_squares(runs);
  if (GetParam() == "cpu") EXPECT_EQ(got, want) << "one chunk per run, added in the runs' order";
  else EXPECT_NEAR(got, want, 1e-12 * want);
  EXPECT_EQ(compute_->sum_of_squares(runs), got) << "the same order on every call";
  EXPECT_EQ(compute_->sum_of_squares({}), 0.0);
}

// AdamW and SGD over one run, every grad/param dtype pair and the unstaged and aliased forms,
// against the kernels on one thread.
struct UpdateCase {
  DType grads, params;  // params kU8: not staged; kF64: the aliased f32 shard (params are main)
};

TEST_P(ComputeConformance, AdamWAndSgdMatchTheKernelsOnOneThread) {
  const int64_t n = 200'017;  // over two of the CPU's threads, and an odd tail
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> d(-1, 1);
  std::vector<float> grad32(n), main(n), m(n), v(n);
  for (int64_t i = 0; i < n; ++i) {
    grad32[static_cast<size_t>(i)] = bf16_to_f32(f32_to_bf16(d(rng)));
    main[static_cast<size_t>(i)] = d(rng);
    m[static_cast<size_t>(i)] = 0.1f * d(rng);
    v[static_cast<size_t>(i)] = 0.01f * std::fabs(d(rng));
  }
  std::vector<bf16_bits> grad16(static_cast<size_t>(n));
  convert_f32_to_bf16(grad32.data(), grad16.data(), grad16.size());
  const AdamWScalars adam{.lr = 3e-4f, .weight_decay = 0.1f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
                          .step_size = 3e-4f / 0.271f, .bias_correction2_sqrt = 0.3122f, .clip_coeff = 0.7f, .l2 = 0.0f};
  const SgdScalars sgd{.lr = 0.05f, .weight_decay = 0.01f, .momentum = 0.9f, .clip_coeff = 0.5f};
  const optim_kernel::AdamScalars ka{adam.lr,        adam.weight_decay, adam.beta1, adam.beta2, adam.eps,
                                     adam.step_size, adam.bias_correction2_sqrt, adam.clip_coeff, adam.l2};
  const optim_kernel::SgdScalars ks{sgd.lr, sgd.weight_decay, sgd.momentum, sgd.clip_coeff};

  for (const bool is_adam : {true, false})
    for (const UpdateCase c : {UpdateCase{DType::kF32, DType::kBF16}, UpdateCase{DType::kBF16, DType::kF32},
                               UpdateCase{DType::kBF16, DType::kBF16}, UpdateCase{DType::kF32, DType::kF32},
                               UpdateCase{DType::kF32, DType::kU8}, UpdateCase{DType::kBF16, DType::kF64}}) {
      SCOPED_TRACE(std::string(is_adam ? "adamw" : "sgd") + " grads " + std::string(dtype_name(c.grads)) + " params " +
                   std::string(dtype_name(c.params)));
      const bool aliased = c.params == DType::kF64, staged = c.params == DType::kF32 || c.params == DType::kBF16;
      // The reference, on one thread.
      std::vector<float> rmain = main, rm = m, rv = v, rp32(static_cast<size_t>(n));
      std::vector<bf16_bits> rp16(static_cast<size_t>(n));
      const auto run_ref = [&](auto* g) {
        auto* none = static_cast<optim_kernel::NoStage*>(nullptr);
        if (is_adam) {
          if (c.params == DType::kF32) optim_kernel::adamw(g, rmain.data(), rm.data(), rv.data(), rp32.data(), n, ka);
          else if (c.params == DType::kBF16) optim_kernel::adamw(g, rmain.data(), rm.data(), rv.data(), rp16.data(), n, ka);
          else optim_kernel::adamw(g, rmain.data(), rm.data(), rv.data(), none, n, ka);
        } else {
          if (c.params == DType::kF32) optim_kernel::sgd(g, rmain.data(), rm.data(), rp32.data(), n, ks);
          else if (c.params == DType::kBF16) optim_kernel::sgd(g, rmain.data(), rm.data(), rp16.data(), n, ks);
          else optim_kernel::sgd(g, rmain.data(), rm.data(), none, n, ks);
        }
      };
      if (c.grads == DType::kF32) run_ref(grad32.data());
      else run_ref(grad16.data());

      ComputeBuffer dg = c.grads == DType::kF32 ? upload(grad32) : upload(grad16);
      ComputeBuffer dmain = upload(main), dm = upload(m), dv = upload(v);
      ComputeBuffer dp = compute_->allocate(static_cast<size_t>(n) * sizeof(float), MemoryCategory::kScratch, tracker_);
      const TensorView main_view = dmain.view(DType::kF32, Shape{n});
      const ShardUpdate shard{.grads = dg.view(c.grads, Shape{n}),
                              .main = static_cast<float*>(dmain.data()),
                              .state0 = static_cast<float*>(dm.data()),
                              .state1 = is_adam ? static_cast<float*>(dv.data()) : nullptr,
                              .params = aliased  ? main_view
                                        : staged ? dp.view(c.params, Shape{n})
                                                 : TensorView{}};
      if (is_adam) compute_->adamw(shard, adam);
      else compute_->sgd(shard, sgd);
      const std::vector<float> got_main = download<float>(dmain, static_cast<size_t>(n));
      const std::vector<float> got_m = download<float>(dm, static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        const auto k = static_cast<size_t>(i);
        ASSERT_TRUE(same_value(got_main[k], rmain[k])) << i;
        ASSERT_TRUE(same_value(got_m[k], rm[k])) << i;
      }
      if (is_adam) {
        const std::vector<float> got_v = download<float>(dv, static_cast<size_t>(n));
        for (size_t k = 0; k < got_v.size(); ++k) ASSERT_TRUE(same_value(got_v[k], rv[k])) << k;
      }
      if (c.params == DType::kF32) {
        const std::vector<float> p = download<float>(dp, static_cast<size_t>(n));
        for (size_t k = 0; k < p.size(); ++k) ASSERT_TRUE(same_value(p[k], rp32[k])) << k;
      } else if (c.params == DType::kBF16) {
        EXPECT_EQ(download<bf16_bits>(dp, static_cast<size_t>(n)), rp16);
      } else {
        for (float x : download<float>(dp, static_cast<size_t>(n))) ASSERT_EQ(x, 0.0f) << "nothing staged";
      }
    }
}

TEST_P(ComputeConformance, BadShardsAreErrorsNamingWhatIsWrong) {
  ComputeBuffer b = compute_->allocate(64 * sizeof(float), MemoryCategory::kScratch, tracker_);
  const TensorView v = b.view(DType::kF32, Shape{64});
  auto* p = static_cast<float*>(b.data());
  const auto message = [&](const ShardUpdate& s) {
    try {
      compute_->adamw(s, AdamWScalars{});
    } catch (const Error& e) {
      return e.message();
    }
    return std::string();
  };
  EXPECT_NE(message({.grads = v, .main = p, .state0 = p, .state1 = p, .params = v.slice(0, 63)}).find("63 staged params"),
            std::string::npos);
  EXPECT_NE(message({.grads = b.view(DType::kI32, Shape{64}), .main = p, .state0 = p, .state1 = p}).find("grads must be"),
            std::string::npos);
  EXPECT_NE(message({.grads = v, .main = nullptr, .state0 = p, .state1 = p}).find("null main"), std::string::npos);
  TensorView elsewhere = v;  // a view of another place's memory
  elsewhere.device = compute_->device().is_cpu() ? Device::cuda(7) : Device::cpu();
  EXPECT_NE(message({.grads = elsewhere, .main = p, .state0 = p, .state1 = p}).find("compute works on"),
            std::string::npos);
  EXPECT_NE(message({.grads = v, .main = p, .state0 = p, .state1 = p, .params = b.view(DType::kBF16, Shape{64})})
                .find("main itself"),
            std::string::npos)
      << "params that are main must be f32";
}

INSTANTIATE_TEST_SUITE_P(Usable, ComputeConformance, ::testing::ValuesIn(usable_computes()),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

// Says in the log which implementations ran: CUDA's only where the build has it and a device is.
TEST(ComputeImplementations, CudaRunsWhereADeviceIs) {
#if MXDDP_TEST_CUDA
  std::string why;
  if (cuda_device_count(&why) == 0) GTEST_SKIP() << "cuda compute not tested: " << why;
  EXPECT_EQ(make_cuda_compute(nullptr)->name(), "cuda");
#else
  GTEST_SKIP() << "cuda compute not tested: this build has no CUDA compiler (MXDDP_CUDA off)";
#endif
}

}  // namespace
}  // namespace mxddp::testing
