// The f32 row kernels (src/model/row_kernels.h), every ISA table this CPU runs, against f64
// references computed from the same f32 inputs; and the threaded entry points giving the same bits
// at 1 and 2 threads. Inputs cover wide ranges (GELU out to +-1e30, logits +-80 apart), and every
// output must be finite wherever the reference is.
//
// Bounds (u = 2^-24, f32's unit roundoff):
//   exp            relative error <= 2 ulp of the result on [-87.3, 88.3]; exactly 0 below -87.3
//   GELU           |y - y64| <= 4u (|x| + 1e-2)
//   GELU slope     |dx - dy gelu'64| <= 8u |dy| (1 + |x|)
//   LayerNorm      with e = (c u mean|x| + 4u (|x| + |mean|)) rstd + (c + 4) u |xhat|, xhat's
//                  error (the mean's sum, f32's x - mean, rstd's relative error):
//                  y: 8u (|y64| + |b|) + e |w|; dx: 64u (sum_j |dy w| rstd / c + |dy w| rstd + |dx0|)
//                  + e rstd |mean(dxhat xhat)|; dw, db: 4 (n + 1) u sum_i |term_i|
//   cross-entropy  row loss: 16u (1 + |loss64|); gradient: 8u |grad_scale|
//   causal softmax p: 8u; dS: 16u scale sum_j p |dp| + 8u |dS64| per row
//   round to BF16  the same bits as core.h's f32_to_bf16 (RNE; ties, Inf, NaN, subnormals)
//   GELU, LayerNorm in BF16: the same bits as their f32 results rounded by f32_to_bf16
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include <mxddp/model.h>

#include "model/row_kernels.h"

