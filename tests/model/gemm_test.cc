// The model's matrix products (src/model/gemm.h) against an f64 reference: every transpose
// combination, leading dimensions wider than the rows, alpha and beta, in F32 and in BF16 compute;
// the per-thread compute dtype and thread count; and bad arguments.
//
// Bounds, with u32 = 2^-24 (f32 unit roundoff), u16 = 2^-8 (bf16's) and
// mag[i, j] = |alpha| sum_p |op(A)[i, p] op(B)[p, j]| + |beta C0[i, j]|:
//   F32:  |C - C_f64| <= (k + 2) u32 mag       (a dot product of k terms, then alpha and beta)
//   BF16: |C - C_f64| <= (2 u16 + u16^2 + (k + 2) u32) mag   (each operand rounded once to bf16)
// and BF16 against the f64 product of the bf16-rounded operands: the F32 bound, which is what
// shows the accumulation is F32 and not BF16.
#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <omp.h>

#include <mxddp/core.h>
#include <mxddp/model.h>

#include "model/gemm.h"

namespace mxddp::model {
namespace {

constexpr double kU32 = 1.0 / (1 << 24);
constexpr double kU16 = 1.0 / (1 << 8);

float round_to_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

struct Case {
  Op op_a, op_b;
  int m, n, k;
  float alpha, beta;
  int pad;  // extra columns in every leading dimension
};

// A stored [m, k] (or [k, m] when transposed), B [k, n] (or [n, k]), C [m, n], each with ld = cols + pad.
struct Operands {
  int lda, ldb, ldc;
  std::vector<float> a, b, c0;
};

Operands make_operands(const Case& t, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  Operands o;
  const int a_rows = t.op_a == Op::kN ? t.m : t.k, a_cols = t.op_a == Op::kN ? t.k : t.m;
  const int b_rows = t.op_b == Op::kN ? t.k : t.n, b_cols = t.op_b == Op::kN ? t.n : t.k;
  o.lda = a_cols + t.pad;
  o.ldb = b_cols + t.pad;
  o.ldc = t.n + t.pad;
  o.a.resize(static_cast<size_t>(a_rows) * o.lda);
  o.b.resize(static_cast<size_t>(b_rows) * o.ldb);
  o.c0.resize(static_cast<size_t>(t.m) * o.ldc);
  for (float& x : o.a) x = dist(rng);
  for (float& x : o.b) x = dist(rng);
  for (float& x : o.c0) x = dist(rng);
  return o;
}

float at(const std::vector<float>& x, int ld, Op op, int row, int col) {
  return op == Op::kN ? x[static_cast<size_t>(row) * ld + col] : x[static_cast<size_t>(col) * ld + row];
}

// ref[i, j] (f64) and mag[i, j] as in the header; round: operands rounded to bf16 first.
void reference(const Case& t, const Operands& o, bool round, std::vector<double>& ref, std::vector<double>& mag) {
  ref.assign(static_cast<size_t>(t.m) * t.n, 0.0);
  mag.assign(ref.size(), 0.0);
  for (int i = 0; i < t.m; ++i)
    for (int j = 0; j < t.n; ++j) {
      double sum = 0, abs_sum = 0;
      for (int p = 0; p < t.k; ++p) {
        float x = at(o.a, o.lda, t.op_a, i, p), y = at(o.b, o.ldb, t.op_b, p, j);
        if (round) x = round_to_bf16(x), y = round_to_bf16(y);
        sum += static_cast<double>(x) * y;
        abs_sum += std::abs(static_cast<double>(x) * y);
      }
      const double c0 = t.beta == 0.0f ? 0.0 : o.c0[static_cast<size_t>(i) * o.ldc + j];
      ref[static_cast<size_t>(i) * t.n + j] = t.alpha * sum + t.beta * c0;
      mag[static_cast<size_t>(i) * t.n + j] = std::abs(t.alpha) * abs_sum + std::abs(t.beta * c0);
    }
}

// Runs the case in `dtype`; checks C against the f64 reference (on rounded operands when
// round_ref) within rel_bound x mag, and that the padding columns of C were not written.
// stored_bf16: 1 stores A in BF16 (the rounded values), 2 stores B, 3 both; such operands are
// passed as GemmOperand{.., bf16 = true} and read in place.
void check_case(const Case& t, GemmDType dtype, bool round_ref, double rel_bound, uint64_t seed, int stored_bf16 = 0) {
  const Operands o = make_operands(t, seed);
  std::vector<bf16_bits> a16(o.a.size()), b16(o.b.size());
  for (size_t i = 0; i < o.a.size(); ++i) a16[i] = f32_to_bf16(o.a[i]);
  for (size_t i = 0; i < o.b.size(); ++i) b16[i] = f32_to_bf16(o.b[i]);
  std::vector<float> c = o.c0;
  if (t.beta == 0.0f)  // beta = 0 must not read C: NaN there would show through
    for (int i = 0; i < t.m; ++i)
      for (int j = 0; j < t.n; ++j) c[static_cast<size_t>(i) * o.ldc + j] = std::nanf("");
  {
    const ScopedGemmDType scope(dtype);
    if (stored_bf16 == 0) {
      gemm(t.op_a, t.op_b, t.m, t.n, t.k, t.alpha, o.a.data(), o.lda, o.b.data(), o.ldb, t.beta, c.data(), o.ldc);
    } else {
      const GemmOperand a = (stored_bf16 & 1) ? GemmOperand{a16.data(), o.lda, true} : GemmOperand{o.a.data(), o.lda, false};
      const GemmOperand b = (stored_bf16 & 2) ? GemmOperand{b16.data(), o.ldb, true} : GemmOperand{o.b.data(), o.ldb, false};
      gemm(t.op_a, t.op_b, t.m, t.n, t.k, t.alpha, a, b, t.beta, c.data(), o.ldc);
    }
  }
  std::vector<double> ref, mag;
  reference(t, o, round_ref, ref, mag);
  double worst = 0;
  for (int i = 0; i < t.m; ++i) {
    for (int j = 0; j < t.n; ++j) {
      const size_t ij = static_cast<size_t>(i) * t.n + j;
      const double err = std::abs(c[static_cast<size_t>(i) * o.ldc + j] - ref[ij]);
      ASSERT_LE(err, rel_bound * mag[ij] + 1e-30) << "C[" << i << ", " << j << "] = " << c[static_cast<size_t>(i) * o.ldc + j]
                                                 << ", f64 " << ref[ij];
      worst = std::max(worst, err / std::max(mag[ij], 1e-30));
    }
    for (int j = t.n; j < o.ldc; ++j)
      ASSERT_EQ(std::memcmp(&c[static_cast<size_t>(i) * o.ldc + j], &o.c0[static_cast<size_t>(i) * o.ldc + j], 4), 0)
          << "padding C[" << i << ", " << j << "] was written";
  }
  ::testing::Test::RecordProperty("worst_error_over_mag", std::to_string(worst));
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (Op op_a : {Op::kN, Op::kT})
    for (Op op_b : {Op::kN, Op::kT}) {
      out.push_back({op_a, op_b, 67, 45, 129, 1.0f, 0.0f, 0});
      out.push_back({op_a, op_b, 33, 80, 200, 0.125f, 1.0f, 7});  // attention's scale; accumulate
      out.push_back({op_a, op_b, 1, 3, 513, -2.0f, 0.5f, 3});
    }
  return out;
}

TEST(Gemm, F32MatchesF64WithinTheDotProductBound) {
  uint64_t seed = 1;
  for (const Case& t : cases()) {
    SCOPED_TRACE(::testing::Message() << "op_a " << static_cast<int>(t.op_a) << " op_b " << static_cast<int>(t.op_b)
                                    << " m " << t.m << " n " << t.n << " k " << t.k);
    check_case(t, GemmDType::kF32, false, (t.k + 2) * kU32, seed++);
  }
}

TEST(Gemm, Bf16MatchesF64WithinTheRoundingBound) {
  uint64_t seed = 100;
  for (const Case& t : cases()) {
    SCOPED_TRACE(::testing::Message() << "op_a " << static_cast<int>(t.op_a) << " op_b " << static_cast<int>(t.op_b)
                                    << " m " << t.m << " n " << t.n << " k " << t.k);
    check_case(t, GemmDType::kBF16, false, 2 * kU16 + kU16 * kU16 + (t.k + 2) * kU32, seed++);
  }
}

TEST(Gemm, Bf16AccumulatesInF32) {
  // Against the f64 product of the bf16-rounded operands the F32 bound holds (only when the CPU
  // computes in BF16; otherwise the products are F32 and the rounded reference does not apply).
  if (!bf16_gemm_supported()) {
    check_case(cases()[0], GemmDType::kBF16, false, (cases()[0].k + 2) * kU32, 7);
    return;
  }
  uint64_t seed = 200;
  for (const Case& t : cases()) check_case(t, GemmDType::kBF16, true, (t.k + 2) * kU32, seed++);
}

TEST(Gemm, Bf16StoredOperandsAreReadInPlaceWithF32Accumulation) {
  // A BF16 param is read as stored: A, B or both in BF16 storage give the f64 product of the
  // rounded values within the F32 bound, in every layout (transposes, padded leading dimensions).
  if (!bf16_gemm_supported()) {
    const ScopedGemmDType scope(GemmDType::kBF16);
    const bf16_bits one = f32_to_bf16(1.0f);
    float c = 0;
    EXPECT_THROW(gemm(Op::kN, Op::kN, 1, 1, 1, 1.0f, GemmOperand{&one, 1, true}, GemmOperand{&c, 1, false}, 0.0f, &c, 1),
                 Error);
    return;
  }
  uint64_t seed = 300;
  for (int stored = 1; stored <= 3; ++stored)
    for (const Case& t : cases()) check_case(t, GemmDType::kBF16, true, (t.k + 2) * kU32, seed++, stored);
}

TEST(Gemm, BiasIsAddedToEveryRowInF32AndBf16) {
  // A linear layer's product: C = op(A) op(B) + bias, beta 0 (C starts as NaN: not read), in f32
  // and BF16 compute, within each one's bound with |bias| added to the magnitude.
  for (GemmDType dtype : {GemmDType::kF32, GemmDType::kBF16}) {
    const bool bf16 = dtype == GemmDType::kBF16 && bf16_gemm_supported();
    const Case t{Op::kN, Op::kT, 37, 29, 70, 1.0f, 0.0f, 3};
    const Operands o = make_operands(t, 77);
    std::vector<float> bias(static_cast<size_t>(t.n));
    for (int j = 0; j < t.n; ++j) bias[static_cast<size_t>(j)] = 0.25f * static_cast<float>(j % 7) - 0.5f;
    std::vector<float> c(o.c0.size(), std::nanf(""));
    {
      const ScopedGemmDType scope(dtype);
      gemm(t.op_a, t.op_b, t.m, t.n, t.k, 1.0f, GemmOperand{o.a.data(), o.lda, false}, GemmOperand{o.b.data(), o.ldb, false},
           0.0f, c.data(), o.ldc, bias.data());
    }
    std::vector<double> ref, mag;
    reference(t, o, bf16, ref, mag);
    for (int i = 0; i < t.m; ++i)
      for (int j = 0; j < t.n; ++j) {
        const size_t ij = static_cast<size_t>(i) * t.n + j;
        const double want = ref[ij] + bias[static_cast<size_t>(j)];
        const double bound = (t.k + 3) * kU32 * (mag[ij] + std::abs(bias[static_cast<size_t>(j)]));
        ASSERT_LE(std::abs(c[static_cast<size_t>(i) * o.ldc + j] - want), bound) << (bf16 ? "bf16" : "f32") << " C[" << i
                                                                                 << ", " << j << "]";
      }
  }
  float one = 1.0f, c = 0.0f;
  EXPECT_THROW(gemm(Op::kN, Op::kN, 1, 1, 1, 2.0f, GemmOperand{&one, 1, false}, GemmOperand{&one, 1, false}, 0.0f, &c, 1,
                    &one),
               Error);
}

TEST(Gemm, Bf16StoredOperandNeedsBf16Compute) {
  const bf16_bits one = f32_to_bf16(1.0f);
  const float b = 2.0f;
  float c = 0;
  EXPECT_THROW(gemm(Op::kN, Op::kN, 1, 1, 1, 1.0f, GemmOperand{&one, 1, true}, GemmOperand{&b, 1, false}, 0.0f, &c, 1),
               Error);
}

TEST(Gemm, Bf16ReallyRoundsOperandsWhereSupported) {
  // 1 + 2^-10 is not a bf16 value (it rounds to 1): an F32 product keeps the 2^-10, a BF16 one loses it.
  const float a = 1.0f + 1.0f / 1024, b = 1.0f;
  float c = 0;
  {
    const ScopedGemmDType scope(GemmDType::kBF16);
    gemm(Op::kN, Op::kN, 1, 1, 1, 1.0f, &a, 1, &b, 1, 0.0f, &c, 1);
  }
  EXPECT_EQ(c, bf16_gemm_supported() ? 1.0f : a);
  gemm(Op::kN, Op::kN, 1, 1, 1, 1.0f, &a, 1, &b, 1, 0.0f, &c, 1);  // the default is F32 again
  EXPECT_EQ(c, a);
}

TEST(Gemm, ZeroSizesAndZeroDepth) {
  std::vector<float> c = {1.0f, 2.0f, 3.0f, 4.0f};
  const float one = 1.0f;
  gemm(Op::kN, Op::kN, 0, 2, 3, 1.0f, &one, 3, &one, 2, 0.0f, c.data(), 2);  // m = 0: nothing happens
  EXPECT_EQ(c[0], 1.0f);
  gemm(Op::kN, Op::kN, 2, 2, 0, 1.0f, &one, 1, &one, 2, 0.5f, c.data(), 2);  // k = 0: C = beta C
  EXPECT_EQ(c, (std::vector<float>{0.5f, 1.0f, 1.5f, 2.0f}));
  gemm(Op::kN, Op::kN, 2, 2, 0, 1.0f, &one, 1, &one, 2, 0.0f, c.data(), 2);
  EXPECT_EQ(c, (std::vector<float>(4, 0.0f)));
}

TEST(Gemm, BadArgumentsAreErrors) {
  std::vector<float> x(64, 1.0f);
  EXPECT_THROW(gemm(Op::kN, Op::kN, -1, 2, 2, 1.0f, x.data(), 2, x.data(), 2, 0.0f, x.data(), 2), Error);
  EXPECT_THROW(gemm(Op::kN, Op::kN, 2, 2, 4, 1.0f, x.data(), 3, x.data(), 2, 0.0f, x.data(), 2), Error);  // lda < k
  EXPECT_THROW(gemm(Op::kT, Op::kN, 4, 2, 2, 1.0f, x.data(), 2, x.data(), 2, 0.0f, x.data(), 2), Error);  // lda < m
  EXPECT_THROW(gemm(Op::kN, Op::kT, 2, 4, 3, 1.0f, x.data(), 3, x.data(), 2, 0.0f, x.data(), 4), Error);  // ldb < k
  EXPECT_THROW(gemm(Op::kN, Op::kN, 2, 4, 2, 1.0f, x.data(), 2, x.data(), 4, 0.0f, x.data(), 3), Error);  // ldc < n
  try {
    gemm(Op::kN, Op::kN, 2, 2, 4, 1.0f, x.data(), 3, x.data(), 2, 0.0f, x.data(), 2);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("lda 3"), std::string::npos) << e.what();
  }
}

TEST(Gemm, F64MatchesTheReference) {
  // The gradient check's products: [3, 4] x [4, 2] by hand.
  const double a[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, b[] = {1, 0, 0, 1, 1, 1, 2, -1};
  double c[6] = {1, 1, 1, 1, 1, 1};
  gemm(Op::kN, Op::kN, 3, 2, 4, 2.0, a, 4, b, 2, 1.0, c, 2);
  const double want[] = {1 + 2 * (1 + 3 + 8), 1 + 2 * (2 + 3 - 4), 1 + 2 * (5 + 7 + 16), 1 + 2 * (6 + 7 - 8),
                         1 + 2 * (9 + 11 + 24), 1 + 2 * (10 + 11 - 12)};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(c[i], want[i]) << i;
}

TEST(ComputeThreads, EachThreadHasItsOwn) {
  // OpenMP's thread count belongs to the calling thread: two threads that set different counts
  // each read back their own, and a fresh thread starts from the default (every core), not
  // from its parent's setting.
  set_compute_threads(0);
  const int default_threads = compute_threads();
  EXPECT_GE(default_threads, 1);
  set_compute_threads(3);
  int seen_fresh = -1, seen_1 = -1, seen_2 = -1;
  std::thread fresh([&] { seen_fresh = compute_threads(); });
  fresh.join();
  std::thread t1([&] {
    set_compute_threads(1);
    std::vector<float> a(64 * 64, 1.0f), c(64 * 64);
    gemm(Op::kN, Op::kN, 64, 64, 64, 1.0f, a.data(), 64, a.data(), 64, 0.0f, c.data(), 64);
    seen_1 = compute_threads();
  });
  std::thread t2([&] {
    set_compute_threads(2);
    seen_2 = compute_threads();
  });
  t1.join();
  t2.join();
  // OMP_THREAD_LIMIT (the TSan suite runs with 1) caps every count.
  const auto capped = [](int n) { return std::min(n, omp_get_thread_limit()); };
  EXPECT_EQ(seen_fresh, default_threads);
  EXPECT_EQ(seen_1, 1);
  EXPECT_EQ(seen_2, capped(2));
  EXPECT_EQ(compute_threads(), capped(3));
  set_compute_threads(0);
  EXPECT_EQ(compute_threads(), default_threads);
  EXPECT_THROW(set_compute_threads(-1), Error);
}

TEST(ComputeThreads, GemmDTypeIsPerThread) {
  const ScopedGemmDType scope(GemmDType::kBF16);
  GemmDType other = GemmDType::kBF16;
  std::thread t([&] { other = gemm_dtype(); });
  t.join();
  EXPECT_EQ(other, GemmDType::kF32);
  EXPECT_EQ(gemm_dtype(), GemmDType::kBF16);
}

TEST(ComputeInfo, NamesLibraryKernelAndThreads) {
  set_compute_threads(1);
  const ComputeInfo info = compute_info();
  EXPECT_NE(info.library.find("oneDNN"), std::string::npos);
  EXPECT_FALSE(info.isa.empty());
  EXPECT_FALSE(info.f32_kernel.empty());
  EXPECT_EQ(info.threads, 1);
  EXPECT_EQ(info.bf16_supported, bf16_gemm_supported());
  EXPECT_EQ(info.bf16_kernel.empty(), !info.bf16_supported);
  EXPECT_NE(info.describe(false).find("f32 products on " + info.f32_kernel), std::string::npos);
  EXPECT_NE(info.describe(true).find(info.bf16_supported ? "bf16 products" : "no native BF16"), std::string::npos);
  set_compute_threads(0);
}

}  // namespace
}  // namespace mxddp::model
