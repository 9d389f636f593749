// Every operation of compute.h on every implementation this process can use (the CPU's always,
// CUDA's where the build has it and a device is usable) against the CPU reference: core.h's casts
// and finiteness test, the optimizer kernels (src/optim/adamw_kernel.h) run on one thread, and the
// collectives' reduction written out element by element. Equal bits everywhere but the sum of
// squares, whose order is each implementation's own (and a NaN's payload, a device's own).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <omp.h>

#include <fmt/format.h>
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

// Host memory for staging (page-locked on a device): on the host, charged there, zeroed on request;
// the copies in and out of it, including a copy_from_host out of it that the compute is synchronized
// after before the block is written again (the staged collectives' order).
TEST_P(ComputeConformance, AllocateHostIsHostMemoryChargedThereThatTheCopiesUse) {
  {
    ComputeBuffer staging = compute_->allocate_host(4096, MemoryCategory::kComm, tracker_);
    EXPECT_EQ(staging.device(), Device::cpu());
    EXPECT_EQ(tracker_.usage().at(MemoryPlace::kHost).live(MemoryCategory::kComm), 4096);
    EXPECT_EQ(tracker_.usage().at(MemoryPlace::kDevice).live(MemoryCategory::kComm), 0);
    auto* host = static_cast<float*>(staging.data());
    for (int i = 0; i < 1024; ++i) ASSERT_EQ(host[i], 0.0f) << i;  // read directly: it is host memory
    for (int i = 0; i < 1024; ++i) host[i] = static_cast<float>(i) - 0.25f;
    ComputeBuffer b = compute_->allocate(4096, MemoryCategory::kScratch, tracker_);
    compute_->copy_from_host(b.data(), host, 4096);
    compute_->synchronize();
    for (int i = 0; i < 1024; ++i) host[i] = 0.0f;
    compute_->copy_to_host(host, b.data(), 4096);
    for (int i = 0; i < 1024; ++i) ASSERT_EQ(host[i], static_cast<float>(i) - 0.25f) << i;
    ComputeBuffer empty = compute_->allocate_host(0, MemoryCategory::kComm, tracker_, /*zeroed=*/false);
    EXPECT_EQ(empty.size_bytes(), 0u);
  }
  EXPECT_EQ(tracker_.usage().total_live_bytes, 0);
}