namespace mxddp::model {
namespace {

constexpr double kU = 1.0 / (1 << 24);

std::vector<float> random_floats(size_t n, float scale, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

double ulp_of(float y) {
  const float a = std::fabs(y);
  return static_cast<double>(std::nextafter(a, std::numeric_limits<float>::infinity()) - a);
}

double gelu64(double x) {
  return 0.5 * x * (1 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
}
double gelu_slope64(double x) {
  const double k = 0.7978845608028654, a = 0.044715;
  const double t = std::tanh(k * (x + a * x * x * x));
  return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * a * x * x);
}

// Inputs for the elementwise kernels: a dense sweep of the interesting range, random values,
// and far-out magnitudes of both signs.
std::vector<float> wide_inputs() {
  std::vector<float> x;
  for (int i = -40000; i <= 40000; ++i) x.push_back(static_cast<float>(i) * 5e-4f);  // [-20, 20]
  const std::vector<float> r = random_floats(10000, 3.0f, 7);
  x.insert(x.end(), r.begin(), r.end());
  for (float m : {1e-30f, 1e-6f, 0.5f, 6.0f, 10.0f, 30.0f, 100.0f, 1e3f, 1e4f, 1e5f, 1e8f, 1e20f, 1e30f,
                  std::numeric_limits<float>::max()}) {
    x.push_back(m);
    x.push_back(-m);
  }
  return x;
}

class RowKernels : public ::testing::TestWithParam<const row_kernels::RowKernelTable*> {
 protected:
  const row_kernels::RowKernelTable& k() const { return *GetParam(); }
};

TEST_P(RowKernels, ExpWithinTwoUlpAndZeroBelowItsRange) {
  std::vector<float> x;
  for (int i = 0; i <= 400000; ++i) x.push_back(-87.3f + static_cast<float>(i) * (175.6f / 400000));
  for (float v : {-87.3f, 88.3f, 0.0f, -0.0f, 1e-8f, -1e-8f, 0.34657359f, -0.34657359f}) x.push_back(v);
  std::vector<float> y(x.size());
  k().exp(x.data(), y.data(), static_cast<int64_t>(x.size()));
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (x[i] > 88.3f || x[i] < -87.3f) continue;  // the sweep's rounding may step just past an end
    const double ref = std::exp(static_cast<double>(x[i]));
    ASSERT_TRUE(std::isfinite(y[i])) << x[i];
    const double ulps = std::fabs(y[i] - ref) / ulp_of(static_cast<float>(ref));
    worst = std::max(worst, ulps);
    ASSERT_LE(ulps, 2.0) << "exp(" << x[i] << ") = " << y[i] << ", f64 " << ref;
  }
  std::printf("[%s] exp: worst %.3f ulp\n", k().isa, worst);
  const std::vector<float> outside{-87.31f, -100.0f, -1e30f, -std::numeric_limits<float>::infinity(), 88.31f, 1e30f,
                                   std::numeric_limits<float>::infinity()};
  std::vector<float> yo(outside.size());
  k().exp(outside.data(), yo.data(), static_cast<int64_t>(outside.size()));
  for (int i = 0; i < 4; ++i) EXPECT_EQ(yo[static_cast<size_t>(i)], 0.0f) << outside[static_cast<size_t>(i)];
  for (int i = 4; i < 7; ++i) EXPECT_TRUE(std::isfinite(yo[static_cast<size_t>(i)]) && yo[static_cast<size_t>(i)] > 1e38f);
}

TEST_P(RowKernels, GeluForwardAndSlopeMatchF64) {
  const std::vector<float> x = wide_inputs();
  const std::vector<float> dy = random_floats(x.size(), 1.0f, 11);
  std::vector<float> y(x.size()), dx(x.size());
  k().gelu_forward(x.data(), y.data(), static_cast<int64_t>(x.size()));
  k().gelu_backward(x.data(), dy.data(), dx.data(), static_cast<int64_t>(x.size()));
  double worst_y = 0, worst_dx = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double xd = x[i], ref = gelu64(xd), slope = gelu_slope64(xd);
    if (std::isfinite(ref)) {
      ASSERT_TRUE(std::isfinite(y[i])) << "gelu(" << x[i] << ") = " << y[i];
    }
    if (std::isfinite(slope)) {
      ASSERT_TRUE(std::isfinite(dx[i])) << "gelu'(" << x[i] << ") gave " << dx[i];
    }
    const double ey = std::fabs(y[i] - ref) / (std::fabs(xd) + 1e-2);
    const double edx = std::fabs(dx[i] - dy[i] * slope) / (std::fabs(dy[i]) * (1 + std::fabs(xd)) + 1e-30);
    worst_y = std::max(worst_y, ey);
    worst_dx = std::max(worst_dx, edx);
    ASSERT_LE(ey, 4 * kU) << "gelu(" << x[i] << ") = " << y[i] << ", f64 " << ref;
    ASSERT_LE(edx, 8 * kU) << "gelu'(" << x[i] << ") = " << dx[i] / dy[i] << ", f64 " << slope;
  }
  std::printf("[%s] gelu: worst |y - y64| / (|x| + 0.01) = %.2f u; slope: %.2f u\n", k().isa, worst_y / kU,
              worst_dx / kU);
  // dx may alias dy.
  std::vector<float> in_place = dy;
  k().gelu_backward(x.data(), in_place.data(), in_place.data(), static_cast<int64_t>(x.size()));
  EXPECT_EQ(0, std::memcmp(in_place.data(), dx.data(), dx.size() * sizeof(float)));
}

TEST_P(RowKernels, GeluForwardBf16IsTheF32ResultRounded) {
  // One pass that computes GELU and rounds it: the same bits as gelu_forward then f32_to_bf16, so
  // it inherits gelu_forward's bound against f64 plus BF16's one rounding.
  const std::vector<float> x = wide_inputs();
  std::vector<float> y(x.size());
  std::vector<uint16_t> y16(x.size() + 1, 0xabcd);
  k().gelu_forward(x.data(), y.data(), static_cast<int64_t>(x.size()));
  k().gelu_forward_bf16(x.data(), y16.data(), static_cast<int64_t>(x.size()));
  for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(y16[i], f32_to_bf16(y[i])) << "gelu(" << x[i] << ")";
  EXPECT_EQ(y16.back(), 0xabcd) << "wrote past the end";
}

TEST_P(RowKernels, GeluForwardBackwardBf16IsTheF32ResultsAndTheirRoundings) {
  // One pass that computes GELU's output and dx = dy gelu'(x): y16 the same bits as
  // gelu_forward_bf16, dx the same bits as gelu_backward (so their bounds against f64 hold), dx16
  // those bits rounded by f32_to_bf16; in place (dx over dy) as the graph calls it.
  const std::vector<float> x = wide_inputs();
  const std::vector<float> dy = random_floats(x.size(), 2.0f, 51);
  std::vector<float> dx(x.size()), dx_fused = dy;
  std::vector<uint16_t> y16_ref(x.size()), y16(x.size() + 1, 0xabcd), dx16(x.size() + 1, 0xabcd);
  k().gelu_forward_bf16(x.data(), y16_ref.data(), static_cast<int64_t>(x.size()));
  k().gelu_backward(x.data(), dy.data(), dx.data(), static_cast<int64_t>(x.size()));
  k().gelu_forward_backward_bf16(x.data(), dx_fused.data(), y16.data(), dx_fused.data(), dx16.data(),
                                 static_cast<int64_t>(x.size()));
  EXPECT_EQ(0, std::memcmp(dx.data(), dx_fused.data(), dx.size() * sizeof(float)));
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(y16[i], y16_ref[i]) << "gelu(" << x[i] << ")";
    ASSERT_EQ(dx16[i], f32_to_bf16(dx[i])) << "gelu'(" << x[i] << ")";
  }
  EXPECT_EQ(y16.back(), 0xabcd) << "wrote past the end";
  EXPECT_EQ(dx16.back(), 0xabcd) << "wrote past the end";
}

