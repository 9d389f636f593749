// Block-causal, flash-style attention (src/model/causal_attention.h) against the plain full-matrix
// algorithm it replaces (scores for every (query, key) pair, then a mask, the probabilities kept
// for backward), written here in f64: the blocked f64 code agrees with it to rounding (any block
// size, T a multiple of the block or not), saves the softmax statistics the reference's rows have,
// f32 within a stated bound, nothing above the diagonal block is read (the scratch starts as NaN,
// which would reach the outputs), and the result is the same bits at 1 and 2 threads.
//
// f32 bound: |out - out64| <= 64 u (1 + |out64|) with u = 2^-24; the inputs are O(1), T <= 130.
//
// BF16 products (the thread's gemm dtype kBF16 on a CPU with native BF16): q, k, v and dy are
// rounded to BF16 once and each block's P and dS before the product that reads them; everything
// else is f32. So the reference runs on the BF16-rounded q, k, v, dy, and the only BF16 error
// left is P's and dS's rounding (relative u_bf16 = 2^-8 per entry) times the magnitudes the
// reference sums: |out - out64| <= u_bf16 m + 64 u (1 + |out64|), with m = sum_j P_ij |v_je| for
// y, sum_j |dS_ij| |k_je| for dq, sum_j |dS_ji| |q_je| for dk, sum_j P_ji |dy_je| for dv. Where
// the CPU has no native BF16, kBF16 is the f32 path's bits.
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include <mxddp/model.h>

#include <mxddp/core.h>

#include "model/causal_attention.h"
#include "model/gemm.h"