// copy_to_host_async into allocate_host's memory, then an event: once the event is waited for, the
// bytes are there, including those of work enqueued before the copy (a zero). Events are waited
// for from another thread (a collective's progress thread waits for them).
TEST_P(ComputeConformance, CopyToHostAsyncIsThereOnceAnEventAfterItIsWaitedFor) {
  constexpr int kNumel = 1 << 18;
  std::vector<float> values(kNumel);
  for (int i = 0; i < kNumel; ++i) values[static_cast<size_t>(i)] = static_cast<float>(i) * 0.75f - 3.0f;
  ComputeBuffer device = upload(values);
  compute_->zero(device.data(), 16 * sizeof(float));  // work before the copy: the copy sees it
  ComputeBuffer staging = compute_->allocate_host(kNumel * sizeof(float), MemoryCategory::kComm, tracker_);
  compute_->copy_to_host_async(staging.data(), device.data(), kNumel * sizeof(float));
  std::unique_ptr<ComputeEvent> copied = compute_->record_event();
  std::thread([&] { copied->wait(); }).join();
  const auto* host = static_cast<const float*>(staging.data());
  for (int i = 0; i < kNumel; ++i) ASSERT_EQ(host[i], i < 16 ? 0.0f : values[static_cast<size_t>(i)]) << i;
  compute_->copy_to_host_async(staging.data(), device.data(), 0);  // nothing to copy: nothing happens
  EXPECT_THROW(compute_->copy_to_host_async(nullptr, device.data(), 4), Error);
  compute_->record_event()->wait();  // an event with nothing before it is reached
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

TEST_P(ComputeConformance, CountZerosOverRunsMatchesCore) {
  // +0, -0, the smallest denormals (not zero, whatever the CPU's flush-to-zero), NaN, and ones.
  std::vector<float> a(100'003, 1.0f);
  for (size_t i = 0; i < a.size(); i += 7) a[i] = i % 2 ? -0.0f : 0.0f;
  a[1] = std::numeric_limits<float>::denorm_min();
  a[2] = -std::numeric_limits<float>::denorm_min();
  a[3] = std::numeric_limits<float>::quiet_NaN();
  std::vector<bf16_bits> b(5'001, f32_to_bf16(2.0f));
  for (size_t i = 0; i < b.size(); i += 3) b[i] = i % 2 ? 0x8000u : 0x0000u;
  b[1] = 0x0001u;  // bf16's smallest denormal
  ComputeBuffer da = upload(a), db = upload(b);
  const TensorView va = da.view(DType::kF32, Shape{100'003}), vb = db.view(DType::kBF16, Shape{5'001});
  const int64_t zeros_a = count_zeros(TensorView{a.data(), DType::kF32, Shape{100'003}, Device::cpu()});
  const int64_t zeros_b = count_zeros(TensorView{b.data(), DType::kBF16, Shape{5'001}, Device::cpu()});
  EXPECT_EQ(zeros_a, 14'287);  // ceil(100'003 / 7)
  EXPECT_EQ(zeros_b, 1'667);
  const std::vector<TensorView> runs{va.slice(0, 50'000), vb, va.slice(50'000, 50'003), vb.slice(0, 0)};
  EXPECT_EQ(compute_->count_zeros(runs), zeros_a + zeros_b);
  EXPECT_EQ(compute_->count_zeros({}), 0);
  EXPECT_EQ(compute_->count_zeros(std::vector<TensorView>{va.slice(7, 1)}), 1);
  const std::vector<TensorView> ints{da.view(DType::kI64, Shape{10})};
  EXPECT_THROW(compute_->count_zeros(ints), Error) << "f32 or bf16 only";
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

// The collectives' reduction, as ReduceRun defines it, one element at a time: floats from input 0
// (times the prescale), then each next input in order; bf16 through f32, rounded once.
// bool is held in uint8_t (any nonzero byte is true; the result is 0 or 1).
template <typename T>
T reference_reduce(const std::vector<std::vector<T>>& in, size_t i, DType dtype, ReduceOp op, float prescale) {
  const auto n = static_cast<int>(in.size());
  if (dtype == DType::kBool) {
    bool any = false;
    for (int k = 0; k < n; ++k) any = any || in[static_cast<size_t>(k)][i] != 0;
    return static_cast<T>(any);
  }
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, bf16_bits>) {
    using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
    const auto load = [&](int k) -> A {
      if constexpr (std::is_same_v<T, bf16_bits>) return bf16_to_f32(in[static_cast<size_t>(k)][i]);
      else return in[static_cast<size_t>(k)][i];
    };
    A acc = load(0) * static_cast<A>(prescale);
    for (int k = 1; k < n; ++k) {
      const A x = load(k);
      acc = op == ReduceOp::kMax ? ((x > acc || x != x) ? x : acc) : acc + x * static_cast<A>(prescale);
    }
    if (op == ReduceOp::kAvg) acc = acc / static_cast<A>(n);
    if constexpr (std::is_same_v<T, bf16_bits>) return f32_to_bf16(acc);
    else return acc;
  } else {
    using U = std::make_unsigned_t<T>;
    T acc = in[0][i];
    for (int k = 1; k < n; ++k) {
      const T x = in[static_cast<size_t>(k)][i];
      acc = op == ReduceOp::kMax ? std::max(acc, x) : static_cast<T>(static_cast<U>(acc) + static_cast<U>(x));
    }
    return acc;
  }
}

// Equal, or both NaN (a device's NaN carries its own payload).
template <typename T>
bool same_element(T a, T b) {
  if constexpr (std::is_same_v<T, float>) return same_value(a, b);
  else if constexpr (std::is_same_v<T, double>) return (std::isnan(a) && std::isnan(b)) || std::memcmp(&a, &b, 8) == 0;
  else if constexpr (std::is_same_v<T, bf16_bits>) return a == b || (std::isnan(bf16_to_f32(a)) && std::isnan(bf16_to_f32(b)));
  else return a == b;
}

// Three ranks' inputs reduced into two outputs, one of them input 1 itself (all_reduce's in-place
// write-back), against reference_reduce; values include NaN, Inf and integer overflow.
template <typename T>
void check_reduce(Compute& compute, MemoryTracker& tracker, DType dtype, ReduceOp op, float prescale,
                  const std::function<T(std::mt19937&, size_t)>& draw) {
  SCOPED_TRACE(fmt::format("{} {} prescale {}", dtype_name(dtype), reduce_op_name(op), prescale));
  constexpr size_t kCount = 10'007, kInputs = 3;
  std::mt19937 rng(static_cast<unsigned>(dtype) * 31 + static_cast<unsigned>(op));
  std::vector<std::vector<T>> in(kInputs, std::vector<T>(kCount));
  for (auto& v : in)
    for (size_t i = 0; i < kCount; ++i) v[i] = draw(rng, i);
  std::vector<ComputeBuffer> buffers;
  std::vector<const void*> inputs;
  for (auto& v : in) {
    buffers.push_back(compute.allocate(kCount * sizeof(T), MemoryCategory::kScratch, tracker));
    compute.copy_from_host(buffers.back().data(), v.data(), kCount * sizeof(T));
    inputs.push_back(buffers.back().data());
  }
  ComputeBuffer extra = compute.allocate(kCount * sizeof(T), MemoryCategory::kScratch, tracker);
  void* const outputs[2] = {extra.data(), buffers[1].data()};
  compute.reduce({.dtype = dtype, .op = op, .prescale = prescale, .count = static_cast<int64_t>(kCount),
                  .inputs = inputs, .outputs = outputs});
  for (void* out : outputs) {
    std::vector<T> got(kCount);
    compute.copy_to_host(got.data(), out, kCount * sizeof(T));
    for (size_t i = 0; i < kCount; ++i) {
      const T want = reference_reduce(in, i, dtype, op, prescale);
      ASSERT_TRUE(same_element(got[i], want)) << "element " << i << ": got " << +got[i] << ", want " << +want;
    }
  }
}

TEST_P(ComputeConformance, ReduceMatchesTheReferenceForEveryDtypeAndOp) {
  const auto awkward = [](std::mt19937& rng, size_t i) {
    if (i % 1000 == 7) return std::numeric_limits<float>::quiet_NaN();
    if (i % 1000 == 8) return std::numeric_limits<float>::infinity();
    return std::uniform_real_distribution<float>(-1e3f, 1e3f)(rng);
  };
  for (const ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
    const float prescale = op == ReduceOp::kMax ? 1.0f : 0.125f;
    check_reduce<float>(*compute_, tracker_, DType::kF32, op, prescale, awkward);
    check_reduce<float>(*compute_, tracker_, DType::kF32, op, 1.0f, awkward);
    check_reduce<bf16_bits>(*compute_, tracker_, DType::kBF16, op, prescale,
                            [&](std::mt19937& rng, size_t i) { return f32_to_bf16(awkward(rng, i)); });
    check_reduce<double>(*compute_, tracker_, DType::kF64, op, prescale,
                         [&](std::mt19937& rng, size_t i) { return 1.0 / 3.0 * awkward(rng, i); });
  }
  for (const ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
    check_reduce<uint8_t>(*compute_, tracker_, DType::kU8, op, 1.0f,
                          [](std::mt19937& rng, size_t) { return static_cast<uint8_t>(rng()); });
    check_reduce<int32_t>(*compute_, tracker_, DType::kI32, op, 1.0f,
                          [](std::mt19937& rng, size_t) { return static_cast<int32_t>(rng()); });  // sums wrap
    check_reduce<int64_t>(*compute_, tracker_, DType::kI64, op, 1.0f, [](std::mt19937& rng, size_t) {
      return static_cast<int64_t>((uint64_t{rng()} << 32) | rng());
    });
    check_reduce<uint8_t>(*compute_, tracker_, DType::kBool, op, 1.0f,  // 2: a nonzero byte other than 1
                          [](std::mt19937& rng, size_t) { return static_cast<uint8_t>(rng() % 7 == 0 ? 2 : 0); });
  }
}

TEST_P(ComputeConformance, CopyToManyAndBadReductionsNamingWhatIsWrong) {
  std::vector<int32_t> host(70'001);
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<int32_t>(i * 7);
  ComputeBuffer src = upload(host);
  ComputeBuffer a = compute_->allocate(host.size() * 4, MemoryCategory::kScratch, tracker_);
  ComputeBuffer b = compute_->allocate(host.size() * 4, MemoryCategory::kScratch, tracker_);
  void* const dsts[2] = {a.data(), b.data()};
  compute_->copy_to_many(src.data(), dsts, host.size() * 4);
  EXPECT_EQ(download<int32_t>(a, host.size()), host);
  EXPECT_EQ(download<int32_t>(b, host.size()), host);

  const void* const inputs[1] = {src.data()};
  void* const outputs[1] = {a.data()};
  const auto message = [&](DType dtype, ReduceOp op, float prescale, std::span<const void* const> in) {
    try {
      compute_->reduce({.dtype = dtype, .op = op, .prescale = prescale, .count = 10, .inputs = in, .outputs = outputs});
    } catch (const Error& e) {
      return e.message();
    }
    return std::string();
  };
  EXPECT_NE(message(DType::kI32, ReduceOp::kAvg, 1.0f, inputs).find("avg of i32"), std::string::npos);
  EXPECT_NE(message(DType::kF32, ReduceOp::kMax, 0.5f, inputs).find("prescale 0.5 with max"), std::string::npos);
  EXPECT_NE(message(DType::kE4M3, ReduceOp::kSum, 1.0f, inputs).find("dtype e4m3; valid"), std::string::npos);
  EXPECT_NE(message(DType::kF32, ReduceOp::kSum, 1.0f, {}).find("0 inputs"), std::string::npos);
  EXPECT_EQ(message(DType::kF32, ReduceOp::kSum, 1.0f, inputs), "");
}

// quant.h's codec (mx_quantize on the host, the reference every implementation must equal): both
// orientations and formats, both scale rules, f32 and bf16 inputs, shapes with partial blocks, and
// zero, Inf and NaN blocks among the awkward floats.
TEST_P(ComputeConformance, MxQuantizeMatchesTheHostCodec) {
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{77, 45}, {64, 96}, {1, 1}, {33, 257}}) {
    const auto n = static_cast<size_t>(rows * cols);
    std::vector<float> values = awkward_floats(std::max<size_t>(n, 4), static_cast<unsigned>(rows * 1000 + cols));
    values.resize(n);  // awkward_floats sets its first four
    for (size_t i = 0; i < std::min<size_t>(n, 32); ++i) values[i] = 0.0f;  // a zero block (row-wise)
    const Shape shape{rows, cols};
    std::vector<bf16_bits> halves(n);
    convert_f32_to_bf16(values.data(), halves.data(), n);
    ComputeBuffer in32 = upload(values), in16 = upload(halves);
    for (DType dtype : {DType::kF32, DType::kBF16})
      for (QuantAxis axis : {QuantAxis::kRow, QuantAxis::kCol})
        for (Fp8Format elem : {Fp8Format::kE4M3, Fp8Format::kE5M2})
          for (ScaleMode mode : {ScaleMode::kRceil, ScaleMode::kFloor}) {
            SCOPED_TRACE(fmt::format("{}x{} {} {} {} {}", rows, cols, dtype_name(dtype), quant_axis_name(axis),
                                     fp8_format_name(elem), scale_mode_name(mode)));
            const QuantizeOptions options{elem, mode, axis};
            const Shape scale_shape = mx_scale_shape(rows, cols, axis);
            const auto scale_numel = static_cast<size_t>(scale_shape.numel());
            const TensorView host_in = dtype == DType::kF32 ? TensorView{values.data(), dtype, shape}
                                                            : TensorView{halves.data(), dtype, shape};
            std::vector<uint8_t> want_data(n), want_scales(scale_numel);
            mx_quantize(host_in, {want_data.data(), DType::kU8, shape}, {want_scales.data(), DType::kU8, scale_shape},
                        options);
            ComputeBuffer data = compute_->allocate(n, MemoryCategory::kMxfp8, tracker_);
            ComputeBuffer scales = compute_->allocate(scale_numel, MemoryCategory::kMxfp8, tracker_);
            const ComputeBuffer& in = dtype == DType::kF32 ? in32 : in16;
            compute_->mx_quantize(in.view(dtype, shape),
                                  {data.view(DType::kU8, shape), scales.view(DType::kU8, scale_shape), options});
            ASSERT_EQ(download<uint8_t>(data, n), want_data);
            ASSERT_EQ(download<uint8_t>(scales, scale_numel), want_scales);
          }
  }
}

// quant.h's shard codec (FSDP's MXFP8 shards) against the host's: shards cut anywhere (mid-row,
// mid-block, the whole tensor, one element, none), both orientations, formats and scale rules, f32
// and bf16.
TEST_P(ComputeConformance, MxShardCodecMatchesTheHostCodec) {
  const int64_t rows = 45, cols = 77;
  const Shape shape{rows, cols};
  const auto total = static_cast<size_t>(rows * cols);
  std::vector<float> values = awkward_floats(total, 5);
  std::vector<bf16_bits> halves(total);
  convert_f32_to_bf16(values.data(), halves.data(), total);
  for (const auto& [offset, n] : {std::pair<int64_t, int64_t>{0, rows * cols}, {0, 1000}, {1000, 1001}, {2001, 1464},
                                  {77 * 13 + 5, 1}, {500, 0}})
    for (DType dtype : {DType::kF32, DType::kBF16})
      for (QuantAxis axis : {QuantAxis::kRow, QuantAxis::kCol})
        for (Fp8Format elem : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
          // Both scale rules, alternating with the format.
          const ScaleMode mode = elem == Fp8Format::kE4M3 ? ScaleMode::kRceil : ScaleMode::kFloor;
          SCOPED_TRACE(fmt::format("[{}, {}) {} {} {} {}", offset, offset + n, dtype_name(dtype), quant_axis_name(axis),
                                   fp8_format_name(elem), scale_mode_name(mode)));
          const QuantizeOptions options{elem, mode, axis};
          const auto scale_numel = static_cast<size_t>(mx_scale_shape(rows, cols, axis).numel());
          const auto count = static_cast<size_t>(n);
          const TensorView host_shard = dtype == DType::kF32
                                            ? TensorView{values.data() + offset, dtype, Shape{n}}
                                            : TensorView{halves.data() + offset, dtype, Shape{n}};
          std::vector<uint8_t> want_scales(scale_numel), want_data(count);
          mx_shard_scales(host_shard, offset, shape, {want_scales.data(), DType::kU8, Shape{int64_t(scale_numel)}}, options);
          mx_shard_encode(host_shard, offset, shape, {want_scales.data(), DType::kU8, Shape{int64_t(scale_numel)}},
                          {want_data.data(), DType::kU8, Shape{n}}, options);
          ComputeBuffer shard = dtype == DType::kF32
                                    ? upload(std::vector<float>(values.begin() + offset, values.begin() + offset + n))
                                    : upload(std::vector<bf16_bits>(halves.begin() + offset, halves.begin() + offset + n));
          ComputeBuffer scales = compute_->allocate(scale_numel, MemoryCategory::kMxfp8, tracker_);
          ComputeBuffer data = compute_->allocate(std::max<size_t>(count, 1), MemoryCategory::kMxfp8, tracker_);
          compute_->mx_shard_scales(shard.view(dtype, Shape{n}), offset, shape,
                                    scales.view(DType::kU8, Shape{int64_t(scale_numel)}), options);
          ASSERT_EQ(download<uint8_t>(scales, scale_numel), want_scales);
          compute_->mx_shard_encode(shard.view(dtype, Shape{n}), offset, shape,
                                    scales.view(DType::kU8, Shape{int64_t(scale_numel)}), data.view(DType::kU8, Shape{n}),
                                    options);
          if (n > 0) {
            ASSERT_EQ(download<uint8_t>(data, count), want_data);
          }
        }
  // Bad cuts and views name the value.
  ComputeBuffer shard = compute_->allocate(100 * 4, MemoryCategory::kScratch, tracker_);
  ComputeBuffer scales = compute_->allocate(rows * 3, MemoryCategory::kScratch, tracker_);
  const auto message = [&](auto&& call) {
    try {
      call();
    } catch (const Error& e) {
      return e.message();
    }
    return std::string();
  };
  const TensorView s = scales.view(DType::kU8, Shape{rows * 3});
  EXPECT_NE(message([&] { compute_->mx_shard_scales(shard.view(DType::kF32, Shape{100}), rows * cols - 50, shape, s, {}); })
                .find("a shard of 100 elements at offset 3415 does not fit a [45, 77] tensor"),
            std::string::npos);
  EXPECT_NE(message([&] {
              compute_->mx_shard_encode(shard.view(DType::kF32, Shape{100}), 0, shape, s,
                                        scales.view(DType::kU8, Shape{99}), {});
            }).find("mx_shard_encode: data must be u8 [100]"),
            std::string::npos);
}

TEST_P(ComputeConformance, BadMxQuantizeArgumentsAreErrorsNamingWhatIsWrong) {
  ComputeBuffer in = compute_->allocate(64 * 4, MemoryCategory::kScratch, tracker_);
  ComputeBuffer data = compute_->allocate(64, MemoryCategory::kScratch, tracker_);
  ComputeBuffer scales = compute_->allocate(8, MemoryCategory::kScratch, tracker_);
  const auto message = [&](const TensorView& input, const Mxfp8View& out) {
    try {
      compute_->mx_quantize(input, out);
    } catch (const Error& e) {
      return e.message();
    }
    return std::string();
  };
  const Shape shape{2, 32};
  const Mxfp8View good{data.view(DType::kU8, shape), scales.view(DType::kU8, Shape{2, 1}), {}};
  EXPECT_EQ(message(in.view(DType::kF32, shape), good), "");
  EXPECT_NE(message(in.view(DType::kF32, Shape{64}), good).find("expects a 2-D [M, N] tensor; got [64]"),
            std::string::npos);
  Mxfp8View bad_scales = good;
  bad_scales.scales = scales.view(DType::kU8, Shape{1, 2});
  EXPECT_NE(message(in.view(DType::kF32, shape), bad_scales).find("scales must be u8 [2, 1]"), std::string::npos);
  // Host memory handed to a device's implementation (or a device's to the host's) is refused.
  std::vector<float> host(64);
  TensorView elsewhere{host.data(), DType::kF32, shape, compute_->device().is_cpu() ? Device::cuda(3) : Device::cpu()};
  EXPECT_NE(message(elsewhere, good), "");
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