struct LayerNormCase {
  int n, c;
};

TEST_P(RowKernels, LayerNormForwardBf16IsTheF32ResultRounded) {
  // The BF16 output is the f32 output rounded (f32_to_bf16), and mean and rstd are the same bits.
  for (const LayerNormCase lc : {LayerNormCase{5, 384}, LayerNormCase{3, 37}, LayerNormCase{2, 1}}) {
    const size_t nc = static_cast<size_t>(lc.n) * lc.c;
    const std::vector<float> x = random_floats(nc, 2.0f, 41), w = random_floats(lc.c, 1.0f, 42),
                             b = random_floats(lc.c, 0.5f, 43);
    std::vector<float> y(nc), mean(lc.n), rstd(lc.n), mean16(lc.n), rstd16(lc.n);
    std::vector<uint16_t> y16(nc + 1, 0xabcd);
    k().layernorm_forward(x.data(), w.data(), b.data(), y.data(), mean.data(), rstd.data(), lc.n, lc.c, 1e-5f);
    k().layernorm_forward_bf16(x.data(), w.data(), b.data(), y16.data(), mean16.data(), rstd16.data(), lc.n, lc.c, 1e-5f);
    for (size_t i = 0; i < nc; ++i) ASSERT_EQ(y16[i], f32_to_bf16(y[i])) << "c " << lc.c << " element " << i;
    EXPECT_EQ(0, std::memcmp(mean.data(), mean16.data(), mean.size() * sizeof(float)));
    EXPECT_EQ(0, std::memcmp(rstd.data(), rstd16.data(), rstd.size() * sizeof(float)));
    EXPECT_EQ(y16.back(), 0xabcd) << "wrote past the end";
  }
}