namespace mxddp::model {
namespace {

constexpr double kU = 1.0 / (1 << 24);
constexpr double kUBf16 = 1.0 / (1 << 8);

struct Shape {
  int batch, seq, c, heads;
};

template <typename T>
std::vector<T> random_values(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> dist(0.0, 1.0);
  std::vector<T> v(n);
  for (T& x : v) x = static_cast<T>(dist(rng));
  return v;
}

// The full-matrix reference: S = q k^T / sqrt(D) for every pair, masked above the diagonal; stats
// as attention_forward's, [B, H, 2, T]: each row's max score and 1 / its exponentials' sum.
// mag (optional, shaped as y then dqkv: y's first) gets each output's sum of the magnitudes of
// the P or dS terms it adds up (the BF16 bound's m, see the top).
void full_attention64(const Shape& s, const std::vector<double>& qkv, const std::vector<double>& dy,
                      std::vector<double>& y, std::vector<double>& dqkv, std::vector<double>& stats,
                      std::vector<double>* mag = nullptr) {
  const int d = s.c / s.heads, ld = 3 * s.c, t = s.seq;
  const double scale = 1 / std::sqrt(double(d));
  y.assign(static_cast<size_t>(s.batch) * t * s.c, 0);
  dqkv.assign(static_cast<size_t>(s.batch) * t * ld, 0);
  stats.assign(static_cast<size_t>(s.batch) * s.heads * 2 * t, 0);
  if (mag != nullptr) mag->assign(y.size() + dqkv.size(), 0);
  std::vector<double> p(static_cast<size_t>(t) * t), dp(static_cast<size_t>(t) * t);
  for (int b = 0; b < s.batch; ++b)
    for (int h = 0; h < s.heads; ++h) {
      auto q = [&](int i, int e) { return qkv[(static_cast<size_t>(b) * t + i) * ld + static_cast<size_t>(h) * d + e]; };
      auto k = [&](int i, int e) { return qkv[(static_cast<size_t>(b) * t + i) * ld + s.c + static_cast<size_t>(h) * d + e]; };
      auto v = [&](int i, int e) { return qkv[(static_cast<size_t>(b) * t + i) * ld + 2 * s.c + static_cast<size_t>(h) * d + e]; };
      auto g = [&](int i, int e) { return dy[(static_cast<size_t>(b) * t + i) * s.c + static_cast<size_t>(h) * d + e]; };
      for (int i = 0; i < t; ++i) {
        double mx = -std::numeric_limits<double>::infinity();
        for (int j = 0; j < t; ++j) {
          double acc = 0;
          for (int e = 0; e < d; ++e) acc += q(i, e) * k(j, e);
          p[static_cast<size_t>(i) * t + j] = j <= i ? acc * scale : -std::numeric_limits<double>::infinity();
          mx = std::max(mx, p[static_cast<size_t>(i) * t + j]);
        }
        double sum = 0;
        for (int j = 0; j < t; ++j) sum += (p[static_cast<size_t>(i) * t + j] = std::exp(p[static_cast<size_t>(i) * t + j] - mx));
        for (int j = 0; j < t; ++j) p[static_cast<size_t>(i) * t + j] /= sum;
        const size_t head_stats = (static_cast<size_t>(b) * s.heads + static_cast<size_t>(h)) * 2 * t;
        stats[head_stats + static_cast<size_t>(i)] = mx;
        stats[head_stats + static_cast<size_t>(t + i)] = 1 / sum;
        for (int e = 0; e < d; ++e) {
          double acc = 0, m = 0;
          for (int j = 0; j < t; ++j) {
            acc += p[static_cast<size_t>(i) * t + j] * v(j, e);
            m += p[static_cast<size_t>(i) * t + j] * std::fabs(v(j, e));
          }
          y[(static_cast<size_t>(b) * t + i) * s.c + static_cast<size_t>(h) * d + e] = acc;
          if (mag != nullptr) (*mag)[(static_cast<size_t>(b) * t + i) * s.c + static_cast<size_t>(h) * d + e] = m;
        }
      }
      for (int i = 0; i < t; ++i) {
        double dot = 0;
        for (int j = 0; j < t; ++j) {
          double acc = 0;
          for (int e = 0; e < d; ++e) acc += g(i, e) * v(j, e);
          dp[static_cast<size_t>(i) * t + j] = acc;
          dot += p[static_cast<size_t>(i) * t + j] * acc;
        }
        for (int j = 0; j < t; ++j) dp[static_cast<size_t>(i) * t + j] = scale * p[static_cast<size_t>(i) * t + j] * (dp[static_cast<size_t>(i) * t + j] - dot);
      }
      for (int i = 0; i < t; ++i)
        for (int e = 0; e < d; ++e) {
          double dq = 0, dk = 0, dv = 0, mq = 0, mk = 0, mv = 0;
          for (int j = 0; j < t; ++j) {
            dq += dp[static_cast<size_t>(i) * t + j] * k(j, e);
            dk += dp[static_cast<size_t>(j) * t + i] * q(j, e);
            dv += p[static_cast<size_t>(j) * t + i] * g(j, e);
            mq += std::fabs(dp[static_cast<size_t>(i) * t + j] * k(j, e));
            mk += std::fabs(dp[static_cast<size_t>(j) * t + i] * q(j, e));
            mv += std::fabs(p[static_cast<size_t>(j) * t + i] * g(j, e));
          }
          const size_t row = (static_cast<size_t>(b) * t + i) * ld + static_cast<size_t>(h) * d + e;
          dqkv[row] = dq;
          dqkv[row + s.c] = dk;
          dqkv[row + 2 * s.c] = dv;
          if (mag != nullptr) {
            (*mag)[y.size() + row] = mq;
            (*mag)[y.size() + row + s.c] = mk;
            (*mag)[y.size() + row + 2 * s.c] = mv;
          }
        }
    }
}

// The blocked code in T: y, dqkv and stats; outputs start as 7 and the scratch as NaN, so what is
// not written, and any unwritten tile entry a product reads, shows.
template <typename T>
void blocked_attention(const Shape& s, int block, const std::vector<T>& qkv, const std::vector<T>& dy,
                       std::vector<T>& y, std::vector<T>& dqkv, std::vector<T>& stats) {
  const size_t n = static_cast<size_t>(s.batch) * s.seq;
  y.assign(n * s.c, T(7));
  dqkv.assign(n * 3 * s.c, T(7));
  stats.assign(static_cast<size_t>(attention_stats_numel(s.batch, s.seq, s.heads)), T(7));
  std::vector<T> scratch(static_cast<size_t>(attention_scratch_numel(s.seq, 0, block)),
                         std::numeric_limits<T>::quiet_NaN());
  attention_forward(qkv.data(), stats.data(), y.data(), scratch.data(), s.batch, s.seq, s.c, s.heads, block);
  attention_backward(dy.data(), qkv.data(), stats.data(), dqkv.data(), scratch.data(), s.batch, s.seq, s.c, s.heads,
                     block);
}

const Shape kShapes[] = {{2, 37, 24, 3}, {1, 130, 32, 2}, {3, 16, 8, 1}};

TEST(CausalAttention, BlockedF64MatchesTheFullMatrixAlgorithmForAnyBlock) {
  for (const Shape& s : kShapes)
    for (int block : {0, 1, 5, 16, 32, 64, 256}) {  // 0: attention_block(T)
      const size_t n = static_cast<size_t>(s.batch) * s.seq;
      const auto qkv = random_values<double>(n * 3 * s.c, 1), dy = random_values<double>(n * s.c, 2);
      std::vector<double> y_ref, d_ref, stats_ref, y, d, stats;
      full_attention64(s, qkv, dy, y_ref, d_ref, stats_ref);
      blocked_attention(s, block, qkv, dy, y, d, stats);
      for (size_t i = 0; i < y.size(); ++i) ASSERT_NEAR(y[i], y_ref[i], 1e-12) << "T " << s.seq << " block " << block;
      for (size_t i = 0; i < d.size(); ++i) ASSERT_NEAR(d[i], d_ref[i], 1e-12) << "T " << s.seq << " block " << block;
      ASSERT_EQ(stats.size(), stats_ref.size());
      for (size_t i = 0; i < stats.size(); ++i)
        ASSERT_NEAR(stats[i], stats_ref[i], 1e-12 * (1 + std::fabs(stats_ref[i]))) << "statistic " << i;
    }
}

TEST(CausalAttention, F32WithinBoundOfTheF64Reference) {
  double worst = 0;
  for (const Shape& s : kShapes)
    for (int block : {16, 64}) {
      const size_t n = static_cast<size_t>(s.batch) * s.seq;
      const auto qkv64 = random_values<double>(n * 3 * s.c, 3), dy64 = random_values<double>(n * s.c, 4);
      const std::vector<float> qkv(qkv64.begin(), qkv64.end()), dy(dy64.begin(), dy64.end());
      std::vector<double> y_ref, d_ref, stats_ref;
      // The reference sees exactly the f32 inputs.
      full_attention64(s, std::vector<double>(qkv.begin(), qkv.end()), std::vector<double>(dy.begin(), dy.end()),
                       y_ref, d_ref, stats_ref);
      std::vector<float> y, d, stats;
      blocked_attention(s, block, qkv, dy, y, d, stats);
      for (size_t i = 0; i < y.size(); ++i) {
        ASSERT_LE(std::fabs(y[i] - y_ref[i]), 64 * kU * (1 + std::fabs(y_ref[i]))) << i;
        worst = std::max(worst, std::fabs(y[i] - y_ref[i]) / (1 + std::fabs(y_ref[i])));
      }
      for (size_t i = 0; i < d.size(); ++i) {
        ASSERT_TRUE(std::isfinite(d[i]));
        ASSERT_LE(std::fabs(d[i] - d_ref[i]), 64 * kU * (1 + std::fabs(d_ref[i]))) << i;
        worst = std::max(worst, std::fabs(d[i] - d_ref[i]) / (1 + std::fabs(d_ref[i])));
      }
    }
  std::printf("attention f32: worst |out - out64| / (1 + |out64|) = %.2f u\n", worst / kU);
}

std::vector<float> rounded_to_bf16(const std::vector<float>& x) {
  std::vector<float> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = bf16_to_f32(f32_to_bf16(x[i]));
  return r;
}

TEST(CausalAttention, Bf16ProductsWithinBoundOfTheF64ReferenceOnBf16RoundedInputs) {
  if (!bf16_gemm_supported()) GTEST_SKIP() << "no native BF16 on this CPU: kBF16 is the f32 path (next test)";
  double worst = 0;
  for (const Shape& s : kShapes)
    for (int block : {0, 16, 64}) {
      const size_t n = static_cast<size_t>(s.batch) * s.seq;
      const auto qkv64 = random_values<double>(n * 3 * s.c, 17), dy64 = random_values<double>(n * s.c, 18);
      const std::vector<float> qkv(qkv64.begin(), qkv64.end()), dy(dy64.begin(), dy64.end());
      const std::vector<float> qkv16 = rounded_to_bf16(qkv), dy16 = rounded_to_bf16(dy);
      std::vector<double> y_ref, d_ref, stats_ref, mag;
      full_attention64(s, std::vector<double>(qkv16.begin(), qkv16.end()), std::vector<double>(dy16.begin(), dy16.end()),
                       y_ref, d_ref, stats_ref, &mag);
      std::vector<float> y, d, stats, y32, d32, stats32;
      {
        const ScopedGemmDType bf16(GemmDType::kBF16);
        blocked_attention(s, block, qkv, dy, y, d, stats);
      }
      for (size_t i = 0; i < y.size(); ++i) {
        const double err = std::fabs(y[i] - y_ref[i]), bound = kUBf16 * mag[i] + 64 * kU * (1 + std::fabs(y_ref[i]));
        ASSERT_LE(err, bound) << "y " << i << " T " << s.seq << " block " << block;
        worst = std::max(worst, err / bound);
      }
      for (size_t i = 0; i < d.size(); ++i) {
        ASSERT_TRUE(std::isfinite(d[i]));
        const double err = std::fabs(d[i] - d_ref[i]);
        const double bound = kUBf16 * mag[y.size() + i] + 64 * kU * (1 + std::fabs(d_ref[i]));
        ASSERT_LE(err, bound) << "dqkv " << i << " T " << s.seq << " block " << block;
        worst = std::max(worst, err / bound);
      }
      for (size_t i = 0; i < stats.size(); ++i)
        ASSERT_LE(std::fabs(stats[i] - stats_ref[i]), 64 * kU * (1 + std::fabs(stats_ref[i]))) << "statistic " << i;
      // The BF16 products ran: the f32 path's result differs (its P and dS are not rounded).
      blocked_attention(s, block, qkv, dy, y32, d32, stats32);
      EXPECT_NE(0, std::memcmp(y32.data(), y.data(), y.size() * sizeof(float))) << "T " << s.seq;
    }
  std::printf("attention bf16: worst |out - out64| / bound = %.3f\n", worst);
}

TEST(CausalAttention, Bf16ComputeWithoutNativeBf16IsTheF32Path) {
  if (bf16_gemm_supported()) GTEST_SKIP() << "this CPU multiplies BF16 natively (previous test)";
  const Shape s{2, 70, 32, 4};
  const size_t n = static_cast<size_t>(s.batch) * s.seq;
  const auto qkv = random_values<float>(n * 3 * s.c, 15), dy = random_values<float>(n * s.c, 16);
  for (int threads : {1, 2}) {
    set_compute_threads(threads);
    std::vector<float> y32, d32, s32, y16, d16, s16;
    blocked_attention(s, 32, qkv, dy, y32, d32, s32);
    {
      const ScopedGemmDType bf16(GemmDType::kBF16);
      blocked_attention(s, 32, qkv, dy, y16, d16, s16);
      EXPECT_EQ(gemm_dtype(), GemmDType::kBF16) << "the caller's dtype is restored";
    }
    EXPECT_EQ(0, std::memcmp(y32.data(), y16.data(), y32.size() * sizeof(float))) << threads << " thread(s)";
    EXPECT_EQ(0, std::memcmp(d32.data(), d16.data(), d32.size() * sizeof(float))) << threads << " thread(s)";
    EXPECT_EQ(0, std::memcmp(s32.data(), s16.data(), s32.size() * sizeof(float))) << threads << " thread(s)";
  }
  set_compute_threads(0);
}

TEST(CausalAttention, SameBitsAtOneAndTwoThreads) {
  const Shape s{2, 70, 32, 4};
  const size_t n = static_cast<size_t>(s.batch) * s.seq;
  const auto qkv = random_values<float>(n * 3 * s.c, 5), dy = random_values<float>(n * s.c, 6);
  for (const GemmDType dtype : {GemmDType::kF32, GemmDType::kBF16}) {  // BF16: products in BF16 where native
    const ScopedGemmDType products(dtype);
    std::vector<float> y1, d1, s1, y2, d2, s2;
    set_compute_threads(1);
    blocked_attention(s, 32, qkv, dy, y1, d1, s1);
    set_compute_threads(2);
    blocked_attention(s, 32, qkv, dy, y2, d2, s2);
    set_compute_threads(0);
    const char* name = dtype == GemmDType::kF32 ? "f32" : "bf16";
    EXPECT_EQ(0, std::memcmp(y1.data(), y2.data(), y1.size() * sizeof(float))) << name;
    EXPECT_EQ(0, std::memcmp(d1.data(), d2.data(), d1.size() * sizeof(float))) << name;
    EXPECT_EQ(0, std::memcmp(s1.data(), s2.data(), s1.size() * sizeof(float))) << name;
  }
}

}  // namespace
}  // namespace mxddp::model