TEST_P(RowKernels, LayerNormForwardAndBackwardMatchF64) {
  for (const LayerNormCase& lc : {LayerNormCase{37, 45}, LayerNormCase{64, 384}, LayerNormCase{5, 1}}) {
    const int n = lc.n, c = lc.c;
    std::vector<float> x = random_floats(static_cast<size_t>(n) * c, 2.0f, 1);
    for (int j = 0; j < c; ++j) x[static_cast<size_t>(j)] += 100.0f;  // a row with a large mean
    const std::vector<float> w = random_floats(static_cast<size_t>(c), 1.0f, 2), b = random_floats(static_cast<size_t>(c), 1.0f, 3);
    const std::vector<float> dy = random_floats(static_cast<size_t>(n) * c, 1.0f, 4);
    std::vector<float> y(x.size()), mean(static_cast<size_t>(n)), rstd(static_cast<size_t>(n)), dx = random_floats(x.size(), 1.0f, 5);
    std::vector<float> dw = random_floats(static_cast<size_t>(c), 1.0f, 6), db = random_floats(static_cast<size_t>(c), 1.0f, 8);
    const std::vector<float> dx0 = dx, dw0 = dw, db0 = db;
    k().layernorm_forward(x.data(), w.data(), b.data(), y.data(), mean.data(), rstd.data(), n, c, 1e-5f);
    k().layernorm_backward_data(dy.data(), x.data(), w.data(), mean.data(), rstd.data(), dx.data(), n, c);
    k().layernorm_param_grads(dy.data(), x.data(), mean.data(), rstd.data(), dw.data(), db.data(), n, c, 0, c);
    std::vector<double> dw64(static_cast<size_t>(c), 0), db64(static_cast<size_t>(c), 0), dw_mag(static_cast<size_t>(c), 0), db_mag(static_cast<size_t>(c), 0);
    for (int i = 0; i < n; ++i) {
      const float* xi = &x[static_cast<size_t>(i) * c];
      double m = 0, v = 0;
      for (int j = 0; j < c; ++j) m += xi[j];
      m /= c;
      for (int j = 0; j < c; ++j) v += (xi[j] - m) * (xi[j] - m);
      v /= c;
      const double r = 1 / std::sqrt(v + 1e-5);
      double mean_abs = 0;
      for (int j = 0; j < c; ++j) mean_abs += std::fabs(xi[j]);
      mean_abs /= c;
      ASSERT_NEAR(mean[static_cast<size_t>(i)], m, 8 * kU * (1 + std::fabs(m)));
      ASSERT_NEAR(rstd[static_cast<size_t>(i)], r, 16 * kU * r);
      double a = 0, bb = 0, scale = 0;
      for (int j = 0; j < c; ++j) {
        const size_t e = static_cast<size_t>(i) * c + static_cast<size_t>(j);
        const double xhat = (xi[j] - m) * r, ref = xhat * w[static_cast<size_t>(j)] + b[static_cast<size_t>(j)];
        // xhat's error: the mean's (a sum of c terms: c u mean|x|), x - mean's rounding
        // (u (|x| + |mean|), which dominates far from zero mean), and rstd's relative (c + 4) u.
        const double xhat_err = (c * kU * mean_abs + 4 * kU * (std::fabs(xi[j]) + std::fabs(m))) * r +
                                (c + 4) * kU * std::fabs(xhat);
        ASSERT_TRUE(std::isfinite(y[e]));
        ASSERT_LE(std::fabs(y[e] - ref), 8 * kU * (std::fabs(ref) + std::fabs(b[static_cast<size_t>(j)])) +
                                             xhat_err * std::fabs(w[static_cast<size_t>(j)]))
            << "y[" << i << ", " << j << "]";
        const double dxhat = double(dy[e]) * w[static_cast<size_t>(j)];
        a += dxhat;
        bb += dxhat * xhat;
        scale += std::fabs(dxhat) * r;
        dw64[static_cast<size_t>(j)] += dy[e] * xhat;
        db64[static_cast<size_t>(j)] += dy[e];
        dw_mag[static_cast<size_t>(j)] += std::fabs(dy[e] * xhat);
        db_mag[static_cast<size_t>(j)] += std::fabs(dy[e]);
      }
      a /= c;
      bb /= c;
      scale /= c;
      for (int j = 0; j < c; ++j) {
        const size_t e = static_cast<size_t>(i) * c + static_cast<size_t>(j);
        const double xhat = (xi[j] - m) * r;
        const double ref = dx0[e] + r * (double(dy[e]) * w[static_cast<size_t>(j)] - a - xhat * bb);
        const double xhat_err = (c * kU * mean_abs + 4 * kU * (std::fabs(xi[j]) + std::fabs(m))) * r +
                                (c + 4) * kU * std::fabs(xhat);
        const double bound = 64 * kU * (scale + std::fabs(double(dy[e]) * w[static_cast<size_t>(j)]) * r + std::fabs(dx0[e])) +
                             xhat_err * r * std::fabs(bb);
        ASSERT_LE(std::fabs(dx[e] - ref), bound) << "dx[" << i << ", " << j << "] (n " << n << ", c " << c << ")";
      }
    }
    for (int j = 0; j < c; ++j) {
      ASSERT_LE(std::fabs(dw[static_cast<size_t>(j)] - (dw0[static_cast<size_t>(j)] + dw64[static_cast<size_t>(j)])),
                4 * (n + 1) * kU * (dw_mag[static_cast<size_t>(j)] + std::fabs(dw0[static_cast<size_t>(j)])));
      ASSERT_LE(std::fabs(db[static_cast<size_t>(j)] - (db0[static_cast<size_t>(j)] + db64[static_cast<size_t>(j)])),
                4 * (n + 1) * kU * (db_mag[static_cast<size_t>(j)] + std::fabs(db0[static_cast<size_t>(j)])));
    }
  }
}

TEST_P(RowKernels, CrossEntropyLossAndGradientMatchF64) {
  for (int v : {40, 256, 3}) {
    const int n = 29;
    std::vector<float> logits = random_floats(static_cast<size_t>(n) * v, 4.0f, 12);
    logits[0] = 80.0f;                 // one logit far above the rest
    logits[static_cast<size_t>(v) + 1] = -80.0f;    // one far below
    std::vector<int32_t> targets(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) targets[static_cast<size_t>(i)] = (i * 7 + 3) % v;
    targets[1] = 1;  // the target is the far-below logit: a large loss
    const float grad_scale = 0.37f;
    std::vector<float> grads = logits, losses(static_cast<size_t>(n)), eval_losses(static_cast<size_t>(n)), untouched = logits;
    k().cross_entropy(grads.data(), targets.data(), losses.data(), n, v, grad_scale);
    k().cross_entropy(untouched.data(), targets.data(), eval_losses.data(), n, v, 0.0f);
    EXPECT_EQ(0, std::memcmp(untouched.data(), logits.data(), logits.size() * sizeof(float)))
        << "grad_scale 0 leaves the logits alone";
    for (int i = 0; i < n; ++i) {
      const float* z = &logits[static_cast<size_t>(i) * v];
      double mx = z[0];
      for (int j = 1; j < v; ++j) mx = std::max(mx, double(z[j]));
      double sum = 0;
      for (int j = 0; j < v; ++j) sum += std::exp(z[j] - mx);
      const double lse = std::log(sum) + mx, loss = lse - z[targets[static_cast<size_t>(i)]];
      ASSERT_LE(std::fabs(losses[static_cast<size_t>(i)] - loss), 16 * kU * (1 + std::fabs(lse))) << "row " << i << " v " << v;
      ASSERT_LE(std::fabs(eval_losses[static_cast<size_t>(i)] - loss), 16 * kU * (1 + std::fabs(lse)));
      for (int j = 0; j < v; ++j) {
        const double g = (std::exp(z[j] - lse) - (j == targets[static_cast<size_t>(i)] ? 1 : 0)) * grad_scale;
        ASSERT_LE(std::fabs(grads[static_cast<size_t>(i) * v + static_cast<size_t>(j)] - g), 8 * kU * grad_scale) << i << ", " << j;
      }
    }
  }
}

TEST_P(RowKernels, CausalSoftmaxAndBackwardMatchF64WriteOnlyTheirBlockAndRebuildFromTheirStatistics) {
  const int ld = 80, first_row = 13, rows = 19, width = first_row + rows;  // a block of rows 13..31
  std::vector<float> s = random_floats(static_cast<size_t>(rows) * ld, 3.0f, 21);
  s[5] = 60.0f;
  for (int r = 0; r < rows; ++r)
    for (int j = width; j < ld; ++j) s[static_cast<size_t>(r) * ld + static_cast<size_t>(j)] = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> s0 = s;
  const std::vector<float> dp0 = random_floats(s.size(), 1.0f, 22);
  std::vector<float> dp = dp0;
  for (int r = 0; r < rows; ++r)
    for (int j = width; j < ld; ++j) dp[static_cast<size_t>(r) * ld + static_cast<size_t>(j)] = std::numeric_limits<float>::quiet_NaN();
  const float scale = 0.125f;
  std::vector<float> row_max(rows), row_inv_sum(rows);
  k().causal_softmax(s.data(), ld, first_row, rows, width, row_max.data(), row_inv_sum.data());
  // Rebuilt from the scores and the statistics: the same bits, as attention's backward needs.
  std::vector<float> rebuilt = s0;
  k().causal_softmax_from_stats(rebuilt.data(), ld, first_row, rows, width, row_max.data(), row_inv_sum.data());
  for (size_t i = 0; i < s.size(); ++i)
    if (!std::isnan(s[i])) ASSERT_EQ(rebuilt[i], s[i]) << "element " << i << " rebuilt from the statistics";
    else ASSERT_TRUE(std::isnan(rebuilt[i])) << "element " << i << " past the width is never written";
  k().causal_softmax_backward(s.data(), dp.data(), ld, first_row, rows, width, scale);
  for (int r = 0; r < rows; ++r) {
    const int len = first_row + r + 1;
    const float* z = &s0[static_cast<size_t>(r) * ld];
    double mx = z[0], sum = 0;
    for (int j = 1; j < len; ++j) mx = std::max(mx, double(z[j]));
    for (int j = 0; j < len; ++j) sum += std::exp(z[j] - mx);
    EXPECT_EQ(row_max[static_cast<size_t>(r)], static_cast<float>(mx)) << "row " << r << "'s max";
    EXPECT_LE(std::fabs(row_inv_sum[static_cast<size_t>(r)] - 1 / sum), 8 * kU / sum) << "row " << r << "'s 1 / sum";
    double dot = 0, mag = 0;
    std::vector<double> p64(static_cast<size_t>(len));
    for (int j = 0; j < len; ++j) {
      p64[static_cast<size_t>(j)] = std::exp(z[j] - mx) / sum;
      ASSERT_LE(std::fabs(s[static_cast<size_t>(r) * ld + static_cast<size_t>(j)] - p64[static_cast<size_t>(j)]), 8 * kU) << r << ", " << j;
      dot += p64[static_cast<size_t>(j)] * dp0[static_cast<size_t>(r) * ld + static_cast<size_t>(j)];
      mag += p64[static_cast<size_t>(j)] * std::fabs(dp0[static_cast<size_t>(r) * ld + static_cast<size_t>(j)]);
    }
    for (int j = 0; j < len; ++j) {
      const double ref = scale * p64[static_cast<size_t>(j)] * (dp0[static_cast<size_t>(r) * ld + static_cast<size_t>(j)] - dot);
      ASSERT_LE(std::fabs(dp[static_cast<size_t>(r) * ld + static_cast<size_t>(j)] - ref), 16 * kU * scale * mag + 8 * kU * std::fabs(ref));
    }
    for (int j = len; j < width; ++j) {
      EXPECT_EQ(s[static_cast<size_t>(r) * ld + static_cast<size_t>(j)], 0.0f);
      EXPECT_EQ(dp[static_cast<size_t>(r) * ld + static_cast<size_t>(j)], 0.0f);
    }
    for (int j = width; j < ld; ++j) {
      EXPECT_TRUE(std::isnan(s[static_cast<size_t>(r) * ld + static_cast<size_t>(j)])) << "past the block's width is never written";
      EXPECT_TRUE(std::isnan(dp[static_cast<size_t>(r) * ld + static_cast<size_t>(j)]));
    }
  }
}

std::string isa_name(const ::testing::TestParamInfo<const row_kernels::RowKernelTable*>& info) {
  std::string s = info.param->isa;
  for (char& ch : s)
    if (ch == '-') ch = '_';
  return s;
}

TEST_P(RowKernels, RoundToBf16GivesTheReferenceBitsIncludingTiesAndSpecials) {
  std::vector<float> x = random_floats(4099, 3.0f, 21);
  const uint32_t specials[] = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00001u,
                               0x7f800001u, 0x7f7fffffu, 0xff7fffffu, 0x00000001u, 0x807fffffu, 0x3f808000u,
                               0x3f818000u, 0x3f808001u, 0x3f817fffu, 0x7f7f8000u, 0x00008000u, 0x00018000u};
  for (uint32_t bits : specials) x.push_back(std::bit_cast<float>(bits));
  for (uint32_t i = 0; i < 70000; ++i) x.push_back(std::bit_cast<float>(i * 61357u));  // every exponent, many mantissas
  std::vector<uint16_t> y(x.size() + 1, 0xabcd);
  k().round_to_bf16(x.data(), y.data(), static_cast<int64_t>(x.size()));
  for (size_t i = 0; i < x.size(); ++i)
    ASSERT_EQ(y[i], f32_to_bf16(x[i])) << "x bits " << std::hex << std::bit_cast<uint32_t>(x[i]);
  EXPECT_EQ(y.back(), 0xabcd) << "wrote past the end";
}

INSTANTIATE_TEST_SUITE_P(EveryIsaThisCpuRuns, RowKernels, ::testing::ValuesIn(row_kernels::supported()), isa_name);

// The threaded entry points: the same bits at 1 and 2 threads, and the same as one table call.
TEST(RowKernelsThreaded, SameBitsAtOneAndTwoThreads) {
  const int n = 512, c = 96, v = 256;
  const std::vector<float> x = random_floats(static_cast<size_t>(n) * c, 1.5f, 31), dy = random_floats(static_cast<size_t>(n) * c, 1.0f, 32);
  const std::vector<float> w = random_floats(static_cast<size_t>(c), 1.0f, 33), b = random_floats(static_cast<size_t>(c), 1.0f, 34);
  const std::vector<float> logits0 = random_floats(static_cast<size_t>(n) * v, 3.0f, 35);
  std::vector<int32_t> targets(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) targets[static_cast<size_t>(i)] = (i * 31) % v;
  struct Out {
    std::vector<float> y, mean, rstd, dx, dw, db, g, dg, logits, row_loss, colsum, dg2;
    std::vector<uint16_t> dg16, g16;
    double loss = 0;
  };
  auto run = [&](int threads) {
    set_compute_threads(threads);
    Out o{std::vector<float>(x.size()), std::vector<float>(static_cast<size_t>(n)), std::vector<float>(static_cast<size_t>(n)),
          std::vector<float>(x.size(), 0.5f), std::vector<float>(static_cast<size_t>(c), 0.25f), std::vector<float>(static_cast<size_t>(c), 0.0f),
          std::vector<float>(x.size()), dy, logits0, std::vector<float>(static_cast<size_t>(n)), std::vector<float>(static_cast<size_t>(c), 1.0f)};
    layernorm_forward(x.data(), w.data(), b.data(), o.y.data(), o.mean.data(), o.rstd.data(), n, c);
    layernorm_backward(dy.data(), x.data(), w.data(), o.mean.data(), o.rstd.data(), o.dx.data(), o.dw.data(),
                       o.db.data(), n, c);
    gelu_forward(x.data(), o.g.data(), int64_t{n} * c);
    gelu_backward(x.data(), o.dg.data(), o.dg.data(), int64_t{n} * c);
    o.dg2 = dy;
    o.dg16.assign(x.size(), 0);
    o.g16.assign(x.size(), 0);
    gelu_forward_backward_bf16(x.data(), o.dg2.data(), o.g16.data(), o.dg2.data(), o.dg16.data(), int64_t{n} * c);
    o.loss = cross_entropy(o.logits.data(), targets.data(), o.row_loss.data(), n, v, 0.5f);
    add_column_sums(dy.data(), n, c, o.colsum.data());
    return o;
  };
  const Out one = run(1), two = run(2);
  set_compute_threads(0);
  auto same = [](const std::vector<float>& a, const std::vector<float>& b2) {
    return a.size() == b2.size() && std::memcmp(a.data(), b2.data(), a.size() * sizeof(float)) == 0;
  };
  EXPECT_TRUE(same(one.y, two.y) && same(one.mean, two.mean) && same(one.rstd, two.rstd));
  EXPECT_TRUE(same(one.dx, two.dx) && same(one.dw, two.dw) && same(one.db, two.db));
  EXPECT_TRUE(same(one.g, two.g) && same(one.dg, two.dg));
  EXPECT_TRUE(same(one.dg2, one.dg) && same(two.dg2, one.dg)) << "the fused GELU backward's f32 gradient";
  EXPECT_TRUE(one.dg16 == two.dg16 && one.g16 == two.g16);
  EXPECT_TRUE(same(one.logits, two.logits) && same(one.row_loss, two.row_loss));
  EXPECT_EQ(one.loss, two.loss);
  EXPECT_TRUE(same(one.colsum, two.colsum));
  double sum = 0;
  for (float l : one.row_loss) sum += l;
  EXPECT_EQ(one.loss, sum) << "the loss is the f64 sum of the rows' losses in row order";
  // One table call over everything gives what the split calls gave.
  std::vector<float> y(x.size()), mean(static_cast<size_t>(n)), rstd(static_cast<size_t>(n));
  row_kernels::active().layernorm_forward(x.data(), w.data(), b.data(), y.data(), mean.data(), rstd.data(), n, c,
                                          static_cast<float>(kLayerNormEps));
  EXPECT_TRUE(same(y, one.y));
}

// round_rows_to_bf16 gathers rows of a wider matrix into a dense BF16 block: each row is
// round_to_bf16's bits, nothing outside the rows' columns is read into it or written past it,
// for widths that are and are not a multiple of 16 and more rows than it prefetches ahead.
TEST(RowKernelsGather, RoundRowsToBf16IsEachRowRoundedIntoADenseBlock) {
  for (const int cols : {64, 37, 1})
    for (const int rows : {40, 3}) {
      const int64_t ld = 3 * cols + 5;
      const std::vector<float> x = random_floats(static_cast<size_t>(rows) * ld, 2.0f, 41);
      std::vector<uint16_t> y(static_cast<size_t>(rows) * cols + 1, 0xabcd);
      round_rows_to_bf16(x.data(), ld, y.data(), rows, cols);
      for (int i = 0; i < rows; ++i)
        for (int j = 0; j < cols; ++j)
          ASSERT_EQ(y[static_cast<size_t>(i) * cols + j], f32_to_bf16(x[static_cast<size_t>(i * ld + j)]))
              << "row " << i << " column " << j << " of " << cols;
      EXPECT_EQ(y.back(), 0xabcd) << "wrote past the end";
    }
}

}  // namespace
}  // namespace mxddp::model
